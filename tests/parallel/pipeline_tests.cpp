// Pipeline parallel built by parallelize() against one process: every schedule, with DP replicas,
// with a tied embedding and with clipping. Every rank also trains the one-process reference on
// the whole global batch; the pipeline's loss (from its last stage, averaged over DP) must equal
// the reference's step by step (fp32, Gloo), its clipping norm the reference's, and its trained
// weights the reference's. The rank bodies are tagged and run by CTest (see CMakeLists.txt).
#include <chrono>
#include <filesystem>
#include <map>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <torch/nn/utils/clip_grad.h>  // the reference norm

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/parallelize.hpp>

#include "one_process_load.hpp"

namespace mt = meshtorch;
namespace llama = meshtorch::llama;

// Named: the unity build puts this file beside parallelize_tests.cpp.
namespace pipeline_tests {

constexpr std::int64_t global_batch = 8;
constexpr std::int64_t seq_length = 32;
constexpr int steps = 30;

double relative_difference(double actual, double expected) { return std::abs(actual - expected) / std::abs(expected); }

struct PipelineCase {
  mt::PipelineOptions pipeline;
  std::vector<int> extents;
  llama::Config config = llama::presets::llama_tiny;
  double max_grad_norm = 0;  // 0: no clipping
  mt::FsdpOptions fsdp{};    // with an FSDP axis
  // With FSDP: the all-gathers each layer's unit issues per step (0: not checked).
  int gathers_per_step = 0;
};

template <mt::MeshType M>
void check_pipeline_against_one_process(const PipelineCase& test) {
  auto mesh = mt::comm::init<M>({.timeout = std::chrono::seconds(60), .extents = test.extents});
  const auto& config = test.config;

  torch::manual_seed(7);
  llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  llama::materialize(reference, torch::TensorOptions());
  torch::manual_seed(7);
  auto parallel = mt::parallelize(llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh,
                                  {.fsdp = test.fsdp, .pipeline = test.pipeline});
  INFO(parallel.summary());
  WARN(parallel.summary() << "\n" << parallel.schedule_grid());

  mt::train::AdamW reference_optimizer(mt::train::named_trainable_parameters(*reference), {.lr = 1e-3});
  mt::train::AdamW optimizer(parallel.named_parameters(), {.lr = 1e-3});
  const std::int64_t local_batch = global_batch / parallel.data_parallel_size();

  torch::manual_seed(11);  // the same global batches on every rank
  double worst = 0, worst_norm = 0;
  for (int step = 0; step < steps; ++step) {
    const auto ids = torch::randint(0, config.vocab_size, {global_batch, seq_length}, torch::kLong);
    auto expected = reference->loss(ids, ids);
    expected.backward();
    double expected_norm = 0;
    if (test.max_grad_norm > 0)
      expected_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), test.max_grad_norm);
    reference_optimizer.step();
    reference_optimizer.zero_grad();

    const auto local = ids.narrow(0, parallel.data_parallel_rank() * local_batch, local_batch);
    const auto loss = parallel.step(local, local);
    if (test.max_grad_norm > 0) {
      const double norm = parallel.clip_grad_norm(test.max_grad_norm);
      INFO("step " << step << ": grad norm " << norm << " against one process's " << expected_norm);
      CHECK(relative_difference(norm, expected_norm) < 1e-4);
      worst_norm = std::max(worst_norm, relative_difference(norm, expected_norm));
    }
    optimizer.step();
    optimizer.zero_grad();
    const double actual = parallel.mean_over_data_parallel(loss).template item<double>();
    INFO("step " << step << ": " << actual << " against one process's " << expected.template item<double>());
    CHECK(relative_difference(actual, expected.template item<double>()) < 1e-5);
    worst = std::max(worst, relative_difference(actual, expected.template item<double>()));
  }
  WARN(parallel.layout() << ": largest relative loss difference over " << steps << " steps: " << worst
                         << ", of the clipping norm: " << worst_norm);
  if (test.gathers_per_step > 0) {
    REQUIRE(parallel.fully_sharded());
    for (const auto& unit : parallel.fully_sharded()->units())
      if (unit->name().starts_with("model.layers.")) {
        INFO(unit->describe());
        CHECK(unit->gathers_issued() == test.gathers_per_step * steps);
      }
  }

  // This rank trains only its stages' weights, and they are the reference's.
  auto reference_weights = reference->named_parameters();
  std::int64_t whole = 0;
  for (const auto& p : reference->parameters()) whole += p.numel();
  CHECK(parallel.local_numel() < whole);
  for (const auto& piece : parallel.sharded_parameters()) {
    INFO(piece.name << " " << mt::io::to_string(piece.box));
    const auto expected =
        mt::io::view_of(reference_weights[piece.name].detach(), mt::io::whole(piece.global_shape), piece.box);
    REQUIRE(piece.local.sizes() == expected.sizes());
    CHECK(((piece.local.detach() - expected).abs().max() / expected.abs().max()).template item<double>() < 2e-3);
  }

  // Saved as global boxes, the checkpoint loads into one process as the reference's weights and
  // AdamW state.
  mt::testing::TemporaryCheckpoint checkpoint("pipeline", mesh.world(), mesh.env().master_port, parallel, optimizer,
                                              steps);
  mt::testing::check_loads_as_reference(checkpoint.saved.folder, config, reference, reference_optimizer);
  checkpoint.remove();
}

using Pipeline = mt::Mesh<mt::PP<mt::dynamic>>;
using ReplicatedPipeline = mt::Mesh<mt::DP<mt::dynamic>, mt::PP<mt::dynamic>>;
using TensorParallelPipeline = mt::Mesh<mt::PP<mt::dynamic>, mt::TP<mt::dynamic>>;
using ShardedPipeline = mt::Mesh<mt::FSDP<mt::dynamic>, mt::PP<mt::dynamic>>;

// An identity whose backward counts its runs: placed in a graph, it tells whether a part of the
// graph ran twice.
struct CountingIdentity : torch::autograd::Function<CountingIdentity> {
  static inline int backward_runs = 0;
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    ++backward_runs;
    return grads;
  }
};

}  // namespace pipeline_tests

using namespace pipeline_tests;

TEST_CASE("rank body: GPipe on 2 ranks equals one process", "[.][pipeline_gpipe]") {
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::gpipe, .microbatches = 4}});
}

TEST_CASE("rank body: 1F1B on 2 ranks with clipping equals one process", "[.][pipeline_1f1b]") {
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 4}, .max_grad_norm = 0.5});
}

TEST_CASE("rank body: Interleaved 1F1B on 2 ranks equals one process", "[.][pipeline_interleaved]") {
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::interleaved_1f1b, .stages_per_rank = 2, .microbatches = 4}});
}

TEST_CASE("rank body: ZBV on 2 ranks equals one process", "[.][pipeline_zbv]") {
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::zero_bubble_v, .stages_per_rank = 2, .microbatches = 4}});
}

TEST_CASE("rank body: 1F1B on 4 ranks, a layer per stage, equals one process", "[.][pipeline_1f1b_4]") {
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {
           .schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 4, .units_per_stage = {2, 1, 1, 2}}});
}

TEST_CASE("rank body: DP x PP on 4 ranks equals one process", "[.][pipeline_dp]") {
  check_pipeline_against_one_process<ReplicatedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .max_grad_norm = 0.5});
}

TEST_CASE("rank body: PP x TP (sequence parallel) on 4 ranks with clipping equals one process", "[.][pipeline_tp]") {
  check_pipeline_against_one_process<TensorParallelPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .max_grad_norm = 0.5});
}

TEST_CASE("rank body: ZBV with TP in each stage on 4 ranks equals one process", "[.][pipeline_zbv_tp]") {
  check_pipeline_against_one_process<TensorParallelPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::zero_bubble_v, .stages_per_rank = 2, .microbatches = 2},
       .extents = {mt::from_world_size, 2}});
}

TEST_CASE("rank body: a tied embedding under 1F1B on 2 ranks equals one process", "[.][pipeline_tied]") {
  llama::Config tied = llama::presets::llama_tiny;
  tied.tie_word_embeddings = true;
  check_pipeline_against_one_process<Pipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 2},
       .config = tied,
       .max_grad_norm = 0.5});
}

TEST_CASE("rank body: PP x FSDP on 4 ranks with clipping equals one process", "[.][pipeline_fsdp]") {
  check_pipeline_against_one_process<ShardedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .max_grad_norm = 0.5});
}

// Without resharding after forward, the table gathers each stage once a step (UNSHARD ... RESHARD)
// and every layer's unit stays gathered through the stage's micro-batches: one all-gather a step.
TEST_CASE("rank body: PP x FSDP gathering each stage once a step on 4 ranks equals one process",
          "[.][pipeline_fsdp_stage_gathers]") {
  check_pipeline_against_one_process<ShardedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::interleaved_1f1b, .stages_per_rank = 2, .microbatches = 4},
       .extents = {mt::from_world_size, 2},
       .max_grad_norm = 0.5,
       .fsdp = {.reshard_after_forward = false},
       .gathers_per_step = 1});
}

// Resharding after forward, every micro-batch gathers each layer for its forward and its backward.
TEST_CASE("rank body: PP x FSDP gathering layer by layer on 4 ranks gathers twice per micro-batch",
          "[.][pipeline_fsdp_layer_gathers]") {
  check_pipeline_against_one_process<ShardedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::gpipe, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .fsdp = {.reshard_after_forward = true, .prefetch_layers = 0},
       .gathers_per_step = 4});
}

// Under FSDP a tied embedding is a unit on the first stage's ranks and on the last's (1F1B: apart,
// their gradients exchanged) or one unit gathered by both uses on one rank (ZBV's V puts stage 0
// and the last on rank 0), whose weight step repeats the input path.
namespace pipeline_tests {
llama::Config tied_tiny() {
  llama::Config tied = llama::presets::llama_tiny;
  tied.tie_word_embeddings = true;
  return tied;
}
}  // namespace pipeline_tests

TEST_CASE("rank body: a tied embedding under 1F1B with FSDP on 4 ranks equals one process", "[.][pipeline_fsdp_tied]") {
  check_pipeline_against_one_process<ShardedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::one_f_one_b, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .config = tied_tiny(),
       .max_grad_norm = 0.5});
}

TEST_CASE("rank body: a tied embedding under ZBV with FSDP on 4 ranks equals one process",
          "[.][pipeline_fsdp_tied_zbv]") {
  check_pipeline_against_one_process<ShardedPipeline>(
      {.pipeline = {.schedule = mt::pp::ScheduleKind::zero_bubble_v, .stages_per_rank = 2, .microbatches = 2},
       .extents = {mt::from_world_size, 2},
       .config = tied_tiny()});
}

TEST_CASE("split backward: the input step, then the weight step, equal one backward and run each node once",
          "[single]") {
  torch::manual_seed(3);
  const auto w1 = torch::randn({16, 8}, torch::requires_grad()), w2 = torch::randn({4, 16}, torch::requires_grad());
  const auto norm = torch::rand({16}, torch::requires_grad());
  const auto x0 = torch::randn({5, 8});
  const auto grad_output = torch::randn({5, 4});
  // x -> [count] -> x W1^T * norm -> relu -> [count] -> W2: two layers' worth of weight nodes.
  const auto stage = [&](const torch::Tensor& x) {
    auto h = torch::relu(at::linear(CountingIdentity::apply(x), w1) * norm);
    return at::linear(CountingIdentity::apply(h), w2);
  };

  auto x = x0.clone().requires_grad_(true);
  stage(x).backward(grad_output);
  const auto expected =
      std::vector<torch::Tensor>{x.grad().clone(), w1.grad().clone(), w2.grad().clone(), norm.grad().clone()};
  for (auto w : {w1, w2, norm}) w.mutable_grad() = torch::Tensor();
  CHECK(CountingIdentity::backward_runs == 2);

  CountingIdentity::backward_runs = 0;
  auto input = x0.clone().requires_grad_(true);
  mt::SplitBackward split(stage(input), grad_output, input, {w1, w2, norm});
  const auto input_gradient = split.input_gradient();
  CHECK(CountingIdentity::backward_runs == 2);
  CHECK_FALSE(w1.grad().defined());  // the weight step has not run
  split.weight_gradients();
  CHECK(CountingIdentity::backward_runs == 2);  // nothing on the input's path ran again
  CHECK(torch::allclose(input_gradient, expected[0]));
  CHECK(torch::allclose(w1.grad(), expected[1]));
  CHECK(torch::allclose(w2.grad(), expected[2]));
  CHECK(torch::allclose(norm.grad(), expected[3]));

  // Asked to repeat the input path (FSDP inside the stages), the weight step is one backward from
  // the output: the same gradients, the input path's nodes that lead to weights run again.
  for (auto w : {w1, w2, norm}) w.mutable_grad() = torch::Tensor();
  CountingIdentity::backward_runs = 0;
  auto repeated_input = x0.clone().requires_grad_(true);
  mt::SplitBackward repeated(stage(repeated_input), grad_output, repeated_input, {w1, w2, norm},
                             /*repeat_input_path=*/true);
  CHECK(torch::allclose(repeated.input_gradient(), expected[0]));
  CHECK_FALSE(w1.grad().defined());
  repeated.weight_gradients();
  CHECK(CountingIdentity::backward_runs == 3);  // again the one between the weights, not the one before w1
  CHECK(torch::allclose(w1.grad(), expected[1]));
  CHECK(torch::allclose(w2.grad(), expected[2]));
  CHECK(torch::allclose(norm.grad(), expected[3]));

  // Without an input (a first stage's token ids), the weight step is one backward.
  for (auto w : {w1, w2, norm}) w.mutable_grad() = torch::Tensor();
  mt::SplitBackward whole(stage(x0), grad_output, torch::Tensor(), {w1, w2, norm});
  CHECK_FALSE(whole.input_gradient().defined());
  whole.weight_gradients();
  CHECK(torch::allclose(w1.grad(), expected[1]));
  CHECK(torch::allclose(norm.grad(), expected[3]));
}
