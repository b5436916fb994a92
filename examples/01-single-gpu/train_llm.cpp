// Chapter 1: causal-LM training on one device.
//
// Config -> untrained Llama (built on the meta device, then materialised), tokenised and packed
// data, a prefetching loader, fused AdamW with the cosine schedule, timed phases, a metrics line
// every --log-freq steps and a checkpoint every --ckpt-freq steps; a run started again with the
// same -e resumes where the last checkpoint left off.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/grad_clipping.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;

int train(const mt::train::TrainArgs& args) {
  if (args.threads > 0) torch::set_num_threads(args.threads);
  mt::train::use_deterministic_algorithms(args.deterministic);
  if (args.measure_waiting) throw mt::ConfigError("--measure-waiting: one process waits for no other rank");
  const auto device = mt::train::resolve_device(args.device);
  const auto dtype = mt::train::resolve_dtype(args.dtype, device, mt::llama::weights_dtype(args.model_name));
  torch::manual_seed(args.seed);

  // The model: from a preset or a config.json; no memory is touched until materialize().
  const auto config = mt::llama::resolve_model(args.model_name);
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  mt::llama::materialize(model, torch::TensorOptions().device(device).dtype(dtype));
  mt::llama::load_pretrained_weights_if_present(model, args.model_name);
  mt::checkpoint_activations(model, mt::activation_checkpointing(args));  // --activation-checkpointing
  model->loss_chunk = args.loss_chunk;                                    // --loss-chunk

  // The data: tokenised once, packed into seq_length blocks, shuffled per epoch from the seed.
  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size);
  mt::train::AdamW optimizer(mt::train::named_trainable_parameters(*model), {.lr = args.lr});
  const auto schedule = mt::train::lr_schedule(args, sampler.steps_per_epoch());

  // The experiment folder: metrics (and TensorBoard files with --tensorboard), checkpoints, and
  // resuming from the last one.
  mt::train::Experiment experiment(args, /*rank=*/0, sampler.global_batch(), device,
                                   mt::train::tensorboard_tracker(args, /*rank=*/0));
  experiment.log().info(fmt::format("model {}: {} parameters, {} on {}; {} blocks of {} tokens, {} steps per epoch",
                                    args.model_name, config.num_parameters(), mt::llama::dtype_name(dtype),
                                    device.str(), blocks.size(), args.seq_length, sampler.steps_per_epoch()));
  auto state = experiment.resume(model, optimizer);
  mt::train::PhaseTimers timers(device);

  for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
    mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
    mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/true);
    while (state.epoch_step < sampler.steps_per_epoch()) {
      if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

      torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
      for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
        torch::Tensor input_ids;
        {
          auto timer = timers.time("data");
          input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
        }
        torch::Tensor loss;
        {
          auto timer = timers.time("forward");
          loss = model->loss(input_ids, /*labels=*/input_ids) / static_cast<double>(sampler.micro_batches());
        }
        {
          auto timer = timers.time("backward");
          loss.backward();
        }
        step_loss += loss.detach().to(torch::kDouble);
      }
      {
        auto timer = timers.time("update");
        if (args.max_grad_norm > 0) state.grad_norm = mt::clip_grad_norm(model->parameters(), args.max_grad_norm);
        optimizer.set_lr(schedule.lr_at(state.global_step));
        optimizer.step();
        optimizer.zero_grad();
      }
      experiment.end_step(state, step_loss.item<double>(), progress);
      if (state.global_step % args.log_freq == 0)
        experiment.log_metrics(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
      if (experiment.checkpoint_due(state, sampler.steps_per_epoch())) experiment.save(state, model, optimizer);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 1: train a Llama-style causal LM on one device"};
  mt::train::TrainArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
