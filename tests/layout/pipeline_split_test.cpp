// Pipeline stage splits: the units of a stage in model terms, the split that balances a cost
// model, and a list that does not fit the model refused with the flag.
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/layout/pipeline_split.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/models/llama/stage_costs.hpp>
#include <meshtorch/models/llama/stage_memory.hpp>

using meshtorch::ConfigError;
namespace pp = meshtorch::pp;

namespace {

double slowest_of(const std::vector<double>& costs, const std::vector<int>& split) {
  double slowest = 0;
  std::size_t unit = 0;
  for (int n : split) {
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += costs[unit++];
    slowest = std::max(slowest, sum);
  }
  return slowest;
}

}  // namespace

TEST_CASE("pipeline stages: a stage split names each stage's embedding, layers and head") {
  const pp::StageSplit split(4, {2, 1, 1, 2});
  CHECK(split.stages() == 4);
  const auto first = split.stage(0), second = split.stage(1), last = split.stage(3);
  CHECK(first.embedding);
  CHECK(first.first_layer == 0);
  CHECK(first.end_layer == 1);
  CHECK_FALSE(first.head);
  CHECK_FALSE(second.embedding);
  CHECK(second.first_layer == 1);
  CHECK(second.end_layer == 2);
  CHECK(last.first_layer == 3);
  CHECK(last.end_layer == 4);
  CHECK(last.head);
  CHECK(split.describe() == "embedding+layer 0 | layer 1 | layer 2 | layer 3+norm+head");
  // A stage of the embedding alone, and one of the head alone.
  const pp::StageSplit ends(2, {1, 2, 1});
  CHECK(ends.stage(0).layers() == 0);
  CHECK(ends.stage(2).layers() == 0);
  CHECK(ends.describe() == "embedding | layers 0-1 | norm+head");
}

TEST_CASE("pipeline stages: a stage list that does not cover the model is refused with the flag") {
  CHECK_THROWS_WITH(pp::StageSplit(4, {2, 2, 1}), Catch::Contains("--units-per-stage 2,2,1") &&
                                                      Catch::Contains("plus the embedding and the head (6)"));
  CHECK_THROWS_WITH(pp::StageSplit(4, {6, 0}), Catch::Contains("at least one unit"));
  CHECK_THROWS_WITH(pp::balanced_units(std::vector<double>(6, 1.0), 7),
                    Catch::Contains("every stage needs a unit; lower --pp or --stages-per-rank to 6 stages or fewer"));
}

TEST_CASE("pipeline stages: the balanced split makes the slowest stage as fast as any contiguous split can") {
  // Equal layers, a cheap embedding and a costly head: the head's stage takes fewer layers.
  const std::vector<double> costs{0.1, 1, 1, 1, 1, 1, 1, 1, 1, 2.5};
  const auto split = pp::balanced_units(costs, 4);
  REQUIRE(std::accumulate(split.begin(), split.end(), 0) == 10);
  // Exhaustive check over every contiguous split of 10 units into 4 stages.
  double best = 1e300;
  for (int a = 1; a < 10; ++a)
    for (int b = 1; a + b < 10; ++b)
      for (int c = 1; a + b + c < 10; ++c) best = std::min(best, slowest_of(costs, {a, b, c, 10 - a - b - c}));
  CHECK(slowest_of(costs, split) == Approx(best));
  CHECK(split.back() < split[1]);
  // Among equal splits, earlier stages hold fewer units.
  CHECK(pp::balanced_units(std::vector<double>(6, 1.0), 4) == std::vector<int>{1, 1, 2, 2});
}

TEST_CASE("pipeline stages: llama-100m over 4 stages: the slowest stage within 10% of the mean by the cost model") {
  // bench/reference/configs/llama-100m/config.json
  const meshtorch::llama::Config llama_100m{.hidden_size = 768,
                                            .intermediate_size = 2048,
                                            .num_hidden_layers = 16,
                                            .num_attention_heads = 12,
                                            .num_key_value_heads = 4,
                                            .vocab_size = 264};
  const auto* config = &llama_100m;
  const auto costs = meshtorch::llama::stage_unit_costs(*config, 1024);
  REQUIRE(costs.size() == static_cast<std::size_t>(config->num_hidden_layers + 2));
  const auto split = pp::balanced_units(costs, 4);
  const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
  INFO(pp::StageSplit(static_cast<int>(config->num_hidden_layers), split).describe());
  CHECK(slowest_of(costs, split) / (total / 4) <= 1.10);
}

TEST_CASE("pipeline stages: the micro-batches each stage holds at once, per schedule") {
  using pp::ScheduleKind;
  // GPipe keeps every micro-batch on every stage until backward; 1F1B at most p - s on stage s.
  CHECK(pp::microbatches_in_flight(pp::make_schedule(ScheduleKind::gpipe, 2, 1, 4)) == std::vector<int>{4, 4});
  CHECK(pp::microbatches_in_flight(pp::make_schedule(ScheduleKind::one_f_one_b, 2, 1, 4)) == std::vector<int>{2, 1});
  CHECK(pp::microbatches_in_flight(pp::make_schedule(ScheduleKind::one_f_one_b, 4, 1, 8)) ==
        std::vector<int>{4, 3, 2, 1});
  // Of a schedule with static extents.
  using S = pp::Schedule<pp::OneFOneB, 2, 1, 8>;
  CHECK(pp::microbatches_in_flight(S::table()) == std::vector<int>{2, 1});
}

TEST_CASE("pipeline stages: each stage's memory is its share of the model's state plus the micro-batches it holds") {
  namespace llama = meshtorch::llama;
  const auto config = llama::presets::llama_tiny;
  const llama::RunShape run{.batch = 1, .seq = 256, .compute_bytes = 4, .state_bytes = 4};
  const llama::LayoutSizes ddp{.data_parallel = llama::DataParallelKind::ddp};
  const auto one_process = llama::memory_detail::step_bytes(config, ddp, run);
  const auto counts = *config.parameter_counts();
  const pp::StageSplit split(static_cast<int>(config.num_hidden_layers), {3, 3});  // embedding+2 layers | 2+head

  for (const auto kind : {pp::ScheduleKind::gpipe, pp::ScheduleKind::one_f_one_b}) {
    const auto table = pp::make_schedule(kind, 2, 1, 4);
    const auto in_flight = pp::microbatches_in_flight(table);
    std::vector<llama::StageMemory> stages;
    for (int s = 0; s < 2; ++s) stages.push_back(llama::stage_memory(config, ddp, run, split.stage(s), in_flight[s]));
    INFO(pp::to_string(kind));
    // The stages hold the model's parameters once (llama-tiny's head is its own).
    REQUIRE_FALSE(config.tie_word_embeddings);
    CHECK(stages[0].parameters + stages[1].parameters == counts.total);
    // Weights, gradients and two AdamW moments, each in fp32.
    CHECK(stages[0].trained_state == 16.0 * static_cast<double>(stages[0].parameters));
    // A micro-batch's activations: the layers' as one process keeps them, and the loss's on the last stage.
    CHECK(stages[0].activations == 2 * one_process.per_layer);
    CHECK(stages[1].activations ==
          2 * one_process.per_layer + one_process.final_norm + one_process.head_input + one_process.loss_kept);
    // GPipe's stages hold all 4 micro-batches; 1F1B's first 2 (the ranks), its last 1.
    CHECK(stages[0].peak() ==
          stages[0].trained_state + in_flight[0] * stages[0].activations + one_process.layer_working);
    // One stage per rank: the rank's peak is its stage's.
    CHECK(llama::rank_peak(table, 0, stages) == Approx(stages[0].peak()).epsilon(1e-12));
    CHECK(llama::rank_peak(table, 1, stages) == Approx(stages[1].peak()).epsilon(1e-12));
  }

  // A tied embedding is held by the first stage and, as the head, by the last: twice.
  auto tied = config;
  tied.tie_word_embeddings = true;
  const auto tied_counts = *tied.parameter_counts();
  CHECK(llama::stage_memory(tied, ddp, run, split.stage(0), 1).parameters +
            llama::stage_memory(tied, ddp, run, split.stage(1), 1).parameters ==
        tied_counts.total + tied_counts.embedding);

  // FSDP over 4 ranks inside the stages: a quarter of the trained state. Gathering a layer at a time,
  // the stage's embedding stays gathered and the working set holds a layer (and one prefetched) with
  // a reduce-scatter's buffers; gathering the stage at once, its weights count from its UNSHARD to
  // its RESHARD, in the table.
  {
    const llama::LayoutSizes fsdp{.data_parallel = llama::DataParallelKind::fsdp, .data_parallel_ranks = 4};
    const auto fsdp_bytes = llama::memory_detail::step_bytes(config, fsdp, run);
    const auto table = pp::make_schedule(pp::ScheduleKind::one_f_one_b, 2, 1, 4);
    const auto in_flight = pp::microbatches_in_flight(table);
    const auto first = llama::stage_memory(config, fsdp, run, split.stage(0), in_flight[0]);
    const auto replicated = llama::stage_memory(config, ddp, run, split.stage(0), in_flight[0]);
    CHECK(first.trained_state ==
          Approx(replicated.trained_state / 4 + 4.0 * static_cast<double>(counts.embedding)).epsilon(1e-12));
    CHECK(first.working == Approx(replicated.working + 2 * fsdp_bytes.layer_unit.gathered +
                                  fsdp_bytes.layer_unit.full_gradients + fsdp_bytes.layer_unit.send)
                               .epsilon(1e-12));
    CHECK(first.stage_gathered == 0);

    auto whole = run;
    whole.reshard_after_forward = false;
    const auto gathered_table = pp::make_schedule(pp::ScheduleKind::one_f_one_b, 2, 1, 4, /*stage_gathers=*/true);
    std::vector<llama::StageMemory> stages;
    for (int s = 0; s < 2; ++s)
      stages.push_back(llama::stage_memory(config, fsdp, whole, split.stage(s), in_flight[s]));
    CHECK(stages[0].trained_state == Approx(replicated.trained_state / 4).epsilon(1e-12));
    CHECK(stages[0].stage_gathered == 4.0 * static_cast<double>(stages[0].parameters));
    CHECK(llama::rank_peak(gathered_table, 0, stages) == Approx(stages[0].peak()).epsilon(1e-12));
    // The same stages under a table without gathers hold their weights throughout: the same peak here,
    // where one stage per rank computes from its first action to its last.
    CHECK(llama::rank_peak(table, 0, stages) == Approx(stages[0].peak()).epsilon(1e-12));
  }

  // Interleaved, 2 stages per rank: a rank counts only what its two stages hold at one moment, which
  // is no more than the sum of each stage's own most.
  const pp::StageSplit four(static_cast<int>(config.num_hidden_layers), {2, 1, 1, 2});
  const auto table = pp::make_schedule(pp::ScheduleKind::interleaved_1f1b, 2, 2, 4);
  const auto in_flight = pp::microbatches_in_flight(table);
  std::vector<llama::StageMemory> stages;
  for (int s = 0; s < 4; ++s) stages.push_back(llama::stage_memory(config, ddp, run, four.stage(s), in_flight[s]));
  const double separately = stages[0].peak() + stages[2].peak();
  const double together = llama::rank_peak(table, 0, stages);
  CHECK(together > stages[0].trained_state + stages[2].trained_state);
  CHECK(together <= separately);
}
