#pragma once
// A data set (-d, --dataset-subset) tokenised once into its token cache and mapped at every later
// start: which tokenizer reads it (the -m folder's when it has one, with its chat template for
// conversations, else the byte tokenizer; an llm.c .bin file's own ids), the cache file's key and
// place, writing it and opening it. No
// LibTorch: meshtorch-tokenize --prepare uses it; TokenBlocks over the cache is in
// dataset_tokenizer.hpp.
//
// Link requirements: PCRE2, libsentencepiece and minja (CMake target meshtorch::tokenizers).
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <meshtorch/data/chat_template.hpp>
#include <meshtorch/data/data_files.hpp>
#include <meshtorch/data/documents.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/data/token_cache.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

// Where a data set's token cache goes: $MESHTORCH_DATA_CACHE when set (a node-local folder when
// the data's folder is read-only, as the guide points $HF_HOME at node-local disk), else
// `.meshtorch-cache` in the data's folder.
MESHTORCH_DECL std::filesystem::path token_cache_dir(const DataFiles& data);

struct DatasetRequest {
  std::string name;    // -d: a file, folder or pattern (not 'builtin': it has no files to cache)
  std::string subset;  // --dataset-subset: a subfolder of the folder -d names
  std::string model;   // -m: its tokenizer is used when it has one
};

// A data set tokenised through its token cache (token_cache.hpp): the first start tokenises every
// file in batches on `threads` threads (0: one per core) into the cache file, later starts map it.
class CachedDataset {
 public:
  // Resolves the files and the cache file's key; the tokenizer itself is loaded only when the
  // cache has to be written (a cached start does not parse a 10 MB tokenizer.json).
  explicit CachedDataset(const DatasetRequest& request, unsigned threads = 0);

  const DataFiles& files() const { return data_; }
  const std::filesystem::path& cache_path() const { return cache_path_; }
  const std::string& tokenizer_note() const { return tokenizer_note_; }

  // The cache file mapped when it is there and current; otherwise nullopt and `why`.
  std::optional<CachedTokens> open(std::string* why = nullptr) const {
    return open_token_cache(cache_path_, key_, why);
  }

  // Tokenises every file into a new cache file (replacing a stale one only once it is complete).
  void build();

  // Opens the cache, building it first when needed; `built` says which happened.
  CachedTokens open_or_build(bool* built = nullptr);

  // "corpus.jsonl" or "data (subset train)": what error messages and the log call the data set.
  std::string source_name() const;

  // The data line a run logs: what was read, what packing into `seq_length` blocks keeps and
  // drops, what was skipped.
  std::string report(const CachedTokens& cached, std::int64_t seq_length, bool built) const;

 private:
  DatasetRequest request_;
  DataFiles data_;
  unsigned threads_ = 0;
  bool folder_tokenizer_ = false;
  std::string tokenizer_note_;
  std::uint64_t key_ = 0;
  std::filesystem::path cache_path_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <fmt/format.h>

namespace meshtorch::data {

MESHTORCH_DECL std::filesystem::path token_cache_dir(const DataFiles& data) {
  if (const char* dir = std::getenv("MESHTORCH_DATA_CACHE"); dir && *dir) return dir;
  return data.root / ".meshtorch-cache";
}

MESHTORCH_DECL CachedDataset::CachedDataset(const DatasetRequest& request, unsigned threads)
    : request_(request), data_(resolve_data_files(request.name, request.subset)), threads_(threads) {
  folder_tokenizer_ = !data_.tokenized && folder_has_tokenizer(request.model);
  TokenCacheKey key;
  if (data_.tokenized) {
    key.add("llm.c ids");
    tokenizer_note_ = "the llm.c files' own ids";
  } else if (folder_tokenizer_) {
    // The folder's tokenizer files decide which tokenizer is built and how: their contents are the key.
    key.add("folder tokenizer");
    for (const char* name : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                             "special_tokens_map.json", "chat_template.jinja"})
      key.add_file_contents(std::filesystem::path(request.model) / name);
    tokenizer_note_ = fmt::format("the tokenizer of {} (not loaded: its token cache is current)", request.model);
  } else {
    key.add("byte tokenizer");
    tokenizer_note_ = fmt::format("byte tokenizer ({} holds no tokenizer)", request.model);
  }
  for (const auto& file : data_.files) key.add_file_stamp(file);
  key_ = key.value();
  cache_path_ = token_cache_path(token_cache_dir(data_), key_);
}

MESHTORCH_DECL void CachedDataset::build() {
  DocumentEncoder encode = byte_encoder();
  std::unique_ptr<TextTokenizer> tokenizer;
  std::uint32_t id_bytes = 2;  // the byte tokenizer's 258 ids, and llm.c's uint16 files
  std::optional<ChatTemplate> chat_template;
  ChatRenderer chat;
  if (folder_tokenizer_) {
    tokenizer = load_tokenizer(request_.model, &tokenizer_note_);
    id_bytes = id_bytes_for(tokenizer->vocab_size());
    encode = [&tokenizer, this](const DocumentBatch& batch, std::vector<std::int32_t>& out) {
      const auto ids = tokenizer->encode_documents(batch.texts, threads_, batch.from_chat_template);
      out.insert(out.end(), ids.begin(), ids.end());
    };
    // Loaded with the tokenizer, so a folder with a broken template fails here even when no
    // record is a conversation: the template is the model's, and the next data set may need it.
    chat_template = ChatTemplate::from_folder(request_.model);
    if (chat_template) {
      tokenizer_note_ += fmt::format("; chat template {}", chat_template->origin());
      chat = chat_template->for_training();
    }
  }
  TokenCacheWriter writer(cache_path_, key_, id_bytes);
  const auto stats = tokenize_files(
      data_, encode, [&](std::span<const std::int32_t> ids) { writer.append(ids); }, chat);
  writer.finish(stats);
}

MESHTORCH_DECL CachedTokens CachedDataset::open_or_build(bool* built) {
  if (auto cached = open()) {
    if (built) *built = false;
    return std::move(*cached);
  }
  build();
  if (built) *built = true;
  std::string why;
  if (auto cached = open(&why)) return std::move(*cached);
  throw DataError(fmt::format("the token cache just written cannot be read back: {}", why));
}

MESHTORCH_DECL std::string CachedDataset::source_name() const {
  return request_.subset.empty() ? request_.name : fmt::format("{} (subset {})", request_.name, request_.subset);
}

MESHTORCH_DECL std::string CachedDataset::report(const CachedTokens& cached, std::int64_t seq_length,
                                                 bool built) const {
  const auto blocks = static_cast<std::int64_t>(cached.count) / seq_length;
  const auto dropped = static_cast<std::int64_t>(cached.count) - blocks * seq_length;
  std::string text = fmt::format("{}: {} file(s)", source_name(), cached.stats.files);
  if (!data_.ignored.empty())
    text += fmt::format(" ({} other file(s) not read: {}{})", data_.ignored.size(),
                        data_.ignored.front().filename().string(), data_.ignored.size() > 1 ? ", ..." : "");
  if (!data_.tokenized) text += fmt::format(", {} document(s)", cached.stats.documents);
  text += fmt::format(", {} tokens in {} blocks of {}", cached.count, blocks, seq_length);
  if (dropped > 0) text += fmt::format("; the {} tokens after the last full block dropped", dropped);
  if (cached.stats.skipped_lines > 0) text += fmt::format("; {} blank line(s) skipped", cached.stats.skipped_lines);
  return text + fmt::format("; token cache {} ({})", cache_path_.string(), built ? "written now" : "reused");
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
