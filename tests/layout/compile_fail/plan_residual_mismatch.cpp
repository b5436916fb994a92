// Sequence-parallel norms, but o_proj all-reduces to Replicate: the residual add would mix a
// sequence shard with a whole sequence.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
struct Styles : mt::llama::SequenceParallelStyles {
  using o_proj = mt::RowwiseParallel<mt::Shard<-1>, mt::Replicate>;
};
using Plan = mt::llama::Plan<mt::Mesh<mt::TP<2>>, mt::llama::presets::llama_tiny, Styles>;
static_assert(Plan::has_tp);
