#pragma once
// Data sets as training reads them: `builtin` in memory, anything else through its token cache
// (cached_dataset.hpp), as TokenBlocks over the mapped file.
//
// Link requirements: PCRE2, libsentencepiece and minja (CMake target meshtorch::tokenizers), and LibTorch.
#include <cstdint>
#include <filesystem>
#include <string>

#include <meshtorch/torch.hpp>

#include <meshtorch/data/cached_dataset.hpp>
#include <meshtorch/data/dataset.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

// Blocks over the cached ids without a copy (uint16 or int32, as the cache holds them): the tensor
// keeps the mapping alive.
MESHTORCH_DECL TokenBlocks blocks_of(const CachedTokens& cached, std::int64_t seq_length, std::string source);

// What an example calls with -d and -m on one process: 'builtin' in memory, anything else through
// its token cache. `note` (if given) receives the tokenizer and the data line for the log.
MESHTORCH_DECL TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length,
                                        const std::string& model_name_or_dir, std::string* note = nullptr,
                                        const std::string& subset = {});

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <fmt/format.h>

namespace meshtorch::data {

MESHTORCH_DECL TokenBlocks blocks_of(const CachedTokens& cached, std::int64_t seq_length, std::string source) {
  const auto dtype = cached.id_bytes == 2 ? torch::kUInt16 : torch::kInt;
  auto ids = cached.count == 0 ? torch::empty({0}, dtype)
                               : torch::from_blob(
                                     const_cast<void*>(cached.ids.get()), {static_cast<std::int64_t>(cached.count)},
                                     [mapping = cached.ids](void*) {}, torch::TensorOptions().dtype(dtype));
  return TokenBlocks(std::move(ids), seq_length, std::move(source), TokenBlocks::IdRange{cached.min_id, cached.max_id});
}

MESHTORCH_DECL TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length,
                                        const std::string& model_name_or_dir, std::string* note,
                                        const std::string& subset) {
  if (name == "builtin" && subset.empty()) {
    if (note) *note = "byte tokenizer (built-in corpus)";
    return load_dataset(name, seq_length);
  }
  CachedDataset dataset({.name = name, .subset = subset, .model = model_name_or_dir});
  bool built = false;
  const auto cached = dataset.open_or_build(&built);
  if (note) *note = fmt::format("{}; {}", dataset.tokenizer_note(), dataset.report(cached, seq_length, built));
  return blocks_of(cached, seq_length, dataset.source_name());
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
