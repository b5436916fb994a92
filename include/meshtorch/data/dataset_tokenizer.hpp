#pragma once
// Which tokenizer a data set is read with, and loading it so: a text or JSONL file (-d) with a model
// folder holding a tokenizer (-m) is tokenised by the folder's tokenizer; `builtin` keeps the byte
// tokenizer and an llm.c .bin file its own ids, as does any data set with a preset model.
//
// Link requirements: PCRE2 and libsentencepiece (CMake target meshtorch::tokenizers), and LibTorch.
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>

namespace meshtorch::data {

// The folder's tokenizer when it applies to `dataset_name`, else nullptr (the byte tokenizer or
// the file's own ids). `note` (if given) receives what was chosen, for the caller's log.
inline std::unique_ptr<TextTokenizer> tokenizer_for_dataset(const std::string& dataset_name,
                                                            const std::string& model_name_or_dir,
                                                            std::string* note = nullptr) {
  const auto ext = std::filesystem::path(dataset_name).extension().string();
  const bool text_data = dataset_name != "builtin" && ext != ".bin";
  if (!text_data || !folder_has_tokenizer(model_name_or_dir)) {
    if (note)
      *note = dataset_name == "builtin" || ext == ".bin"
                  ? "byte tokenizer (built-in corpus) or the file's own ids"
                  : fmt::format("byte tokenizer ({} holds no tokenizer)", model_name_or_dir);
    return nullptr;
  }
  return load_tokenizer(model_name_or_dir, note);
}

// A text (documents separated by blank lines) or JSONL file tokenised with `tokenizer` on
// `threads` threads (0: one per core), each document as [<bos>] ids <eos>, packed into blocks.
inline TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length, const TextTokenizer& tokenizer,
                                unsigned threads = 0) {
  const std::filesystem::path path(name);
  if (!std::filesystem::is_regular_file(path))
    throw DataError(fmt::format("-d/--dataset-name '{}' is not an existing text or JSONL file", name));
  const auto ext = path.extension().string();
  const auto documents = ext == ".jsonl" || ext == ".json" ? read_jsonl_documents(path) : read_text_documents(path);
  return TokenBlocks(tokenizer.encode_documents(documents, threads), seq_length, name);
}

// What an example calls with -d and -m: the folder's tokenizer for text and JSONL, otherwise
// load_dataset(name, seq_length) as before.
inline TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length, const std::string& model_name_or_dir,
                                std::string* note = nullptr) {
  if (const auto tokenizer = tokenizer_for_dataset(name, model_name_or_dir, note))
    return load_dataset(name, seq_length, *tokenizer);
  return load_dataset(name, seq_length);
}

}  // namespace meshtorch::data
