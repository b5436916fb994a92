// Chapter 5: the Llama-405B recipe. Chapter 4's FSDP training, with what a model that does not
// fit changes:
//   - weights from a model folder, read by rank 0 and broadcast into the shards
//     (--weights-read-by rank0, the guide's way; every-rank reads each rank's rows itself);
//     the model is built on the meta device, so no rank ever holds it whole;
//   - the root (embedding, final norm, lm_head) stays gathered from forward to backward;
//   - activation checkpointing on every decoder layer (--activation-checkpointing full): a
//     layer keeps only its input and recomputes the rest in backward, with forward's RNG;
//   - CPU offload (--cpu-offload): shards, gradients and AdamW state in CPU memory, the fused
//     AdamW kernel stepping there, gradients copied there without blocking and zeroed in place
//     rather than freed; or only AdamW's state and step on the host (--optimizer-offload,
//     DeepSpeed's offload_optimizer), the shards and gradients staying on the device;
//   - the next layer's all-gather issued while a layer computes (--prefetch-layers), and
//     reduce-scatters left running while backward goes on;
//   - the loss over chunks of positions (--loss-chunk; automatic: chunked once the batch's fp32
//     logits would pass 256 MiB, as a 128k vocabulary's do), so full logits never exist;
//   - optionally (--optimizer-in-backward, torchtune's optimizer_in_bwd) AdamW stepping each
//     layer's shards as their gradients arrive in backward, so the model's gradients are never
//     all held at once (not with clipping or accumulation, which need them all first).
// Launch over a hosts file with launch.sh; watch with the log tails and meshtorch-top.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>>;

struct Chapter5Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  bool optimizer_in_backward = false;
  bool optimizer_offload = false;
  Chapter5Args() {
    // The recipe's defaults; each can be turned off from the command line.
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

  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size, model);
  // With --cpu-offload the shards are CPU tensors: the fused AdamW steps on the CPU, where
  // --optimizer-offload takes it too.
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr, .offload = args.optimizer_offload});
  const auto schedule = mt::train::lr_schedule(args, sampler.steps_per_epoch());
  if (args.optimizer_in_backward) model.step_in_backward(optimizer, args.max_grad_norm, sampler.micro_batches());

  mt::train::Experiment experiment(args, mesh.rank(), sampler.global_batch(), device,
                                   mt::train::tensorboard_tracker(args, mesh.rank()));
  auto state = experiment.resume(model, optimizer);
  mt::train::PhaseTimers timers(device);  // data, forward, backward, update: the guide's step breakdown

  for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
    mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
    mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/mesh.rank() == 0);
    while (state.epoch_step < sampler.steps_per_epoch()) {
      if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

      optimizer.set_lr(schedule.lr_at(state.global_step));  // before backward, which may step
      torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
      for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
        torch::Tensor input_ids;
        {
          auto timer = timers.time("data");
          input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
        }
        if (args.measure_waiting && micro == 0) model.wait_for_slowest(timers);
        torch::Tensor loss;
        {
          // Each layer keeps only its input; the next layer's weights are already on their way.
          auto timer = timers.time("forward");
          loss = model.loss(input_ids, /*labels=*/input_ids) / static_cast<double>(sampler.micro_batches());
        }
        {
          // Per layer: re-gather, recompute the forward, backward, reduce-scatter (left running;
          // with --optimizer-in-backward, the layer's AdamW step once it lands).
          auto timer = timers.time("backward");
          loss.backward();
        }
        step_loss += loss.detach().to(torch::kDouble);
      }
      {
        auto timer = timers.time("update");
        if (!args.optimizer_in_backward) {
          if (args.max_grad_norm > 0) state.grad_norm = model.clip_grad_norm(args.max_grad_norm);
          optimizer.step();
          optimizer.zero_grad(/*set_to_none=*/!args.cpu_offload);
        }
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
  CLI::App app{"Chapter 5: the Llama-405B recipe (FSDP, checkpointing, CPU offload, prefetch)"};
  Chapter5Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
