#pragma once
// How ParallelLlama (parallel/parallelize.hpp) fills its pieces: drawn as chapter 1 draws the
// whole weights (initialise), or from a model folder, every rank reading only the rows its pieces
// lie in, or one reader per group (the world's rank 0, or each
// node's) reading each weight whole and broadcasting it. The reader lists the folder's weights
// first, so that a bad folder is an error on every rank, not a hang in the next broadcast.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/parallel/parallelize.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// A weight of a model folder as the group's reader (its rank 0) lists it: every rank learns its
// name, shape and dtype, the reader also where it lies.
struct FolderWeight {
  std::string name;
  std::vector<std::int64_t> shape;
  torch::ScalarType dtype;
  std::filesystem::path file;  // the reader's only
  io::SafetensorsEntry entry;  // the reader's only
};

// The group's reader lists the weights of `dir` that `take(entry, file)` accepts (it returns false
// to skip one and throws for a bad one) and sends the list, or what is wrong with the folder, to
// every rank: a bad folder is an error on every rank (over `world` when groups read per node),
// not a hang in the next broadcast.
MESHTORCH_DECL std::vector<FolderWeight> list_folder_weights(
    const std::filesystem::path& dir, const comm::AxisGroup& group, const comm::AxisGroup& world,
    const std::function<bool(const io::SafetensorsEntry&, const std::filesystem::path&)>& take);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/models/llama/weights.hpp>

namespace meshtorch {

namespace parallelize_detail {

inline std::vector<std::int64_t> rows_shape(std::vector<std::int64_t> shape, std::int64_t rows) {
  shape[0] = rows;
  return shape;
}

// `buffer`'s first bytes as a tensor of `shape` and `dtype`: the one buffer each weight is read
// (or received) into in turn, so that loading leaves no buffer per weight behind for glibc's
// heap to keep (measured: with one per weight, a rank's resident set peaked up to 99 MiB
// higher in some runs and not in others).
inline torch::Tensor view_of_buffer(torch::Tensor& buffer, const std::vector<std::int64_t>& shape,
                                    torch::ScalarType dtype) {
  const auto bytes = c10::multiply_integers(shape) * static_cast<std::int64_t>(c10::elementSize(dtype));
  if (buffer.numel() < bytes) buffer = torch::empty({bytes}, buffer.options());
  return buffer.narrow(0, 0, bytes).view(dtype).view(shape);
}

}  // namespace parallelize_detail

MESHTORCH_DECL std::string ParallelLlamaRuntime::load_report() const {
  constexpr double mib = 1024.0 * 1024.0;
  return fmt::format(
      "weights from {} read by {}: this rank read {} of the model's {} elements; resident set "
      "+{:.0f} MiB at the peak of loading, its pieces {:.0f} MiB",
      options_.weights_from.string(), to_string(options_.weights_read_by), read_elements_,
      model_->config.num_parameters(), static_cast<double>(load_rss_growth_) / mib,
      static_cast<double>(local_bytes()) / mib);
}

MESHTORCH_DECL void ParallelLlamaRuntime::keep_piece(const std::map<std::string, torch::Tensor>& trained,
                                                     const std::string& name, const torch::Tensor& piece,
                                                     const std::string& source) {
  torch::NoGradGuard no_grad;
  auto target = trained.at(name);
  if (piece.sizes() != target.sizes())
    throw DataError(fmt::format("{}: tensor '{}' gives a piece of shape {}, this rank holds {}", source, name,
                                c10::str(piece.sizes()), c10::str(target.sizes())));
  target.copy_(piece);
}

MESHTORCH_DECL void ParallelLlamaRuntime::initialise(torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  const auto tensors = leaf_tensors(*model_);  // global_shapes_' order
  const auto trained = trained_by_name();
  for (std::size_t i = 0; i < global_shapes_.size(); ++i) {
    const auto& [name, shape] = global_shapes_[i];
    if (tensors[i].name != name)
      throw std::logic_error(fmt::format("parallelize: '{}' initialised as '{}'", name, tensors[i].name));
    auto full = torch::empty(shape, torch::TensorOptions().device(options_.device).dtype(dtype));
    llama::init_weight(*tensors[i].leaf, tensors[i].slot, full, model_->config);
    keep_piece(trained, name, piece_of(name, full), "initialisation");
  }
}

MESHTORCH_DECL void ParallelLlamaRuntime::load_weights(const std::filesystem::path& dir) {
  using parallelize_detail::rows_shape;
  using parallelize_detail::view_of_buffer;
  std::set<std::string> loaded;
  const auto trained = trained_by_name();
  // Every file opened and its header checked once, first: a wrong shape stops the load before
  // anything is read, and the read buffer is sized once, for the largest piece.
  const auto readers = llama::open_weight_files(dir);
  std::int64_t largest_read = 0;
  for (const auto& reader : readers)
    for (const auto& entry : reader.header().entries)
      if (is_loaded(entry.name)) {
        check_shape(entry, reader.path());
        const auto row_bytes = static_cast<std::int64_t>(entry.row_bytes());
        largest_read = std::max(largest_read, rows_read_for(entry).second * row_bytes);
      }
  auto buffer = torch::empty({largest_read}, torch::TensorOptions().dtype(torch::kByte));
  for (const auto& reader : readers) {
    for (const auto& entry : reader.header().entries) {
      const auto& name = entry.name;
      if (!is_loaded(name)) continue;
      // The rows the piece lies in, whole; then the piece's columns of them (TP's dim-1 chunks).
      const auto box = piece_box(name, entry.shape);
      const auto read_box =
          entry.shape.empty() ? box : io::rows(io::whole(entry.shape), box.offsets[0], box.offsets[0] + box.sizes[0]);
      const auto [first_row, row_count] = rows_read_for(entry);
      auto read =
          view_of_buffer(buffer, entry.shape.empty() ? entry.shape : rows_shape(entry.shape, row_count), entry.dtype);
      reader.read_rows_into(entry, first_row, row_count, read);
      const auto rows = read.to(options_.device);
      read_elements_ += rows.numel();
      keep_piece(trained, name, io::view_of(rows, read_box, box), reader.path().string());
      loaded.insert(name);
    }
  }
  for (const auto& [name, shape] : global_shapes_)
    if (!loaded.count(name)) throw DataError(fmt::format("{}: weight '{}' is missing", dir.string(), name));
}

MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> ParallelLlamaRuntime::rows_read_for(
    const io::SafetensorsEntry& entry) const {
  if (entry.shape.empty()) return {0, 1};
  const auto box = piece_box(entry.name, entry.shape);
  return {box.offsets[0], box.sizes[0]};
}

MESHTORCH_DECL void ParallelLlamaRuntime::load_weights_through(const std::filesystem::path& dir,
                                                               const comm::AxisGroup& group) {
  using parallelize_detail::view_of_buffer;
  const bool reader_rank = group.rank() == 0;
  const int reader = group.global_rank_of(0);
  const auto listing = list_folder_weights(dir, group, world_,
                                           [&](const io::SafetensorsEntry& entry, const std::filesystem::path& file) {
                                             if (!is_loaded(entry.name)) return false;
                                             check_shape(entry, file);
                                             return true;
                                           });

  std::set<std::string> loaded;
  const auto trained = trained_by_name();
  std::optional<io::SafetensorsReader> file_reader;
  // One buffer for every weight, as big as the largest, read into on the reader and received
  // into on the others (on the CPU the reader's is the one it broadcasts from).
  std::int64_t largest = 0;
  for (const auto& weight : listing)
    largest = std::max(
        largest, c10::multiply_integers(weight.shape) * static_cast<std::int64_t>(c10::elementSize(weight.dtype)));
  auto read_buffer = torch::empty({reader_rank ? largest : 0}, torch::TensorOptions().dtype(torch::kByte));
  auto receive_buffer = torch::empty({reader_rank && options_.device.is_cpu() ? 0 : largest},
                                     torch::TensorOptions().dtype(torch::kByte).device(options_.device));
  for (const auto& [name, shape, dtype, file, entry] : listing) {
    torch::Tensor full;
    if (reader_rank) {
      if (!file_reader || file_reader->path() != file) file_reader.emplace(file);
      auto read = view_of_buffer(read_buffer, shape, dtype);
      file_reader->read_rows_into(entry, 0, shape.empty() ? 0 : shape[0], read);
      full = options_.device.is_cpu() ? read : view_of_buffer(receive_buffer, shape, dtype).copy_(read);
      read_elements_ += full.numel();
    } else {
      full = view_of_buffer(receive_buffer, shape, dtype);
    }
    full = comm::broadcast(group, full, 0);
    keep_piece(trained, name, piece_of(name, full), fmt::format("rank {}'s {}", reader, dir.string()));
    loaded.insert(name);
  }
  for (const auto& [name, shape] : global_shapes_)
    if (!loaded.count(name)) throw DataError(fmt::format("{}: weight '{}' is missing", dir.string(), name));
}

MESHTORCH_DECL bool ParallelLlamaRuntime::is_loaded(const std::string& name) const {
  if (name.find("rotary_emb.inv_freq") != std::string::npos) return false;
  return !(name == "lm_head.weight" && model_->config.tie_word_embeddings);
}

MESHTORCH_DECL void ParallelLlamaRuntime::check_shape(const io::SafetensorsEntry& entry,
                                                      const std::filesystem::path& file) const {
  const auto* shape = shape_of(entry.name);
  if (!shape) throw DataError(fmt::format("{}: tensor '{}' is not a weight of this model", file.string(), entry.name));
  llama::check_weight_dtype(file.string(), entry.name, entry.dtype);
  if (entry.shape != *shape)
    throw DataError(fmt::format("{}: tensor '{}' has shape {}, the model needs {}", file.string(), entry.name,
                                c10::str(c10::IntArrayRef(entry.shape)), c10::str(c10::IntArrayRef(*shape))));
}

MESHTORCH_DECL const std::vector<std::int64_t>* ParallelLlamaRuntime::shape_of(const std::string& name) const {
  for (const auto& [n, shape] : global_shapes_)
    if (n == name) return &shape;
  return nullptr;
}

MESHTORCH_DECL std::vector<FolderWeight> list_folder_weights(
    const std::filesystem::path& dir, const comm::AxisGroup& group, const comm::AxisGroup& world,
    const std::function<bool(const io::SafetensorsEntry&, const std::filesystem::path&)>& take) {
  const bool reader_rank = group.rank() == 0;
  std::vector<FolderWeight> listed;
  nlohmann::json listing = nlohmann::json::object();
  if (reader_rank) {
    try {
      auto weights = nlohmann::json::array();
      for (const auto& reader : llama::open_weight_files(dir))
        for (const auto& entry : reader.header().entries) {
          const auto& file = reader.path();
          if (!take(entry, file)) continue;
          weights.push_back({{"name", entry.name}, {"shape", entry.shape}, {"dtype", static_cast<int>(entry.dtype)}});
          listed.push_back({entry.name, entry.shape, entry.dtype, file, entry});
        }
      listing["weights"] = std::move(weights);
    } catch (const std::exception& e) {
      listing["error"] = e.what();
    }
  }
  const int reader = group.global_rank_of(0);
  listing = nlohmann::json::parse(comm::all_gather_object(group, reader_rank ? listing.dump() : "").front());
  const std::string error = listing.contains("error") ? listing["error"].get<std::string>() : "";
  // Each node's reader decides for its node: the others learn of a failure here, not in a hang.
  const std::string reader_error =
      error.empty() ? "" : fmt::format("rank {}, reading {} for its ranks: {}", reader, dir.string(), error);
  if (group.size() < world.size())
    comm::raise_first_error(world, reader_error);
  else if (!reader_error.empty())
    throw DataError(reader_error);
  if (reader_rank) return listed;
  for (const auto& weight : listing["weights"])
    listed.push_back({weight["name"].get<std::string>(),
                      weight["shape"].get<std::vector<std::int64_t>>(),
                      static_cast<torch::ScalarType>(weight["dtype"].get<int>()),
                      {},
                      {}});
  return listed;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
