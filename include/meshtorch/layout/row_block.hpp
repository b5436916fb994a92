#pragma once
// Which rows of a tensor rank `rank` of `ranks` owns when its dim 0 is split: torch.chunk's
// split (FSDP2's Shard(0), DTensor's), ceil(rows / ranks) rows per rank, the last ranks' blocks
// clipped, possibly to none. Every row-sharded layout asks this one function: FSDP and ZeRO-2
// for their shards, TP for its chunks, checkpoints for their boxes, loading for the rows it
// reads, the memory plan for the largest shard. No LibTorch: it is layout arithmetic, checked
// at compile time below.
#include <algorithm>
#include <cstdint>

namespace meshtorch {

struct RowBlock {
  std::int64_t rows_per_rank = 0;  // every rank's block, padded: ceil(rows / ranks)
  std::int64_t first = 0;          // the first row this rank owns (rows, when it owns none)
  std::int64_t count = 0;          // the rows it owns: rows_per_rank, fewer, or none

  constexpr std::int64_t end() const { return first + count; }
  // Rows of padding that bring this rank's block to rows_per_rank.
  constexpr std::int64_t padding() const { return rows_per_rank - count; }
  friend constexpr bool operator==(const RowBlock&, const RowBlock&) = default;
};

// Callers check ranks > 0 and 0 <= rank < ranks, naming their own input.
constexpr RowBlock row_block(std::int64_t rows, std::int64_t ranks, std::int64_t rank) {
  const std::int64_t per_rank = (rows + ranks - 1) / ranks;
  const std::int64_t first = std::min(rows, rank * per_rank);
  return {per_rank, first, std::min(rows, first + per_rank) - first};
}

static_assert(row_block(8, 2, 1) == RowBlock{4, 4, 4});
static_assert(row_block(7, 2, 1) == RowBlock{4, 4, 3}, "the last block is clipped");
static_assert(row_block(5, 4, 2) == RowBlock{2, 4, 1} && row_block(5, 4, 3) == RowBlock{2, 5, 0},
              "ceil(5 / 4) = 2 rows per rank leaves the last rank none, as torch.chunk does");
static_assert(row_block(0, 3, 1) == RowBlock{0, 0, 0});

}  // namespace meshtorch
