// A plan named for one mesh type, applied to another: the plan the program logs and compares at
// start-up would not be the one it applies.
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::TP<mt::dynamic>>;
using Plan = mt::llama::Plan<mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>>;

auto build(const mt::comm::DeviceMesh<Mesh>& mesh) {
  return mt::parallelize<Plan>(mt::llama::LlamaForCausalLM(mt::llama::presets::llama_tiny), mesh);
}
