// docs_corpus.hpp — prepare_data's documentation corpus (the tool's code, not the
// library's): English prose from the manuals of the Linux kernel, Python, Perl and LLVM,
// as Debian ships their sources.
//
// A scaling-law sweep needs tens of MB of real English that no run repeats, and the
// fortunes corpus (2 MB) is too small. Four Debian 12 packages install hand-written
// manuals as plain text files, with no compression and no HTML to parse:
//   linux-doc-6.1   html/_sources/**/*.rst.txt   the kernel's Documentation, 21 MB of rst
//   python3.11-doc  html/_sources/**/*.rst.txt   the Python manuals, 11 MB of rst
//   perl-doc        pod/*.pod                    the Perl manuals and FAQ, 9 MB of POD
//   llvm-15-doc     html/_sources/**/*.rst.txt   the LLVM manuals, 6 MB of rst
// which clean to about 31 MB of prose.
// Both markups are line- and paragraph-oriented, so one pass over the lines tells prose
// from code, tables and directives without a full parser. (Man pages were the other
// candidate: troff needs groff to render, and is mostly reference, not prose.)
//
// The cleaners keep what a reader of the rendered page reads as running text —
// paragraphs, titles, list items, the bodies of notes and of function descriptions —
// and drop literal and code blocks (rst "::" blocks and code directives, POD verbatim
// paragraphs), doctests, tables, comments, link targets, directive options and
// markup-only lines. Inline markup is reduced to its visible text (:func:`open` ->
// open(), ``x`` -> x, `text <url>`_ -> text, C<x> -> x, L<text|page> -> text). Each
// paragraph is unwrapped onto one line (list items and definitions each start a line),
// whitespace is collapsed, and only printable ASCII and valid UTF-8 is kept, since the
// byte tokenizer would otherwise spend tokens on tabs, control bytes and broken
// sequences. A line that is mostly not letters (a hex dump, code that escaped the
// block rules) is dropped.
//
// load_docs_corpus reads each source's files in byte order of their paths, cleans
// them, drops documents with little prose and exact duplicates (of the cleaned text, so
// a page copied into two places counts once), and splits by whole documents as
// load_text_corpus does for fortunes (every 10th for 0.1), so a page is never half in
// train and half in validation. The result is a pure function of the installed files.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/data/tokenizer.hpp"

namespace llmpar::docs {

enum class DocsMarkup { kRst, kPod };

// A directory of documentation sources and the Debian package that installs it.
struct DocsSource {
  std::string package;         // named in the error when it is not installed
  std::filesystem::path root;  // searched recursively for files ending in `suffix`
  std::string probe;           // a file under root that only `package` installs
  std::string suffix;          // of the source files: ".rst.txt" (Sphinx's copies), ".pod"
  DocsMarkup markup = DocsMarkup::kRst;
  std::vector<std::string> skip;  // entries directly under root that are left out
};

// Debian 12's manuals. Left out: the kernel's translations/ (Chinese, Japanese, Korean,
// Italian, Spanish: the corpus is English), perltoc (the headings of every other page),
// perluniprops (tables of Unicode properties) and LLVM's AMDGPU/ (4 MB of instruction
// syntax tables). The Perl directory also holds perldiag.pod from perl-modules, hence
// the probe.
inline std::vector<DocsSource> default_docs_sources() {
  return {{.package = "linux-doc-6.1",
           .root = "/usr/share/doc/linux-doc-6.1/html/_sources",
           .probe = "process/howto.rst.txt",
           .suffix = ".rst.txt",
           .markup = DocsMarkup::kRst,
           .skip = {"translations"}},
          {.package = "python3.11-doc",
           .root = "/usr/share/doc/python3.11/html/_sources",
           .probe = "tutorial/index.rst.txt",
           .suffix = ".rst.txt",
           .markup = DocsMarkup::kRst,
           .skip = {}},
          {.package = "perl-doc",
           .root = "/usr/share/perl/5.36.0/pod",
           .probe = "perlfunc.pod",
           .suffix = ".pod",
           .markup = DocsMarkup::kPod,
           .skip = {"perltoc.pod", "perluniprops.pod"}},
          {.package = "llvm-15-doc",
           .root = "/usr/share/doc/llvm-15-doc/html/_sources",
           .probe = "LangRef.rst.txt",
           .suffix = ".rst.txt",
           .markup = DocsMarkup::kRst,
           .skip = {"AMDGPU"}}};
}

// A cleaned document shorter than this is a table of contents or a stub, not prose.
inline constexpr std::size_t kMinDocsDocumentBytes = 200;

// What one source contributed.
struct DocsSourceStats {
  std::string package;
  std::int64_t files = 0;
  std::int64_t documents = 0;  // kept
  std::int64_t bytes = 0;      // of the kept documents, cleaned
};

// TextCorpus plus what the cleaning dropped.
struct DocsCorpus : data::TextCorpus {
  std::vector<DocsSourceStats> sources;
  std::int64_t source_bytes = 0;  // of the files read, before cleaning
  std::int64_t duplicates = 0;    // documents identical to an earlier one, dropped
  std::int64_t short_docs = 0;    // documents under kMinDocsDocumentBytes once cleaned, dropped
};

namespace detail::prose {

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }
inline bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
inline bool is_upper(char c) { return c >= 'A' && c <= 'Z'; }
inline bool is_digit(char c) { return c >= '0' && c <= '9'; }
inline bool is_alnum(char c) { return is_alpha(c) || is_digit(c); }
inline bool is_punct(char c) { return c > 0x20 && c < 0x7f && !is_alnum(c); }
inline char to_lower(char c) { return is_upper(c) ? static_cast<char>(c - 'A' + 'a') : c; }

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Length of the valid UTF-8 sequence at s[i] (1 for ASCII), or 0 if it is not one.
inline std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = b(i);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned cp = 0;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
    cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (b(i + k) & 0x3f);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

// One output line: printable ASCII and valid UTF-8 only (no controls, no C1 controls,
// no byte-order marks, no-break spaces as spaces), runs of 4 or more of one punctuation
// character dropped, and whitespace collapsed to single spaces.
inline std::string normalise_line(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto space = [&] {
    if (!out.empty() && out.back() != ' ') out += ' ';
  };
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (is_punct(c)) {
      std::size_t run = 1;
      while (i + run < s.size() && s[i + run] == c) ++run;
      if (run >= 4) {
        space();
        i += run;
        continue;
      }
      out.append(s.substr(i, run));
      i += run;
      continue;
    }
    const std::size_t n = utf8_length(s, i);
    if (n == 0) {
      ++i;  // an invalid byte
    } else if (n == 1) {
      if (c == ' ' || c == '\t')
        space();
      else if (c > 0x20 && c < 0x7f)
        out += c;
      ++i;
    } else {
      const std::string_view seq = s.substr(i, n);
      if (seq == "\xc2\xa0") {
        space();
      } else if (seq != "\xef\xbb\xbf" && !(seq[0] == '\xc2' && static_cast<unsigned char>(seq[1]) < 0xa0)) {
        out.append(seq);
      }
      i += n;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// Whether a cleaned line reads as text: enough of it is letters and spaces (code,
// hex dumps and ASCII diagrams that escaped the block rules are mostly not), and it has
// a word.
inline bool reads_as_text(std::string_view s) {
  std::size_t letters = 0;
  std::size_t spaces = 0;
  std::size_t ascii = 0;
  for (const char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) continue;
    ++ascii;
    letters += is_alpha(c) ? 1 : 0;
    spaces += c == ' ' ? 1 : 0;
  }
  if (letters < 2) return false;
  return static_cast<double>(letters + spaces) >= 0.7 * static_cast<double>(ascii);
}

// Appends a paragraph (markup already removed) as one line, when it reads as text.
inline void append_line(std::string& out, std::string_view paragraph) {
  const std::string line = normalise_line(paragraph);
  if (!reads_as_text(line)) return;
  out += line;
  out += '\n';
}

}  // namespace detail::prose

namespace detail::rst {

using namespace ::llmpar::docs::detail::prose;

// One source line: its indentation in columns (tabs to multiples of 8, as docutils
// reads them) and its text without the indentation and trailing whitespace.
struct Line {
  int indent = 0;
  std::string_view text;  // empty: a blank line
};

inline std::vector<Line> split_lines(std::string_view s) {
  std::vector<Line> lines;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t eol = s.find('\n', pos);
    const std::size_t end = eol == std::string_view::npos ? s.size() : eol;
    std::string_view raw = s.substr(pos, end - pos);
    Line line;
    std::size_t i = 0;
    for (; i < raw.size() && (raw[i] == ' ' || raw[i] == '\t'); ++i)
      line.indent = raw[i] == '\t' ? (line.indent / 8 + 1) * 8 : line.indent + 1;
    line.text = trim(raw.substr(i));
    lines.push_back(line);
    pos = end + 1;
  }
  return lines;
}

// The end of the block that line `at` opens: the lines after it, up to `end`, that are
// blank or indented deeper than it, less trailing blank lines.
inline std::size_t block_end(std::span<const Line> lines, std::size_t at, std::size_t end) {
  std::size_t last = at;  // last non-blank line of the block
  for (std::size_t j = at + 1; j < end; ++j) {
    if (lines[j].text.empty()) continue;
    if (lines[j].indent <= lines[at].indent) break;
    last = j;
  }
  return last + 1;
}

// A line that is one punctuation character repeated (section adornments, transitions).
inline bool is_adornment(std::string_view t) {
  return t.size() >= 3 && is_punct(t[0]) && t.find_first_not_of(t[0]) == std::string_view::npos;
}

// "=====  =====": a simple table's border (at least two columns).
inline bool is_simple_table_border(std::string_view t) {
  return t.size() >= 3 && t[0] == '=' && t.back() == '=' && t.find_first_not_of("= ") == std::string_view::npos &&
         t.find(' ') != std::string_view::npos;
}

// "+----+----+" or "+====+": a grid table's border.
inline bool is_grid_table_border(std::string_view t) {
  return t.size() >= 3 && t[0] == '+' && (t[1] == '-' || t[1] == '=') &&
         t.find_first_not_of("+-=") == std::string_view::npos;
}

// ":Author: ..." or ":param x:" — a field list item or a directive option. A role at the
// start of a line (":ref:`x`") is not one: it is followed by a backquote.
inline bool is_field(std::string_view t) {
  if (t.size() < 3 || t[0] != ':' || t[1] == ':' || is_space(t[1])) return false;
  const std::size_t close = t.find(':', 1);
  if (close == std::string_view::npos || t[close - 1] == ' ') return false;
  return close + 1 == t.size() || is_space(t[close + 1]);
}

// "c:function" -> "function": the domain does not change what a directive or role is.
inline std::string_view without_domain(std::string_view name) {
  const std::size_t colon = name.rfind(':');
  return colon == std::string_view::npos ? name : name.substr(colon + 1);
}

// The name of a directive ".. name:: argument" (lowercased, domain kept: "c:function"),
// or empty when the explicit markup is not a directive.
inline std::string directive_name(std::string_view rest) {
  const std::size_t colons = rest.find("::");
  if (colons == std::string_view::npos || colons == 0) return {};
  if (colons + 2 < rest.size() && !is_space(rest[colons + 2])) return {};
  std::string name;
  for (const char c : rest.substr(0, colons)) {
    if (!is_alnum(c) && c != '-' && c != '_' && c != ':' && c != '+' && c != '.') return {};
    name += to_lower(c);
  }
  return name;
}

enum class DirectiveKind {
  kDrop,     // code, tables, navigation, metadata: the directive and its body go
  kBody,     // the body is prose; the argument is dropped
  kTitled,   // the argument is text (a note's first line, a function's signature) and the body prose
  kVersion,  // versionadded and friends: "New in version 3.9." and the body
};

// Whether `word` is one of the space-separated words of `list`.
inline bool in_word_list(std::string_view list, std::string_view word) {
  for (std::size_t at = list.find(word); at != std::string_view::npos; at = list.find(word, at + 1)) {
    const std::size_t after = at + word.size();
    if ((at == 0 || list[at - 1] == ' ') && (after == list.size() || list[after] == ' ')) return true;
  }
  return false;
}

inline DirectiveKind directive_kind(std::string_view name) {
  const std::string_view base = without_domain(name);
  constexpr std::string_view kDrop =
      "code-block code sourcecode literalinclude include highlight highlightlang toctree table list-table csv-table "
      "flat-table tabularcolumns math graphviz image figure kernel-figure kernel-render kernel-doc kernel-feat "
      "kernel-abi kernel-include maintainers-include raw parsed-literal productionlist doctest testcode testoutput "
      "testsetup testcleanup index module currentmodule moduleauthor sectionauthor codeauthor program default-role "
      "role contents sectnum meta title cssclass namespace namespace-push namespace-pop audit-event "
      "audit-event-table availability miscnews limited-api-list autosummary automodule autoclass autofunction only "
      "ifconfig";
  constexpr std::string_view kTitled =
      "admonition attention caution danger error hint important note tip warning seealso rubric topic sidebar "
      "centered function method classmethod staticmethod abstractmethod coroutinefunction coroutinemethod decorator "
      "decoratormethod class exception attribute data macro member type var struct union enum enumerator envvar "
      "option cmdoption describe object opcode pdbcommand 2to3fixer fixer";
  constexpr std::string_view kVersion = "versionadded versionchanged deprecated deprecated-removed";
  if (in_word_list(kDrop, base)) return DirectiveKind::kDrop;
  if (in_word_list(kTitled, base)) return DirectiveKind::kTitled;
  if (in_word_list(kVersion, base)) return DirectiveKind::kVersion;
  return DirectiveKind::kBody;
}

inline std::string version_sentence(std::string_view name, std::string_view argument) {
  const std::string_view version = argument.substr(0, argument.find(' '));
  const std::string_view rest = trim(argument.substr(version.size()));
  std::string s = name == "versionadded"     ? "New in version "
                  : name == "versionchanged" ? "Changed in version "
                                             : "Deprecated since version ";
  s += version;
  s += rest.empty() ? "." : ": ";
  s += rest;
  return s;
}

// Width of a list item's marker with the spaces after it ("- ", "12. ", "#. ", "(a) "),
// or 0 when the text does not start a list item.
inline std::size_t list_marker_width(std::string_view t) {
  std::size_t n = 0;
  if (t.size() >= 2 && (t[0] == '-' || t[0] == '*' || t[0] == '+') && t[1] == ' ') {
    n = 1;
  } else if (t.starts_with("\xe2\x80\xa2 ")) {  // U+2022 bullet
    n = 3;
  } else {
    const bool paren = t.starts_with('(');
    const std::size_t from = paren ? 1 : 0;
    std::size_t k = from;
    if (k < t.size() && t[k] == '#') {
      ++k;
    } else if (k + 1 < t.size() && is_alpha(t[k]) && !is_alpha(t[k + 1])) {
      ++k;  // a single letter: "a)", "(b)"
    } else {
      while (k < t.size() && k - from < 4 && is_digit(t[k])) ++k;
    }
    if (k == from || k - from > 3 || k >= t.size()) return 0;
    if (paren ? t[k] != ')' : (t[k] != '.' && t[k] != ')')) return 0;
    n = k + 1;
    if (n >= t.size() || t[n] != ' ') return 0;
  }
  while (n < t.size() && t[n] == ' ') ++n;
  return n;
}

// Kept lines and paragraph breaks (an empty text), in order.
struct Kept {
  int indent = 0;
  std::string text;
};

inline void paragraph_break(std::vector<Kept>& out) {
  if (!out.empty() && !out.back().text.empty()) out.push_back({});
}

// The block-level pass over lines [begin, end): drops what is not prose and appends
// the rest to `out`. Directive bodies are passed through it again.
inline void keep_prose_lines(std::span<const Line> lines, std::size_t begin, std::size_t end, std::vector<Kept>& out) {
  int literal_after = -1;    // text indentation of a paragraph that ended in "::", or -1
  int paragraph_indent = 0;  // text indentation of the current paragraph
  std::size_t i = begin;
  while (i < end) {
    const Line& line = lines[i];
    const std::string_view t = line.text;
    if (t.empty()) {
      paragraph_break(out);
      ++i;
      continue;
    }
    // The literal block a "::" announced: everything indented deeper than its paragraph.
    if (literal_after >= 0) {
      const int base = literal_after;
      literal_after = -1;
      if (line.indent > base) {
        while (i < end && (lines[i].text.empty() || lines[i].indent > base)) ++i;
        paragraph_break(out);
        continue;
      }
    }
    // Explicit markup: directives, comments, targets, footnotes, substitutions.
    if (t.starts_with("..") && (t.size() == 2 || t[2] == ' ')) {
      const std::size_t stop = block_end(lines, i, end);
      const std::string_view rest = trim(t.substr(2));
      const std::string name = directive_name(rest);
      paragraph_break(out);
      if (!name.empty()) {
        const DirectiveKind kind = directive_kind(name);
        const std::string_view argument = trim(rest.substr(rest.find("::") + 2));
        if (kind == DirectiveKind::kTitled && !argument.empty()) {
          out.push_back({line.indent, std::string(argument)});
          paragraph_break(out);
        } else if (kind == DirectiveKind::kVersion) {
          out.push_back({line.indent, version_sentence(without_domain(name), argument)});
          paragraph_break(out);
        }
        if (kind != DirectiveKind::kDrop) {
          // Options come first, before the first blank line; the head's other lines
          // continue the argument (a second signature) or begin the body (a note).
          std::size_t j = i + 1;
          while (j < stop && !lines[j].text.empty() && is_field(lines[j].text)) ++j;
          keep_prose_lines(lines, j, stop, out);
          paragraph_break(out);
        }
      }
      i = stop;
      continue;
    }
    // Tables: a grid table is every following line that starts with '+' or '|'; a simple
    // table runs to the border that is followed by a blank line.
    if (is_grid_table_border(t)) {
      ++i;
      while (i < end && !lines[i].text.empty() && (lines[i].text[0] == '+' || lines[i].text[0] == '|')) ++i;
      paragraph_break(out);
      continue;
    }
    if (is_simple_table_border(t)) {
      std::size_t j = i + 1;
      while (j < end && !(is_simple_table_border(lines[j].text) && (j + 1 == end || lines[j + 1].text.empty()))) ++j;
      i = j < end ? j + 1 : i + 1;
      paragraph_break(out);
      continue;
    }
    // Interactive sessions: the paragraph that starts with ">>>".
    if (t.starts_with(">>>")) {
      while (i < end && !lines[i].text.empty()) ++i;
      paragraph_break(out);
      continue;
    }
    if (t == "::") {
      literal_after = line.indent;
      paragraph_break(out);
      ++i;
      continue;
    }
    // Title adornments, transitions and other lines of punctuation only.
    if (t.find_first_not_of("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ ") == std::string_view::npos) {
      paragraph_break(out);
      ++i;
      continue;
    }
    // A field list item reads "Name: body" (":Author: A. Person"); one without a body
    // (":orphan:") is a flag for Sphinx. The body's further lines continue it.
    if (is_field(t)) {
      const std::size_t close = t.find(':', 1);
      const std::string_view body = trim(t.substr(close + 1));
      const bool more = i + 1 < end && !lines[i + 1].text.empty() && lines[i + 1].indent > line.indent;
      paragraph_break(out);
      if (!body.empty() || more) {
        std::string shown(t.substr(1, close - 1));
        shown += ": ";
        shown += body;
        out.push_back({more ? lines[i + 1].indent : line.indent, std::move(shown)});
      }
      ++i;
      continue;
    }
    // A line is a title when an adornment follows it; it is a paragraph of its own.
    const bool title = i + 1 < end && is_adornment(lines[i + 1].text) && lines[i + 1].indent == line.indent;
    if (title) paragraph_break(out);
    if (out.empty() || out.back().text.empty()) paragraph_indent = line.indent + static_cast<int>(list_marker_width(t));
    if (t.ends_with("::")) {
      // "Example::" reads "Example:", "text ::" reads "text"; a literal block follows,
      // indented deeper than the paragraph's text.
      std::string_view shown = t.substr(0, t.size() - 1);
      if (shown.size() >= 2 && shown[shown.size() - 2] == ' ') shown = trim(shown.substr(0, shown.size() - 1));
      out.push_back({line.indent, std::string(shown)});
      literal_after = paragraph_indent;
    } else {
      out.push_back({line.indent, std::string(t)});
    }
    if (title) {
      paragraph_break(out);
      ++i;  // the adornment
    }
    ++i;
  }
}

// Whether an inline-markup start at s[i] is allowed by what precedes it.
inline bool markup_may_open(std::string_view s, std::size_t i) {
  if (i == 0) return true;
  const char p = s[i - 1];
  return is_space(p) || p == '(' || p == '[' || p == '{' || p == '<' || p == '"' || p == '\'' || p == '-' || p == '/' ||
         p == ':';
}

// Whether an inline-markup end just before s[i] is allowed by what follows.
inline bool markup_may_close(std::string_view s, std::size_t i) {
  return i >= s.size() || is_space(s[i]) || (is_punct(s[i]) && s[i] != '`');
}

// The visible text of `text <target>`, `<target>` and `~a.b.c`.
inline std::string shown_text(std::string_view content, bool is_ref) {
  if (content.ends_with('>')) {
    const std::size_t open = content.rfind('<');
    if (open != std::string_view::npos) {
      const std::string_view before = trim(content.substr(0, open));
      content = before.empty() ? content.substr(open + 1, content.size() - open - 2) : before;
      is_ref = false;  // an explicit title is shown as written
    }
  }
  if (content.starts_with('!')) content.remove_prefix(1);
  if (content.starts_with('~')) {
    content.remove_prefix(1);
    const std::size_t dot = content.rfind('.');
    if (dot != std::string_view::npos) content.remove_prefix(dot + 1);
  }
  std::string s(content);
  // A bare :ref: label stands for a section title; its words read better than its underscores.
  if (is_ref)
    for (char& c : s)
      if (c == '_' || c == '-') c = ' ';
  return s;
}

// Inline markup reduced to the text a reader sees.
inline std::string strip_inline_markup(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    // ``literal``: its content verbatim (backslashes included).
    if (c == '`' && s.substr(i).starts_with("``") && markup_may_open(s, i)) {
      std::size_t close = s.find("``", i + 2);
      while (close != std::string_view::npos && !markup_may_close(s, close + 2)) close = s.find("``", close + 1);
      if (close != std::string_view::npos && close > i + 2) {
        out.append(s.substr(i + 2, close - i - 2));
        i = close + 2;
        continue;
      }
    }
    // :role:`content`
    if (c == ':' && markup_may_open(s, i)) {
      std::size_t k = i + 1;
      while (k < s.size() && (is_alnum(s[k]) || s[k] == '-' || s[k] == '_' || s[k] == '.' || s[k] == '+' ||
                              (s[k] == ':' && k + 1 < s.size() && s[k + 1] != '`')))
        ++k;
      if (k > i + 1 && k + 1 < s.size() && s[k] == ':' && s[k + 1] == '`') {
        const std::size_t close = s.find('`', k + 2);
        if (close != std::string_view::npos) {
          std::string role(s.substr(i + 1, k - i - 1));
          for (char& r : role) r = to_lower(r);
          const std::string_view base = without_domain(role);
          const std::string_view content = s.substr(k + 2, close - k - 2);
          std::string text = shown_text(content, base == "ref");
          // As Sphinx shows them: :func:`f` -> f(), :pep:`8` -> PEP 8, :rfc:`2119` -> RFC 2119.
          if ((base == "func" || base == "meth") && !text.empty() && text.back() != ')') text += "()";
          if ((base == "pep" || base == "rfc") && !content.ends_with('>'))
            text = ::llmpar::detail::concat(base == "pep" ? "PEP " : "RFC ", text);
          out += text;
          i = close + 1;
          continue;
        }
      }
    }
    // `interpreted text`, `link <url>`_, `anonymous`__
    if (c == '`' && markup_may_open(s, i)) {
      const std::size_t close = s.find('`', i + 1);
      if (close != std::string_view::npos && close > i + 1) {
        out += shown_text(s.substr(i + 1, close - i - 1), false);
        i = close + 1;
        while (i < s.size() && s[i] == '_') ++i;
        continue;
      }
    }
    // **strong** and *emphasis*
    if (c == '*' && markup_may_open(s, i)) {
      const std::size_t width = s.substr(i).starts_with("**") ? 2 : 1;
      const std::string_view delim = s.substr(i, width);
      if (i + width < s.size() && !is_space(s[i + width]) && s[i + width] != '*') {
        std::size_t close = s.find(delim, i + width);
        while (close != std::string_view::npos && (is_space(s[close - 1]) || !markup_may_close(s, close + width) ||
                                                   (width == 1 && close + 1 < s.size() && s[close + 1] == '*')))
          close = s.find(delim, close + 1);
        if (close != std::string_view::npos) {
          out += strip_inline_markup(s.substr(i + width, close - i - width));
          i = close + width;
          continue;
        }
      }
    }
    // Footnote and citation references: "[1]_", "[#]_", "[#note]_", "[Knuth74]_".
    if (c == '[') {
      const std::size_t close = s.find("]_", i + 1);
      if (close != std::string_view::npos && close - i <= 32 &&
          s.substr(i + 1, close - i - 1).find_first_of(" []") == std::string_view::npos) {
        while (!out.empty() && out.back() == ' ') out.pop_back();
        i = close + 2;
        continue;
      }
    }
    // Escapes: "\ " joins markup to a word ("int\ s"), "\*" is a literal star.
    if (c == '\\') {
      if (i + 1 < s.size() && s[i + 1] != ' ') out += s[i + 1];
      i += 2;
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

}  // namespace detail::rst

// The prose of one reStructuredText document: one line per paragraph, title or list
// item, each ending in '\n'; empty when nothing in it is prose. See the note at the top
// for what is kept.
inline std::string clean_rst(std::string_view rst) {
  namespace r = detail::rst;
  const std::vector<r::Line> lines = r::split_lines(rst);
  std::vector<r::Kept> kept;
  r::keep_prose_lines(lines, 0, lines.size(), kept);

  std::string out;
  std::string joined;
  const auto flush = [&] {
    detail::prose::append_line(out, r::strip_inline_markup(joined));
    joined.clear();
  };
  // Unwrap each paragraph: a line continues the one before when it is indented as that
  // line's text is (a list item's text starts after its marker); anything else (a new
  // list item, a definition under its term) starts a line of its own.
  int continue_at = -1;
  for (const r::Kept& k : kept) {
    if (k.text.empty()) {
      if (!joined.empty()) flush();
      continue_at = -1;
      continue;
    }
    const std::size_t marker = r::list_marker_width(k.text);
    if (!joined.empty() && (marker > 0 || k.indent != continue_at)) flush();
    if (joined.empty()) {
      continue_at = k.indent + static_cast<int>(marker);
    } else {
      joined += ' ';
    }
    joined += k.text;
  }
  if (!joined.empty()) flush();
  return out;
}

namespace detail::pod {

using namespace ::llmpar::docs::detail::prose;

// UTF-8 of a code point (for E<233>).
inline void append_utf8(std::string& out, unsigned long cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | cp >> 6);
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | cp >> 12);
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x110000) {
    out += static_cast<char>(0xf0 | cp >> 18);
    out += static_cast<char>(0x80 | (cp >> 12 & 0x3f));
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// E<name>: POD's escapes and the HTML entities the Perl manuals use; others are dropped.
inline void append_entity(std::string& out, std::string_view name) {
  static constexpr std::pair<std::string_view, unsigned long> kNamed[] = {
      {"lt", '<'},      {"gt", '>'},      {"verbar", '|'},  {"sol", '/'},     {"quot", '"'},    {"amp", '&'},
      {"apos", '\''},   {"nbsp", ' '},    {"copy", 0xa9},   {"reg", 0xae},    {"aacute", 0xe1}, {"agrave", 0xe0},
      {"auml", 0xe4},   {"ccedil", 0xe7}, {"eacute", 0xe9}, {"egrave", 0xe8}, {"iacute", 0xed}, {"ntilde", 0xf1},
      {"oacute", 0xf3}, {"ouml", 0xf6},   {"szlig", 0xdf},  {"uacute", 0xfa}, {"uuml", 0xfc},   {"Eacute", 0xc9},
      {"Auml", 0xc4},   {"Ouml", 0xd6},   {"Uuml", 0xdc},   {"laquo", 0xab},  {"raquo", 0xbb},  {"mdash", 0x2014}};
  for (const auto& [n, cp] : kNamed)
    if (name == n) return append_utf8(out, cp);
  if (name.empty() || !is_digit(name[0])) return;
  const bool hex = name.starts_with("0x") || name.starts_with("0X");
  unsigned long cp = 0;
  for (const char c : name.substr(hex ? 2 : 0)) {
    const int d = is_digit(c) ? c - '0' : hex && to_lower(c) >= 'a' && to_lower(c) <= 'f' ? to_lower(c) - 'a' + 10 : -1;
    if (d < 0 || cp > 0x10ffff) return;
    cp = cp * (hex ? 16 : 10) + static_cast<unsigned long>(d);
  }
  append_utf8(out, cp);
}

inline void append_text(std::string& out, std::string_view s);

// L<text|target>, L<page>, L<page/section>, L</section>, L<"section">, L<url>: what
// perldoc shows.
inline void append_link(std::string& out, std::string_view content) {
  const std::size_t bar = content.find('|');
  if (bar != std::string_view::npos) return append_text(out, content.substr(0, bar));
  if (content.find("://") != std::string_view::npos) return append_text(out, content);
  std::string_view page = content;
  std::string_view section;
  if (content.starts_with('"')) {
    page = {};
    section = content;
  } else if (const std::size_t slash = content.find('/'); slash != std::string_view::npos) {
    page = content.substr(0, slash);
    section = content.substr(slash + 1);
  }
  if (section.size() >= 2 && section.front() == '"' && section.back() == '"')
    section = section.substr(1, section.size() - 2);
  if (section.empty()) return append_text(out, page);
  out += '"';
  append_text(out, section);
  out += '"';
  if (!page.empty()) {
    out += " in ";
    append_text(out, page);
  }
}

// Text with POD formatting codes (B<> I<> C<> F<> S<> L<> E<> X<> Z<>, also in the
// C<< x >> form) reduced to what a reader sees.
inline void append_text(std::string& out, std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const char code = s[i];
    if (is_upper(code) && i + 1 < s.size() && s[i + 1] == '<') {
      const std::size_t open = i + 1;
      std::size_t n = 0;
      while (open + n < s.size() && s[open + n] == '<') ++n;
      std::string_view content;
      std::size_t next = std::string_view::npos;
      if (n >= 2 && open + n < s.size() && is_space(s[open + n])) {
        // C<< x >>: ends at whitespace followed by as many '>'.
        const std::string closing(n, '>');
        std::size_t k = s.find(closing, open + n);
        while (k != std::string_view::npos && !is_space(s[k - 1])) k = s.find(closing, k + 1);
        if (k != std::string_view::npos) {
          content = trim(s.substr(open + n, k - open - n));
          next = k + n;
        }
      } else {
        // C<x>: ends at the '>' that closes it, counting nested codes.
        int depth = 1;
        std::size_t k = open + 1;
        for (; k < s.size(); ++k) {
          if (s[k] == '>' && --depth == 0) break;
          if (s[k] == '<' && is_upper(s[k - 1])) ++depth;
        }
        if (k < s.size()) {
          content = s.substr(open + 1, k - open - 1);
          next = k + 1;
        }
      }
      if (next != std::string_view::npos) {
        if (code == 'E') {
          append_entity(out, content);
        } else if (code == 'L') {
          append_link(out, content);
        } else if (code != 'X' && code != 'Z') {
          append_text(out, content);
        }
        i = next;
        continue;
      }
    }
    out += code;
    ++i;
  }
}

}  // namespace detail::pod

// The prose of one POD document, in the form clean_rst gives: one line per paragraph,
// heading or item. Verbatim (indented) paragraphs, =begin/=end and =for regions, and
// text outside =pod ... =cut are dropped.
inline std::string clean_pod(std::string_view pod) {
  namespace p = detail::pod;
  std::string out;
  bool in_pod = false;
  bool in_region = false;   // between =begin and =end
  std::string item_marker;  // "- " after "=item *": the marker of the next paragraph
  std::string paragraph;
  std::size_t pos = 0;
  while (pos < pod.size()) {
    // The next paragraph: lines up to a blank (or whitespace-only) line.
    while (pos < pod.size() && pod[pos] == '\n') ++pos;
    if (pos >= pod.size()) break;
    std::size_t end = pos;
    std::vector<std::string_view> lines;
    while (end < pod.size()) {
      const std::size_t eol = std::min(pod.find('\n', end), pod.size());
      const std::string_view line = pod.substr(end, eol - end);
      end = eol + (eol < pod.size() ? 1 : 0);
      if (p::trim(line).empty()) break;
      lines.push_back(line);
    }
    pos = end;
    if (lines.empty()) continue;
    const std::string_view first = lines.front();
    paragraph.clear();
    for (const std::string_view line : lines) {
      if (!paragraph.empty()) paragraph += ' ';
      paragraph += p::trim(line);
    }
    if (first.size() >= 2 && first[0] == '=' && p::is_alpha(first[1])) {
      std::size_t k = 1;
      while (k < paragraph.size() && (p::is_alnum(paragraph[k]) || paragraph[k] == '_')) ++k;
      const std::string_view command = std::string_view(paragraph).substr(1, k - 1);
      const std::string_view rest = p::trim(std::string_view(paragraph).substr(k));
      if (command == "cut") {
        in_pod = false;
        continue;
      }
      in_pod = true;
      if (in_region) {
        in_region = command != "end";
        continue;
      }
      if (command == "begin") {
        in_region = true;
      } else if (command.starts_with("head")) {
        std::string text;
        p::append_text(text, rest);
        detail::prose::append_line(out, text);
      } else if (command == "item") {
        // "=item *" and "=item 1." mark the next paragraph; "=item open FILEHANDLE" is a term.
        const std::size_t digits = rest.find_first_not_of("0123456789");
        const bool numbered = digits > 0 && (digits == std::string_view::npos || rest.substr(digits) == ".");
        item_marker.clear();
        if (rest == "*" || rest == "o") {
          item_marker = "- ";
        } else if (numbered) {
          item_marker = ::llmpar::detail::concat(rest.substr(0, digits), ". ");
        } else {
          std::string text = rest.starts_with("* ") ? "- " : "";
          p::append_text(text, rest.starts_with("* ") ? rest.substr(2) : rest);
          detail::prose::append_line(out, text);
        }
      }
      continue;  // =over, =back, =pod, =encoding, =for, ...
    }
    if (!in_pod || in_region) continue;
    if (first[0] == ' ' || first[0] == '\t') continue;  // verbatim: code
    std::string text = std::exchange(item_marker, {});
    p::append_text(text, paragraph);
    detail::prose::append_line(out, text);
  }
  return out;
}

// The prose of a document in either markup.
inline std::string clean_document(std::string_view text, DocsMarkup markup) {
  return markup == DocsMarkup::kPod ? clean_pod(text) : clean_rst(text);
}

namespace detail {

// The source files of each source, in byte order of their paths; an error naming the
// packages to install when a source is missing.
inline std::vector<std::vector<std::filesystem::path>> docs_files(std::span<const DocsSource> sources) {
  namespace fs = std::filesystem;
  std::string missing_roots;
  std::string missing_packages;
  std::vector<std::vector<fs::path>> files;
  for (const DocsSource& src : sources) {
    std::error_code ec;
    if (!fs::is_regular_file(src.root / src.probe, ec)) {
      missing_roots += ::llmpar::detail::concat(missing_roots.empty() ? "" : ", ", "'", (src.root / src.probe).string(),
                                                "' (", src.package, ")");
      missing_packages += ::llmpar::detail::concat(" ", src.package);
      continue;
    }
    std::vector<std::string> paths;
    fs::recursive_directory_iterator it(src.root, ec);
    LLMPAR_CHECK(!ec, "cannot list documentation directory '", src.root.string(), "': ", ec.message());
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      LLMPAR_CHECK(!ec, "cannot list documentation directory '", src.root.string(), "': ", ec.message());
      const fs::path& path = it->path();
      const std::string name = path.filename().string();
      if (it.depth() == 0 && std::find(src.skip.begin(), src.skip.end(), name) != src.skip.end()) {
        it.disable_recursion_pending();
        continue;
      }
      if (name.front() == '.' || !name.ends_with(src.suffix)) continue;
      const fs::file_status st = it->symlink_status(ec);
      if (ec || !fs::is_regular_file(st)) continue;  // links would read a page twice
      paths.push_back(path.string());
    }
    std::sort(paths.begin(), paths.end());
    files.emplace_back(paths.begin(), paths.end());
  }
  LLMPAR_CHECK(missing_packages.empty(), "the documentation corpus is not installed: ", missing_roots,
               " not found; install it with `apt-get install", missing_packages,
               "` (Debian 12), or pass --data with your own token shards");
  return files;
}

}  // namespace detail

// The documentation corpus, cleaned and tokenized: the files of each source in byte
// order of their paths, sources in the order given, each cleaned by clean_document;
// documents under kMinDocsDocumentBytes and exact duplicates are dropped, and each kept
// one is followed by a blank line. Kept document i goes to validation when
// floor((i+1)*val_fraction) > floor(i*val_fraction) (every 10th for 0.1), as for fortunes.
template <data::Tokenizer Tok = data::ByteTokenizer>
DocsCorpus load_docs_corpus(std::span<const DocsSource> sources, double val_fraction = 0.1,
                            const Tok& tokenizer = Tok{}) {
  data::detail::check_val_fraction(val_fraction);
  DocsCorpus corpus;
  corpus.vocab_size = tokenizer.vocab_size();
  const std::vector<std::vector<std::filesystem::path>> files = detail::docs_files(sources);
  std::unordered_set<std::string> seen;
  for (std::size_t s = 0; s < sources.size(); ++s) {
    DocsSourceStats stats{.package = sources[s].package, .files = static_cast<std::int64_t>(files[s].size())};
    for (const auto& file : files[s]) {
      corpus.files.push_back(file);
      const std::string text = data::detail::read_text_file(file);
      corpus.source_bytes += static_cast<std::int64_t>(text.size());
      std::string doc = clean_document(text, sources[s].markup);
      if (doc.size() < kMinDocsDocumentBytes) {
        ++corpus.short_docs;
        continue;
      }
      doc += '\n';
      if (!seen.insert(doc).second) {
        ++corpus.duplicates;
        continue;
      }
      const bool val = data::detail::is_val_document(corpus.documents++, val_fraction);
      corpus.val_documents += val ? 1 : 0;
      ++stats.documents;
      stats.bytes += static_cast<std::int64_t>(doc.size());
      data::detail::append_tokens(val ? corpus.val : corpus.train, tokenizer, doc);
    }
    corpus.sources.push_back(std::move(stats));
  }
  LLMPAR_CHECK(corpus.documents > 0, "the documentation corpus has no document with prose (", corpus.files.size(),
               " files read, ", corpus.short_docs, " under ", kMinDocsDocumentBytes, " bytes once cleaned)");
  LLMPAR_CHECK(val_fraction == 0.0 || !corpus.val.empty(), "val_fraction ", val_fraction, " of the ", corpus.documents,
               " documents leaves the validation split empty; raise val_fraction");
  return corpus;
}

// The Debian 12 manuals of default_docs_sources().
template <data::Tokenizer Tok = data::ByteTokenizer>
DocsCorpus load_docs_corpus(double val_fraction = 0.1, const Tok& tokenizer = Tok{}) {
  const std::vector<DocsSource> sources = default_docs_sources();
  return load_docs_corpus(std::span<const DocsSource>(sources), val_fraction, tokenizer);
}

}  // namespace llmpar::docs
