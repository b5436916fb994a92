#pragma once
// The sharded checkpoint's format: one for every layout (DDP, ZeRO, FSDP, TP, 2D, HSDP, 3D).
// Each rank writes only its own pieces of each tensor, described as boxes of the global tensor
// (io/sharded_tensor.hpp), and a manifest says which file holds which box, with every file's
// size and checksum. Loading (checkpoint/load.hpp) fills any other set of boxes from the
// overlapping saved pieces, so a checkpoint resumes on another mesh or world size. The format is
// documented in docs/checkpoints.md:
//
//   <exp>/checkpoint -> ckpt-<step>         swapped with rename(2) once the folder is complete
//   <exp>/ckpt-<step>/rank<R>.safetensors   the pieces rank R writes, plus its per-rank state
//                     manifest.json         version, world size, layout, per tensor its pieces
//                                           {file, key, box}, per file its size and checksum
//                     state.json            the caller's JSON (training state)
//                     config.json, ...      the caller's extra files (consolidation copies them)
//
// A manifest is data: it is read through the bounded JSON reader, its names are plain file names
// confined to the folder, and its pieces must cover each tensor exactly once (checked in near
// linear time), each naming its own stored tensor.
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

#include <meshtorch/error.hpp>
#include <meshtorch/io/file_digest.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::checkpoint {

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

}  // namespace meshtorch::checkpoint

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <meshtorch/io/json_file.hpp>
#include <meshtorch/io/model_folder.hpp>
#include <meshtorch/io/safetensors.hpp>

namespace meshtorch::checkpoint {

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

namespace detail {

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
  return io::confined_file(dir, name, fmt::format("{}: the manifest's file", dir.string()), io::FolderKind::checkpoint);
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

// A field that is itself an object or array, by reference: a manifest of 100,000 pieces is not
// copied to be read.
inline const nlohmann::json& member(const nlohmann::json& object, const std::string& key, const std::string& where,
                                    nlohmann::json::value_t type) {
  if (!object.is_object() || !object.contains(key))
    throw DataError(fmt::format("{}: field '{}' is missing", where, key));
  const auto& value = object.at(key);
  if (value.type() != type)
    throw DataError(fmt::format("{}: field '{}' must be {}", where, key,
                                type == nlohmann::json::value_t::array ? "a list" : "an object"));
  return value;
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

}  // namespace detail

MESHTORCH_DECL nlohmann::ordered_json to_json(const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = sharded_checkpoint_format;
  j["version"] = m.version;
  j["global_step"] = m.global_step;
  j["world_size"] = m.world_size;
  j["layout"] = m.layout;
  j["checksum"] = "xxh3-64";
  auto& files = j["files"] = nlohmann::ordered_json::object();
  for (const auto& [name, digest] : m.files) files[name] = detail::digest_json(digest);
  auto& tensors = j["tensors"] = nlohmann::ordered_json::object();
  for (const auto& t : m.tensors) {
    auto& entry = tensors[t.name];
    entry["dtype"] = io::safetensors_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    entry["pieces"] = nlohmann::ordered_json::array();
    for (const auto& p : t.pieces) entry["pieces"].push_back(detail::piece_json(p));
  }
  auto& rank_state = j["rank_state"] = nlohmann::ordered_json::object();
  for (const auto& [rank, names] : m.rank_state) rank_state[std::to_string(rank)] = names;
  auto& coordinates = j["coordinates"] = nlohmann::ordered_json::object();
  for (const auto& [rank, coordinate] : m.coordinates) coordinates[std::to_string(rank)] = coordinate;
  return j;
}

MESHTORCH_DECL Manifest read_manifest(const std::filesystem::path& checkpoint_dir) {
  using namespace detail;
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
  using Type = nlohmann::json::value_t;
  const auto& files_json = member(j, "files", where, Type::object);
  const auto& tensors_json = member(j, "tensors", where, Type::object);
  const auto& rank_state_json = member(j, "rank_state", where, Type::object);
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
    const auto& pieces = member(entry, "pieces", tensor_where, Type::array);
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
  const auto& coordinates_json = member(j, "coordinates", where, Type::object);
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
    detail::checkpoint_file(checkpoint_dir, name);
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

}  // namespace meshtorch::checkpoint
#endif  // MESHTORCH_DEFINES(programs)
