// The umbrella header plus a 2D (FSDP x TP) Llama plan checked at compile time for
// llama-3.1-8b, and a model built through parallelize() on that mesh type (tensor parallel, then
// fully_shard per layer and the root) and used for a loss: the compile-time work a chapter-7
// program does.
#include <torch/torch.h>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using Mesh2D = mt::Mesh<mt::FSDP<4>, mt::TP<8>>;
using Plan2D = mt::llama::Plan<Mesh2D, mt::llama::presets::llama_3_1_8b>;

double shard_and_step(const mt::comm::DeviceMesh<Mesh2D>& mesh, const mt::llama::Config& config,
                      const torch::Tensor& ids) {
  auto model = mt::parallelize(mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh,
                               {.model_name = "llama-3.1-8b"});
  auto loss = model.loss(ids, ids);
  loss.backward();
  return loss.item<double>();
}

int main() { return sizeof(Plan2D) > 0 && torch::ones({1}).item<int>() == 1 ? 0 : 1; }
