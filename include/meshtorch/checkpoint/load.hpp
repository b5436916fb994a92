#pragma once
// Loading a sharded checkpoint (the format: checkpoint/manifest.hpp) into any set of boxes:
// another mesh, another world size. Every file's size and checksum is checked first (the
// collective form shares the checksum work), then each rank reads only the rows its boxes need,
// through the one safetensors reader (io/safetensors.hpp).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <meshtorch/torch.hpp>

#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::checkpoint {

// Where a run resumes from: `dir` itself when it is a checkpoint (it holds a manifest), else the
// folder its `checkpoint` link names, or nothing for a fresh experiment. Complete ckpt-* folders
// without the link are an error (never a silent fresh start that would then delete them);
// .partial folders (a save that did not finish) are ignored and listed.
struct ResumePoint {
  std::optional<std::filesystem::path> checkpoint;
  std::vector<std::filesystem::path> ignored_partial;
};

MESHTORCH_DECL ResumePoint find_checkpoint_to_resume(const std::filesystem::path& exp_dir);

// What a load returns besides the tensors it filled.
struct LoadedCheckpoint {
  nlohmann::json state;                        // state.json
  std::optional<io::NamedTensors> rank_state;  // this rank's, when the world size is the saved one
  std::string rank_state_note;                 // why rank_state is absent
  Manifest manifest;
  std::vector<std::string> not_requested;  // tensors the checkpoint holds that were not loaded
};

namespace detail {

// load_sharded_checkpoint's work once the files of `out.manifest` are checked: state.json, the
// tensors and this rank's state into `out`.
MESHTORCH_DECL void load_checked(const std::filesystem::path& checkpoint_dir, std::vector<io::ShardedTensor>& tensors,
                                 int rank, int world_size, LoadedCheckpoint& out);

}  // namespace detail

// Fills each of `tensors` (its `local`, in place, on its device) from a checkpoint folder, as
// rank `rank` of `world_size`, after checking every file's size and `checksummed` files'
// checksums (every file by default). Boxes may differ from the saved ones in any way; a tensor
// absent from the checkpoint, or a box reaching outside the saved pieces, is an error naming it.
template <class ChecksumThis>
LoadedCheckpoint load_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                         std::vector<io::ShardedTensor>& tensors, int rank, int world_size,
                                         ChecksumThis&& checksummed) {
  LoadedCheckpoint out;
  out.manifest = read_manifest(checkpoint_dir);
  throw_if_damaged(checkpoint_dir, check_checkpoint_files(checkpoint_dir, out.manifest, checksummed));
  detail::load_checked(checkpoint_dir, tensors, rank, world_size, out);
  return out;
}

MESHTORCH_DECL LoadedCheckpoint load_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                        std::vector<io::ShardedTensor>& tensors, int rank = 0,
                                                        int world_size = 1);

// The collective load: every rank of `group` calls it with its own boxes. Each file's checksum is
// computed by one rank (file i by rank i mod world) and the verdict shared, so the folder is read
// once for checking; then each rank reads only the rows its boxes need.
MESHTORCH_DECL LoadedCheckpoint load_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                        std::vector<io::ShardedTensor>& tensors,
                                                        const comm::AxisGroup& group);

namespace detail {

class Readers;

// Fills `target` (extent `target_box`) from every saved piece of `record` that overlaps it,
// reading only the rows each overlap needs (consolidation assembles whole tensors with it).
MESHTORCH_DECL void fill_from_pieces(const TensorRecord& record, torch::Tensor& target, const io::Box& target_box,
                                     Readers& readers);

// The safetensors files of one checkpoint folder, each opened once per load.
class Readers {
 public:
  explicit Readers(std::filesystem::path dir) : dir_(std::move(dir)) {}
  MESHTORCH_DECL const io::SafetensorsReader& get(const std::string& file);

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::unique_ptr<io::SafetensorsReader>> readers_;
};

}  // namespace detail
}  // namespace meshtorch::checkpoint

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <meshtorch/comm/collectives.hpp>

namespace meshtorch::checkpoint {

MESHTORCH_DECL ResumePoint find_checkpoint_to_resume(const std::filesystem::path& exp_dir) {
  ResumePoint out;
  if (!std::filesystem::exists(exp_dir)) return out;
  if (std::filesystem::exists(exp_dir / manifest_file_name)) {
    out.checkpoint = std::filesystem::canonical(exp_dir);
    return out;
  }
  std::vector<std::string> complete;
  for (const auto& entry : std::filesystem::directory_iterator(exp_dir)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("ckpt-", 0) != 0 || !entry.is_directory()) continue;
    if (file.ends_with(".partial") || file.ends_with(".replaced"))
      out.ignored_partial.push_back(entry.path());
    else
      complete.push_back(file);
  }
  std::sort(complete.begin(), complete.end());
  std::sort(out.ignored_partial.begin(), out.ignored_partial.end());
  const auto link = exp_dir / checkpoint_link_name;
  if (std::filesystem::is_symlink(link) || std::filesystem::exists(link)) {
    std::error_code error;
    const auto target = std::filesystem::canonical(link, error);
    if (error)
      throw DataError(
          fmt::format("{} points to {}, which does not exist; complete checkpoints here: {}", link.string(),
                      std::filesystem::read_symlink(link, error).string(),
                      complete.empty() ? std::string("none") : fmt::format("{}", fmt::join(complete, ", "))));
    if (!std::filesystem::exists(target / manifest_file_name))
      throw DataError(fmt::format("{} points to {}, which has no {}: not a complete sharded checkpoint", link.string(),
                                  target.string(), manifest_file_name));
    out.checkpoint = target;
    return out;
  }
  if (!complete.empty())
    throw DataError(
        fmt::format("{} has checkpoint folder(s) {} but no '{}' link naming the latest (copied without "
                    "links?); restore it (ln -sfn {} {}) or name the folder with --resume-from",
                    exp_dir.string(), fmt::join(complete, ", "), checkpoint_link_name, complete.back(), link.string()));
  return out;
}

namespace detail {

MESHTORCH_DECL const io::SafetensorsReader& Readers::get(const std::string& file) {
  auto& reader = readers_[file];
  if (!reader) reader = std::make_unique<io::SafetensorsReader>(checkpoint_file(dir_, file));
  return *reader;
}

MESHTORCH_DECL void fill_from_pieces(const TensorRecord& record, torch::Tensor& target, const io::Box& target_box,
                                     Readers& readers) {
  std::vector<io::Box> boxes;
  boxes.reserve(record.pieces.size());
  for (const auto& p : record.pieces) boxes.push_back(p.box);
  const auto uncovered = io::uncovered(target_box, boxes);
  if (!uncovered.empty()) {
    std::vector<std::string> regions;
    for (const auto& b : uncovered) regions.push_back(io::to_string(b));
    throw DataError(fmt::format("tensor '{}': region(s) {} of the requested box {} are in no saved piece", record.name,
                                fmt::join(regions, ", "), io::to_string(target_box)));
  }
  torch::NoGradGuard no_grad;
  for (const auto& p : record.pieces) {
    const auto common = io::intersect(p.box, target_box);
    if (!common) continue;
    const auto& reader = readers.get(p.file);
    const auto* entry = reader.find(p.key);
    if (!entry)
      throw DataError(
          fmt::format("{}: tensor '{}' (a piece of '{}') is missing", reader.path().string(), p.key, record.name));
    if (entry->dtype != record.dtype || entry->shape != p.box.sizes)
      throw DataError(fmt::format("{}: tensor '{}' is {} {}, the manifest says {} {}", reader.path().string(), p.key,
                                  c10::toString(entry->dtype), shape_string(entry->shape), c10::toString(record.dtype),
                                  shape_string(p.box.sizes)));
    torch::Tensor part;
    io::Box part_box = p.box;
    if (p.box.dim() == 0) {
      part = reader.read(*entry);
    } else {
      const auto first = common->offsets[0] - p.box.offsets[0];
      part = reader.read_rows(*entry, first, common->sizes[0]);
      part_box.offsets[0] = common->offsets[0];
      part_box.sizes[0] = common->sizes[0];
    }
    io::copy_overlap(part, part_box, target, target_box);
  }
}

inline std::string world_note(const Manifest& m, int world_size) {
  return fmt::format(
      "the checkpoint was saved by {} ranks and is loaded on {}: per-rank state (RNG) is not "
      "restored; reseed each rank",
      m.world_size, world_size);
}

MESHTORCH_DECL void load_checked(const std::filesystem::path& checkpoint_dir, std::vector<io::ShardedTensor>& tensors,
                                 int rank, int world_size, LoadedCheckpoint& out) {
  const auto& m = out.manifest;
  if (!m.files.contains(std::string(state_file_name)))
    throw DataError(fmt::format("{}: {} is not listed under files", (checkpoint_dir / manifest_file_name).string(),
                                state_file_name));
  out.state = read_checkpoint_json(checkpoint_file(checkpoint_dir, std::string(state_file_name)));

  Readers readers(checkpoint_dir);
  std::set<std::string> requested;
  for (auto& t : tensors) {
    requested.insert(t.name);
    const auto* record = m.find(t.name);
    if (!record)
      throw DataError(fmt::format("tensor '{}' is not in checkpoint {} ({} tensors, saved as layout '{}')", t.name,
                                  checkpoint_dir.string(), m.tensors.size(), m.layout));
    if (record->shape != t.global_shape)
      throw DataError(fmt::format("tensor '{}' has global shape {} in checkpoint {}, this run has {}", t.name,
                                  shape_string(record->shape), checkpoint_dir.string(), shape_string(t.global_shape)));
    if (record->dtype != t.local.scalar_type())
      throw DataError(fmt::format("tensor '{}' is {} in checkpoint {}, this run has {}", t.name,
                                  c10::toString(record->dtype), checkpoint_dir.string(),
                                  c10::toString(t.local.scalar_type())));
    io::sharded(t.name, t.local, t.global_shape, t.box);
    fill_from_pieces(*record, t.local, t.box, readers);
  }
  for (const auto& t : m.tensors)
    if (!requested.contains(t.name)) out.not_requested.push_back(t.name);

  if (world_size != m.world_size) {
    out.rank_state_note = world_note(m, world_size);
  } else {
    io::NamedTensors state;
    const auto it = m.rank_state.find(rank);
    if (it != m.rank_state.end())
      for (const auto& name : it->second) {
        const auto& reader = readers.get(rank_file_name(rank));
        state.emplace_back(name, reader.read(reader.entry(rank_state_key(rank, name))));
      }
    out.rank_state = std::move(state);
  }
}

}  // namespace detail

MESHTORCH_DECL LoadedCheckpoint load_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                        std::vector<io::ShardedTensor>& tensors, int rank,
                                                        int world_size) {
  return load_sharded_checkpoint(checkpoint_dir, tensors, rank, world_size, [](std::size_t) { return true; });
}

MESHTORCH_DECL LoadedCheckpoint load_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                        std::vector<io::ShardedTensor>& tensors,
                                                        const comm::AxisGroup& group) {
  const auto m = read_manifest(checkpoint_dir);
  const auto world = static_cast<std::size_t>(group.size());
  const auto me = static_cast<std::size_t>(group.rank());
  std::vector<int> damaged(m.files.size(), 0);
  std::vector<std::string> problems;
  std::size_t index = 0;
  for (const auto& [name, expected] : m.files) {
    if (auto problem = check_checkpoint_file(checkpoint_dir, name, expected, index % world == me)) {
      damaged[index] = 1;
      problems.push_back(std::move(*problem));
    }
    ++index;
  }
  const auto device = group.device() == comm::Device::cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  auto verdict = torch::zeros({static_cast<std::int64_t>(damaged.size())},
                              torch::TensorOptions().dtype(torch::kInt).device(device));
  for (std::size_t i = 0; i < damaged.size(); ++i) verdict[static_cast<std::int64_t>(i)] = damaged[i];
  verdict = comm::all_reduce(group, verdict, comm::ReduceOp::max).to(torch::kCPU);
  index = 0;
  for (const auto& [name, expected] : m.files) {
    if (verdict[static_cast<std::int64_t>(index)].item<int>() != 0 && !damaged[index])
      problems.push_back(fmt::format("{}: damaged (size or checksum differs from the manifest; checked by rank {})",
                                     (checkpoint_dir / name).string(),
                                     group.global_rank_of(static_cast<int>(index % world))));
    ++index;
  }
  throw_if_damaged(checkpoint_dir, problems);
  return load_sharded_checkpoint(checkpoint_dir, tensors, group.rank(), group.size(),
                                 [](std::size_t) { return false; });
}

}  // namespace meshtorch::checkpoint
#endif  // MESHTORCH_DEFINES(programs)
