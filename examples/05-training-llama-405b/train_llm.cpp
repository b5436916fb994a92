// Chapter 5: the Llama-405B recipe. Chapter 4's FSDP training, with what a model that does not
// fit changes:
//   - weights from a model folder, read by rank 0 and broadcast into the shards (--weights-read-by
//     rank0, the guide's way; every-rank reads each rank's rows), of a model built on the meta device;
//   - the root (embedding, final norm, lm_head) stays gathered from forward to backward;
//   - activation checkpointing on every decoder layer (--activation-checkpointing full);
//   - CPU offload (--cpu-offload): shards, gradients and AdamW state in CPU memory, the fused AdamW
//     stepping there, gradients zeroed in place rather than freed; or only AdamW's state and step in
//     host memory (--optimizer-offload, DeepSpeed's offload_optimizer);
//   - the next layer's all-gather issued while a layer computes (--prefetch-layers);
//   - the loss over chunks of positions, so full logits never exist (--loss-chunk; automatic);
//   - optionally AdamW stepping each layer's shards as their gradients arrive in backward
//     (--optimizer-in-backward, torchtune's optimizer_in_bwd; not with clipping or accumulation).
// Launch over a hosts file with launch.sh; watch with the log tails and meshtorch-top.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>>;

struct Chapter5Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  static constexpr auto description = "Chapter 5: the Llama-405B recipe (FSDP, checkpointing, CPU offload, prefetch)";
  bool optimizer_in_backward = false;
  bool optimizer_offload = false;
  Chapter5Args() {  // the recipe's defaults; each can be turned off from the command line
    activation_checkpointing = "full";
    weights_read_by = "rank0";
  }
  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    add_fsdp_flags(app);  // --reshard-after-forward, --cpu-offload, --prefetch-layers
    app.add_flag("--optimizer-in-backward", optimizer_in_backward,
                 "step each layer's shards as their gradients arrive in backward and free the gradients "
                 "(not with --max-grad-norm or --grad-accum)");
    app.add_flag("--optimizer-offload", optimizer_offload,
                 "keep AdamW's moments and a copy of the shards in host memory and step there; the shards and "
                 "gradients stay on the device (--cpu-offload moves them all)")
        ->excludes("--cpu-offload");
  }
};

int train(const Chapter5Args& args) {
  auto [env, device, compute_dtype, mesh, log] = mt::launch<Mesh>(args);

  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights and who reads them, checkpointing, loss chunk
  options.fsdp = mt::fsdp_options(args, compute_dtype);
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat)), mesh,
      options);
  const auto& fsdp = *model.fully_sharded();
  log.info(
      fmt::format("model {}: {} parameters in {} units; this rank holds {}; the largest unit gathers {}; "
                  "checkpointed layers: {}; prefetch {} layer(s); shards{}",
                  args.model_name, config.num_parameters(), fsdp.units().size(), fsdp.local_numel(),
                  fsdp.largest_unit_numel(), args.activation_checkpointing, args.prefetch_layers,
                  args.cpu_offload         ? " in CPU memory"
                  : args.optimizer_offload ? " on the device, AdamW's state in host memory"
                                           : " on the device"));
  if (!options.weights_from.empty()) log.info(model.load_report());

  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  // With --cpu-offload the shards are CPU tensors: the fused AdamW steps on the CPU, where
  // --optimizer-offload takes it too.
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr, .offload = args.optimizer_offload});
  if (args.optimizer_in_backward) model.step_in_backward(optimizer, args.max_grad_norm, sampler.micro_batches());

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    optimizer.set_lr(loop.lr(state));  // before backward, which may step
    for (const auto& batch : loop.micro_batches()) {
      // Forward: each layer keeps only its input; the next layer's weights are already on their
      // way. Backward, per layer: re-gather, recompute the forward, backward, reduce-scatter (left
      // running; with --optimizer-in-backward, the layer's AdamW step once it lands).
      loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, /*labels=*/batch.input_ids); }));
    }
    loop.timed("update", [&] {
      if (!args.optimizer_in_backward) loop.update(state, /*set_to_none=*/!args.cpu_offload);
    });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter5Args>(argc, argv, train); }
