// ZeRO-2 asked for on an FSDP mesh: FSDP already shards what ZeRO-2 would (and the weights), and
// the mesh type says so at compile time rather than a run-time refusal.
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>>;

auto build(const mt::comm::DeviceMesh<Mesh>& mesh) {
  return mt::parallelize(mt::llama::LlamaForCausalLM(mt::llama::presets::llama_tiny), mesh, {},
                         mt::ZeroStage2Options{});
}
