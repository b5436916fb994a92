// Chapter 4: fully sharded data parallel (FSDP2's fully_shard).
//
// Chapter 2's loop, with the model sharded instead of replicated: it is built on the meta
// device (no memory), and parallelize() makes each decoder layer an FSDP unit and then the root
// (embedding, final norm, lm_head) over the mesh's FSDP axis; only then do weights get memory,
// each rank holding its rows of every weight. Forward all-gathers a unit's weights just before
// it runs and frees them after (--reshard-after-forward); backward gathers them again and
// reduce-scatters the gradients, so each rank keeps only its shard of weights, gradients and
// AdamW state; the next layer's all-gather is on the wire while a layer computes
// (--prefetch-layers), and reduce-scatters run while backward goes on. --cpu-offload keeps all three in CPU memory and
// steps the optimizer there;
// --dtype bfloat16 computes in bf16 while shards and gradient reduction stay fp32. Checkpoints
// are sharded: one file per rank.
#include <meshtorch/checkpoint/consolidate.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>>;

struct Chapter4Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  static constexpr auto description = "Chapter 4: fully sharded data parallel training";
  std::string consolidate_to;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_option("--consolidate-to", consolidate_to,
                   "write the latest checkpoint of -e as one HF folder (config.json + model.safetensors) here "
                   "and exit; one process, no launcher");
    add_fsdp_flags(app);  // --reshard-after-forward, --cpu-offload, --prefetch-layers
  }
};

int train(const Chapter4Args& args) {
  auto [env, device, compute_dtype, mesh, log] = mt::launch<Mesh>(args);

  // Built on the meta device: shapes only, no memory, whatever the model's size. The shards,
  // gradients and optimizer state are fp32; --dtype is the compute dtype (mixed precision).
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.fsdp = mt::fsdp_options(args, compute_dtype);
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat)), mesh,
      options);
  const auto& fsdp = *model.fully_sharded();
  log.info(fmt::format(
      "model {}: {} parameters in {} units; this rank holds {} (with padding); the largest unit "
      "gathers {}; compute {}, shards float32{}",
      args.model_name, config.num_parameters(), fsdp.units().size(), fsdp.local_numel(), fsdp.largest_unit_numel(),
      mt::llama::dtype_name(compute_dtype), args.cpu_offload ? " in CPU memory" : ""));

  // Sharding is data parallelism: each rank trains on its part of the global batch.
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  // The optimizer steps the shards (on the CPU with --cpu-offload): its state is sharded too.
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    for (const auto& batch : loop.micro_batches()) {
      // Forward: the units' hooks all-gather each layer's weights before it runs and free them
      // after. Backward: each unit's weights are gathered again before its backward; its gradients
      // are reduce-scattered into the shards' .grad (accumulating over micro-batches) after it.
      loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, /*labels=*/batch.input_ids); }));
    }
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

// The sharded checkpoint as one HF folder that chapter 1 and transformers load.
int consolidate(const Chapter4Args& args) {
  const auto exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
  const auto checkpoint = mt::checkpoint::find_checkpoint_to_resume(exp_dir).checkpoint;
  if (!checkpoint) throw mt::ConfigError(fmt::format("--consolidate-to: {} holds no checkpoint", exp_dir.string()));
  const auto written = mt::checkpoint::consolidate_sharded_checkpoint(*checkpoint, args.consolidate_to);
  fmt::print("wrote {} tensors into {} from {}\n", written.tensors, args.consolidate_to, checkpoint->string());
  return 0;
}

int main(int argc, char** argv) {
  return mt::train::run_main<Chapter4Args>(argc, argv, [](const Chapter4Args& args) {
    return args.consolidate_to.empty() ? train(args) : consolidate(args);
  });
}
