// Chapter 1: causal-LM training on one device.
//
// Config -> untrained Llama (built on the meta device, then materialised), tokenised and packed
// data, a prefetching loader, fused AdamW with the cosine schedule, timed phases, a metrics line
// every --log-freq steps and a checkpoint every --ckpt-freq steps; a run started again with the
// same -e resumes where the last checkpoint left off.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/caching_host_allocator.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;

int train(const mt::train::TrainArgs& args) {
  if (args.threads > 0) torch::set_num_threads(args.threads);
  mt::train::use_deterministic_algorithms(args.deterministic);
  if (args.measure_waiting) throw mt::ConfigError("--measure-waiting: one process waits for no other rank");
  const auto device = mt::train::resolve_device(args.device);
  if (device.is_cpu()) mt::train::use_host_allocator_from_environment();  // large blocks cached, as CUDA's are
  const auto dtype = mt::train::resolve_dtype(args.dtype, device, mt::llama::weights_dtype(args.model_name));
  torch::manual_seed(args.seed);

  // The model: from a preset or a config.json; no memory is touched until materialize().
  const auto config = mt::llama::resolve_model(args.model_name);
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  mt::llama::materialize(model, torch::TensorOptions().device(device).dtype(dtype));
  mt::llama::load_pretrained_weights_if_present(model, args.model_name);
  mt::checkpoint_activations(model, mt::activation_checkpointing(args));  // --activation-checkpointing
  model->loss_chunk = args.loss_chunk;                                    // --loss-chunk
  model->use_fused_kernels(args.fused == "on");                           // --fused

  // The data: tokenised once, packed into seq_length blocks, shuffled per epoch from the seed.
  const auto [blocks, sampler] = mt::load_training_data(args, config);
  mt::train::AdamW optimizer(mt::train::named_trainable_parameters(*model), {.lr = args.lr});

  // The cosine schedule, the phase timers and the experiment folder: metrics (and TensorBoard
  // files with --tensorboard), checkpoints, and resuming from the last one.
  mt::train::Loop loop(args, model, optimizer, blocks, sampler, /*rank=*/0, device);
  loop.log().info(fmt::format("model {}: {} parameters, {} on {}; {} blocks of {} tokens, {} steps per epoch",
                              args.model_name, config.num_parameters(), mt::llama::dtype_name(dtype), device.str(),
                              blocks.size(), args.seq_length, sampler.steps_per_epoch()));

  // Epoch after epoch from where the checkpoint left off, until --num-epochs or --max-steps.
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    // --grad-accum micro-batches; fetching is the "data" phase. Forward, then backward; on a CPU
    // each half of the rows on a core of its own (--cpu-batch-split).
    for (const auto& batch : loop.micro_batches())
      loop.forward_backward(batch.input_ids,
                            [&](const torch::Tensor& rows) { return model->loss(rows, /*labels=*/rows); });
    loop.timed("update", [&] { loop.update(state); });  // clip, the scheduled rate, step, zero_grad
  }
  return 0;
}

int main(int argc, char** argv) {
  return mt::train::run_main<mt::train::TrainArgs>(argc, argv, "Chapter 1: train a Llama-style causal LM on one device",
                                                   train);
}
