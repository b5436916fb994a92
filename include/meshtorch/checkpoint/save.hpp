#pragma once
// Saving a sharded checkpoint (the format: checkpoint/manifest.hpp). Split into steps that need
// no process group (write_rank_pieces on every rank, publish_sharded_checkpoint on rank 0) and
// the collective save_sharded_checkpoint that orders them with the group. Nothing is published
// until every piece is written and checked, and the previous checkpoint is deleted only after
// the new one is linked.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <meshtorch/torch.hpp>

#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/io/file_digest.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::checkpoint {

struct SaveOptions {
  std::string layout;  // free-form description of the mesh and placements, recorded in the manifest
  // Small files rank 0 writes into the folder (config.json above all: consolidation copies it
  // into the HF folder); listed in the manifest with their checksums.
  std::map<std::string, std::string> extra_files;
  // This rank's place in the mesh ("DP 0, FSDP 1, TP 0"), recorded per rank in the manifest so
  // a file can be traced to the rank that wrote it; each rank passes its own.
  std::string coordinate;
  // Complete checkpoints kept in the experiment folder, the newest ones (--keep-checkpoints):
  // older ones are deleted only once the new one is published, and more than one survives a
  // step whose save is refused.
  int keep = 2;
  // Refuse to save a floating-point piece or per-rank state that holds NaN or infinity: a
  // finite loss does not make finite weights, and such a checkpoint cannot be resumed.
  bool require_finite = true;
};

// Returned by write_rank_pieces: the file this rank wrote and what it cost.
struct RankWriteResult {
  std::filesystem::path file;
  io::FileDigest digest;
  std::int64_t pieces = 0;
  std::int64_t largest_staging_numel = 0;  // the largest copy made to write (0: none)
};

// Step 1 of a save, on every rank, no communication: writes this rank's pieces (those with
// writer = true) and its per-rank state into <partial_dir>/rank<R>.safetensors,
// fsynced, then the list of what it wrote into rank<R>.pieces.json, last: a rank stopped before
// the list is written has not finished, and publishing refuses the folder.
MESHTORCH_DECL RankWriteResult write_rank_pieces(const std::filesystem::path& partial_dir, int rank, int world_size,
                                                 const std::vector<io::ShardedTensor>& tensors,
                                                 const io::NamedTensors& rank_state,
                                                 const std::string& coordinate = "");

// Moves <exp>/<name>.partial to <exp>/<name>, swaps <exp>/checkpoint to it with rename(2), and
// only then removes stale .partial folders and the complete checkpoints beyond the newest `keep`
// (<name> always stays).
MESHTORCH_DECL void publish_checkpoint_folder(const std::filesystem::path& exp_dir, const std::string& name,
                                              int keep = 2);

// Step 2 of a save, on rank 0 after every rank's step 1, no communication: reads every rank's
// piece list, re-checks each file's size and checksum, checks that the pieces cover every tensor
// exactly once, writes state.json, the extra files and manifest.json, and publishes. Anything
// missing or wrong is an error naming the rank or file, and nothing is published.
MESHTORCH_DECL Manifest publish_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                   int world_size, const nlohmann::ordered_json& state,
                                                   const SaveOptions& options = {});

namespace detail {

// The ranks of `group` whose `failed` is true, known to every rank (an all-gather: also the
// barrier between the steps, bounded by the group's timeout).
MESHTORCH_DECL std::vector<int> failed_ranks(const comm::AxisGroup& group, bool failed);

}  // namespace detail

// Saves a checkpoint of step `global_step` into <exp_dir>/ckpt-<step>/, called by every rank of
// `group` (all ranks of the job) with its own pieces: no rank gathers anything. `state` (rank 0's
// is written) becomes state.json; `rank_state` (RNG states, ...) is this rank's own, saved under
// rank<R>/<name> and returned by a load on the same world size. Returns the published folder and
// what this rank wrote. When any rank fails, every rank throws and the previous checkpoint stays
// the one linked.
struct SavedCheckpoint {
  std::filesystem::path folder;
  RankWriteResult written;
};

MESHTORCH_DECL SavedCheckpoint save_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                       const std::vector<io::ShardedTensor>& tensors,
                                                       const nlohmann::ordered_json& state,
                                                       const io::NamedTensors& rank_state, const comm::AxisGroup& group,
                                                       const SaveOptions& options = {});

}  // namespace meshtorch::checkpoint

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <exception>
#include <functional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/safetensors_writer.hpp>

namespace meshtorch::checkpoint {

MESHTORCH_DECL RankWriteResult write_rank_pieces(const std::filesystem::path& partial_dir, int rank, int world_size,
                                                 const std::vector<io::ShardedTensor>& tensors,
                                                 const io::NamedTensors& rank_state, const std::string& coordinate) {
  using namespace detail;
  if (rank < 0 || rank >= world_size)
    throw ConfigError(fmt::format("write_rank_pieces: rank {} is outside a world of {}", rank, world_size));
  const auto file = rank_file_name(rank);
  std::vector<io::SafetensorsEntry> entries;
  std::vector<torch::Tensor> data;
  nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
  std::set<std::string> names;
  std::int64_t written_pieces = 0;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second)
      throw ConfigError(fmt::format("save: tensor '{}' is given twice on rank {}", t.name, rank));
    if (t.name.rfind("rank", 0) == 0 && t.name.find('/') != std::string::npos)
      throw ConfigError(fmt::format("save: tensor name '{}' looks like a per-rank state key (rank<R>/...)", t.name));
    io::sharded(t.name, t.local, t.global_shape, t.box);  // the same checks as building one
    // Every tensor is listed, written or not, so publishing can tell a tensor no rank wrote.
    pieces.push_back({{"name", t.name},
                      {"dtype", io::safetensors_dtype_name(t.local.scalar_type())},
                      {"global_shape", t.global_shape},
                      {"written", t.writer},
                      {"key", t.name},
                      {"offsets", t.box.offsets},
                      {"sizes", t.box.sizes}});
    if (!t.writer) continue;
    entries.push_back(io::SafetensorsEntry{t.name, t.local.scalar_type(), t.box.sizes});
    data.push_back(t.local);
    ++written_pieces;
  }
  std::vector<std::string> state_names;
  for (const auto& [name, tensor] : rank_state) {
    entries.push_back(io::SafetensorsEntry{rank_state_key(rank, name), tensor.scalar_type(), tensor.sizes().vec()});
    data.push_back(tensor);
    state_names.push_back(name);
  }
  io::SafetensorsStreamWriter writer(
      partial_dir / file, std::move(entries),
      {{"format", "pt"}, {"rank", std::to_string(rank)}, {"world_size", std::to_string(world_size)}});
  for (const auto& t : data) writer.append(t);
  RankWriteResult result{partial_dir / file, writer.commit(), written_pieces, writer.largest_staging_numel()};
  nlohmann::ordered_json list{{"rank", rank},
                              {"world_size", world_size},
                              {"file", file},
                              {"bytes", result.digest.bytes},
                              {"xxh3", io::checksum_hex(result.digest.xxh3)},
                              {"pieces", pieces},
                              {"rank_state", state_names},
                              {"coordinate", coordinate}};
  io::write_file_atomically(partial_dir / rank_piece_list_name(rank), list.dump(1) + "\n");
  return result;
}

MESHTORCH_DECL void publish_checkpoint_folder(const std::filesystem::path& exp_dir, const std::string& name, int keep) {
  if (keep < 1) throw ConfigError(fmt::format("--keep-checkpoints {}: keep at least the checkpoint just saved", keep));
  const std::filesystem::path final_dir = exp_dir / name;
  const std::filesystem::path partial_dir = exp_dir / (name + ".partial");
  const std::filesystem::path replaced = exp_dir / (name + ".replaced");
  io::fsync_path(partial_dir);
  std::filesystem::remove_all(replaced);
  if (std::filesystem::exists(final_dir)) std::filesystem::rename(final_dir, replaced);  // the same step saved again
  std::filesystem::rename(partial_dir, final_dir);
  io::fsync_path(exp_dir);
  const std::filesystem::path link = exp_dir / checkpoint_link_name;
  const std::filesystem::path temporary_link = exp_dir / (std::string(checkpoint_link_name) + ".tmp");
  std::filesystem::remove(temporary_link);
  std::filesystem::create_directory_symlink(name, temporary_link);
  std::filesystem::rename(temporary_link, link);
  io::fsync_path(exp_dir);
  // ckpt-<step> names sort by step (8 digits, zero-padded).
  std::vector<std::string> complete;
  for (const auto& entry : std::filesystem::directory_iterator(exp_dir)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("ckpt-", 0) != 0 || file == name) continue;
    if (file.ends_with(".partial") || file.ends_with(".replaced"))
      std::filesystem::remove_all(entry.path());
    else
      complete.push_back(file);
  }
  std::sort(complete.begin(), complete.end(), std::greater<>());
  for (std::size_t i = 0; i < complete.size(); ++i)
    if (static_cast<int>(i) + 1 >= keep) std::filesystem::remove_all(exp_dir / complete[i]);
}

MESHTORCH_DECL Manifest publish_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                   int world_size, const nlohmann::ordered_json& state,
                                                   const SaveOptions& options) {
  using namespace detail;
  const auto name = sharded_checkpoint_name(global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  Manifest m;
  m.global_step = global_step;
  m.world_size = world_size;
  m.layout = options.layout;
  std::map<std::string, TensorRecord> tensors;
  std::map<std::string, int> first_rank;
  for (int rank = 0; rank < world_size; ++rank) {
    const auto list_path = partial_dir / rank_piece_list_name(rank);
    if (!std::filesystem::exists(list_path))
      throw DataError(
          fmt::format("{} is missing: rank {} did not finish writing its pieces (it failed or was "
                      "stopped); {} is not published and the previous checkpoint stays",
                      list_path.string(), rank, name));
    const auto list = read_checkpoint_json(list_path);
    const std::string where = list_path.string();
    if (field<int>(list, "rank", where) != rank || field<int>(list, "world_size", where) != world_size)
      throw DataError(fmt::format("{}: written by rank {} of {}, expected rank {} of {}", where,
                                  field<int>(list, "rank", where), field<int>(list, "world_size", where), rank,
                                  world_size));
    const auto file = field<std::string>(list, "file", where);
    check_plain_file_name(file, where);
    const auto reported = parse_digest(list, where);
    const auto actual = io::digest_file(partial_dir / file);
    if (actual != reported)
      throw DataError(fmt::format("{}: {} bytes with xxh3 {} on disk, rank {} wrote {} bytes with xxh3 {}",
                                  (partial_dir / file).string(), actual.bytes, io::checksum_hex(actual.xxh3), rank,
                                  reported.bytes, io::checksum_hex(reported.xxh3)));
    m.files[file] = actual;
    for (const auto& piece : member(list, "pieces", where, nlohmann::json::value_t::array)) {
      const auto tensor_name = field<std::string>(piece, "name", where);
      const auto dtype = dtype_field(piece, where);
      const auto shape = field<std::vector<std::int64_t>>(piece, "global_shape", where);
      auto [it, added] = tensors.try_emplace(tensor_name, TensorRecord{tensor_name, dtype, shape, {}});
      if (added) first_rank[tensor_name] = rank;
      if (it->second.dtype != dtype || it->second.shape != shape)
        throw DataError(fmt::format("tensor '{}': rank {} saves it as {} {}, rank {} as {} {}", tensor_name,
                                    first_rank[tensor_name], c10::toString(it->second.dtype),
                                    shape_string(it->second.shape), rank, c10::toString(dtype), shape_string(shape)));
      if (!field<bool>(piece, "written", where)) continue;
      PieceRecord p{file, field<std::string>(piece, "key", where), {}, rank};
      p.box.offsets = field<std::vector<std::int64_t>>(piece, "offsets", where);
      p.box.sizes = field<std::vector<std::int64_t>>(piece, "sizes", where);
      check_piece_inside(p, shape, fmt::format("{}: tensor '{}'", where, tensor_name));
      it->second.pieces.push_back(std::move(p));
    }
    m.rank_state[rank] = field<std::vector<std::string>>(list, "rank_state", where);
    m.coordinates[rank] = field<std::string>(list, "coordinate", where);
  }
  for (auto& [tensor_name, record] : tensors) {
    check_exact_cover(record, fmt::format("saving {}", name));
    m.tensors.push_back(std::move(record));
  }
  auto write_small = [&](const std::string& file, const std::string& contents) {
    check_plain_file_name(file, "SaveOptions::extra_files");
    if (file == manifest_file_name || m.files.contains(file))
      throw ConfigError(fmt::format("save: extra file '{}' would overwrite a file of the checkpoint", file));
    io::write_file_atomically(partial_dir / file, contents);
    m.files[file] = io::digest_file(partial_dir / file);
  };
  write_small(std::string(state_file_name), state.dump(2) + "\n");
  for (const auto& [file, contents] : options.extra_files) write_small(file, contents);
  for (int rank = 0; rank < world_size; ++rank) std::filesystem::remove(partial_dir / rank_piece_list_name(rank));
  io::write_file_atomically(partial_dir / manifest_file_name, to_json(m).dump(1) + "\n");
  publish_checkpoint_folder(exp_dir, name, options.keep);
  return m;
}

namespace detail {

inline torch::Tensor flag_tensor(const comm::AxisGroup& group, int value) {
  const auto device = group.device() == comm::Device::cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  return torch::full({1}, value, torch::TensorOptions().dtype(torch::kInt).device(device));
}

MESHTORCH_DECL std::vector<int> failed_ranks(const comm::AxisGroup& group, bool failed) {
  const auto all = comm::all_gather(group, flag_tensor(group, failed ? 1 : 0)).to(torch::kCPU);
  std::vector<int> out;
  for (int r = 0; r < group.size(); ++r)
    if (all[r].item<int>() != 0) out.push_back(group.global_rank_of(r));
  return out;
}

}  // namespace detail

namespace detail {

// Every floating-point piece this rank writes, and its per-rank state, holds only finite values;
// else a DataError naming the first that does not.
inline void require_finite(const std::vector<io::ShardedTensor>& tensors, const io::NamedTensors& rank_state, int rank,
                           std::int64_t global_step) {
  const auto check = [&](const std::string& name, const torch::Tensor& t) {
    if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return;
    const auto bad = (~torch::isfinite(t)).sum().item<std::int64_t>();
    if (bad > 0)
      throw DataError(
          fmt::format("not saving global_step {}: rank {}'s piece of '{}' holds {} non-finite value(s) "
                      "of {} (NaN or infinity), which no run could resume from; the previous checkpoint "
                      "stays the latest",
                      global_step, rank, name, bad, t.numel()));
  };
  torch::NoGradGuard no_grad;
  for (const auto& t : tensors)
    if (t.writer) check(t.name, t.local);
  for (const auto& [name, t] : rank_state) check(name, t);
}

}  // namespace detail

MESHTORCH_DECL SavedCheckpoint save_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                       const std::vector<io::ShardedTensor>& tensors,
                                                       const nlohmann::ordered_json& state,
                                                       const io::NamedTensors& rank_state, const comm::AxisGroup& group,
                                                       const SaveOptions& options) {
  const auto name = sharded_checkpoint_name(global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  auto collective_step = [&](const char* what, auto&& work) {
    std::exception_ptr failure;
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
    const auto failed = detail::failed_ranks(group, failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    if (!failed.empty())
      throw DataError(
          fmt::format("saving {}: rank(s) {} failed to {} (see their logs); the previous checkpoint "
                      "stays",
                      (exp_dir / name).string(), fmt::join(failed, ", "), what));
  };
  if (options.require_finite)
    collective_step("hold only finite values",
                    [&] { detail::require_finite(tensors, rank_state, group.rank(), global_step); });
  collective_step("create the folder", [&] {
    if (group.rank() != 0) return;
    std::filesystem::remove_all(partial_dir);
    std::filesystem::create_directories(partial_dir);
  });
  RankWriteResult written;
  collective_step("write their pieces", [&] {
    written = write_rank_pieces(partial_dir, group.rank(), group.size(), tensors, rank_state, options.coordinate);
  });
  collective_step("verify and publish the checkpoint", [&] {
    if (group.rank() == 0) publish_sharded_checkpoint(exp_dir, global_step, group.size(), state, options);
  });
  return {exp_dir / name, written};
}

}  // namespace meshtorch::checkpoint
#endif  // MESHTORCH_DEFINES(programs)
