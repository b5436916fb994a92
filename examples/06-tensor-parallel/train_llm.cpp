// Chapter 6: tensor parallel, with sequence parallel and loss parallel.
//
// Chapter 2's loop on a two-dimensional mesh, Mesh<DP, TP> (TP innermost, so a TP group stays
// inside a node; `--tp` sets its extent at start-up, the rest of the world is DP): every
// decoder layer's matrices are split over the ranks of a TP group (q/k/v and gate/up by
// columns, o and down by rows), the norms run on a slice of the sequence, the embedding and
// lm_head are split over the vocabulary and the loss is computed without gathering the logits.
// The plan is a type, llama::Plan<Mesh>, checked at compile time; parallelize<Plan>() applies it and
// then DDP across TP groups; all TP ranks of a DP coordinate read the same batch.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::TP<mt::dynamic>>;
// The guide's plan: sequence parallel + loss parallel. launch<Plan> puts it in the fingerprint the
// ranks compare, and parallelize<Plan> applies it: one type for both.
using Plan = mt::llama::Plan<Mesh>;

struct Chapter6Args : mt::train::TrainArgs {
  static constexpr auto description = "Chapter 6: tensor parallel (with sequence parallel and loss parallel)";
  int tp = 2;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    mt::train::add_extent_flag(app, "--tp", tp,
                               "tensor-parallel size: ranks that split each layer (divides the world)");
  }
};

int train(const Chapter6Args& args) {
  auto [env, device, dtype, mesh, log] = mt::launch<Plan>(args, {mt::from_world_size, args.tp});

  // The model on the meta device; each rank materialises only its piece of every matrix.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto model = mt::parallelize<Plan>(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh,
      mt::parallelize_options(args, device));
  log.info(model.summary());

  // The DP ranks split the global batch; all TP ranks of a DP coordinate read the same samples.
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    for (const auto& batch : loop.micro_batches())  // all but the last skip the DP all-reduce
      loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, /*labels=*/batch.input_ids); }));
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter6Args>(argc, argv, train); }
