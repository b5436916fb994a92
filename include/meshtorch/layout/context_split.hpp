#pragma once
// How context parallel splits a sequence over CP ranks so that causal attention's work is
// balanced: the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r (the
// head-tail, or zig-zag, order). Under a causal mask a query chunk i attends to chunks 0..i, so
// the early chunk's light work and the late chunk's heavy work add up to the same on every rank.
// Compile-time arithmetic: the run time (the blockwise attention, the ring) asks it which chunks a
// rank holds and which of them a query chunk sees.
#include <array>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace meshtorch::cp {

// The two chunks (of 2 * ranks) that `rank` holds, in sequence order.
constexpr std::array<int, 2> chunks_of(int rank, int ranks) { return {rank, 2 * ranks - 1 - rank}; }

// What a query chunk sees of a key chunk under a causal mask: everything (an earlier chunk), the
// lower triangle (itself), or nothing (a later chunk, skipped: no work, no exchange needed for it).
enum class ChunkVisibility : std::uint8_t { all, causal, none };

constexpr ChunkVisibility visibility(int query_chunk, int key_chunk) {
  return key_chunk < query_chunk    ? ChunkVisibility::all
         : key_chunk == query_chunk ? ChunkVisibility::causal
                                    : ChunkVisibility::none;
}

// Causal attention work a rank does, in units of one chunk pair fully seen (a causal pair counts
// half): the same on every rank, which is what the head-tail order is for.
constexpr double causal_work(int rank, int ranks) {
  double work = 0;
  for (int query : chunks_of(rank, ranks))
    for (int key = 0; key < 2 * ranks; ++key) {
      const auto seen = visibility(query, key);
      work += seen == ChunkVisibility::all ? 1.0 : seen == ChunkVisibility::causal ? 0.5 : 0.0;
    }
  return work;
}

// How the keys and values reach every rank (--cp-rotate; parallel/context_parallel_attention.hpp):
// passed around a ring, overlapped with compute, or gathered once per layer.
enum class Rotate : std::uint8_t { ring, allgather };

inline constexpr std::array<std::pair<Rotate, std::string_view>, 2> rotate_names{
    {{Rotate::ring, "ring"}, {Rotate::allgather, "allgather"}}};

constexpr std::string_view to_string(Rotate rotate) {
  for (const auto& [value, name] : rotate_names)
    if (value == rotate) return name;
  return "?";
}

// The --cp-rotate value named `text`, or nothing.
constexpr std::optional<Rotate> parse_rotate(std::string_view text) {
  for (const auto& [rotate, name] : rotate_names)
    if (name == text) return rotate;
  return std::nullopt;
}

// Whether a sequence of `seq_length` positions splits into 2 * ranks equal chunks, with each rank's
// positions a multiple of `tp` (sequence parallel cuts them over TP inside the rank); the error
// names the flags and the nearest lengths that work. Empty when it splits.
// What a sequence length must be a multiple of for that: 2 x ranks chunks, ranks x tp positions.
constexpr std::int64_t sequence_unit(std::int64_t ranks, std::int64_t tp = 1) {
  return std::lcm(2 * ranks, ranks * tp);
}

inline std::string sequence_split_problem(std::int64_t seq_length, std::int64_t ranks, std::int64_t tp = 1) {
  const std::int64_t unit = sequence_unit(ranks, tp);
  if (ranks >= 1 && seq_length > 0 && seq_length % unit == 0) return "";
  const std::int64_t below = seq_length / unit * unit, above = below + unit;
  std::string why = "-s/--seq-length " + std::to_string(seq_length) + " does not split into 2 x --cp " +
                    std::to_string(ranks) + " equal chunks";
  if (tp > 1) why += " with each rank's positions a multiple of --tp " + std::to_string(tp);
  return why + " (context parallel's balanced causal split); use a multiple of " + std::to_string(unit) + ": " +
         (below > 0 ? std::to_string(below) + " or " : "") + std::to_string(above);
}

}  // namespace meshtorch::cp
