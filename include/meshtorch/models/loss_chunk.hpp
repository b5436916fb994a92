#pragma once
// How many positions the loss computes at once (models/chunked_loss.hpp computes it): no
// LibTorch, so that meshtorch-plan's memory estimate chunks as the model does.
#include <algorithm>
#include <cstdint>

namespace meshtorch {

// The positions per chunk for `rows` positions of `vocab` logits (this rank's slice): `requested`
// when positive; 0 means all at once; -1 (automatic) chunks once the batch's fp32 logits would
// pass 256 MiB, in chunks of 64 MiB of them.
constexpr std::int64_t loss_chunk_positions(std::int64_t requested, std::int64_t rows, std::int64_t vocab) {
  const std::int64_t all = std::max<std::int64_t>(rows, 1);
  if (requested > 0) return std::min(requested, all);
  if (requested == 0) return all;
  constexpr double limit = 256.0 * 1024 * 1024, piece = 64.0 * 1024 * 1024;
  const double bytes_per_position = static_cast<double>(vocab) * 4;
  if (static_cast<double>(rows) * bytes_per_position <= limit) return all;
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(piece / bytes_per_position));
}

}  // namespace meshtorch
