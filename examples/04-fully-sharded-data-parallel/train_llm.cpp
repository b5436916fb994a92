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
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>>;

struct Chapter4Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  std::string consolidate_to;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    add_fsdp_flags(app);  // --reshard-after-forward, --cpu-offload, --prefetch-layers
    app.add_option("--consolidate-to", consolidate_to,
                   "write the latest checkpoint of -e as one HF folder (config.json + model.safetensors) here "
                   "and exit; one process, no launcher");
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
  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size, model);
  // The optimizer steps the shards (on the CPU with --cpu-offload): its state is sharded too.
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});
  const auto schedule = mt::train::lr_schedule(args, sampler.steps_per_epoch());

  mt::train::Experiment experiment(args, mesh.rank(), sampler.global_batch(), device,
                                   mt::train::tensorboard_tracker(args, mesh.rank()));
  auto state = experiment.resume(model, optimizer);
  mt::train::PhaseTimers timers(device);

  for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
    mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
    mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/mesh.rank() == 0);
    while (state.epoch_step < sampler.steps_per_epoch()) {
      if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

      torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
      for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
        torch::Tensor input_ids;
        {
          auto timer = timers.time("data");
          input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
        }
        if (args.measure_waiting && micro == 0) model.wait_for_slowest(timers);  // the guide's waiting time
        torch::Tensor loss;
        {
          // The units' hooks all-gather each layer's weights before it runs and free them after.
          auto timer = timers.time("forward");
          loss = model.loss(input_ids, /*labels=*/input_ids) / static_cast<double>(sampler.micro_batches());
        }
        {
          // Each unit's weights are gathered again before its backward; its gradients are
          // reduce-scattered into the shards' .grad (accumulating over micro-batches) after it.
          auto timer = timers.time("backward");
          loss.backward();
        }
        step_loss += loss.detach().to(torch::kDouble);
      }
      {
        auto timer = timers.time("update");
        if (args.max_grad_norm > 0) state.grad_norm = model.clip_grad_norm(args.max_grad_norm);
        optimizer.set_lr(schedule.lr_at(state.global_step));
        optimizer.step();
        optimizer.zero_grad();
      }
      experiment.end_step(state, model.mean_over_data_parallel(step_loss).item<double>(), progress);
      if (state.global_step % args.log_freq == 0)
        experiment.log_metrics(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
      if (experiment.checkpoint_due(state, sampler.steps_per_epoch())) experiment.save(state, model, optimizer);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 4: fully sharded data parallel training"};
  Chapter4Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  if (!args.consolidate_to.empty()) {
    // The sharded checkpoint as one HF folder that chapter 1 and transformers load.
    return mt::comm::run_recorded([&] {
      const auto exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
      const auto checkpoint = mt::checkpoint::find_checkpoint_to_resume(exp_dir).checkpoint;
      if (!checkpoint) throw mt::ConfigError(fmt::format("--consolidate-to: {} holds no checkpoint", exp_dir.string()));
      const auto written = mt::checkpoint::consolidate_sharded_checkpoint(*checkpoint, args.consolidate_to);
      fmt::print("wrote {} tensors into {} from {}\n", written.tensors, args.consolidate_to, checkpoint->string());
      return 0;
    });
  }
  return mt::comm::run_recorded([&] { return train(args); });
}
