// --optimizer-in-backward on a DDP mesh: each unit's gradient is final only under FSDP alone, and
// the mesh type says so at compile time.
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

void step(mt::ParallelLlama<mt::Mesh<mt::DP<mt::dynamic>>>& model, mt::train::AdamW& optimizer) {
  model.step_in_backward(optimizer, /*max_grad_norm=*/0, /*micro_batches=*/1);
}
