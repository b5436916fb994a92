// Chapter 4: fully sharded data parallel (FSDP2's fully_shard).
//
// Chapter 2's loop, with the model sharded instead of replicated: it is built on the meta
// device (no memory), each decoder layer is made an FSDP unit and then the root (embedding,
// final norm, lm_head), and only then do weights get memory, each rank holding its rows of
// every weight. Forward all-gathers a unit's weights just before it runs and frees them after
// (--reshard-after-forward); backward gathers them again and reduce-scatters the gradients, so
// each rank keeps only its shard of weights, gradients and AdamW state. --cpu-offload keeps all
// three in CPU memory and steps the optimizer there; --dtype bfloat16 computes in bf16 while
// shards and gradient reduction stay fp32. Checkpoints are sharded: one file per rank.
#include <chrono>
#include <filesystem>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/fsdp_checkpoint.hpp>
#include <meshtorch/parallel/parallel.hpp>

namespace mt = meshtorch;
using Fsdp = mt::Mesh<mt::FSDP<mt::dynamic>>;

struct Chapter4Args : mt::train::TrainArgs {
  bool reshard_after_forward = true;
  bool cpu_offload = false;
  std::string consolidate_to;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", reshard_after_forward,
                 "free each layer's gathered weights after its forward and gather them again for backward")
        ->capture_default_str();
    app.add_flag("--cpu-offload", cpu_offload, "keep shards, gradients and optimizer state in CPU memory")
        ->capture_default_str();
    app.add_option("--consolidate-to", consolidate_to,
                   "write the latest checkpoint of -e as one HF folder (config.json + model.safetensors) here "
                   "and exit; one process, no launcher");
  }

  std::string fingerprint() const {
    return "-m " + model_name + " -d " + dataset_name + " -s " + std::to_string(seq_length) + " -b " +
           std::to_string(batch_size) + " --grad-accum " + std::to_string(grad_accum) + " --seed " +
           std::to_string(seed) + " --dtype " + dtype + " --reshard-after-forward " +
           std::to_string(reshard_after_forward) + " --cpu-offload " + std::to_string(cpu_offload);
  }
};

int train(const Chapter4Args& args) {
  if (args.threads > 0) torch::set_num_threads(args.threads);
  const auto env = mt::comm::launch_env();
  const auto device = mt::train::resolve_device(args.device, env.local_rank);
  // --dtype is the compute dtype; shards, gradients and optimizer state stay fp32.
  const auto compute_dtype = mt::train::resolve_dtype(args.dtype, device);
  auto mesh = mt::comm::init<Fsdp>({.device = device.is_cuda() ? mt::comm::Device::cuda : mt::comm::Device::cpu,
                                    .fingerprint = args.fingerprint(),
                                    .env = env});
  const auto& fsdp_group = mesh.group<mt::FSDP>();
  const auto& world = mesh.world();
  mt::train::Logger log(mesh.rank());
  log.info("rank " + std::to_string(mesh.rank()) + " of " + std::to_string(mesh.world_size()) + " on " +
           device.str() + ", FSDP coordinate " + std::to_string(fsdp_group.rank()) + " of " +
           std::to_string(fsdp_group.size()));
  torch::manual_seed(args.seed);

  // 1. Build on the meta device: shapes only, no memory, whatever the model's size.
  const auto config = mt::llama::resolve_model(args.model_name);
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));

  // 2. fully_shard each decoder layer, then the root, which takes the embedding, final norm
  //    and lm_head. A unit's weights are gathered together, just before the unit runs.
  mt::FullyShardedDataParallel fsdp(model, fsdp_group,
                                    {.reshard_after_forward = args.reshard_after_forward,
                                     .cpu_offload = args.cpu_offload,
                                     .mixed_precision = {.param_dtype = compute_dtype, .reduce_dtype = torch::kFloat},
                                     .device = device});
  for (auto& layer : model->model->decoder_layers) fsdp.fully_shard(layer);
  fsdp.fully_shard(model);

  // 3. Materialise: only the shards get memory. Each rank draws every weight in turn and keeps
  //    its rows, so the model equals chapter 1's at the same seed.
  fsdp.init_weights();
  if (fsdp.load_pretrained_weights_if_present(args.model_name)) log.info("loaded weights from " + args.model_name);
  log.info("model " + args.model_name + ": " + std::to_string(config.num_parameters()) + " parameters in " +
           std::to_string(fsdp.units().size()) + " units; this rank holds " + std::to_string(fsdp.local_numel()) +
           " (with padding); the largest unit gathers " + std::to_string(fsdp.largest_unit_numel()) +
           "; compute " + mt::llama::dtype_name(compute_dtype) + ", shards float32" +
           (args.cpu_offload ? " in CPU memory" : ""));

  const auto blocks = mt::rank_zero_first(world, [&] { return mt::data::load_dataset(args.dataset_name, args.seq_length); });
  blocks.check_vocab(config.vocab_size);
  // Sharding is data parallelism: each rank trains on its part of the global batch.
  const mt::data::DpInvariantSampler sampler({.num_samples = blocks.size(), .batch_size = args.batch_size,
                                               .dp_size = fsdp_group.size(), .dp_rank = fsdp_group.rank(),
                                               .grad_accum = args.grad_accum, .seed = args.seed});
  log.info(std::to_string(blocks.size()) + " blocks of " + std::to_string(args.seq_length) + " tokens, " +
           std::to_string(sampler.steps_per_epoch()) + " steps per epoch, global batch " +
           std::to_string(sampler.global_batch()));

  // 4. The optimizer steps the shards (on the CPU with --cpu-offload): its state is sharded too.
  mt::train::AdamW optimizer(fsdp.named_parameters(), {.lr = args.lr});
  const mt::train::CosineSchedule schedule(args.lr);

  mt::train::TrainState state;
  const mt::train::RunIdentity identity{args.seed, args.seq_length, sampler.global_batch(), args.dataset_name,
                                        args.model_name};
  const std::filesystem::path exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
  mt::train::MetricsFile metrics;
  if (!args.experiment_name.empty()) {
    mt::on_rank_zero(world, [&] { std::filesystem::create_directories(exp_dir); });
    if (auto resumed = mt::parallel::load_sharded_checkpoint(exp_dir, fsdp, optimizer, identity)) {
      state = *resumed;
      log.info("resumed from " + (exp_dir / "checkpoint").string() + " at global_step " +
               std::to_string(state.global_step));
    }
    if (mesh.rank() == 0) metrics = mt::train::MetricsFile(exp_dir / "metrics.jsonl");
  }

  mt::train::PhaseTimers timers(device);
  mt::train::LogWindow window(device, /*tokens_per_step=*/sampler.global_batch() * args.seq_length);

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
        torch::Tensor loss;
        {
          // The units' hooks all-gather each layer's weights before it runs and free them after.
          auto timer = timers.time("forward");
          loss = model->loss(input_ids, /*labels=*/input_ids) / static_cast<double>(sampler.micro_batches());
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
        optimizer.set_lr(schedule.lr_at(state.global_step));
        optimizer.step();
        optimizer.zero_grad();
      }
      const double global_loss = mt::comm::all_reduce(fsdp_group, step_loss, mt::comm::ReduceOp::avg).item<double>();
      ++state.global_step;
      ++state.epoch_step;
      state.running_loss += global_loss;
      ++state.running_steps;
      progress.update(state.epoch_step, "loss=" + std::to_string(global_loss));

      if (state.global_step % args.log_freq == 0) {
        const auto record = window.record(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
        if (mesh.rank() == 0) {
          log.info(mt::train::format_metrics(record));
          metrics.append(record);
        }
        window.close(state, timers);
      }
      if (!args.experiment_name.empty() && state.global_step % args.ckpt_freq == 0) {
        // Every rank writes its own shard; no rank ever holds the whole model.
        const auto save_start = std::chrono::steady_clock::now();
        mt::parallel::save_sharded_checkpoint(exp_dir, config, fsdp, optimizer, state, identity);
        log.info("saved sharded checkpoint at global_step " + std::to_string(state.global_step));
        window.exclude(std::chrono::steady_clock::now() - save_start);
      }
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
      const auto checkpoint = std::filesystem::path(args.save_dir) / args.experiment_name / "checkpoint";
      mt::parallel::consolidate_checkpoint(checkpoint, args.consolidate_to);
      std::cout << "wrote " << args.consolidate_to << "/model.safetensors from " << checkpoint.string() << "\n";
      return 0;
    });
  }
  return mt::comm::run_recorded([&] { return train(args); });
}
