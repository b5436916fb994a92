#pragma once
// Where a training run stands: what a checkpoint saves and a metrics line reports.
#include <cstdint>

namespace meshtorch::train {

struct TrainState {
  std::int64_t epoch = 0;
  std::int64_t global_step = 0;
  std::int64_t epoch_step = 0;     // optimizer steps done in this epoch
  double running_loss = 0;         // sum of step losses since the last log line
  std::int64_t running_steps = 0;  // steps in running_loss
  double grad_norm = -1;           // the last step's gradient norm when clipping (not saved)
};

// The finished check: --max-steps (when positive) steps are done, and the run stops before another.
inline bool max_steps_reached(const TrainState& state, std::int64_t max_steps) {
  return max_steps > 0 && state.global_step >= max_steps;
}

}  // namespace meshtorch::train
