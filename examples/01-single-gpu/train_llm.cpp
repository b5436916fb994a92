// Chapter 1: causal-LM training on one device.
//
// Config -> untrained Llama (built on the meta device, then materialised), tokenised and packed
// data, a prefetching loader, fused AdamW with the cosine schedule, timed phases, a metrics line
// every --log-freq steps and a checkpoint every --ckpt-freq steps; a run started again with the
// same -e resumes where the last checkpoint left off.
#include <chrono>
#include <filesystem>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

int train(const mt::train::TrainArgs& args) {
  mt::train::Logger log(/*rank=*/0);
  if (args.threads > 0) torch::set_num_threads(args.threads);
  const auto device = mt::train::resolve_device(args.device);
  const auto dtype = mt::train::resolve_dtype(args.dtype, device);
  torch::manual_seed(args.seed);

  // The model: from a preset or a config.json; no memory is touched until materialize().
  const auto config = mt::llama::resolve_model(args.model_name);
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  mt::llama::materialize(model, torch::TensorOptions().device(device).dtype(dtype));
  mt::llama::load_pretrained_weights_if_present(model, args.model_name);
  log.info("model " + args.model_name + ": " + std::to_string(config.num_parameters()) + " parameters, " +
           mt::llama::dtype_name(dtype) + " on " + device.str());

  // The data: tokenised once, packed into seq_length blocks, shuffled per epoch from the seed.
  const auto blocks = mt::data::load_dataset(args.dataset_name, args.seq_length);
  blocks.check_vocab(config.vocab_size);
  const mt::data::DpInvariantSampler sampler({.num_samples = blocks.size(), .batch_size = args.batch_size,
                                               .grad_accum = args.grad_accum, .seed = args.seed});
  log.info(std::to_string(blocks.size()) + " blocks of " + std::to_string(args.seq_length) + " tokens, " +
           std::to_string(sampler.steps_per_epoch()) + " steps per epoch");

  mt::train::AdamW optimizer(mt::train::named_trainable_parameters(*model), {.lr = args.lr});
  const mt::train::CosineSchedule schedule(args.lr);

  // The experiment folder: resume from its checkpoint if there is one.
  mt::train::TrainState state;
  const mt::train::RunIdentity identity{args.seed, args.seq_length, sampler.global_batch(), args.dataset_name,
                                        args.model_name};
  const std::filesystem::path exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
  mt::train::MetricsFile metrics;
  if (!args.experiment_name.empty()) {
    std::filesystem::create_directories(exp_dir);
    if (auto resumed = mt::train::load_checkpoint(exp_dir, model, optimizer, identity)) {
      state = *resumed;
      log.info("resumed from " + (exp_dir / "checkpoint").string() + " at global_step " +
               std::to_string(state.global_step));
    }
    metrics = mt::train::MetricsFile(exp_dir / "metrics.jsonl");
  }

  mt::train::PhaseTimers timers(device);
  mt::train::LogWindow window(device, /*tokens_per_step=*/sampler.global_batch() * args.seq_length);

  for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
    mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
    mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/true);
    while (state.epoch_step < sampler.steps_per_epoch()) {
      if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

      double step_loss = 0;
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
        step_loss += loss.item<double>();
      }
      {
        auto timer = timers.time("update");
        optimizer.set_lr(schedule.lr_at(state.global_step));
        optimizer.step();
        optimizer.zero_grad();
      }
      ++state.global_step;
      ++state.epoch_step;
      state.running_loss += step_loss;
      ++state.running_steps;
      progress.update(state.epoch_step, "loss=" + std::to_string(step_loss));

      if (state.global_step % args.log_freq == 0) {
        const auto record = window.record(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
        log.info(mt::train::format_metrics(record));
        metrics.append(record);
        window.close(state, timers);
      }
      if (!args.experiment_name.empty() && state.global_step % args.ckpt_freq == 0) {
        const auto save_start = std::chrono::steady_clock::now();
        mt::train::save_checkpoint(exp_dir, model, optimizer, state, identity);
        log.info("saved checkpoint at global_step " + std::to_string(state.global_step));
        window.exclude(std::chrono::steady_clock::now() - save_start);  // saving is not training
      }
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
