#pragma once
// Writing safetensors: a header known in advance, then the tensors one at a time in its order,
// each byte hashed as it is written (the checkpoint manifest's checksum costs no second read).
// Files are written atomically (io/atomic_file.hpp): a reader never sees half of one.
// io/safetensors.hpp reads what this writes.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/file_digest.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/xxh3.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

// Writes a safetensors file from its entries (name, dtype, shape; the writer assigns the
// offsets), then the tensors in entry order. A tensor on another device or with other strides is
// staged through one CPU copy of itself (the largest such copy is recorded).
class SafetensorsStreamWriter {
 public:
  MESHTORCH_DECL SafetensorsStreamWriter(const std::filesystem::path& path, std::vector<SafetensorsEntry> entries,
                                         const std::map<std::string, std::string>& metadata = {});

  // The next tensor in entry order.
  MESHTORCH_DECL void append(const torch::Tensor& tensor);

  MESHTORCH_DECL FileDigest commit();

  // The entries with the offsets this writer gave them.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }

  // Elements of the largest tensor this writer had to copy (0 when every tensor was written
  // from its own CPU memory): how a test shows saving gathers nothing.
  std::int64_t largest_staging_numel() const { return largest_staging_numel_; }

 private:
  MESHTORCH_DECL void write(const void* data, std::size_t size);

  std::filesystem::path path_;
  std::vector<SafetensorsEntry> entries_;
  AtomicFile file_;
  XXH3_state_t state_;
  std::uint64_t bytes_ = 0;
  std::size_t next_ = 0;
  std::int64_t largest_staging_numel_ = 0;
};

// Writes tensors (any device; copied to CPU one at a time) atomically, in the given order.
MESHTORCH_DECL FileDigest save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                           const std::map<std::string, std::string>& metadata = {});

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>

namespace meshtorch::io {

MESHTORCH_DECL SafetensorsStreamWriter::SafetensorsStreamWriter(const std::filesystem::path& path,
                                                                std::vector<SafetensorsEntry> entries,
                                                                const std::map<std::string, std::string>& metadata)
    : path_(path), entries_(std::move(entries)), file_(path) {
  XXH3_64bits_reset(&state_);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (auto& e : entries_) {
    if (e.name == "__metadata__" || header.contains(e.name))
      throw DataError(fmt::format("{}: tensor name '{}' appears twice or is reserved", path.string(), e.name));
    e.begin = offset;
    e.end = offset + safetensors_bytes(e.dtype, e.shape);
    header[e.name] = {
        {"dtype", safetensors_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
    offset = e.end;
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
  write(cpu.data_ptr(), e.end - e.begin);
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

MESHTORCH_DECL FileDigest save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors)
    entries.push_back(SafetensorsEntry{name, tensor.scalar_type(), tensor.sizes().vec()});
  SafetensorsStreamWriter writer(path, std::move(entries), metadata);
  for (const auto& named : tensors) writer.append(named.second);
  return writer.commit();
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
