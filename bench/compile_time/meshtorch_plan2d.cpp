// The umbrella header plus a 2D (FSDP x TP) Llama plan checked at compile time for
// llama-3.1-8b, applied to a model (tensor parallel, then fully_shard per layer and root) and
// used for a loss: the compile-time work a chapter-7 program does.
#include <torch/torch.h>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using Mesh2D = mt::Mesh<mt::FSDP<4>, mt::TP<8>>;
using Plan2D = mt::llama::Plan<Mesh2D, mt::llama::presets::llama_3_1_8b>;

double shard_and_step(mt::llama::LlamaForCausalLM& model, const mt::comm::AxisGroup& dp, const mt::comm::AxisGroup& tp,
                      const torch::Tensor& ids) {
  auto tensor_parallel = mt::apply_tensor_parallel<Plan2D>(model, tp);
  mt::FullyShardedDataParallel fsdp(model, dp);
  for (auto& layer : model->model->decoder_layers) fsdp.fully_shard(layer);
  fsdp.fully_shard(model);
  auto loss = tensor_parallel.loss(ids, ids);
  loss.backward();
  return loss.item<double>();
}

int main() { return sizeof(Plan2D) > 0 && torch::ones({1}).item<int>() == 1 ? 0 : 1; }
