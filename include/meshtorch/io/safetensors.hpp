#pragma once
// The safetensors format (8-byte little-endian header length, a JSON header of
// name -> {dtype, shape, data_offsets}, then raw little-endian data), written by hand because
// no Debian package offers a C++ reader/writer. Loading runs no code, and every offset, size and
// dtype is checked before use: a malformed file is a DataError naming the file and the tensor.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "meshtorch/error.hpp"
#include "meshtorch/io/atomic_file.hpp"

namespace meshtorch::io {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

namespace safetensors_detail {

inline const std::vector<std::pair<std::string, torch::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, torch::ScalarType>> names{
      {"F64", torch::kDouble}, {"F32", torch::kFloat},  {"F16", torch::kHalf},  {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},    {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return names;
}

inline std::string dtype_name(torch::ScalarType type) {
  for (const auto& [name, t] : dtype_names())
    if (t == type) return name;
  throw DataError(std::string("safetensors: unsupported dtype ") + c10::toString(type));
}

inline std::optional<torch::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& [n, t] : dtype_names())
    if (n == name) return t;
  return std::nullopt;
}

}  // namespace safetensors_detail

// Writes tensors (any device; copied to CPU) atomically. Order is kept in the data section.
inline void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (header.contains(name)) throw DataError(path.string() + ": tensor name '" + name + "' appears twice");
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

struct SafetensorsFile {
  NamedTensors tensors;  // in file order
  std::map<std::string, std::string> metadata;

  const torch::Tensor* find(const std::string& name) const {
    for (const auto& [n, t] : tensors)
      if (n == name) return &t;
    return nullptr;
  }
};

inline SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  const std::string where = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(where + ": cannot open");
  const auto file_size = std::filesystem::file_size(path);
  if (file_size < 8) throw DataError(where + ": too short to be safetensors (" + std::to_string(file_size) + " bytes)");
  unsigned char size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  if (header_size > file_size - 8 || header_size > (std::uint64_t{100} << 20))
    throw DataError(where + ": header length " + std::to_string(header_size) + " exceeds the file (" +
                    std::to_string(file_size) + " bytes); not a safetensors file or truncated");
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(where + ": header is not valid JSON (" + e.what() + ")");
  }
  if (!header.is_object()) throw DataError(where + ": header is not a JSON object");

  SafetensorsFile result;
  const std::uint64_t data_size = file_size - 8 - header_size;
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw DataError(where + ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) throw DataError(where + ": __metadata__." + k + " must be a string");
        result.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string tensor_where = where + ": tensor '" + name + "'";
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      throw DataError(tensor_where + " needs dtype, shape and data_offsets");
    if (!info["dtype"].is_string()) throw DataError(tensor_where + ": dtype must be a string");
    auto dtype = safetensors_detail::dtype_from_name(info["dtype"].get<std::string>());
    if (!dtype) throw DataError(tensor_where + ": unsupported dtype '" + info["dtype"].get<std::string>() + "'");
    Entry e{name, *dtype, {}, 0, 0};
    std::uint64_t numel = 1;
    if (!info["shape"].is_array()) throw DataError(tensor_where + ": shape must be a list of integers");
    for (const auto& d : info["shape"]) {
      if (!d.is_number_unsigned()) throw DataError(tensor_where + ": shape must be a list of non-negative integers");
      e.shape.push_back(d.get<std::int64_t>());
      numel *= d.get<std::uint64_t>();
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw DataError(tensor_where + ": data_offsets must be [begin, end]");
    e.begin = offsets[0].get<std::uint64_t>();
    e.end = offsets[1].get<std::uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      throw DataError(tensor_where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      "] lie outside the data section of " + std::to_string(data_size) + " bytes");
    if (e.end - e.begin != numel * c10::elementSize(*dtype))
      throw DataError(tensor_where + ": " + std::to_string(e.end - e.begin) + " bytes do not match shape and dtype (" +
                      std::to_string(numel * c10::elementSize(*dtype)) + " expected)");
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < entries.size(); ++i)
    if (entries[i].begin < entries[i - 1].end)
      throw DataError(where + ": tensors '" + entries[i - 1].name + "' and '" + entries[i].name + "' overlap");
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(8 + header_size + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    if (!in) throw DataError(where + ": tensor '" + e.name + "' could not be read (truncated file?)");
    result.tensors.emplace_back(e.name, std::move(t));
  }
  return result;
}

}  // namespace meshtorch::io
