// prepare_data's documentation corpus (examples/docs_corpus.hpp): its rst and POD
// cleaners, the split by whole documents, deduplication, and the errors that name a
// missing package.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "docs_corpus.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "temp_dir.hpp"

using namespace llmpar;
using namespace llmpar::docs;
using llmpar::data::ByteTokenizer;
using llmpar::data::unigram_entropy;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("docs") {}
};

void write_text(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::binary);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
  REQUIRE(out.good());
}

// Builds expected messages (GCC 12 warns falsely on `"literal" + std::string&&`).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

namespace {

constexpr const char* kSampleRst = R"rst(.. SPDX-License-Identifier: GPL-2.0

.. _intro:

=====================
A Guide to the Kernel
=====================

:Author: A. Person
:orphan:

This guide explains *why* the kernel
is built the way it is, with **bold** and ``literal`` words,
a :ref:`link to a section <other>` and a :c:func:`kmalloc` call.
See `the site <https://example.org>`_ and :pep:`8` [#]_.

Example::

    int main(void) { return 0; }

Usage ::

    $ make

.. code-block:: c

   x = 1;

.. note:: Read this first.

   Notes are prose too.

.. toctree::
   :maxdepth: 2

   intro

.. function:: open(file, mode='r')
   :noindex:

   Open a file.

   .. versionadded:: 3.9

+------+------+
| a    | b    |
+======+======+

=====  =====
col    col
=====  =====
1      2
=====  =====

>>> print(1)
1

- first item,
  continued
- second item

Term
   Its definition.

Section
-------

Last	 paragraph   here.
)rst";

constexpr const char* kSamplePod = R"pod(#!/usr/bin/perl
print "code before the pod\n";

=head1 NAME

perlthing - a B<bold> test of I<italic> and C<< $a->b >> codes

=head2 Links

See L<perlfunc/open>, L<the manual|perlvar>, L</"Other section"> and
L<http://example.org>; E<lt>tagE<gt> cafE<eacute>X<index entry>.

    my $x = 1;   # verbatim code

=over 4

=item *

First bullet.

=item open FILEHANDLE

Opens a file.

=back

=begin html

<p>raw html</p>

=end html

=for comment dropped note

=cut

sub code_after { }
)pod";

// A document of prose long enough to be kept (kMinDocsDocumentBytes).
std::string rst_doc(const std::string& title) {
  return cat(title, "\n", std::string(title.size(), '='), "\n\n", "This paragraph about ", title,
             " is long enough to count as prose, so the\n",
             "document that holds it is kept by the corpus loader rather than dropped\n",
             "as a stub, which is what a table of contents would be.\n");
}

std::vector<DocsSource> sample_sources(const fs::path& root) {
  return {{"pkg-rst", root / "rst", "a.rst.txt", ".rst.txt", DocsMarkup::kRst, {"translations"}},
          {"pkg-pod", root / "pod", "p.pod", ".pod", DocsMarkup::kPod, {}}};
}

// rst/: a, b, sub/c (kept), copy (a duplicate once cleaned), stub (too short), a link,
// a file with another suffix and translations/ (skipped); pod/: p (kept).
void write_sample_tree(const fs::path& root, bool reverse_order) {
  fs::create_directories(root / "rst" / "sub");
  fs::create_directories(root / "rst" / "translations");
  fs::create_directories(root / "pod");
  std::vector<std::pair<fs::path, std::string>> files = {
      {root / "rst" / "a.rst.txt", rst_doc("Alpha")},
      {root / "rst" / "b.rst.txt", rst_doc("Bravo")},
      {root / "rst" / "sub" / "c.rst.txt", rst_doc("Charlie")},
      {root / "rst" / "copy.rst.txt", ".. a comment, so the file differs\n\n" + rst_doc("Alpha")},
      {root / "rst" / "stub.rst.txt", "Contents\n========\n\n.. toctree::\n\n   a\n   b\n"},
      {root / "rst" / "notes.txt", rst_doc("Not a source")},
      {root / "rst" / "translations" / "x.rst.txt", rst_doc("Translated")},
      {root / "pod" / "p.pod",
       cat("=head1 Papa\n\n", "This paragraph about Papa is long enough to count as prose, ",
           "so the POD document that holds it is kept\nby the corpus loader, and its verbatim ",
           "code is not: a verbatim paragraph\nstarts with whitespace.\n\n    my $code = 1;\n")}};
  if (reverse_order) std::reverse(files.begin(), files.end());
  for (const auto& [path, text] : files) write_text(path, text);
  fs::create_symlink("a.rst.txt", root / "rst" / "link.rst.txt");
}

}  // namespace

TEST_CASE("the rst cleaner keeps titles, paragraphs, lists and directive prose and drops code, tables and markup") {
  CHECK(clean_rst(kSampleRst) ==
        "A Guide to the Kernel\n"
        "Author: A. Person\n"
        "This guide explains why the kernel is built the way it is, with bold and literal words, a link to a "
        "section and a kmalloc() call. See the site and PEP 8.\n"
        "Example:\n"
        "Usage\n"
        "Read this first.\n"
        "Notes are prose too.\n"
        "open(file, mode='r')\n"
        "Open a file.\n"
        "New in version 3.9.\n"
        "- first item, continued\n"
        "- second item\n"
        "Term\n"
        "Its definition.\n"
        "Section\n"
        "Last paragraph here.\n");
  CHECK(clean_rst("") == "");
  CHECK(clean_rst(".. only a comment\n\n::\n\n   code\n") == "");
}

TEST_CASE("the cleaners keep printable ASCII and valid UTF-8, collapse whitespace and drop lines that are not text") {
  CHECK(clean_rst("Tabs\tand   spaces,\x01 a control byte, a bad \xff byte, caf\xc3\xa9 kept,\xc2\xa0no-break "
                  "space,\r\nand ----- a rule.\n") ==
        "Tabs and spaces, a control byte, a bad byte, caf\xc3\xa9 kept, no-break space, and a rule.\n");
  CHECK(clean_rst("0x0000 0x001f 0x00ff 0x7fff\n\nProse stays.\n") == "Prose stays.\n");
  CHECK(clean_pod("=pod\n\nTabs\tand   spaces \xff here.\n") == "Tabs and spaces here.\n");
}

TEST_CASE("the POD cleaner keeps headings, paragraphs and items and drops verbatim code, regions and non-POD") {
  CHECK(clean_pod(kSamplePod) ==
        "NAME\n"
        "perlthing - a bold test of italic and $a->b codes\n"
        "Links\n"
        "See \"open\" in perlfunc, the manual, \"Other section\" and http://example.org; <tag> caf\xc3\xa9.\n"
        "- First bullet.\n"
        "open FILEHANDLE\n"
        "Opens a file.\n");
  CHECK(clean_document(kSamplePod, DocsMarkup::kPod) == clean_pod(kSamplePod));
  CHECK(clean_document(kSampleRst, DocsMarkup::kRst) == clean_rst(kSampleRst));
}

TEST_CASE("the docs corpus reads files in path order, drops duplicates and stubs, and splits by whole documents") {
  TempDir dir;
  write_sample_tree(dir.path, false);
  const std::vector<DocsSource> sources = sample_sources(dir.path);
  const ByteTokenizer tok;
  // Kept, in order: a (0), b (1), sub/c (2), p (3). 0.5: floor((i+1)/2) > floor(i/2) for i = 1, 3.
  const DocsCorpus c = load_docs_corpus(sources, 0.5);
  CHECK(c.files == std::vector<fs::path>{dir / "rst/a.rst.txt", dir / "rst/b.rst.txt", dir / "rst/copy.rst.txt",
                                         dir / "rst/stub.rst.txt", dir / "rst/sub/c.rst.txt", dir / "pod/p.pod"});
  CHECK(c.documents == 4);
  CHECK(c.val_documents == 2);
  CHECK(c.duplicates == 1);
  CHECK(c.short_docs == 1);
  REQUIRE(c.sources.size() == 2);
  CHECK(c.sources[0].package == "pkg-rst");
  CHECK(c.sources[0].files == 5);
  CHECK(c.sources[0].documents == 3);
  CHECK(c.sources[1].documents == 1);
  const std::string a = clean_rst(rst_doc("Alpha")) + "\n";
  const std::string b = clean_rst(rst_doc("Bravo")) + "\n";
  const std::string ch = clean_rst(rst_doc("Charlie")) + "\n";
  CHECK(a.starts_with("Alpha\nThis paragraph about Alpha is long enough"));
  CHECK(tok.decode(c.train) == a + ch);
  const std::string val = tok.decode(c.val);
  CHECK(val.starts_with(b + "Papa\nThis paragraph about Papa"));
  CHECK(val.find("my $code") == std::string::npos);
  CHECK(c.sources[0].bytes + c.sources[1].bytes == static_cast<std::int64_t>(c.train.size() + c.val.size()));

  CHECK(error_of([&] { load_docs_corpus(sources, 0.1); }).find("leaves the validation split empty") !=
        std::string::npos);
}

TEST_CASE("the docs corpus is the same bytes on every run, whatever order its files were written in") {
  TempDir one;
  TempDir two;
  write_sample_tree(one.path, false);
  write_sample_tree(two.path, true);
  const std::vector<DocsSource> s1 = sample_sources(one.path);
  const std::vector<DocsSource> s2 = sample_sources(two.path);
  const DocsCorpus first = load_docs_corpus(s1, 0.5);
  const DocsCorpus again = load_docs_corpus(s1, 0.5);
  const DocsCorpus other = load_docs_corpus(s2, 0.5);
  CHECK(first.train == again.train);
  CHECK(first.val == again.val);
  CHECK(first.train == other.train);
  CHECK(first.val == other.val);
  CHECK(!first.train.empty());
}

TEST_CASE("a missing docs package is named with the apt-get command that installs it") {
  TempDir dir;
  fs::create_directories(dir / "pod");
  write_text(dir / "pod" / "perldiag.pod", "=head1 NAME\n\nperldiag, which another package installs\n");
  const std::vector<DocsSource> sources = {
      {"linux-doc-6.1", dir / "nowhere", "process/howto.rst.txt", ".rst.txt", DocsMarkup::kRst, {}},
      {"perl-doc", dir / "pod", "perlfunc.pod", ".pod", DocsMarkup::kPod, {}}};
  const std::string e = error_of([&] { load_docs_corpus(sources); });
  CHECK(e.find("the documentation corpus is not installed") != std::string::npos);
  CHECK(e.find("nowhere/process/howto.rst.txt' (linux-doc-6.1)") != std::string::npos);
  CHECK(e.find("perlfunc.pod' (perl-doc)") != std::string::npos);
  CHECK(e.find("apt-get install linux-doc-6.1 perl-doc`") != std::string::npos);
  CHECK(e.find("--data") != std::string::npos);

  std::string packages;
  for (const DocsSource& s : default_docs_sources()) packages += s.package + " ";
  CHECK(packages == "linux-doc-6.1 python3.11-doc perl-doc llvm-15-doc ");
}

TEST_CASE("the installed docs corpus loads (skipped without its packages)") {
  const std::vector<DocsSource> sources = default_docs_sources();
  for (const DocsSource& s : sources) {
    if (!fs::is_regular_file(s.root / s.probe)) {
      MESSAGE("skipped: ", s.package, " is not installed (apt-get install ", s.package, ")");
      return;
    }
  }
  const DocsCorpus c = load_docs_corpus();
  const auto bytes = static_cast<double>(c.train.size() + c.val.size());
  MESSAGE("docs: ", c.files.size(), " files, ", c.documents, " documents, ", c.train.size(), " train + ", c.val.size(),
          " val bytes, unigram entropy ", unigram_entropy(c.train), " nats");
  CHECK(c.documents > 3000);
  CHECK(bytes > 25e6);
  const double val_share = static_cast<double>(c.val.size()) / bytes;
  CHECK(val_share > 0.05);
  CHECK(val_share < 0.15);
  const double h = unigram_entropy(c.train);
  CHECK(h > 2.5);
  CHECK(h < 4.0);
}
