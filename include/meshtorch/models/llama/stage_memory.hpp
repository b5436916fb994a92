#pragma once
// What a pipeline stage, and a pipeline rank, holds in device memory: the stage's trained state
// (its layers' weights, gradients and AdamW state, replicated over DP as DDP holds them or sharded
// over FSDP, split over TP as the plan splits them), the weights FSDP gathers (a layer at a time,
// or the whole stage from the table's UNSHARD to its RESHARD) and the activations of the
// micro-batches it keeps in flight, which
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
  double trained_state = 0;     // weights, gradients, AdamW state (FSDP: this rank's rows of them)
  // FSDP gathering whole stages: the stage's weights in the compute dtype, from its UNSHARD to its
  // RESHARD. (Gathering layer by layer, what is gathered at once is in `trained_state`, for the
  // embedding and the head, which stay gathered while micro-batches are in flight, and `working`.)
  double stage_gathered = 0;
  double activations = 0;  // one micro-batch's, kept from its forward to its backward
  double working = 0;      // the largest op's while it runs (FSDP: with the layers gathered around it)
  int microbatches_in_flight = 0;
  constexpr double peak() const {
    return trained_state + stage_gathered + activations * microbatches_in_flight + working;
  }
};

// The parameters a stage holds of one TP rank's `rank` (tp_rank_parameters): its layers, the
// embedding on the first stage, the final norm and the head on the last, which also holds a copy
// of a tied embedding (the two copies' gradients are summed).
constexpr std::int64_t stage_parameters(const TpRankParameters& rank, pp::StageLayers stage) {
  const bool holds_embedding = stage.embedding || (stage.head && rank.head == 0);
  return (stage.end_layer - stage.first_layer) * rank.layer + (holds_embedding ? rank.embedding : 0) +
         (stage.head ? rank.head + rank.final_norm : 0);
}

// `run` is one micro-batch's shape (run.batch: its sequences); `layout.tp` splits the stage. With
// `layout.data_parallel` fsdp, FSDP shards it over `layout.data_parallel_ranks` (FSDP x CP), which
// gather it a layer at a time (run.reshard_after_forward) or a stage at a time; any other kind is
// DDP's replicas.
constexpr StageMemory stage_memory(const llama::Config& c, LayoutSizes layout, RunShape run, pp::StageLayers stage,
                                   int microbatches_in_flight) {
  if (layout.data_parallel != DataParallelKind::fsdp) layout.data_parallel = DataParallelKind::ddp;
  const bool fsdp = layout.data_parallel == DataParallelKind::fsdp;
  const auto counts = c.parameter_counts().value_or(llama::Config::ParameterCounts{});
  const auto bytes = memory_detail::step_bytes(c, layout, run);
  const auto rank_parameters = tp_rank_parameters(counts, layout.tp);

  StageMemory m;
  m.microbatches_in_flight = microbatches_in_flight;
  m.parameters = stage_parameters(rank_parameters, stage);
  const double n = fsdp ? static_cast<double>(layout.data_parallel_ranks) : 1.0;
  m.trained_state = 4 * static_cast<double>(m.parameters) * static_cast<double>(run.state_bytes) / n;
  const double compute = static_cast<double>(run.compute_bytes);
  if (fsdp && !run.reshard_after_forward) {
    m.stage_gathered = static_cast<double>(m.parameters) * compute;
  } else if (fsdp) {
    // The embedding and the head stay gathered from a micro-batch's forward to its backward.
    m.trained_state +=
        static_cast<double>(m.parameters - (stage.end_layer - stage.first_layer) * rank_parameters.layer) * compute;
  }
  for (std::int64_t layer = stage.first_layer; layer < stage.end_layer; ++layer) {
    const bool checkpointed = run.checkpoint_every > 0 && layer % run.checkpoint_every == 0;
    m.activations += checkpointed ? bytes.layer_input : bytes.per_layer;
  }
  if (stage.head) m.activations += bytes.final_norm + bytes.head_input + bytes.loss_kept;
  if (stage.end_layer > stage.first_layer) m.working = bytes.layer_working;
  if (stage.head)
    m.working = std::max({m.working, bytes.loss_forward_working, bytes.loss_backward_working + bytes.rows_gradient});
  // A layer's reduce-scatter: its full gradients and the send buffer (FsdpUnit's, memory_plan.hpp's
  // UnitBytes); gathering a layer at a time, also the one computing and the ones prefetched.
  if (fsdp && stage.end_layer > stage.first_layer) {
    m.working += bytes.layer_unit.full_gradients + bytes.layer_unit.send;
    if (run.reshard_after_forward) m.working += (1 + static_cast<double>(bytes.prefetch)) * bytes.layer_unit.gathered;
  }
  return m;
}

// The most one pipeline rank holds at once: its stages' trained state, and, following its program
// in the table, the activations of every micro-batch its stages hold and the stages FSDP has
// gathered (UNSHARD to RESHARD) after each action, plus the largest working set among them. `stages[s]` is stage s's
// memory (any microbatches_in_flight).
constexpr double rank_peak(const pp::ScheduleTable& table, int rank, const std::vector<StageMemory>& stages) {
  double state = 0, working = 0;
  for (int s = 0; s < table.shape.stages(); ++s)
    if (table.shape.rank_of_stage(s) == rank) {
      state += stages[static_cast<std::size_t>(s)].trained_state;
      working = std::max(working, stages[static_cast<std::size_t>(s)].working);
    }
  double held = 0, most = 0;
  for (const pp::Action& action : table.programs[static_cast<std::size_t>(rank)]) {
    const StageMemory& stage = stages[static_cast<std::size_t>(action.stage)];
    if (action.kind == pp::ActionKind::forward) {
      held += stage.activations;
    } else if (action.kind == pp::ActionKind::backward || action.kind == pp::ActionKind::backward_weight) {
      held -= stage.activations;  // as microbatches_in_flight counts: a split backward frees at its weight step
    } else if (action.kind == pp::ActionKind::unshard) {
      held += stage.stage_gathered;  // FSDP's whole stage, until its RESHARD
    } else if (action.kind == pp::ActionKind::reshard) {
      held -= stage.stage_gathered;
    }
    most = std::max(most, held);
  }
  // A table without the stage gathers for stages that gather whole: held throughout.
  if (!table.shape.stage_gathers)
    for (int s = 0; s < table.shape.stages(); ++s)
      if (table.shape.rank_of_stage(s) == rank) state += stages[static_cast<std::size_t>(s)].stage_gathered;
  return state + most + working;
}

}  // namespace meshtorch::llama
