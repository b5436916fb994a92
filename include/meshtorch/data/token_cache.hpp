#pragma once
// A data set's token ids, tokenised once and kept in a file that every later start maps into
// memory instead of reading: a 10 GB corpus costs each rank page cache, not private memory, and a
// cached start takes the time of an open and an mmap. No LibTorch (meshtorch-tokenize --prepare
// writes caches without it).
//
// On disk: the ids as little-endian uint16 (when the vocabulary has at most 65536 ids: GPT-2's,
// Llama 2's, the byte tokenizer's, llm.c's files) or int32 (Llama 3's 128256) from offset 0, then a
// 64-byte footer (written last, so a file cut short has none): magic "MTTOKEN2", the key, the id
// count, the documents, the lines skipped, the smallest and largest id, the files read, the bytes
// per id. The key hashes what the ids depend
// on (the tokenizer's files and each data file's path, size and modification time), so an edited
// data file or another tokenizer gets a file of its own. Written through AtomicFile: a crash
// leaves no file, never a half one.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/data/documents.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/xxh3.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

static_assert(std::endian::native == std::endian::little, "the token cache stores little-endian ids");

struct TokenCacheFooter {
  char magic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', '2'};
  std::uint64_t key = 0;
  std::uint64_t token_count = 0;
  std::uint64_t documents = 0;
  std::uint64_t skipped_lines = 0;
  std::int32_t min_id = 0;
  std::int32_t max_id = 0;
  std::uint64_t files = 0;
  std::uint32_t id_bytes = 4;  // 2 or 4
  std::uint32_t reserved = 0;
};
static_assert(sizeof(TokenCacheFooter) == 64);

// 2 when every id of a vocabulary of `vocab_size` fits 16 bits, else 4.
inline std::uint32_t id_bytes_for(std::int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// A key over strings: the tokenizer's identity, then each data file's stamp.
class TokenCacheKey {
 public:
  MESHTORCH_DECL TokenCacheKey();

  MESHTORCH_DECL void add(std::string_view text);
  // A file by content (tokenizer files: small, and a rewrite with the same stamp must not match).
  MESHTORCH_DECL void add_file_contents(const std::filesystem::path& path);
  // A data file by path, size and modification time: hashing a 10 GB corpus at every start
  // would cost what the cache saves. An edit changes the size or the time.
  MESHTORCH_DECL void add_file_stamp(const std::filesystem::path& path);

  MESHTORCH_DECL std::uint64_t value() const;

 private:
  XXH3_state_t state_{};
};

// The cached ids, over the mapped file (read-only), which stays mapped while a copy of `ids` lives:
// `count` ids of `id_bytes` bytes each (uint16 or int32).
struct CachedTokens {
  std::shared_ptr<const void> ids;
  std::size_t count = 0;
  std::uint32_t id_bytes = 4;
  std::int32_t min_id = 0, max_id = -1;
  TokenStreamStats stats;
  std::filesystem::path path;

  std::int32_t operator[](std::size_t i) const {
    return id_bytes == 2 ? static_cast<const std::uint16_t*>(ids.get())[i]
                         : static_cast<const std::int32_t*>(ids.get())[i];
  }
  MESHTORCH_DECL std::vector<std::int32_t> to_vector() const;
};

MESHTORCH_DECL std::filesystem::path token_cache_path(const std::filesystem::path& cache_dir, std::uint64_t key);

// The cache file for `key` mapped, or nullopt with `why` when it is absent, belongs to another
// key, or is cut short (the caller then tokenises again and replaces it).
MESHTORCH_DECL std::optional<CachedTokens> open_token_cache(const std::filesystem::path& path, std::uint64_t key,
                                                            std::string* why = nullptr);

// Appends ids to a new cache file and publishes it with its footer at finish().
class TokenCacheWriter {
 public:
  // `id_bytes`: 2 (every id below 65536; a larger one is an error) or 4.
  MESHTORCH_DECL TokenCacheWriter(const std::filesystem::path& path, std::uint64_t key, std::uint32_t id_bytes);

  MESHTORCH_DECL void append(std::span<const std::int32_t> ids);

  MESHTORCH_DECL void finish(const TokenStreamStats& stats);

 private:
  MESHTORCH_DECL static std::filesystem::path prepare(const std::filesystem::path& path);

  std::filesystem::path path_;
  io::AtomicFile file_;
  TokenCacheFooter footer_;
  std::vector<std::uint16_t> narrow_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(programs)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::data {

MESHTORCH_DECL TokenCacheKey::TokenCacheKey() {
  XXH3_64bits_reset(&state_);
  add("meshtorch token cache 2");
}

MESHTORCH_DECL void TokenCacheKey::add(std::string_view text) {
  const std::uint64_t size = text.size();  // the length first, so "ab"+"c" differs from "a"+"bc"
  XXH3_64bits_update(&state_, &size, sizeof size);
  XXH3_64bits_update(&state_, text.data(), text.size());
}

MESHTORCH_DECL void TokenCacheKey::add_file_contents(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return add(fmt::format("{}: absent", path.filename().string()));
  add(path.filename().string());
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw DataError(fmt::format("{}: cannot open ({})", path.string(), std::strerror(errno)));
  char block[1 << 16];
  for (ssize_t n; (n = ::read(fd, block, sizeof block)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw DataError(fmt::format("{}: read failed ({})", path.string(), std::strerror(errno)));
    }
    XXH3_64bits_update(&state_, block, static_cast<std::size_t>(n));
  }
  ::close(fd);
}

MESHTORCH_DECL void TokenCacheKey::add_file_stamp(const std::filesystem::path& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0)
    throw DataError(fmt::format("{}: cannot stat ({})", path.string(), std::strerror(errno)));
  add(fmt::format("{}|{}|{}.{:09}", std::filesystem::absolute(path).lexically_normal().string(), info.st_size,
                  info.st_mtim.tv_sec, info.st_mtim.tv_nsec));
}

MESHTORCH_DECL std::uint64_t TokenCacheKey::value() const { return XXH3_64bits_digest(&state_); }

MESHTORCH_DECL std::vector<std::int32_t> CachedTokens::to_vector() const {
  std::vector<std::int32_t> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = (*this)[i];
  return out;
}

MESHTORCH_DECL std::filesystem::path token_cache_path(const std::filesystem::path& cache_dir, std::uint64_t key) {
  return cache_dir / fmt::format("tokens-{:016x}.ids", key);
}

MESHTORCH_DECL std::optional<CachedTokens> open_token_cache(const std::filesystem::path& path, std::uint64_t key,
                                                            std::string* why) {
  auto refuse = [&](std::string reason) -> std::optional<CachedTokens> {
    if (why) *why = fmt::format("{}: {}", path.string(), reason);
    return std::nullopt;
  };
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    return refuse(errno == ENOENT ? "not written yet" : fmt::format("cannot open ({})", std::strerror(errno)));
  struct stat info {};
  TokenCacheFooter footer;
  const bool read_ok = ::fstat(fd, &info) == 0 && info.st_size >= static_cast<off_t>(sizeof footer) &&
                       ::pread(fd, &footer, sizeof footer, info.st_size - static_cast<off_t>(sizeof footer)) ==
                           static_cast<ssize_t>(sizeof footer);
  if (!read_ok || std::memcmp(footer.magic, TokenCacheFooter{}.magic, sizeof footer.magic) != 0) {
    ::close(fd);
    return refuse("no token-cache footer (cut short?)");
  }
  if (footer.key != key) {
    ::close(fd);
    return refuse(fmt::format("made for key {:016x}, not {:016x}", footer.key, key));
  }
  if (footer.id_bytes != 2 && footer.id_bytes != 4) {
    ::close(fd);
    return refuse(fmt::format("its footer says {} bytes per id (2 or 4 expected)", footer.id_bytes));
  }
  // The count is checked against the file before it is multiplied: 2^63 + n ids of 2 bytes wrapped
  // to the size of n ids, and the mapping then claimed 2^63 + n.
  const auto id_bytes_in_file = static_cast<std::uint64_t>(info.st_size) - sizeof footer;
  if (footer.token_count > id_bytes_in_file / footer.id_bytes) {
    ::close(fd);
    return refuse(fmt::format("{} bytes, fewer than its footer's {} ids of {} bytes", info.st_size, footer.token_count,
                              footer.id_bytes));
  }
  const auto bytes = footer.token_count * footer.id_bytes;
  if (static_cast<std::uint64_t>(info.st_size) != bytes + sizeof footer) {
    ::close(fd);
    return refuse(fmt::format("{} bytes, but its footer counts {} ids ({} bytes)", info.st_size, footer.token_count,
                              bytes + sizeof footer));
  }
  CachedTokens cached{.count = static_cast<std::size_t>(footer.token_count),
                      .id_bytes = footer.id_bytes,
                      .min_id = footer.min_id,
                      .max_id = footer.max_id,
                      .stats = {footer.files, footer.documents, footer.skipped_lines},
                      .path = path};
  if (footer.token_count == 0) {
    ::close(fd);
    return cached;
  }
  void* address = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (address == MAP_FAILED) return refuse(fmt::format("mmap of {} bytes failed ({})", bytes, std::strerror(errno)));
  cached.ids =
      std::shared_ptr<const void>(address, [bytes](const void* data) { ::munmap(const_cast<void*>(data), bytes); });
  return cached;
}

MESHTORCH_DECL TokenCacheWriter::TokenCacheWriter(const std::filesystem::path& path, std::uint64_t key,
                                                  std::uint32_t id_bytes)
    : path_(path), file_(prepare(path)) {
  footer_.key = key;
  footer_.id_bytes = id_bytes;
  footer_.min_id = std::numeric_limits<std::int32_t>::max();
  footer_.max_id = std::numeric_limits<std::int32_t>::min();
}

MESHTORCH_DECL void TokenCacheWriter::append(std::span<const std::int32_t> ids) {
  if (ids.empty()) return;
  const auto [low, high] = std::ranges::minmax(ids);
  footer_.min_id = std::min(footer_.min_id, low);
  footer_.max_id = std::max(footer_.max_id, high);
  footer_.token_count += ids.size();
  if (footer_.id_bytes == 4) return file_.write(ids.data(), ids.size_bytes());
  if (low < 0 || high > 65535)
    throw DataError(fmt::format("{}: token id {} does not fit the 16 bits the vocabulary promised", path_.string(),
                                low < 0 ? low : high));
  narrow_.assign(ids.begin(), ids.end());
  file_.write(narrow_.data(), narrow_.size() * sizeof(std::uint16_t));
}

MESHTORCH_DECL void TokenCacheWriter::finish(const TokenStreamStats& stats) {
  footer_.files = stats.files;
  footer_.documents = stats.documents;
  footer_.skipped_lines = stats.skipped_lines;
  if (footer_.token_count == 0) footer_.min_id = 0, footer_.max_id = -1;
  file_.write(&footer_, sizeof footer_);
  file_.commit();
}

MESHTORCH_DECL std::filesystem::path TokenCacheWriter::prepare(const std::filesystem::path& path) {
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  if (error)
    throw DataError(
        fmt::format("{}: cannot create the token cache folder ({}); set MESHTORCH_DATA_CACHE to a "
                    "writable folder",
                    path.parent_path().string(), error.message()));
  return path;
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(programs)
