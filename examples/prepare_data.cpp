// prepare_data — turns text into the token shards the trainer reads.
//
//   prepare_data --out data/shakespeare input.txt            # your text files
//   prepare_data --out data/fortunes --corpus fortunes       # the Debian fortunes corpus (2 MB)
//   prepare_data --out data/docs --corpus docs               # the kernel, Python, Perl, LLVM manuals (31 MB)
//
// writes PREFIX_train.bin and PREFIX_val.bin in llm.c's shard format, tokenized with the
// byte tokenizer (vocab 256). Text files are split per file (the last --val-fraction of
// each, from a line start, is validation); the corpora are split by whole documents, a
// fortune or a manual page (every 10th for 0.1). Both shards are always written, so a
// rerun never leaves a stale one. The shards are version 1 (uint16 tokens), or version 2
// (uint32) with --token-bits 32, the format of vocabularies above 65536.
#include <CLI/CLI.hpp>
#include <chrono>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "docs_corpus.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/data/shard.hpp"
#include "llmpar/data/tokenizer.hpp"

namespace {

void append(std::vector<std::uint16_t>& to, const std::vector<std::uint16_t>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

int main(int argc, char** argv) {
  namespace data = llmpar::data;
  namespace docs = llmpar::docs;
  try {
    CLI::App app{"Tokenize text into llm.c token shards PREFIX_train.bin and PREFIX_val.bin (byte tokenizer)."};
    std::string out;
    double val_fraction = 0.1;
    bool fortunes = false;
    std::string corpus_name;
    std::string fortunes_dir = data::kDefaultFortunesDir;
    std::vector<std::string> files;
    int token_bits = 16;
    app.add_option("--out", out, "Output prefix: writes PREFIX_train.bin and PREFIX_val.bin")->required();
    app.add_option("--val-fraction", val_fraction, "Fraction of the text kept for validation, in [0, 1)")
        ->capture_default_str();
    app.add_option("--corpus", corpus_name,
                   "Add a built-in corpus to the inputs: fortunes (Debian package `fortunes`, 2 MB) or docs (the "
                   "Linux kernel, Python, Perl and LLVM manuals: packages linux-doc-6.1 python3.11-doc perl-doc "
                   "llvm-15-doc, 31 MB)")
        ->check(CLI::IsMember({"fortunes", "docs"}));
    app.add_flag("--fortunes", fortunes, "Same as --corpus fortunes");
    app.add_option("--fortunes-dir", fortunes_dir, "Directory of fortune files (implies --fortunes)")
        ->capture_default_str();
    app.add_option("--token-bits", token_bits,
                   "Bits a token takes in the shards: 16 (llm.c's version 1) or 32 (version 2, for vocabularies "
                   "above 65536)")
        ->check(CLI::IsMember({16, 32}))
        ->capture_default_str();
    app.add_option("files", files, "Text files to tokenize");
    CLI11_PARSE(app, argc, argv);
    if (app.count("--fortunes-dir") > 0 || corpus_name == "fortunes") fortunes = true;
    const bool manuals = corpus_name == "docs";

    if (files.empty() && !fortunes && !manuals) {
      std::cerr << "prepare_data: no input; give text FILEs, or --corpus fortunes|docs for a built-in corpus\n"
                << app.help();
      return 1;
    }
    if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
      std::cerr << "prepare_data: --val-fraction " << val_fraction
                << " is out of range; it must be in [0, 1) (0.1 keeps a tenth of the text for validation)\n";
      return 1;
    }
    if (out.empty() || out.back() == '/') {
      std::cerr << "prepare_data: --out '" << out
                << "' is not a file prefix; give one like data/mytext (writes data/mytext_train.bin)\n";
      return 1;
    }

    const auto started = std::chrono::steady_clock::now();
    const data::ByteTokenizer tokenizer;
    data::TextCorpus corpus;
    corpus.vocab_size = tokenizer.vocab_size();
    if (fortunes) {
      data::TextCorpus f = data::load_text_corpus(fortunes_dir, val_fraction, tokenizer);
      std::cout << "read " << f.documents << " fortunes (" << f.val_documents << " for validation) from "
                << f.files.size() << " files in " << fortunes_dir << "\n";
      corpus = std::move(f);
    }
    if (manuals) {
      const docs::DocsCorpus d = docs::load_docs_corpus(val_fraction, tokenizer);
      for (const docs::DocsSourceStats& s : d.sources)
        std::cout << "  " << s.package << ": " << s.files << " files, " << s.documents << " documents, " << s.bytes
                  << " bytes of prose\n";
      std::cout << "read " << d.files.size() << " documentation files (" << d.source_bytes << " bytes): " << d.documents
                << " documents kept (" << d.val_documents << " for validation); dropped " << d.duplicates
                << " duplicates and " << d.short_docs << " with under " << docs::kMinDocsDocumentBytes
                << " bytes of prose\n";
      append(corpus.train, d.train);
      append(corpus.val, d.val);
    }
    if (!files.empty()) {
      const std::vector<std::filesystem::path> paths(files.begin(), files.end());
      const data::TextCorpus t = data::load_text_files(paths, val_fraction, tokenizer);
      std::cout << "read " << t.files.size() << " text file(s): " << t.train.size() + t.val.size() << " bytes\n";
      append(corpus.train, t.train);
      append(corpus.val, t.val);
    }

    const std::filesystem::path prefix(out);
    if (prefix.has_parent_path()) std::filesystem::create_directories(prefix.parent_path());
    const std::string train_path = out + "_train.bin";
    const std::string val_path = out + "_val.bin";
    const data::ShardWidth width = token_bits == 32 ? data::ShardWidth::uint32 : data::ShardWidth::narrowest;
    data::write_shard(train_path, corpus.train, width);
    data::write_shard(val_path, corpus.val, width);

    const char* format = token_bits == 32 ? " (version 2: uint32 tokens)" : "";
    std::cout << "wrote " << train_path << ": " << corpus.train.size() << " tokens" << format << "\n"
              << "wrote " << val_path << ": " << corpus.val.size() << " tokens" << format << "\n"
              << "tokenizer: bytes (vocab " << tokenizer.vocab_size() << "); unigram entropy of train " << std::fixed
              << std::setprecision(3) << data::unigram_entropy(corpus.train) << " nats/token\n"
              << "took " << std::setprecision(2)
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() << " s\n";
    if (corpus.val.empty())
      std::cout << "note: the validation shard is empty; raise --val-fraction or give more text to validate\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "prepare_data: " << e.what() << "\n";
    return 1;
  }
}
