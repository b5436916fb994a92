// The umbrella header plus a pipeline mesh with tensor parallel inside the stages
// (Mesh<DP, PP, TP>), llama-3.1-8b's plan on it and an interleaved 1F1B schedule, both checked at
// compile time, and a model built through parallelize() on that mesh type and stepped: the
// compile-time work a chapter-11 program does.
#include <torch/torch.h>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using MeshPP = mt::Mesh<mt::DP<2>, mt::PP<4>, mt::TP<8>>;
using PlanPP = mt::llama::Plan<MeshPP, mt::llama::presets::llama_3_1_8b>;
using Schedule = mt::pp::Schedule<mt::pp::Interleaved1F1B, 4, 2, 8>;
static_assert(Schedule::valid);

double pipeline_step(const mt::comm::DeviceMesh<MeshPP>& mesh, const mt::llama::Config& config,
                     const torch::Tensor& ids) {
  auto model = mt::parallelize(mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh,
                               {.model_name = "llama-3.1-8b"});
  return model.step(ids, ids).item<double>();
}

int main() { return sizeof(PlanPP) > 0 && Schedule::bubble_fraction < 1 ? 0 : 1; }
