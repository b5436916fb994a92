#pragma once
// What context parallel sends per decoder layer, from the config, the layout and the run's shape:
// arithmetic only, for meshtorch-plan --cp beside the memory plan (memory_plan.hpp counts what the
// split keeps; this, what it moves).
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>

namespace meshtorch::llama {

// What one rank sends per decoder layer under context parallel (it receives as much), in bytes:
// its keys and values, [batch, kv / TP, seq / CP] each, reach the CP - 1 other ranks in forward
// (passed around the ring, or by the ring all-gather, the same volume); in backward the ring passes
// them again and their gradients (fp32) CP times, the all-gather reduce-scatters their gradients
// once. A checkpointed layer repeats its forward's exchange in backward.
struct ContextExchange {
  double forward = 0, backward = 0;
};

constexpr ContextExchange context_exchange_bytes(const llama::Config& c, LayoutSizes layout, RunShape run) {
  if (layout.cp <= 1) return {};
  const double n = static_cast<double>(layout.cp);
  const double kv_block = 2 * static_cast<double>(c.kv_size() / layout.tp) * static_cast<double>(run.batch) *
                          static_cast<double>(run.seq) / n;  // elements of one rank's keys and values
  const double d = static_cast<double>(run.compute_bytes);
  const double forward = (n - 1) * kv_block * d;
  const double backward = layout.cp_gathers_kv ? forward : forward + n * kv_block * 4;
  const bool recomputed = run.checkpoint_every > 0;
  return {forward, backward + (recomputed ? forward : 0)};
}

}  // namespace meshtorch::llama
