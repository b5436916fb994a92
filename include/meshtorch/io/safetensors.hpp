#pragma once
// Reading safetensors (an 8-byte little-endian header length, a JSON header of
// name -> {dtype, shape, data_offsets}, then raw little-endian data): the one reader of model
// folders and checkpoints alike. Written by hand because no Debian package offers a C++ reader.
// Loading runs no code, and the header is checked whole before anything is allocated: the
// bounded JSON parse (depth, repeated names), known dtypes, shapes whose bytes and strides fit
// 64 bits, offsets inside the data section that match the shape, no two tensors sharing bytes.
// A malformed file is a DataError naming the file and the tensor. Data is read with pread, only
// the bytes asked for: a rank reads its rows of a weight without the rest.
// io/safetensors_writer.hpp writes the format.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The dtype's name in safetensors headers ("BF16"); a DataError for a dtype the format lacks.
MESHTORCH_DECL std::string safetensors_dtype_name(torch::ScalarType type);
// The dtype of a name in a header, or nothing for a name this reader does not know.
MESHTORCH_DECL std::optional<torch::ScalarType> safetensors_dtype(std::string_view name);

// Bytes of a tensor of this dtype and shape (unchecked: for shapes of tensors that exist).
inline std::uint64_t safetensors_bytes(torch::ScalarType dtype, const std::vector<std::int64_t>& shape) {
  std::uint64_t n = c10::elementSize(dtype);
  for (const auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

// One tensor of a file: what the header says of it. Offsets count from the start of the data
// section; a writer assigns them.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;

  std::uint64_t bytes() const { return end - begin; }
  // Bytes of one row (of the whole tensor when 0-d).
  std::uint64_t row_bytes() const {
    if (shape.empty()) return bytes();
    return shape[0] == 0 ? 0 : bytes() / static_cast<std::uint64_t>(shape[0]);
  }
};

// A checked header: every entry's shape, dtype and offsets agree and lie inside the file, so
// allocating an entry's tensor never asks for more bytes than the file holds.
struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + the header's length
  std::uint64_t data_size = 0;
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;

  // The entry of that name, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const {
    const auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &entries[it->second];
  }
  bool contains(const std::string& name) const { return by_name.count(name) != 0; }

  std::map<std::string, std::size_t> by_name;  // index into entries
};

namespace safetensors_detail {

// HF's own limit on the header (safetensors' MAX_HEADER_SIZE).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// Checks the header's JSON `text` of a file of `file_size` bytes; `where` names the file.
MESHTORCH_DECL SafetensorsHeader parse_header(std::string_view text, std::uint64_t file_size, const std::string& where);

}  // namespace safetensors_detail

// A safetensors file whose header is read and checked once, then any tensor, or any rows of one,
// on demand. Holds the file open; reads are const and may run from several threads.
class SafetensorsReader {
 public:
  // A directory, pipe or device is refused without blocking; a missing file names the path.
  MESHTORCH_DECL explicit SafetensorsReader(const std::filesystem::path& path);
  SafetensorsReader(SafetensorsReader&& other) noexcept
      : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), header_(std::move(other.header_)) {}
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  MESHTORCH_DECL ~SafetensorsReader();

  const SafetensorsHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return path_; }

  // The entry of that name, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const { return header_.find(name); }
  // The entry of that name; a DataError naming the file when it lacks one.
  MESHTORCH_DECL const SafetensorsEntry& entry(const std::string& name) const;

  // The whole tensor, as a new CPU tensor.
  torch::Tensor read(const SafetensorsEntry& entry) const {
    return read_rows(entry, 0, entry.shape.empty() ? 0 : entry.shape[0]);
  }

  // Rows [first_row, first_row + count) of `entry` (one of header().entries) as a new CPU
  // tensor; a 0-d tensor whole.
  MESHTORCH_DECL torch::Tensor read_rows(const SafetensorsEntry& entry, std::int64_t first_row,
                                         std::int64_t count) const;

  // The same into `out`, a contiguous CPU tensor of that shape and the entry's dtype: a buffer
  // the caller reuses from one tensor to the next.
  MESHTORCH_DECL void read_rows_into(const SafetensorsEntry& entry, std::int64_t first_row, std::int64_t count,
                                     torch::Tensor& out) const;

 private:
  [[noreturn]] MESHTORCH_DECL void fail(const std::string& what) const;
  MESHTORCH_DECL void read_exactly(void* into, std::uint64_t size, std::uint64_t offset, const std::string& what) const;

  std::filesystem::path path_;
  int fd_ = -1;
  SafetensorsHeader header_;
};

// Reads and checks only the header: which tensors a file holds, without loading them.
inline SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  return SafetensorsReader(path).header();
}

struct SafetensorsFile {
  NamedTensors tensors;  // in the order of their data in the file
  std::map<std::string, std::string> metadata;

  const torch::Tensor* find(const std::string& name) const {
    for (const auto& [n, t] : tensors)
      if (n == name) return &t;
    return nullptr;
  }
};

// Every tensor of a file.
MESHTORCH_DECL SafetensorsFile load_safetensors(const std::filesystem::path& path);

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/io/json_file.hpp>

namespace meshtorch::io {

namespace safetensors_detail {

inline const std::vector<std::pair<std::string_view, torch::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string_view, torch::ScalarType>> names{
      {"F64", torch::kDouble}, {"F32", torch::kFloat}, {"F16", torch::kHalf},  {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},   {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return names;
}

}  // namespace safetensors_detail

MESHTORCH_DECL std::string safetensors_dtype_name(torch::ScalarType type) {
  for (const auto& [name, t] : safetensors_detail::dtype_names())
    if (t == type) return std::string(name);
  throw DataError(std::string("safetensors: unsupported dtype ") + c10::toString(type));
}

MESHTORCH_DECL std::optional<torch::ScalarType> safetensors_dtype(std::string_view name) {
  for (const auto& [n, t] : safetensors_detail::dtype_names())
    if (n == name) return t;
  return std::nullopt;
}

MESHTORCH_DECL SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  // O_NONBLOCK: opening a pipe for reading would otherwise wait for a writer.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) {
    if (errno == ENOENT) fail("no such file");
    fail(fmt::format("cannot open ({})", std::strerror(errno)));
  }
  try {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail(fmt::format("cannot read its size ({})", std::strerror(errno)));
    if (!S_ISREG(info.st_mode)) fail("not a regular file (a directory, device or pipe)");
    const auto file_size = static_cast<std::uint64_t>(info.st_size);
    if (file_size < 8) fail(fmt::format("too short to be safetensors ({} bytes)", file_size));
    unsigned char size_bytes[8];
    read_exactly(size_bytes, 8, 0, "the header length");
    std::uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
    if (header_size > file_size - 8 || header_size > safetensors_detail::max_header_bytes)
      fail(
          fmt::format("header length {} exceeds the file ({} bytes) or the format's limit of {} bytes; "
                      "not a safetensors file or truncated",
                      header_size, file_size, safetensors_detail::max_header_bytes));
    std::string text(header_size, '\0');
    read_exactly(text.data(), header_size, 8, "the header");
    header_ = safetensors_detail::parse_header(text, file_size, path_.string());
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MESHTORCH_DECL SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

MESHTORCH_DECL const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  const auto* e = find(name);
  if (!e) fail(fmt::format("tensor '{}' is missing", name));
  return *e;
}

MESHTORCH_DECL torch::Tensor SafetensorsReader::read_rows(const SafetensorsEntry& entry, std::int64_t first_row,
                                                          std::int64_t count) const {
  auto shape = entry.shape;
  if (!shape.empty()) shape[0] = std::max<std::int64_t>(count, 0);
  auto out = torch::empty(shape, torch::TensorOptions().dtype(entry.dtype));
  read_rows_into(entry, first_row, count, out);
  return out;
}

MESHTORCH_DECL void SafetensorsReader::read_rows_into(const SafetensorsEntry& entry, std::int64_t first_row,
                                                      std::int64_t count, torch::Tensor& out) const {
  auto shape = entry.shape;
  std::uint64_t offset = entry.begin;
  if (!shape.empty()) {
    if (first_row < 0 || count < 0 || first_row > shape[0] || count > shape[0] - first_row)
      fail(fmt::format("tensor '{}': rows [{}, {}) lie outside its {} rows", entry.name, first_row, first_row + count,
                       shape[0]));
    offset += entry.row_bytes() * static_cast<std::uint64_t>(first_row);
    shape[0] = count;
  }
  if (out.sizes() != c10::IntArrayRef(shape) || out.scalar_type() != entry.dtype || !out.is_contiguous() ||
      !out.device().is_cpu())
    fail(fmt::format("tensor '{}': the buffer to read into is {} {} on {}, not the rows' {} {}", entry.name,
                     c10::toString(out.scalar_type()), c10::str(out.sizes()), out.device().str(),
                     c10::toString(entry.dtype), c10::str(c10::IntArrayRef(shape))));
  read_exactly(out.data_ptr(), static_cast<std::uint64_t>(out.numel()) * out.element_size(),
               header_.data_start + offset, fmt::format("tensor '{}'", entry.name));
}

MESHTORCH_DECL void SafetensorsReader::fail(const std::string& what) const {
  throw DataError(fmt::format("{}: {}", path_.string(), what));
}

MESHTORCH_DECL void SafetensorsReader::read_exactly(void* into, std::uint64_t size, std::uint64_t offset,
                                                    const std::string& what) const {
  auto* bytes = static_cast<char*>(into);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, bytes, size, static_cast<off_t>(offset));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) fail(fmt::format("reading {} failed ({})", what, std::strerror(errno)));
    if (n == 0) fail(fmt::format("reading {}: the file ends early (truncated?)", what));
    bytes += n;
    size -= static_cast<std::uint64_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

MESHTORCH_DECL SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  const SafetensorsReader reader(path);
  SafetensorsFile result;
  result.metadata = reader.header().metadata;
  for (const auto& e : reader.header().entries) result.tensors.emplace_back(e.name, reader.read(e));
  return result;
}

namespace safetensors_detail {

MESHTORCH_DECL SafetensorsHeader parse_header(std::string_view text, std::uint64_t file_size,
                                              const std::string& where) {
  // Depth-limited, and a tensor named twice is refused, as HF refuses it (nlohmann alone would
  // keep the last).
  const auto header = parse_json(text, where, "the header");
  if (!header.is_object()) throw DataError(fmt::format("{}: header is not a JSON object", where));

  SafetensorsHeader result;
  result.data_start = 8 + text.size();
  result.data_size = file_size - result.data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw DataError(fmt::format("{}: __metadata__ must be an object of strings", where));
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) throw DataError(fmt::format("{}: __metadata__.{} must be a string", where, key));
        result.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string tensor_where = where + ": tensor '" + name + "'";
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      throw DataError(fmt::format("{} needs dtype, shape and data_offsets", tensor_where));
    const auto& dtype_field = info.at("dtype");
    if (!dtype_field.is_string()) throw DataError(fmt::format("{}: dtype must be a string", tensor_where));
    const auto dtype = safetensors_dtype(dtype_field.get<std::string>());
    if (!dtype)
      throw DataError(fmt::format("{}: unsupported dtype '{}'", tensor_where, dtype_field.get<std::string>()));
    SafetensorsEntry entry{name, *dtype, {}, 0, 0};
    const auto& shape = info.at("shape");
    if (!shape.is_array()) throw DataError(fmt::format("{}: shape must be a list of integers", tensor_where));
    // Computed without overflow, so that a huge shape cannot wrap around to match a small size.
    // The strides too: LibTorch computes them as products of max(dim, 1), so [0, 2^62, 2^62]
    // holds no bytes yet cannot be allocated.
    std::uint64_t bytes = c10::elementSize(*dtype);
    std::int64_t stride_span = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned() ||
          d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw DataError(
            fmt::format("{}: shape {} must be a list of non-negative 64-bit integers", tensor_where, shape.dump()));
      entry.shape.push_back(d.get<std::int64_t>());
      if (__builtin_mul_overflow(bytes, d.get<std::uint64_t>(), &bytes))
        throw DataError(fmt::format("{}: shape {} holds more than 2^64 bytes", tensor_where, shape.dump()));
      if (__builtin_mul_overflow(stride_span, std::max<std::int64_t>(entry.shape.back(), 1), &stride_span))
        throw DataError(
            fmt::format("{}: shape {} is too large: its strides overflow 64 bits", tensor_where, shape.dump()));
    }
    const auto& offsets = info.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw DataError(fmt::format("{}: data_offsets must be [begin, end]", tensor_where));
    entry.begin = offsets[0].get<std::uint64_t>();
    entry.end = offsets[1].get<std::uint64_t>();
    if (entry.begin > entry.end || entry.end > result.data_size)
      throw DataError(fmt::format("{}: data_offsets [{}, {}] lie outside the data section of {} bytes", tensor_where,
                                  entry.begin, entry.end, result.data_size));
    if (entry.end - entry.begin != bytes)
      throw DataError(fmt::format("{}: {} bytes do not match shape and dtype ({} expected)", tensor_where,
                                  entry.end - entry.begin, bytes));
    result.entries.push_back(std::move(entry));
  }
  // By (begin, end): an empty tensor sits before a tensor starting at its offset, as HF writes them.
  std::sort(result.entries.begin(), result.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  for (std::size_t i = 0; i < result.entries.size(); ++i) {
    if (i > 0 && result.entries[i].begin < result.entries[i - 1].end)
      throw DataError(
          fmt::format("{}: tensors '{}' and '{}' overlap", where, result.entries[i - 1].name, result.entries[i].name));
    result.by_name.emplace(result.entries[i].name, i);
  }
  return result;
}

}  // namespace safetensors_detail
}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
