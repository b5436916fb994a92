// A column-parallel layer cannot start from partial sums.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
struct Styles : mt::llama::TensorParallelStyles {
  using lm_head = mt::ColwiseParallel<mt::Partial, mt::Replicate>;
};
using Plan = mt::llama::Plan<mt::Mesh<mt::TP<2>>, mt::llama::presets::llama_tiny, Styles>;
static_assert(Plan::has_tp);
