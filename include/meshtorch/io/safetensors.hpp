#pragma once
// The safetensors format (8-byte little-endian header length, a JSON header of
// name -> {dtype, shape, data_offsets}, then raw little-endian data), written by hand because
// no Debian package offers a C++ reader/writer. Loading runs no code, and every offset, size and
// dtype is checked before anything is allocated: a malformed file is a DataError naming the
// file and the tensor.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <istream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

namespace safetensors_detail {

// The dtype's name in safetensors headers ("BF16"); a DataError for a dtype the format lacks.
MESHTORCH_DECL std::string dtype_name(torch::ScalarType type);
// The dtype of a name in a header, or nothing for a name this reader does not know.
MESHTORCH_DECL std::optional<torch::ScalarType> dtype_from_name(const std::string& name);

}  // namespace safetensors_detail

// Writes tensors (any device; copied to CPU) atomically. Order is kept in the data section.
MESHTORCH_DECL void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                     const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  NamedTensors tensors;  // in the order of their data in the file
  std::map<std::string, std::string> metadata;

  const torch::Tensor* find(const std::string& name) const {
    for (const auto& [n, t] : tensors)
      if (n == name) return &t;
    return nullptr;
  }
};

// One tensor as the header describes it; offsets count from the start of the data section.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
};

// A checked header: every entry's shape, dtype and offsets agree and lie inside the file, so
// allocating an entry's tensor never asks for more bytes than the file holds.
struct SafetensorsHeader {
  std::uint64_t data_start = 0;  // 8 + the header's length
  std::uint64_t data_size = 0;
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;

  bool contains(const std::string& name) const {
    return std::any_of(entries.begin(), entries.end(), [&](const SafetensorsEntry& e) { return e.name == name; });
  }
};

namespace safetensors_detail {

// HF's own limit on the header (safetensors' MAX_HEADER_SIZE).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// Opens a regular file for binary reading and returns its size. A directory, FIFO or device is
// refused before it is opened: reading one gives a raw ios_failure, and opening a FIFO blocks.
MESHTORCH_DECL std::ifstream open_regular_file(const std::filesystem::path& path, std::uint64_t& size);

// Reads the header at the start of `in` (a file of `file_size` bytes) and checks it.
MESHTORCH_DECL SafetensorsHeader parse_header(std::istream& in, std::uint64_t file_size, const std::string& where);

}  // namespace safetensors_detail

// Reads and checks only the header: which tensors a file holds, without loading them.
inline SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  std::uint64_t file_size = 0;
  auto in = safetensors_detail::open_regular_file(path, file_size);
  return safetensors_detail::parse_header(in, file_size, path.string());
}

// A safetensors file whose header is read and checked once, then any rows of any tensor on
// demand: only those bytes are read into memory. What a rank uses to take its piece of each weight
// of a model folder without reading the rest.
class SafetensorsRowReader {
 public:
  explicit SafetensorsRowReader(const std::filesystem::path& path) : path_(path), where_(path.string()) {
    std::uint64_t file_size = 0;
    in_ = safetensors_detail::open_regular_file(path, file_size);
    header_ = safetensors_detail::parse_header(in_, file_size, where_);
  }

  const SafetensorsHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return path_; }

  // Rows [first_row, first_row + count) of `entry` (one of header().entries) as a new CPU tensor;
  // a 0-d tensor whole.
  torch::Tensor read_rows(const SafetensorsEntry& entry, std::int64_t first_row, std::int64_t count) {
    auto t = torch::empty(rows_shape(entry, count), torch::TensorOptions().dtype(entry.dtype));
    read_rows_into(entry, first_row, count, t);
    return t;
  }

  // The same into `out`, a contiguous CPU tensor of that shape and the entry's dtype: a buffer
  // the caller reuses from one tensor to the next.
  MESHTORCH_DECL void read_rows_into(const SafetensorsEntry& entry, std::int64_t first_row, std::int64_t count,
                                     torch::Tensor& out);

  // Bytes of one row of `entry` (of the whole tensor when 0-d).
  static std::uint64_t row_bytes(const SafetensorsEntry& entry) {
    if (entry.shape.empty()) return entry.end - entry.begin;
    return entry.shape[0] == 0 ? 0 : (entry.end - entry.begin) / static_cast<std::uint64_t>(entry.shape[0]);
  }

 private:
  static std::vector<std::int64_t> rows_shape(const SafetensorsEntry& entry, std::int64_t count) {
    auto shape = entry.shape;
    if (!shape.empty()) shape[0] = count;
    return shape;
  }

  std::filesystem::path path_;
  std::string where_;
  std::ifstream in_;
  SafetensorsHeader header_;
};

MESHTORCH_DECL SafetensorsFile load_safetensors(const std::filesystem::path& path);

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/json_file.hpp>

namespace meshtorch::io {

namespace safetensors_detail {

inline const std::vector<std::pair<std::string, torch::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, torch::ScalarType>> names{
      {"F64", torch::kDouble}, {"F32", torch::kFloat},  {"F16", torch::kHalf},  {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},    {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return names;
}

MESHTORCH_DECL std::string dtype_name(torch::ScalarType type) {
  for (const auto& [name, t] : dtype_names())
    if (t == type) return name;
  throw DataError(std::string("safetensors: unsupported dtype ") + c10::toString(type));
}

MESHTORCH_DECL std::optional<torch::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& [n, t] : dtype_names())
    if (n == name) return t;
  return std::nullopt;
}

MESHTORCH_DECL std::ifstream open_regular_file(const std::filesystem::path& path, std::uint64_t& size) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (!std::filesystem::exists(status)) throw DataError(fmt::format("{}: no such file", path.string()));
  if (!std::filesystem::is_regular_file(status))
    throw DataError(fmt::format("{}: not a regular file (a directory, device or pipe)", path.string()));
  size = std::filesystem::file_size(path, error);
  if (error) throw DataError(fmt::format("{}: cannot read its size ({})", path.string(), error.message()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  return in;
}

}  // namespace safetensors_detail

MESHTORCH_DECL void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (header.contains(name)) throw DataError(fmt::format("{}: tensor name '{}' appears twice", path.string(), name));
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const std::uint64_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", safetensors_detail::dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned, as HF does
  const std::uint64_t header_size = text.size();
  AtomicFile file(path);
  unsigned char size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<unsigned char>(header_size >> (8 * i));
  file.write(size_bytes, 8);
  file.write(text);
  for (const auto& t : cpu) file.write(t.data_ptr(), t.numel() * t.element_size());
  file.commit();
}

MESHTORCH_DECL void SafetensorsRowReader::read_rows_into(const SafetensorsEntry& entry, std::int64_t first_row,
                                                         std::int64_t count, torch::Tensor& out) {
  std::uint64_t offset = entry.begin;
  if (!entry.shape.empty()) {
    if (first_row < 0 || count < 0 || first_row + count > entry.shape[0])
      throw DataError(fmt::format("{}: tensor '{}': rows [{}, {}) lie outside its {} rows", where_, entry.name,
                                  first_row, first_row + count, entry.shape[0]));
    offset += row_bytes(entry) * static_cast<std::uint64_t>(first_row);
  }
  if (out.sizes() != c10::IntArrayRef(rows_shape(entry, count)) || out.scalar_type() != entry.dtype ||
      !out.is_contiguous() || !out.device().is_cpu())
    throw DataError(fmt::format("{}: tensor '{}': the buffer to read into is {} {} on {}, not the rows' {} {}",
                                where_, entry.name, c10::toString(out.scalar_type()), c10::str(out.sizes()),
                                out.device().str(), c10::toString(entry.dtype),
                                c10::str(c10::IntArrayRef(rows_shape(entry, count)))));
  in_.clear();
  in_.seekg(static_cast<std::streamoff>(header_.data_start + offset));
  in_.read(static_cast<char*>(out.data_ptr()), static_cast<std::streamsize>(out.numel() * out.element_size()));
  if (!in_) throw DataError(fmt::format("{}: tensor '{}' could not be read (truncated file?)", where_, entry.name));
}

MESHTORCH_DECL SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  const std::string where = path.string();
  std::uint64_t file_size = 0;
  auto in = safetensors_detail::open_regular_file(path, file_size);
  auto header = safetensors_detail::parse_header(in, file_size, where);
  SafetensorsFile result;
  result.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(header.data_start + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    if (!in) throw DataError(fmt::format("{}: tensor '{}' could not be read (truncated file?)", where, e.name));
    result.tensors.emplace_back(std::move(e.name), std::move(t));
  }
  return result;
}

namespace safetensors_detail {

MESHTORCH_DECL SafetensorsHeader parse_header(std::istream& in, std::uint64_t file_size, const std::string& where) {
  if (file_size < 8) throw DataError(fmt::format("{}: too short to be safetensors ({} bytes)", where, file_size));
  unsigned char size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  if (!in || header_size > file_size - 8 || header_size > max_header_bytes)
    throw DataError(fmt::format("{}: header length {} exceeds the file ({} bytes) or the format's limit of {} bytes; "
                                "not a safetensors file or truncated",
                                where, header_size, file_size, max_header_bytes));
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  if (!in) throw DataError(fmt::format("{}: the header could not be read (truncated file?)", where));

  // A tensor named twice is refused, as HF refuses it (nlohmann alone would keep the last).
  const auto header = parse_json(text, where, "the header");
  if (!header.is_object()) throw DataError(fmt::format("{}: header is not a JSON object", where));

  SafetensorsHeader result;
  result.data_start = 8 + header_size;
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
    const auto dtype = dtype_from_name(dtype_field.get<std::string>());
    if (!dtype) throw DataError(fmt::format("{}: unsupported dtype '{}'",
                                            tensor_where, dtype_field.get<std::string>()));
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
        throw DataError(fmt::format("{}: shape {} must be a list of non-negative 64-bit integers",
                                    tensor_where, shape.dump()));
      entry.shape.push_back(d.get<std::int64_t>());
      if (__builtin_mul_overflow(bytes, d.get<std::uint64_t>(), &bytes))
        throw DataError(fmt::format("{}: shape {} holds more than 2^64 bytes", tensor_where, shape.dump()));
      if (__builtin_mul_overflow(stride_span, std::max<std::int64_t>(entry.shape.back(), 1), &stride_span))
        throw DataError(fmt::format("{}: shape {} is too large: its strides overflow 64 bits",
                                    tensor_where, shape.dump()));
    }
    const auto& offsets = info.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw DataError(fmt::format("{}: data_offsets must be [begin, end]", tensor_where));
    entry.begin = offsets[0].get<std::uint64_t>();
    entry.end = offsets[1].get<std::uint64_t>();
    if (entry.begin > entry.end || entry.end > result.data_size)
      throw DataError(fmt::format("{}: data_offsets [{}, {}] lie outside the data section of {} bytes",
                                  tensor_where, entry.begin, entry.end, result.data_size));
    if (entry.end - entry.begin != bytes)
      throw DataError(fmt::format("{}: {} bytes do not match shape and dtype ({} expected)",
                                  tensor_where, entry.end - entry.begin, bytes));
    result.entries.push_back(std::move(entry));
  }
  std::sort(result.entries.begin(), result.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < result.entries.size(); ++i)
    if (result.entries[i].begin < result.entries[i - 1].end)
      throw DataError(fmt::format("{}: tensors '{}' and '{}' overlap",
                                  where, result.entries[i - 1].name, result.entries[i].name));
  return result;
}

}  // namespace safetensors_detail
}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
