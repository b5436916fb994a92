#pragma once
// One checkpoint format for every layout (DDP, ZeRO, FSDP, TP, 2D, HSDP, 3D): each rank writes
// only its own pieces of each tensor, described as boxes of the global tensor (io/sharded_tensor.hpp),
// and a manifest says which file holds which box, with every file's size and checksum. Loading
// fills any other set of boxes from the overlapping saved pieces, so a checkpoint resumes on
// another mesh or world size. The format is documented in docs/checkpoints.md:
//
//   <exp>/checkpoint -> ckpt-<step>         swapped with rename(2) once the folder is complete
//   <exp>/ckpt-<step>/rank<R>.safetensors   the pieces rank R writes, plus its per-rank state
//                     manifest.json         version, world size, layout, per tensor its pieces
//                                           {file, key, box}, per file its size and checksum
//                     state.json            the caller's JSON (training state)
//                     config.json, ...      the caller's extra files (consolidation copies them)
//
// Saving is split into steps that need no process group (write_rank_pieces on every rank,
// publish_sharded_checkpoint on rank 0) and the collective save_sharded_checkpoint that orders
// them with the group; loading likewise (the collective form shares the checksum work).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/safetensors_writer.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::parallel {

inline constexpr int sharded_checkpoint_version = 1;
inline constexpr std::string_view sharded_checkpoint_format = "meshtorch-sharded-checkpoint";
inline constexpr std::string_view manifest_file_name = "manifest.json";
inline constexpr std::string_view state_file_name = "state.json";
using train::checkpoint_link_name;
// Tensors named with this prefix are optimizer state: loaded like weights, left out of consolidation.
inline constexpr std::string_view optimizer_prefix = "optimizer/";

MESHTORCH_DECL std::string sharded_checkpoint_name(std::int64_t global_step);
MESHTORCH_DECL std::string rank_file_name(int rank);
MESHTORCH_DECL std::string rank_piece_list_name(int rank);
// Per-rank state (RNG) lives in the rank's file under these keys and is never resharded.
MESHTORCH_DECL std::string rank_state_key(int rank, const std::string& name);

struct SaveOptions {
  std::string layout;  // free-form description of the mesh and placements, recorded in the manifest
  // Small files rank 0 writes into the folder (config.json above all: consolidation copies it
  // into the HF folder); listed in the manifest with their checksums.
  std::map<std::string, std::string> extra_files;
  // This rank's place in the mesh ("DP 0, FSDP 1, TP 0"), recorded per rank in the manifest so
  // a file can be traced to the rank that wrote it; each rank passes its own.
  std::string coordinate;
};

struct PieceRecord {
  std::string file;  // a plain file name inside the checkpoint folder
  std::string key;   // the tensor's name inside that file
  io::Box box;
  int rank = 0;
};

struct TensorRecord {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<std::int64_t> shape;
  std::vector<PieceRecord> pieces;
};

// The contents of manifest.json.
struct Manifest {
  int version = sharded_checkpoint_version;
  std::int64_t global_step = 0;
  int world_size = 0;
  std::string layout;
  std::vector<TensorRecord> tensors;                   // sorted by name
  std::map<std::string, io::FileDigest> files;         // every file of the folder but manifest.json
  std::map<int, std::vector<std::string>> rank_state;  // rank -> names (keys are rank_state_key)
  std::map<int, std::string> coordinates;              // rank -> SaveOptions::coordinate

  // The tensor of that name, or nullptr.
  MESHTORCH_DECL const TensorRecord* find(const std::string& name) const;
};

MESHTORCH_DECL nlohmann::ordered_json to_json(const Manifest& m);

// Reads and checks <dir>/manifest.json (structure, names, boxes, exact cover); the files
// themselves are checked by verify_checkpoint_files.
MESHTORCH_DECL Manifest read_manifest(const std::filesystem::path& checkpoint_dir);

// One file against its manifest entry: its size always, its checksum when asked; what is wrong
// with it (naming it), or nothing.
MESHTORCH_DECL std::optional<std::string> check_checkpoint_file(const std::filesystem::path& checkpoint_dir,
                                                                const std::string& name, const io::FileDigest& expected,
                                                                bool checksum);

// Every file's size, and the checksum of those `checksum_this(index)` picks (index in the
// manifest's file order). One message per damaged file.
template <class ChecksumThis>
std::vector<std::string> check_checkpoint_files(const std::filesystem::path& checkpoint_dir, const Manifest& m,
                                                ChecksumThis&& checksum_this) {
  std::vector<std::string> problems;
  std::size_t index = 0;
  for (const auto& [name, expected] : m.files)
    if (auto problem = check_checkpoint_file(checkpoint_dir, name, expected, checksum_this(index++)))
      problems.push_back(std::move(*problem));
  return problems;
}

MESHTORCH_DECL void throw_if_damaged(const std::filesystem::path& checkpoint_dir,
                                     const std::vector<std::string>& problems);

// Every file's size and checksum, in one process (consolidation, tools, tests).
MESHTORCH_DECL void verify_checkpoint_files(const std::filesystem::path& checkpoint_dir, const Manifest& m);

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
// only then removes older checkpoints and stale .partial folders.
MESHTORCH_DECL void publish_checkpoint_folder(const std::filesystem::path& exp_dir, const std::string& name);

// Step 2 of a save, on rank 0 after every rank's step 1, no communication: reads every rank's
// piece list, re-checks each file's size and checksum, checks that the pieces cover every tensor
// exactly once, writes state.json, the extra files and manifest.json, and publishes. Anything
// missing or wrong is an error naming the rank or file, and nothing is published.
MESHTORCH_DECL Manifest publish_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                   int world_size, const nlohmann::ordered_json& state,
                                                   const SaveOptions& options = {});

namespace sharded_detail {

// The ranks of `group` whose `failed` is true, known to every rank (an all-gather: also the
// barrier between the steps, bounded by the group's timeout).
MESHTORCH_DECL std::vector<int> failed_ranks(const comm::AxisGroup& group, bool failed);

}  // namespace sharded_detail

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

namespace sharded_detail {

// load_sharded_checkpoint's work once the files of `out.manifest` are checked: state.json, the
// tensors and this rank's state into `out`.
MESHTORCH_DECL void load_checked(const std::filesystem::path& checkpoint_dir, std::vector<io::ShardedTensor>& tensors,
                                 int rank, int world_size, LoadedCheckpoint& out);

}  // namespace sharded_detail

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
  sharded_detail::load_checked(checkpoint_dir, tensors, rank, world_size, out);
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

// AdamW's state for `parameters` as pieces with the same boxes, so optimizer state reshards like
// the weights: "optimizer/<name>.exp_avg" and ".exp_avg_sq" share the parameter's box, and
// ".step" is a replicated scalar written by the rank holding the parameter's first element. The
// tensors alias the optimizer's own, so a load fills the optimizer in place. Any optimizer whose
// state() names AdamW's state so (AdamW, ZeroRedundancyOptimizer for the parameters it owns).
template <class Optimizer>
std::vector<io::ShardedTensor> adamw_state_tensors(const Optimizer& optimizer,
                                                   const std::vector<io::ShardedTensor>& parameters) {
  const auto state = optimizer.state();
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  auto take = [&](const std::string& name) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(
          fmt::format("adamw_state_tensors: the optimizer has no state '{}' (is it built on the same "
                      "parameter names as the pieces?)",
                      name));
    return it->second;
  };
  std::vector<io::ShardedTensor> out;
  for (const auto& p : parameters) {
    const std::string prefix = fmt::format("{}{}", optimizer_prefix, p.name);
    out.push_back(io::sharded(prefix + ".exp_avg", take(p.name + ".exp_avg"), p.global_shape, p.box, p.writer));
    out.push_back(io::sharded(prefix + ".exp_avg_sq", take(p.name + ".exp_avg_sq"), p.global_shape, p.box, p.writer));
    const bool holds_origin = !p.box.empty() && std::all_of(p.box.offsets.begin(), p.box.offsets.end(),
                                                            [](std::int64_t o) { return o == 0; });
    out.push_back(io::replicated(prefix + ".step", take(p.name + ".step"), p.writer && holds_origin));
  }
  return out;
}

// What consolidate_sharded_checkpoint wrote.
struct ConsolidateResult {
  std::vector<std::filesystem::path> files;
  std::int64_t tensors = 0;
  std::uint64_t bytes = 0;  // of tensor data
};

struct ConsolidateOptions {
  std::uint64_t max_shard_bytes = std::uint64_t{5} << 30;  // transformers' default: 5 GB per file
  bool include_optimizer = false;
};

// Turns a sharded checkpoint into an HF folder: config.json (and the other extra files) copied,
// model.safetensors, or model-0000i-of-0000n.safetensors with model.safetensors.index.json beyond
// max_shard_bytes. One process, no launcher; assembles one full tensor at a time, written straight
// into the output file (whose header is planned from the manifest), so memory holds one tensor.
MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options = {});

}  // namespace meshtorch::parallel

#if MESHTORCH_DEFINES(programs)
#include <exception>
#include <fstream>
#include <memory>
#include <set>

#include <fmt/ranges.h>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/json_file.hpp>
#include <meshtorch/io/model_folder.hpp>

namespace meshtorch::parallel {

MESHTORCH_DECL std::string sharded_checkpoint_name(std::int64_t global_step) {
  return fmt::format("ckpt-{:08d}", global_step);
}
MESHTORCH_DECL std::string rank_file_name(int rank) { return fmt::format("rank{}.safetensors", rank); }
MESHTORCH_DECL std::string rank_piece_list_name(int rank) { return fmt::format("rank{}.pieces.json", rank); }
MESHTORCH_DECL std::string rank_state_key(int rank, const std::string& name) {
  return fmt::format("rank{}/{}", rank, name);
}

MESHTORCH_DECL const TensorRecord* Manifest::find(const std::string& name) const {
  const auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                                   [](const TensorRecord& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

namespace sharded_detail {

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Names in a manifest are data, never paths: a file must be a plain name inside the folder.
inline void check_plain_file_name(const std::string& name, const std::string& where) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos)
    throw DataError(fmt::format("{}: '{}' is not a plain file name inside the checkpoint folder", where, name));
}

// A file the manifest names, confined to the checkpoint folder as a model folder's files are to
// theirs: a plain name, and no link leading out of the folder.
inline std::filesystem::path checkpoint_file(const std::filesystem::path& dir, const std::string& name) {
  return io::confined_file(dir, name, fmt::format("{}: the manifest's file", dir.string()),
                           io::FolderKind::checkpoint);
}

// Through the one bounded JSON reader (depth, repeated keys, size, numbers in range).
inline nlohmann::json read_checkpoint_json(const std::filesystem::path& path) {
  if (!io::present_in_folder(path)) throw DataError(fmt::format("{} is missing", path.string()));
  return io::read_json_file<DataError>(path);
}

// Typed access to a JSON field, naming the file and the field when it is missing or mistyped.
template <class T>
T field(const nlohmann::json& object, const std::string& key, const std::string& where) {
  if (!object.is_object() || !object.contains(key))
    throw DataError(fmt::format("{}: field '{}' is missing", where, key));
  try {
    return object.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw DataError(fmt::format("{}: field '{}' has the wrong type ({})", where, key, object.at(key).dump()));
  }
}

inline torch::ScalarType dtype_field(const nlohmann::json& object, const std::string& where) {
  const auto name = field<std::string>(object, "dtype", where);
  const auto dtype = io::safetensors_dtype(name);
  if (!dtype) throw DataError(fmt::format("{}: unsupported dtype '{}'", where, name));
  return *dtype;
}

inline nlohmann::ordered_json piece_json(const PieceRecord& p) {
  return {{"file", p.file}, {"key", p.key}, {"rank", p.rank}, {"offsets", p.box.offsets}, {"sizes", p.box.sizes}};
}

inline PieceRecord parse_piece(const nlohmann::json& j, const std::string& where) {
  PieceRecord p;
  p.file = field<std::string>(j, "file", where);
  check_plain_file_name(p.file, where);
  p.key = field<std::string>(j, "key", where);
  p.rank = field<int>(j, "rank", where);
  p.box.offsets = field<std::vector<std::int64_t>>(j, "offsets", where);
  p.box.sizes = field<std::vector<std::int64_t>>(j, "sizes", where);
  if (p.box.offsets.size() != p.box.sizes.size())
    throw DataError(fmt::format("{}: offsets and sizes have different lengths", where));
  return p;
}

inline void check_piece_inside(const PieceRecord& p, const std::vector<std::int64_t>& shape, const std::string& where) {
  for (std::size_t d = 0; d < p.box.dim(); ++d)
    if (p.box.offsets[d] < 0 || p.box.sizes[d] < 0) throw DataError(fmt::format("{}: negative offset or size", where));
  if (p.box.dim() != shape.size() || !io::contains(io::whole(shape), p.box))
    throw DataError(fmt::format("{}: box {} does not lie inside the tensor's shape {}", where, io::to_string(p.box),
                                shape_string(shape)));
}

// Pieces must cover the global tensor exactly once: no region twice (two writers of one
// replica), none missing (no writer at all). Near-linear (a sweep, then a count), so that a
// manifest of 100,000 pieces costs no more than reading it.
inline void check_exact_cover(const TensorRecord& t, const std::string& where) {
  std::vector<io::Box> boxes;
  boxes.reserve(t.pieces.size());
  for (const auto& p : t.pieces) boxes.push_back(p.box);
  if (const auto both = io::first_overlap(boxes))
    throw DataError(
        fmt::format("{}: tensor '{}': region {} is written by rank {} and by rank {}; mark one "
                    "replica writer and the others not",
                    where, t.name, io::to_string(*io::intersect(boxes[both->first], boxes[both->second])),
                    t.pieces[both->first].rank, t.pieces[both->second].rank));
  // Disjoint pieces inside the tensor cover it exactly when their elements add up to its own.
  std::int64_t covered = 0;
  for (const auto& b : boxes) covered += b.numel();
  if (covered == io::whole(t.shape).numel()) return;
  std::vector<std::string> regions;
  for (const auto& b : io::uncovered(io::whole(t.shape), boxes)) regions.push_back(io::to_string(b));
  throw DataError(
      fmt::format("{}: tensor '{}' of shape {}: region(s) {} written by no rank (is every replica "
                  "marked writer = false?)",
                  where, t.name, shape_string(t.shape), fmt::join(regions, ", ")));
}

inline nlohmann::ordered_json digest_json(const io::FileDigest& d) {
  return {{"bytes", d.bytes}, {"xxh3", io::checksum_hex(d.xxh3)}};
}

inline io::FileDigest parse_digest(const nlohmann::json& j, const std::string& where) {
  io::FileDigest d;
  d.bytes = field<std::uint64_t>(j, "bytes", where);
  const auto hex = field<std::string>(j, "xxh3", where);
  try {
    std::size_t used = 0;
    d.xxh3 = std::stoull(hex, &used, 16);
    if (used != hex.size() || hex.size() != 16) throw std::invalid_argument(hex);
  } catch (const std::exception&) {
    throw DataError(fmt::format("{}: xxh3 '{}' is not 16 hex digits", where, hex));
  }
  return d;
}

}  // namespace sharded_detail

MESHTORCH_DECL nlohmann::ordered_json to_json(const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = sharded_checkpoint_format;
  j["version"] = m.version;
  j["global_step"] = m.global_step;
  j["world_size"] = m.world_size;
  j["layout"] = m.layout;
  j["checksum"] = "xxh3-64";
  auto& files = j["files"] = nlohmann::ordered_json::object();
  for (const auto& [name, digest] : m.files) files[name] = sharded_detail::digest_json(digest);
  auto& tensors = j["tensors"] = nlohmann::ordered_json::object();
  for (const auto& t : m.tensors) {
    auto& entry = tensors[t.name];
    entry["dtype"] = io::safetensors_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    entry["pieces"] = nlohmann::ordered_json::array();
    for (const auto& p : t.pieces) entry["pieces"].push_back(sharded_detail::piece_json(p));
  }
  auto& rank_state = j["rank_state"] = nlohmann::ordered_json::object();
  for (const auto& [rank, names] : m.rank_state) rank_state[std::to_string(rank)] = names;
  auto& coordinates = j["coordinates"] = nlohmann::ordered_json::object();
  for (const auto& [rank, coordinate] : m.coordinates) coordinates[std::to_string(rank)] = coordinate;
  return j;
}

MESHTORCH_DECL Manifest read_manifest(const std::filesystem::path& checkpoint_dir) {
  using namespace sharded_detail;
  const auto path = checkpoint_dir / manifest_file_name;
  if (!std::filesystem::exists(path))
    throw DataError(
        fmt::format("{} is missing: {} is not a complete sharded checkpoint (was it copied without "
                    "it, or written by an older meshtorch?)",
                    path.string(), checkpoint_dir.string()));
  const auto j = read_checkpoint_json(path);
  const std::string where = path.string();
  if (field<std::string>(j, "format", where) != sharded_checkpoint_format)
    throw DataError(fmt::format("{}: format is not '{}'", where, sharded_checkpoint_format));
  Manifest m;
  m.version = field<int>(j, "version", where);
  if (m.version != sharded_checkpoint_version)
    throw DataError(fmt::format("{}: version {} is not the version {} this meshtorch reads", where, m.version,
                                sharded_checkpoint_version));
  m.global_step = field<std::int64_t>(j, "global_step", where);
  m.world_size = field<int>(j, "world_size", where);
  if (m.world_size < 1) throw DataError(fmt::format("{}: world_size {} is not positive", where, m.world_size));
  m.layout = field<std::string>(j, "layout", where);
  const auto files_json = field<nlohmann::json>(j, "files", where);
  const auto tensors_json = field<nlohmann::json>(j, "tensors", where);
  const auto rank_state_json = field<nlohmann::json>(j, "rank_state", where);
  if (!files_json.is_object() || !tensors_json.is_object() || !rank_state_json.is_object())
    throw DataError(fmt::format("{}: files, tensors and rank_state must be objects", where));
  for (const auto& [name, digest] : files_json.items()) {
    check_plain_file_name(name, where + ": files");
    m.files[name] = parse_digest(digest, fmt::format("{}: files.{}", where, name));
  }
  std::set<std::pair<std::string, std::string>> stored;  // (file, key) of every piece
  for (const auto& [name, entry] : tensors_json.items()) {
    const std::string tensor_where = fmt::format("{}: tensors.{}", where, name);
    TensorRecord t;
    t.name = name;
    t.dtype = dtype_field(entry, tensor_where);
    t.shape = field<std::vector<std::int64_t>>(entry, "shape", tensor_where);
    std::int64_t elements = 1;
    for (auto s : t.shape) {
      if (s < 0) throw DataError(fmt::format("{}: negative size in shape {}", tensor_where, shape_string(t.shape)));
      if (__builtin_mul_overflow(elements, s, &elements))
        throw DataError(fmt::format("{}: shape {} has more than 2^63 elements", tensor_where, shape_string(t.shape)));
    }
    const auto pieces = field<nlohmann::json>(entry, "pieces", tensor_where);
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const std::string piece_where = fmt::format("{}.pieces[{}]", tensor_where, i);
      auto p = parse_piece(pieces[i], piece_where);
      check_piece_inside(p, t.shape, piece_where);
      if (!m.files.contains(p.file))
        throw DataError(fmt::format("{}: file '{}' is not listed under files", piece_where, p.file));
      // One stored tensor is one piece: pieces sharing it would multiply what a load or an
      // export writes out of one file's bytes.
      if (!stored.emplace(p.file, p.key).second)
        throw DataError(fmt::format("{}: '{}' in '{}' is already another piece", piece_where, p.key, p.file));
      t.pieces.push_back(std::move(p));
    }
    check_exact_cover(t, where);
    m.tensors.push_back(std::move(t));
  }
  std::sort(m.tensors.begin(), m.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& [rank, names] : rank_state_json.items()) {
    int r = -1;
    try {
      r = std::stoi(rank);
    } catch (const std::exception&) {
    }
    if (r < 0 || r >= m.world_size)
      throw DataError(fmt::format("{}: rank_state has rank '{}' outside 0..{}", where, rank, m.world_size - 1));
    if (!names.is_array() || !std::all_of(names.begin(), names.end(), [](const auto& n) { return n.is_string(); }))
      throw DataError(fmt::format("{}: rank_state.{} must be a list of names", where, rank));
    m.rank_state[r] = names.get<std::vector<std::string>>();
  }
  const auto coordinates_json = field<nlohmann::json>(j, "coordinates", where);
  for (const auto& [rank, coordinate] : coordinates_json.items()) {
    if (!coordinate.is_string()) throw DataError(fmt::format("{}: coordinates.{} must be a string", where, rank));
    int r = -1;
    try {
      r = std::stoi(rank);
    } catch (const std::exception&) {
    }
    if (r < 0 || r >= m.world_size)
      throw DataError(fmt::format("{}: coordinates has rank '{}' outside 0..{}", where, rank, m.world_size - 1));
    m.coordinates[r] = coordinate.get<std::string>();
  }
  return m;
}

MESHTORCH_DECL std::optional<std::string> check_checkpoint_file(const std::filesystem::path& checkpoint_dir,
                                                                const std::string& name, const io::FileDigest& expected,
                                                                bool checksum) {
  const auto path = checkpoint_dir / name;
  if (!io::present_in_folder(path)) return fmt::format("{} is missing", path.string());
  try {
    sharded_detail::checkpoint_file(checkpoint_dir, name);
  } catch (const DataError& e) {  // a verdict, not an exception: the collective load shares it
    return e.what();
  }
  std::error_code error;
  const auto size = std::filesystem::file_size(path, error);
  if (error) return fmt::format("{} is missing ({})", path.string(), error.message());
  if (size != expected.bytes)
    return fmt::format("{} has {} bytes, the manifest says {}: {}", path.string(), size, expected.bytes,
                       size < expected.bytes ? "truncated" : "written past its end");
  if (!checksum) return std::nullopt;
  io::FileDigest actual;
  try {
    actual = io::digest_file(path);
  } catch (const DataError& e) {  // a verdict, not an exception: the collective load shares it
    return e.what();
  }
  if (actual.xxh3 != expected.xxh3)
    return fmt::format("{}: checksum xxh3 {} differs from the manifest's {}: the file is damaged", path.string(),
                       io::checksum_hex(actual.xxh3), io::checksum_hex(expected.xxh3));
  return std::nullopt;
}

MESHTORCH_DECL void throw_if_damaged(const std::filesystem::path& checkpoint_dir,
                                     const std::vector<std::string>& problems) {
  if (problems.empty()) return;
  throw DataError(
      fmt::format("checkpoint {} is damaged or incomplete: {}; resume from another checkpoint "
                  "(or start afresh in a new experiment folder)",
                  checkpoint_dir.string(), fmt::join(problems, "; ")));
}

MESHTORCH_DECL void verify_checkpoint_files(const std::filesystem::path& checkpoint_dir, const Manifest& m) {
  throw_if_damaged(checkpoint_dir, check_checkpoint_files(checkpoint_dir, m, [](std::size_t) { return true; }));
}

MESHTORCH_DECL RankWriteResult write_rank_pieces(const std::filesystem::path& partial_dir, int rank, int world_size,
                                                 const std::vector<io::ShardedTensor>& tensors,
                                                 const io::NamedTensors& rank_state, const std::string& coordinate) {
  using namespace sharded_detail;
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

MESHTORCH_DECL void publish_checkpoint_folder(const std::filesystem::path& exp_dir, const std::string& name) {
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
  for (const auto& entry : std::filesystem::directory_iterator(exp_dir)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("ckpt-", 0) == 0 && file != name) std::filesystem::remove_all(entry.path());
  }
}

MESHTORCH_DECL Manifest publish_sharded_checkpoint(const std::filesystem::path& exp_dir, std::int64_t global_step,
                                                   int world_size, const nlohmann::ordered_json& state,
                                                   const SaveOptions& options) {
  using namespace sharded_detail;
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
    for (const auto& piece : field<nlohmann::json>(list, "pieces", where)) {
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
  publish_checkpoint_folder(exp_dir, name);
  return m;
}

namespace sharded_detail {

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

}  // namespace sharded_detail

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
    const auto failed = sharded_detail::failed_ranks(group, failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    if (!failed.empty())
      throw DataError(
          fmt::format("saving {}: rank(s) {} failed to {} (see their logs); the previous checkpoint "
                      "stays",
                      (exp_dir / name).string(), fmt::join(failed, ", "), what));
  };
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

namespace sharded_detail {

// Readers opened once per file and load.
class Readers {
 public:
  explicit Readers(std::filesystem::path dir) : dir_(std::move(dir)) {}
  const io::SafetensorsReader& get(const std::string& file) {
    auto& reader = readers_[file];
    if (!reader) reader = std::make_unique<io::SafetensorsReader>(checkpoint_file(dir_, file));
    return *reader;
  }

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::unique_ptr<io::SafetensorsReader>> readers_;
};

// Fills `target` (extent `target_box`) from every saved piece of `record` that overlaps it,
// reading only the rows each overlap needs.
inline void fill_from_pieces(const TensorRecord& record, torch::Tensor& target, const io::Box& target_box,
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

}  // namespace sharded_detail

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
  auto verdict = sharded_detail::flag_tensor(group, 0).repeat({static_cast<std::int64_t>(damaged.size())});
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

MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options) {
  using namespace sharded_detail;
  const auto m = read_manifest(checkpoint_dir);
  verify_checkpoint_files(checkpoint_dir, m);
  if (!m.files.contains("config.json"))
    throw DataError(
        fmt::format("{}: no config.json was saved with the checkpoint (pass it in "
                    "SaveOptions::extra_files); an HF folder needs one",
                    checkpoint_dir.string()));
  std::vector<const TensorRecord*> model;
  for (const auto& t : m.tensors)
    if (options.include_optimizer || t.name.rfind(optimizer_prefix, 0) != 0) model.push_back(&t);
  if (model.empty()) throw DataError(fmt::format("{}: the checkpoint holds no model tensors", checkpoint_dir.string()));

  std::vector<std::vector<const TensorRecord*>> shards(1);
  std::uint64_t in_shard = 0, total = 0;
  for (const auto* t : model) {
    const auto bytes = io::safetensors_bytes(t->dtype, t->shape);
    if (in_shard > 0 && in_shard + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += bytes;
    total += bytes;
  }
  std::filesystem::create_directories(out_dir);
  ConsolidateResult result;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  Readers readers(checkpoint_dir);
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const auto file = shards.size() == 1 ? std::string("model.safetensors")
                                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    std::vector<io::SafetensorsEntry> entries;
    for (const auto* t : shards[s]) entries.push_back(io::SafetensorsEntry{t->name, t->dtype, t->shape});
    io::SafetensorsStreamWriter writer(out_dir / file, std::move(entries), {{"format", "pt"}});
    for (const auto* t : shards[s]) {
      auto full = torch::empty(t->shape, torch::TensorOptions().dtype(t->dtype));
      fill_from_pieces(*t, full, io::whole(t->shape), readers);
      writer.append(full);
      weight_map[t->name] = file;
      ++result.tensors;
    }
    writer.commit();
    result.files.push_back(out_dir / file);
  }
  result.bytes = total;
  if (shards.size() > 1) {
    const nlohmann::ordered_json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    io::write_file_atomically(out_dir / "model.safetensors.index.json", index.dump(2) + "\n");
    result.files.push_back(out_dir / "model.safetensors.index.json");
  }
  for (const auto& [file, digest] : m.files) {
    const bool rank_file = file.rfind("rank", 0) == 0 && file.ends_with(".safetensors");
    if (rank_file || file == state_file_name) continue;
    // Small files (config.json, ...) whose size and checksum were verified above.
    std::ifstream in(checkpoint_file(checkpoint_dir, file), std::ios::binary);
    std::string contents(digest.bytes, '\0');
    in.read(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!in) throw DataError(fmt::format("{}: could not be read whole", (checkpoint_dir / file).string()));
    io::write_file_atomically(out_dir / file, contents);
    result.files.push_back(out_dir / file);
  }
  return result;
}

}  // namespace meshtorch::parallel
#endif  // MESHTORCH_DEFINES(programs)
