// Llama plans generated from mesh types: what they choose, and the run-time checks of a config.
#include <catch2/catch.hpp>

#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/models/llama/plan.hpp>

namespace mt = meshtorch;
namespace llama = meshtorch::llama;

using SpPlan = llama::Plan<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<4>>, llama::presets::llama_tiny>;
static_assert(SpPlan::has_tp && SpPlan::tp_extent == 4 && SpPlan::sequence_parallel && SpPlan::loss_parallel);

// The real presets split over the TP extents they are trained with.
using Plan8b = llama::Plan<mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<8>>, llama::presets::llama_3_1_8b>;
using Plan405b = llama::Plan<mt::Mesh<mt::FSDP<8>, mt::TP<8>>, llama::presets::llama_3_1_405b>;
static_assert(Plan8b::has_tp && Plan405b::tp_extent == 8);

// One rank's device memory for a preset, checked when it compiles: the guide's 405B recipe (seq
// 4096, batch 1, bf16 compute over fp32 shards in host memory, every layer checkpointed) on 64
// ranks of FSDP peaks at 61.7 GB (57.4 GiB), within an 80 GiB GPU, while the second layer of
// backward is gathered (the memory timeline below); without prefetching 55.2 GB. Without
// checkpointing the activations alone do not fit.
constexpr mt::llama::RunShape recipe{
    .batch = 1, .seq = 4096, .compute_bytes = 2, .checkpoint_every = 1, .cpu_offload = true};
constexpr mt::llama::RunShape recipe_without_prefetch = [] {
  auto run = recipe;
  run.prefetch_layers = 0;
  return run;
}();
using Recipe405b = llama::Plan<mt::Mesh<mt::FSDP<64>>, llama::presets::llama_3_1_405b>;
static_assert(Recipe405b::peak_bytes(recipe) <= 80 * mt::llama::GiB);
static_assert(Recipe405b::peak_bytes(recipe_without_prefetch) < Recipe405b::peak_bytes(recipe));
static_assert(Recipe405b::memory(recipe).trained_state() == 0 && Recipe405b::memory(recipe).host > 100e9);
static_assert(Recipe405b::memory({.batch = 1, .seq = 4096, .cpu_offload = true}).activations > 80 * mt::llama::GiB);
// Stepping AdamW in backward holds one unit's gradient shards, the largest unit's at most (for
// Llama-3.1-8B the root: embedding, head and final norm, 1,050,677,248 parameters), over 8 ranks.
using Fsdp8b = llama::Plan<mt::Mesh<mt::FSDP<8>>, llama::presets::llama_3_1_8b>;
static_assert(Fsdp8b::memory({.state_bytes = 4, .optimizer_in_backward = true}).gradients == 1050677248.0 * 4 / 8);
static_assert(Fsdp8b::memory({.state_bytes = 4}).gradients >
              7 * Fsdp8b::memory({.state_bytes = 4, .optimizer_in_backward = true}).gradients);
// Optimizer offload alone: the AdamW state leaves the device for the host, where a copy of the
// shards and their gradients joins it; the device keeps the shards and gradients.
constexpr mt::llama::RunShape fp32_state{.state_bytes = 4},
    offloaded_optimizer{.state_bytes = 4, .optimizer_offload = true};
static_assert(Fsdp8b::memory(offloaded_optimizer).optimizer == 0);
static_assert(Fsdp8b::memory(offloaded_optimizer).host == 2 * Fsdp8b::memory(fp32_state).optimizer);
static_assert(Fsdp8b::memory(offloaded_optimizer).weights == Fsdp8b::memory(fp32_state).weights &&
              Fsdp8b::memory(offloaded_optimizer).gradients == Fsdp8b::memory(fp32_state).gradients);
constexpr double peak_saved = Fsdp8b::peak_bytes(fp32_state) - Fsdp8b::peak_bytes(offloaded_optimizer);
static_assert(peak_saved > Fsdp8b::memory(fp32_state).optimizer - 1 &&
              peak_saved < Fsdp8b::memory(fp32_state).optimizer + 1);
// 2D: the TP extent divides what a rank holds and computes.
static_assert(Plan405b::memory(recipe).gathered < Recipe405b::memory(recipe).gathered / 4);

// The memory timeline (memory_plan.hpp): the device memory after each event of one step, whose
// peak is the most held at one moment, not the sum of the parts. At 405B (the guide's run:
// meshtorch-plan -m llama-3.1-405b --world 64 --dtype bfloat16 -s 4096 --activation-checkpointing
// full --cpu-offload), the peak is the all-gather of layer 124, the second in backward, with layer
// 123's prefetched and layer 125's reduce-scatter in flight, while nearly every checkpointed input
// is still held.
namespace timeline {
namespace presets = meshtorch::llama::presets;
using meshtorch::llama::MemoryPart;
constexpr mt::llama::RunShape guide{
    .batch = 1, .seq = 4096, .compute_bytes = 2, .state_bytes = 2, .checkpoint_every = 1, .cpu_offload = true};
constexpr auto guide_memory = Recipe405b::memory(guide);
constexpr auto counts = *presets::llama_3_1_405b.parameter_counts();
constexpr double layer = static_cast<double>(counts.attention + counts.mlp + counts.layer_norms);
constexpr double root = static_cast<double>(counts.embedding + counts.head + counts.final_norm);
constexpr double tokens = 4096, hidden = 16384;
constexpr bool near(double a, double b) { return a - b < 1e-9 * b && b - a < 1e-9 * b; }
static_assert(guide_memory.at_peak.what == "backward: its weights gathered" && guide_memory.at_peak.layer == 124);
// What is held then (every row count divides by 64: no padding): the root gathered since forward,
// layer 124's full weights and the all-gather buffer they were copied out of, with its input (a
// bf16 shard copied from the host), layer 123's prefetched buffer and input; layer 125's send
// buffer and output (a 64th) still in flight, and the final norm's gradient; the inputs of layers
// 0-124; and the output weight's gradient. The root's gradients wait in autograd until the
// embedding's arrive, at the end of backward, for the root's reduce-scatter. Layer 124's own
// reduce-scatter comes later, after layer 125's is waited for and 124's weights are freed
// (FSDP2's order, fsdp_unit.hpp).
static_assert(near(guide_memory.at_peak[MemoryPart::gathered], 2 * root + 3 * 2 * layer + 2 * 2 * layer / 64));
static_assert(near(guide_memory.at_peak[MemoryPart::reductions], 4 * layer + 4 * layer / 64 + 2 * hidden));
static_assert(near(guide_memory.at_peak[MemoryPart::activations], 125 * hidden * 2 * tokens));
static_assert(near(guide_memory.at_peak[MemoryPart::loss], 2 * static_cast<double>(counts.head)));
static_assert(guide_memory.at_peak[MemoryPart::trained_state] == 0 && guide_memory.at_peak[MemoryPart::working] == 0);
static_assert(guide_memory.peak() > 61.5e9 && guide_memory.peak() < 61.8e9);
// The parts at their largest do not all live at once.
static_assert(guide_memory.peak() < guide_memory.gathered + guide_memory.reductions + guide_memory.activations +
                                        guide_memory.loss + guide_memory.backward_peak);
// Each lever moves the peak by what it holds then: without prefetching, layer 123's buffer and
// input; with every reduce-scatter waited for at once, at most layer 125's send buffer and output.
constexpr auto with = [](auto change) {
  auto run = guide;
  change(run);
  return Recipe405b::memory(run);
};
static_assert(near(guide_memory.peak() - with([](auto& run) { run.prefetch_layers = 0; }).peak(),
                   2 * layer + 2 * layer / 64));
// (Without reduce-scatters in flight the peak moves to another moment, so it falls by less.)
constexpr double saved_by_waiting =
    guide_memory.peak() - with([](auto& run) { run.reduce_scatters_in_flight = 0; }).peak();
static_assert(saved_by_waiting > 0 && saved_by_waiting <= 4 * layer + 4 * layer / 64 + 2 * hidden);

// The order of events: forward gathers each layer after its prefetch was issued and frees it
// after saving its input, except the last; backward reduce-scatters the layers from the last,
// the root after them; the step ends where it started.
constexpr auto index_of = [](const auto& events, std::string_view what, std::int64_t layer) {
  for (std::size_t i = 0; i < events.size(); ++i)
    if (events[i].what == what && events[i].layer == layer) return static_cast<std::int64_t>(i);
  return std::int64_t{-1};
};
constexpr bool guide_order = [] {
  const auto events = mt::llama::memory_timeline(
      presets::llama_3_1_405b, {.data_parallel = mt::llama::DataParallelKind::fsdp, .data_parallel_ranks = 64}, guide);
  const auto at = [&](std::string_view what, std::int64_t layer) { return index_of(events, what, layer); };
  return events.front().what == "step starts: the trained state on the device" &&
         events.back().what == "zero_grad: the gradients freed" && events.back().live() == events.front().live() &&
         at("forward: a later layer's all-gather issued (prefetch)", 0) < at("forward: its weights gathered", 0) &&
         at("forward: its input saved (checkpointed)", 0) < at("forward: its weights freed", 0) &&
         at("forward: its weights freed", 125) == -1 &&       // kept for backward, which starts with it
         at("backward: its all-gather issued", 125) == -1 &&  // so not gathered again
         at("backward: its all-gather issued", 124) > at("backward: its reduce-scatter issued", 125) &&
         at("backward: its all-gather issued", 123) == -1 &&  // layer 124 prefetched it
         at("backward: its reduce-scatter issued", 0) < at("backward: the root's reduce-scatter issued", -1) &&
         at("backward: the embedding's gradient", -1) < at("backward: the root's reduce-scatter issued", -1);
}();
static_assert(guide_order);

// Without FSDP on one rank (the CPU measurement's layout, tests/core): the step starts with the
// weights and AdamW's state, holds the activations and the loss after forward, and its peak is
// where the whole loss's gradient is taken: log_softmax's fp32 output's and the logits'.
constexpr mt::llama::RunShape tiny_run{.batch = 4, .seq = 128, .compute_bytes = 4, .loss_chunk = 0};
constexpr auto tiny =
    mt::llama::estimate_memory(presets::llama_tiny, {.data_parallel = mt::llama::DataParallelKind::ddp}, tiny_run);
static_assert(tiny.start == tiny.weights + tiny.optimizer && tiny.gathered == 0 && tiny.reductions == 0);
static_assert(near(tiny.after_forward - tiny.start, tiny.activations + tiny.loss));
static_assert(tiny.at_peak.what == "backward: the loss's gradient and the logits'");
static_assert(near(tiny.step_peak(), tiny.activations + tiny.loss + 2 * 4 * 264 * 512));
}  // namespace timeline

// Without a TP axis nothing is sharded inside layers.
using DpPlan = llama::Plan<mt::Mesh<mt::DP<mt::dynamic>>>;
static_assert(!DpPlan::has_tp && DpPlan::tp_extent == 1 && !DpPlan::sequence_parallel);
static_assert(std::is_same_v<DpPlan::styles::q_proj, mt::NoParallel>);

// Megatron's plan without sequence parallel checks too, and keeps logits whole.
using MegatronPlan = llama::Plan<mt::Mesh<mt::TP<2>>, llama::presets::llama_tiny, llama::TensorParallelStyles>;
static_assert(!MegatronPlan::sequence_parallel && !MegatronPlan::loss_parallel);

// Style names and the collectives the styles imply.
static_assert(mt::ColwiseParallel<mt::Shard<1>, mt::Shard<-1>>::name == "ColwiseParallel<Shard<1>, Shard<-1>>");
// Each style's collectives, forward and backward, as Megatron-LM pairs them.
static_assert(mt::ColwiseParallel<mt::Shard<1>>::enter::forward == mt::Collective::all_gather);
static_assert(mt::ColwiseParallel<mt::Shard<1>>::enter::backward == mt::Collective::reduce_scatter);
static_assert(mt::ColwiseParallel<>::enter::forward == mt::Collective::none);         // f ...
static_assert(mt::ColwiseParallel<>::enter::backward == mt::Collective::all_reduce);  // ... its all-reduce
static_assert(mt::ColwiseParallel<mt::Replicate, mt::Replicate>::leave::forward == mt::Collective::all_gather);
static_assert(mt::ColwiseParallel<mt::Replicate, mt::Replicate>::leave::backward == mt::Collective::local_chunk);
static_assert(mt::RowwiseParallel<mt::Shard<-1>, mt::Shard<1>>::leave::forward == mt::Collective::reduce_scatter);
static_assert(mt::RowwiseParallel<mt::Shard<-1>, mt::Shard<1>>::leave::backward == mt::Collective::all_gather);
static_assert(mt::RowwiseParallel<>::leave::forward == mt::Collective::all_reduce);  // g ...
static_assert(mt::RowwiseParallel<>::leave::backward == mt::Collective::none);       // ... identity back
static_assert(mt::RowwiseParallel<mt::Replicate, mt::Replicate>::enter::forward == mt::Collective::local_chunk);
static_assert(mt::RowwiseParallel<mt::Replicate, mt::Replicate>::enter::backward == mt::Collective::all_gather);
static_assert(mt::PrepareModuleInput<mt::Shard<1>, mt::Replicate>::enter::backward == mt::Collective::reduce_scatter);
static_assert(mt::SequenceParallel<1>::weight::backward == mt::Collective::all_reduce);

TEST_CASE("a plan describes every module's style for logs and fingerprints") {
  const auto text = SpPlan::describe();
  CHECK(text.rfind("Mesh<DP<dynamic>, TP<4>>: ", 0) == 0);
  CHECK(text.find("o_proj=RowwiseParallel<Shard<-1>, Shard<1>>") != std::string::npos);
  CHECK(text.find("lm_head=ColwiseParallel<Shard<1>, Shard<-1>>") != std::string::npos);
  CHECK(text.find("input_layernorm=SequenceParallel<Shard<1>>") != std::string::npos);
}

TEST_CASE("a run-time config is checked against the plan at the resolved TP size") {
  using Plan = llama::Plan<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<2>>>;
  auto config = llama::presets::llama_tiny;
  CHECK_NOTHROW(Plan::validate(config, 2));
  CHECK_THROWS_WITH(
      Plan::validate(config, 8, "tiny/config.json"),
      "tiny/config.json: num_key_value_heads is not divisible by the TP size (8) of Mesh<DP<dynamic>, TP<2>>");
  config.intermediate_size = 385;
  CHECK_THROWS_WITH(Plan::validate(config, 2), Catch::Contains("intermediate_size is not divisible"));
  config = llama::presets::llama_tiny;
  config.vocab_size = 263;
  CHECK_THROWS_WITH(Plan::validate(config, 2), Catch::Contains("vocab_size is not divisible"));
  CHECK_NOTHROW(Plan::validate(config, 1));
  CHECK_THROWS_WITH(Plan::validate_sequence(63, 2),
                    Catch::Contains("--seq-length 63 is not divisible by the TP size 2"));
  CHECK_NOTHROW(Plan::validate_sequence(64, 2));
}

// The memory plan's shards are row_block's: on one rank the whole TP piece, on n ranks the first
// rank's ceil(rows / n) rows of every tensor, so the largest shard is never under the average.
namespace row_shards {
using meshtorch::llama::largest_row_shards;
using meshtorch::llama::tp_rank_parameters;
namespace presets = meshtorch::llama::presets;
constexpr auto tiny_counts = *presets::llama_tiny.parameter_counts();
static_assert(largest_row_shards(presets::llama_tiny, 1, 1) == tp_rank_parameters(tiny_counts, 1));
static_assert(largest_row_shards(presets::llama_3_1_8b, 8, 1) ==
              tp_rank_parameters(*presets::llama_3_1_8b.parameter_counts(), 8));
// 128 hidden rows over 3 ranks: 43, 43 and 42; the first rank holds 43 of each norm.
static_assert(largest_row_shards(presets::llama_tiny, 1, 3).final_norm == 43);
static_assert(3 * largest_row_shards(presets::llama_tiny, 1, 3).layer >= tp_rank_parameters(tiny_counts, 1).layer);
static_assert(largest_row_shards(presets::llama_tiny, 1, 4).layer * 4 == tp_rank_parameters(tiny_counts, 1).layer,
              "rows that divide evenly: the shards are exact quarters");
// Qwen2's q/k/v biases are counted with the layer and split with the heads.
constexpr auto tiny_qwen2 = [] {
  auto c = presets::llama_tiny;
  c.family = meshtorch::llama::Family::qwen2;
  return c;
}();
static_assert(tiny_qwen2.num_parameters() ==
              presets::llama_tiny.num_parameters() + 4 * (tiny_qwen2.q_size() + 2 * tiny_qwen2.kv_size()));
static_assert(largest_row_shards(tiny_qwen2, 1, 1) == tp_rank_parameters(*tiny_qwen2.parameter_counts(), 1));
static_assert(largest_row_shards(tiny_qwen2, 2, 1) == tp_rank_parameters(*tiny_qwen2.parameter_counts(), 2));
}  // namespace row_shards

// A pipeline of as many stages as llama-tiny has layers with its embedding and head (4 + 2) is a
// valid plan; one more is a compile error (layout.compile_fail.plan_pp_more_stages_than_layers).
static_assert(
    meshtorch::llama::Plan<meshtorch::Mesh<meshtorch::PP<6>>, meshtorch::llama::presets::llama_tiny>::has_preset);

// Context parallel: a rank computes 1/CP of each sequence, so with the ring its activations and
// loss are one rank's at a CP-th of the length; gathering the keys and values keeps every rank's
// for backward, 2 x kv width x the other ranks' positions per layer (bf16).
TEST_CASE("the memory plan splits activations over CP, and counts the gathered keys and values") {
  const auto& c = llama::presets::llama_3_1_8b;
  mt::llama::RunShape run{.batch = 1, .seq = 32768};
  mt::llama::RunShape quarter = run;
  quarter.seq = run.seq / 4;
  const auto ring = mt::llama::estimate_memory(c, {.data_parallel_ranks = 8, .cp = 4}, run);
  const auto one_rank_quarter = mt::llama::estimate_memory(c, {.data_parallel_ranks = 8}, quarter);
  CHECK(ring.activations == Approx(one_rank_quarter.activations));
  CHECK(ring.loss == Approx(one_rank_quarter.loss));
  const auto gathered = mt::llama::estimate_memory(c, {.data_parallel_ranks = 8, .cp = 4, .cp_gathers_kv = true}, run);
  const double others_kv =
      2.0 * static_cast<double>(c.kv_size()) * 2 * 3 * 8192 * static_cast<double>(c.num_hidden_layers);
  CHECK(gathered.activations - ring.activations == Approx(others_kv));
}
