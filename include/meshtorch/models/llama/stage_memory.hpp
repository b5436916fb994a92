#pragma once
// What a pipeline stage, and a pipeline rank, holds in device memory: the stage's trained state
// (its layers' weights, gradients and AdamW state, replicated over DP as DDP holds them, split over
// TP as the plan splits them) and the activations of the micro-batches it keeps in flight, which
// the schedule decides (1F1B's first stage holds p micro-batches, GPipe's every stage m), plus the
// working set of the largest op. The per-micro-batch figures are the memory plan's
// (memory_plan.hpp's step_bytes, at the micro-batch's sequences); a rank's peak follows its
// program in the table action by action, so the stages of an interleaved rank count together only
// as much as they hold at one moment.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <meshtorch/layout/pipeline_action.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/layout/pipeline_split.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>

namespace meshtorch::llama {

struct StageMemory {
  std::int64_t parameters = 0;  // of one TP rank
  double trained_state = 0;     // weights, gradients, AdamW state
  double activations = 0;       // one micro-batch's, kept from its forward to its backward
  double working = 0;           // the largest op's while it runs
  int microbatches_in_flight = 0;
  constexpr double peak() const { return trained_state + activations * microbatches_in_flight + working; }
};

// The parameters a stage holds of one TP rank's `rank` (tp_rank_parameters): its layers, the
// embedding on the first stage, the final norm and the head on the last, which also holds a copy
// of a tied embedding (the two copies' gradients are summed).
constexpr std::int64_t stage_parameters(const TpRankParameters& rank, pp::StageLayers stage) {
  const bool holds_embedding = stage.embedding || (stage.head && rank.head == 0);
  return (stage.end_layer - stage.first_layer) * rank.layer + (holds_embedding ? rank.embedding : 0) +
         (stage.head ? rank.head + rank.final_norm : 0);
}

// `run` is one micro-batch's shape (run.batch: its sequences); `layout.tp` splits the stage.
constexpr StageMemory stage_memory(const llama::Config& c, LayoutSizes layout, RunShape run, pp::StageLayers stage,
                                   int microbatches_in_flight) {
  layout.data_parallel = DataParallelKind::ddp;  // stages replicate over DP (no FSDP inside them yet)
  const auto counts = c.parameter_counts().value_or(llama::Config::ParameterCounts{});
  const auto bytes = memory_detail::step_bytes(c, layout, run);

  StageMemory m;
  m.microbatches_in_flight = microbatches_in_flight;
  m.parameters = stage_parameters(tp_rank_parameters(counts, layout.tp), stage);
  m.trained_state = 4 * static_cast<double>(m.parameters) * static_cast<double>(run.state_bytes);
  for (std::int64_t layer = stage.first_layer; layer < stage.end_layer; ++layer) {
    const bool checkpointed = run.checkpoint_every > 0 && layer % run.checkpoint_every == 0;
    m.activations += checkpointed ? bytes.layer_input : bytes.per_layer;
  }
  if (stage.head) m.activations += bytes.final_norm + bytes.head_input + bytes.loss_kept;
  if (stage.end_layer > stage.first_layer) m.working = bytes.layer_working;
  if (stage.head)
    m.working = std::max({m.working, bytes.loss_forward_working, bytes.loss_backward_working + bytes.rows_gradient});
  return m;
}

// The most one pipeline rank holds at once: its stages' trained state, and, following its program
// in the table, the activations of every micro-batch its stages hold after each action, plus the
// largest working set among them. `stages[s]` is stage s's memory (any microbatches_in_flight).
constexpr double rank_peak(const pp::ScheduleTable& table, int rank, const std::vector<StageMemory>& stages) {
  double state = 0, working = 0;
  for (int s = 0; s < table.shape.stages(); ++s)
    if (table.shape.rank_of_stage(s) == rank) {
      state += stages[static_cast<std::size_t>(s)].trained_state;
      working = std::max(working, stages[static_cast<std::size_t>(s)].working);
    }
  double held = 0, most = 0;
  for (const pp::Action& action : table.programs[static_cast<std::size_t>(rank)]) {
    const double one = stages[static_cast<std::size_t>(action.stage)].activations;
    if (action.kind == pp::ActionKind::forward) {
      held += one;
      most = std::max(most, held);
    } else if (action.kind == pp::ActionKind::backward || action.kind == pp::ActionKind::backward_weight) {
      held -= one;  // as microbatches_in_flight counts: a split backward frees at its weight step
    }
  }
  return state + most + working;
}

}  // namespace meshtorch::llama
