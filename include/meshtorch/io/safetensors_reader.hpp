#pragma once
// Safetensors streamed both ways, for files too large to hold whole: a writer that takes the
// header first and then one tensor at a time, hashing every byte it writes, and a reader that
// reads only the rows of one tensor a caller asks for (pread, no mapping, so only those bytes
// reach memory). io/safetensors.hpp's load_safetensors reads whole files; this is its
// counterpart for sharded checkpoints and consolidation.
//
// Checksums are XXH3-64 (io/xxh3.hpp); it hashes far above disk speed, so verifying a checkpoint
// costs one read of it and no CPU to speak of.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/xxh3.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

// A file's size and XXH3-64 checksum, as a checkpoint manifest records them.
struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
  friend bool operator==(const FileDigest&, const FileDigest&) = default;
};

MESHTORCH_DECL std::string checksum_hex(std::uint64_t value);

// Reads the whole file in 4 MiB blocks (never more in memory).
MESHTORCH_DECL FileDigest digest_file(const std::filesystem::path& path);

struct TensorEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<std::int64_t> shape;
  std::uint64_t bytes() const {
    std::uint64_t n = c10::elementSize(dtype);
    for (auto s : shape) n *= static_cast<std::uint64_t>(s);
    return n;
  }
};

// Writes a safetensors file atomically from a header known in advance, then the tensors one at
// a time in header order; hashes what it writes. A tensor on another device or with other
// strides is staged through one CPU copy of itself (the largest such copy is recorded).
class SafetensorsStreamWriter {
 public:
  MESHTORCH_DECL SafetensorsStreamWriter(const std::filesystem::path& path, std::vector<TensorEntry> entries,
                                         const std::map<std::string, std::string>& metadata = {});

  // The next tensor in header order.
  MESHTORCH_DECL void append(const torch::Tensor& tensor);

  MESHTORCH_DECL FileDigest commit();

  // Elements of the largest tensor this writer had to copy (0 when every tensor was written
  // from its own CPU memory): how a test shows saving gathers nothing.
  std::int64_t largest_staging_numel() const { return largest_staging_numel_; }

 private:
  MESHTORCH_DECL void write(const void* data, std::size_t size);

  std::filesystem::path path_;
  std::vector<TensorEntry> entries_;
  AtomicFile file_;
  XXH3_state_t state_;
  std::uint64_t bytes_ = 0;
  std::size_t next_ = 0;
  std::int64_t largest_staging_numel_ = 0;
};

// Reads the header of a safetensors file once, then any rows of any tensor on demand.
class SafetensorsRangeReader {
 public:
  MESHTORCH_DECL explicit SafetensorsRangeReader(const std::filesystem::path& path);
  SafetensorsRangeReader(const SafetensorsRangeReader&) = delete;
  SafetensorsRangeReader& operator=(const SafetensorsRangeReader&) = delete;
  MESHTORCH_DECL ~SafetensorsRangeReader();

  const std::filesystem::path& path() const { return path_; }

  // The tensor's dtype and shape, or nullptr when the file has no tensor of that name.
  const TensorEntry* find(const std::string& name) const {
    const auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }

  // Rows [first_row, first_row + count) of a tensor (the whole of a 0-d one), read from disk
  // into a new CPU tensor: only those bytes are read.
  MESHTORCH_DECL torch::Tensor read_rows(const std::string& name, std::int64_t first_row, std::int64_t count) const;

  // The whole tensor.
  MESHTORCH_DECL torch::Tensor read(const std::string& name) const;

 private:
  struct Located : TensorEntry {
    std::uint64_t begin = 0, end = 0;  // in the data section
  };

  MESHTORCH_DECL void read_header();

  [[noreturn]] MESHTORCH_DECL void fail(const std::string& what) const;

  MESHTORCH_DECL void read_exactly(void* into, std::uint64_t size, std::uint64_t offset, const std::string& what) const;

  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t data_start_ = 0;
  std::map<std::string, Located> entries_;
};

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(programs)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
namespace meshtorch::io {

MESHTORCH_DECL std::string checksum_hex(std::uint64_t value) { return fmt::format("{:016x}", value); }

MESHTORCH_DECL FileDigest digest_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw DataError(fmt::format("{}: cannot open ({})", path.string(), std::strerror(errno)));
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  std::vector<char> block(std::size_t{4} << 20);
  FileDigest digest;
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      throw DataError(fmt::format("{}: read failed ({})", path.string(), std::strerror(error)));
    }
    if (n == 0) break;
    XXH3_64bits_update(&state, block.data(), static_cast<std::size_t>(n));
    digest.bytes += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  digest.xxh3 = XXH3_64bits_digest(&state);
  return digest;
}

MESHTORCH_DECL SafetensorsStreamWriter::SafetensorsStreamWriter(const std::filesystem::path& path,
                                                                std::vector<TensorEntry> entries,
                                                                const std::map<std::string, std::string>& metadata)
    : path_(path), entries_(std::move(entries)), file_(path) {
  XXH3_64bits_reset(&state_);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& e : entries_) {
    if (e.name == "__metadata__" || header.contains(e.name))
      throw DataError(fmt::format("{}: tensor name '{}' appears twice or is reserved", path.string(), e.name));
    header[e.name] = {{"dtype", safetensors_detail::dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes()}}};
    offset += e.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // 8-byte aligned data, as HF writes it
  unsigned char size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<unsigned char>(std::uint64_t{text.size()} >> (8 * i));
  write(size_bytes, 8);
  write(text.data(), text.size());
}

MESHTORCH_DECL void SafetensorsStreamWriter::append(const torch::Tensor& tensor) {
  if (next_ >= entries_.size())
    throw DataError(fmt::format("{}: more tensors appended than the header's {}", path_.string(), entries_.size()));
  const auto& e = entries_[next_];
  if (tensor.scalar_type() != e.dtype || tensor.sizes().vec() != e.shape)
    throw DataError(fmt::format("{}: tensor '{}' is {} [{}], the header says {} [{}]", path_.string(), e.name,
                                c10::toString(tensor.scalar_type()), fmt::join(tensor.sizes(), ", "),
                                c10::toString(e.dtype), fmt::join(e.shape, ", ")));
  auto cpu = tensor.detach();
  if (!cpu.device().is_cpu() || !cpu.is_contiguous()) {
    cpu = cpu.to(torch::kCPU).contiguous();
    largest_staging_numel_ = std::max(largest_staging_numel_, cpu.numel());
  }
  write(cpu.data_ptr(), e.bytes());
  ++next_;
}

MESHTORCH_DECL FileDigest SafetensorsStreamWriter::commit() {
  if (next_ != entries_.size())
    throw DataError(fmt::format("{}: {} of {} tensors written", path_.string(), next_, entries_.size()));
  file_.commit();
  return FileDigest{bytes_, XXH3_64bits_digest(&state_)};
}

MESHTORCH_DECL void SafetensorsStreamWriter::write(const void* data, std::size_t size) {
  file_.write(data, size);
  XXH3_64bits_update(&state_, data, size);
  bytes_ += size;
}

MESHTORCH_DECL SafetensorsRangeReader::SafetensorsRangeReader(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY);
  if (fd_ < 0) throw DataError(fmt::format("{}: cannot open ({})", path.string(), std::strerror(errno)));
  try {
    read_header();
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MESHTORCH_DECL SafetensorsRangeReader::~SafetensorsRangeReader() { ::close(fd_); }

MESHTORCH_DECL torch::Tensor SafetensorsRangeReader::read_rows(const std::string& name, std::int64_t first_row,
                                                               std::int64_t count) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) fail(fmt::format("tensor '{}' is missing", name));
  const auto& e = it->second;
  auto shape = e.shape;
  std::uint64_t offset = e.begin;
  if (!shape.empty()) {
    if (first_row < 0 || count < 0 || first_row + count > shape[0])
      fail(fmt::format("tensor '{}': rows [{}, {}) lie outside its {} rows", name, first_row, first_row + count,
                       shape[0]));
    const std::uint64_t row_bytes = shape[0] == 0 ? 0 : e.bytes() / static_cast<std::uint64_t>(shape[0]);
    offset += row_bytes * static_cast<std::uint64_t>(first_row);
    shape[0] = count;
  }
  auto out = torch::empty(shape, torch::TensorOptions().dtype(e.dtype));
  read_exactly(out.data_ptr(), static_cast<std::uint64_t>(out.numel()) * out.element_size(), data_start_ + offset,
               fmt::format("tensor '{}'", name));
  return out;
}

MESHTORCH_DECL torch::Tensor SafetensorsRangeReader::read(const std::string& name) const {
  const auto* e = find(name);
  if (!e) fail(fmt::format("tensor '{}' is missing", name));
  return read_rows(name, 0, e->shape.empty() ? 0 : e->shape[0]);
}

MESHTORCH_DECL void SafetensorsRangeReader::read_header() {
  struct stat info {};
  ::fstat(fd_, &info);
  const auto file_size = static_cast<std::uint64_t>(info.st_size);
  if (file_size < 8) fail(fmt::format("too short to be safetensors ({} bytes)", file_size));
  unsigned char size_bytes[8];
  read_exactly(size_bytes, 8, 0, "the header length");
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  if (header_size > file_size - 8 || header_size > (std::uint64_t{100} << 20))
    fail(fmt::format("header length {} exceeds the file ({} bytes); truncated or not safetensors", header_size,
                     file_size));
  std::string text(header_size, '\0');
  read_exactly(text.data(), header_size, 8, "the header");
  data_start_ = 8 + header_size;
  const std::uint64_t data_size = file_size - data_start_;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(fmt::format("header is not valid JSON ({})", e.what()));
  }
  if (!header.is_object()) fail("header is not a JSON object");
  for (const auto& [name, info_json] : header.items()) {
    if (name == "__metadata__") continue;
    const auto bad = [&](const std::string& what) { fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!info_json.is_object() || !info_json.contains("dtype") || !info_json["dtype"].is_string() ||
        !info_json.contains("shape") || !info_json["shape"].is_array() || !info_json.contains("data_offsets") ||
        !info_json["data_offsets"].is_array() || info_json["data_offsets"].size() != 2)
      bad("needs dtype, shape and data_offsets [begin, end]");
    Located entry;
    entry.name = name;
    const auto dtype = safetensors_detail::dtype_from_name(info_json["dtype"].get<std::string>());
    if (!dtype) bad(fmt::format("unsupported dtype '{}'", info_json["dtype"].get<std::string>()));
    entry.dtype = *dtype;
    for (const auto& d : info_json["shape"]) {
      if (!d.is_number_unsigned()) bad("shape must be a list of non-negative integers");
      entry.shape.push_back(d.get<std::int64_t>());
    }
    for (const auto& o : info_json["data_offsets"])
      if (!o.is_number_unsigned()) bad("data_offsets must be non-negative integers");
    entry.begin = info_json["data_offsets"][0].get<std::uint64_t>();
    entry.end = info_json["data_offsets"][1].get<std::uint64_t>();
    if (entry.begin > entry.end || entry.end > data_size)
      bad(fmt::format("data_offsets [{}, {}] lie outside the data section of {} bytes", entry.begin, entry.end,
                      data_size));
    if (entry.end - entry.begin != entry.bytes())
      bad(fmt::format("{} bytes do not match its shape and dtype ({} expected)", entry.end - entry.begin,
                      entry.bytes()));
    entries_.emplace(name, std::move(entry));
  }
}

MESHTORCH_DECL void SafetensorsRangeReader::fail(const std::string& what) const {
  throw DataError(fmt::format("{}: {}", path_.string(), what));
}

MESHTORCH_DECL void SafetensorsRangeReader::read_exactly(void* into, std::uint64_t size, std::uint64_t offset,
                                                        const std::string& what) const {
  auto* bytes = static_cast<char*>(into);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, bytes, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(fmt::format("reading {} failed ({})", what, std::strerror(errno)));
    if (n == 0) fail(fmt::format("reading {}: the file ends early (truncated?)", what));
    bytes += n;
    size -= static_cast<std::uint64_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(programs)
