#pragma once
// The checks of pipeline schedules: check_rules() holds the rules each kind sets on its shape (as
// PyTorch's schedules enforce them); check_schedule() proves a table, generated or edited by hand
// (every stage runs forward and backward once per micro-batch, in dependency order, each send has
// its receive), then simulates all ranks to give each action its tick and find deadlocks;
// bubble_fraction() measures the idle share of a checked table. Apart from the generator so that
// the proof does not lean on the code it checks.
#include <algorithm>
#include <cstddef>
#include <string_view>
#include <vector>

#include <meshtorch/layout/pipeline_action.hpp>

namespace meshtorch::pp {

// Enough for 64 ranks x 8 stages x 1024 micro-batches; beyond, the table would take seconds to build.
inline constexpr long max_compute_actions = 1L << 21;

// The rules of each kind, as PyTorch's schedules enforce them. The static_asserts of Schedule say
// the same in their own words (a static_assert message must be a literal).
constexpr Problem check_rules(const ScheduleShape& shape) {
  const ScheduleKind kind = shape.kind;
  if (shape.ranks < 1) return {ProblemCode::no_ranks, "a pipeline needs at least one rank; set --pp to 1 or more"};
  if (shape.stages_per_rank < 1)
    return {ProblemCode::no_stages_per_rank, "each rank needs at least one stage; set --stages-per-rank to 1 or more"};
  if (shape.microbatches < 1)
    return {ProblemCode::no_microbatches,
            "a pipeline schedule needs at least one micro-batch; set --microbatches to 1 or more"};
  if ((kind == ScheduleKind::gpipe || kind == ScheduleKind::one_f_one_b) && shape.stages_per_rank != 1)
    return {ProblemCode::one_stage_schedule_with_more_stages,
            "GPipe and 1F1B run one stage per rank; set --stages-per-rank 1, or use the interleaved-1f1b schedule "
            "for more"};
  if (kind == ScheduleKind::one_f_one_b && shape.microbatches < shape.stages())
    return {ProblemCode::one_f_one_b_too_few_microbatches,
            "1F1B needs at least as many micro-batches as stages; raise --microbatches to --pp or more, or use the "
            "gpipe schedule"};
  if (kind == ScheduleKind::interleaved_1f1b && shape.stages_per_rank < 2)
    return {ProblemCode::interleaved_one_stage_per_rank,
            "Interleaved1F1B needs at least 2 stages per rank; raise --stages-per-rank to 2, or use the 1f1b schedule "
            "for one stage per rank"};
  if (kind == ScheduleKind::interleaved_1f1b) {
    const int rounds = std::max(1, shape.microbatches / shape.ranks);
    if (shape.microbatches % rounds != 0)
      return {ProblemCode::interleaved_microbatches_not_multiple_of_rounds,
              "Interleaved1F1B runs the micro-batches in rounds of max(1, micro-batches / ranks) and needs them to "
              "divide evenly; set --microbatches to a multiple of --pp, or to fewer than twice --pp"};
  }
  if (kind == ScheduleKind::zero_bubble_v && shape.stages_per_rank != 2)
    return {ProblemCode::zero_bubble_v_not_two_stages, "ZBV runs exactly 2 stages per rank; set --stages-per-rank 2"};
  if (3L * shape.stages() * std::max(shape.microbatches, 2 * shape.ranks) > max_compute_actions)
    return {ProblemCode::table_too_large,
            "the schedule's table would pass two million actions; lower --microbatches or --pp"};
  return {};
}

namespace detail {

// Where one (stage, micro-batch) pair's actions are: the position in its rank's program, or -1.
struct StepPositions {
  int forward = -1, backward = -1, input = -1, weight = -1;
  int forward_count = 0, backward_count = 0, input_count = 0, weight_count = 0;
  // Transfers out of this stage (its SEND_F / SEND_B) and into it (its RECV_F / RECV_B).
  int send_forward = -1, receive_forward = -1, send_backward = -1, receive_backward = -1;
  int transfer_count[4] = {0, 0, 0, 0};
};

constexpr Problem problem_at(ProblemCode code, std::string_view what, int rank, const Action& action) {
  return {code, what, rank, action};
}

}  // namespace detail

// Checks a table, made here or edited by hand, and gives each action its tick by simulating every
// rank: a rank runs its actions in order, one compute action per tick; a receive waits for its send.
// Returns the first problem, or none.
constexpr Problem check_schedule(ScheduleTable& table) {
  using detail::problem_at;
  const ScheduleShape& shape = table.shape;
  if (const Problem rules = check_rules(shape)) return rules;
  if (static_cast<int>(table.programs.size()) != shape.ranks)
    return {ProblemCode::wrong_rank_count, "the table has a program count other than its ranks; give one per rank"};
  const int stages = shape.stages(), m = shape.microbatches;
  std::vector<detail::StepPositions> steps(static_cast<std::size_t>(stages) * m);
  const auto at = [&](int stage, int microbatch) -> detail::StepPositions& {
    return steps[static_cast<std::size_t>(stage) * m + microbatch];
  };

  // Each action in range and on the rank that holds its stage; where each one is.
  for (int rank = 0; rank < shape.ranks; ++rank) {
    const std::vector<Action>& program = table.programs[rank];
    for (int position = 0; position < static_cast<int>(program.size()); ++position) {
      const Action& action = program[position];
      if (action.kind == ActionKind::unshard || action.kind == ActionKind::reshard) continue;
      if (action.stage < 0 || action.stage >= stages)
        return problem_at(ProblemCode::stage_out_of_range,
                          "an action names a stage the pipeline does not have; use stages 0 to ranks x stages per "
                          "rank - 1",
                          rank, action);
      if (action.microbatch < 0 || action.microbatch >= m)
        return problem_at(ProblemCode::microbatch_out_of_range,
                          "an action names a micro-batch the step does not have; use micro-batches 0 to "
                          "--microbatches - 1",
                          rank, action);
      if (shape.rank_of_stage(action.stage) != rank)
        return problem_at(ProblemCode::stage_on_wrong_rank,
                          "a stage's action is on a rank that does not hold it; each stage runs on one rank only (loop "
                          "placement: stage s on rank s mod ranks; ZBV: ranks r and 2 x ranks - 1 - r)",
                          rank, action);
      if ((action.kind == ActionKind::receive_forward && action.stage == 0) ||
          (action.kind == ActionKind::receive_backward && action.stage == stages - 1))
        return problem_at(ProblemCode::transfer_within_rank,
                          "the first stage receives no activation and the last no gradient; remove that receive", rank,
                          action);
      detail::StepPositions& step = at(action.stage, action.microbatch);
      switch (action.kind) {
        case ActionKind::forward:
          step.forward = position, ++step.forward_count;
          break;
        case ActionKind::backward:
          step.backward = position, ++step.backward_count;
          break;
        case ActionKind::backward_input:
          step.input = position, ++step.input_count;
          break;
        case ActionKind::backward_weight:
          step.weight = position, ++step.weight_count;
          break;
        case ActionKind::send_forward:
          step.send_forward = position, ++step.transfer_count[0];
          break;
        case ActionKind::receive_forward:
          step.receive_forward = position, ++step.transfer_count[1];
          break;
        case ActionKind::send_backward:
          step.send_backward = position, ++step.transfer_count[2];
          break;
        case ActionKind::receive_backward:
          step.receive_backward = position, ++step.transfer_count[3];
          break;
        default:
          break;
      }
    }
  }

  // Every stage runs forward and backward once per micro-batch, backward after forward, W after I,
  // and each transfer between ranks has one send and one receive, around the actions they serve.
  const int last = stages - 1;
  for (int s = 0; s < stages; ++s) {
    const int rank = shape.rank_of_stage(s);
    for (int mb = 0; mb < m; ++mb) {
      const detail::StepPositions& step = at(s, mb);
      const Action forward{ActionKind::forward, s, mb};
      const Action backward{shape.splits_backward() ? ActionKind::backward_input : ActionKind::backward, s, mb};
      if (step.forward_count == 0)
        return problem_at(ProblemCode::forward_missing,
                          "a stage never runs forward for a micro-batch; add its F action", rank, forward);
      if (step.forward_count > 1)
        return problem_at(ProblemCode::forward_repeated,
                          "a stage runs forward twice for a micro-batch; keep one F action", rank, forward);
      if (step.backward_count > 0 && (step.input_count > 0 || step.weight_count > 0))
        return problem_at(ProblemCode::backward_split_mixed,
                          "a stage runs both a whole backward (B) and a split one (I, W) for a micro-batch; keep B "
                          "or I and W",
                          rank, backward);
      if (step.backward_count + step.input_count == 0)
        return problem_at(ProblemCode::backward_missing,
                          "a stage never runs backward for a micro-batch; add its B action (or I and W)", rank,
                          backward);
      if (step.backward_count > 1 || step.input_count > 1 || step.weight_count > 1)
        return problem_at(ProblemCode::backward_repeated,
                          "a stage runs backward twice for a micro-batch; keep one B action (or one I and one W)", rank,
                          backward);
      if (step.input_count != step.weight_count)
        return problem_at(ProblemCode::backward_missing,
                          "a stage runs the input gradient (I) without the weight gradient (W) of a micro-batch, or "
                          "W without I; add the missing one",
                          rank, backward);
      const int first_backward = step.backward_count > 0 ? step.backward : step.input;
      if (first_backward < step.forward)
        return problem_at(ProblemCode::backward_before_forward,
                          "a stage runs backward for a micro-batch before its forward; move the backward after the F",
                          rank, backward);
      if (step.weight_count > 0 && step.weight < step.input)
        return problem_at(ProblemCode::weight_before_input,
                          "a stage runs the weight gradient (W) of a micro-batch before its input gradient (I); move "
                          "W after I",
                          rank, {ActionKind::backward_weight, s, mb});

      // Forward activations leave stage s for s + 1; gradients leave stage s for s - 1.
      const bool sends_forward = s < last && shape.rank_of_stage(s + 1) != rank;
      const bool sends_backward = s > 0 && shape.rank_of_stage(s - 1) != rank;
      const int forward_receives = s < last ? at(s + 1, mb).transfer_count[1] : 0;
      const int backward_receives = s > 0 ? at(s - 1, mb).transfer_count[3] : 0;
      for (int kind = 0; kind < 4; ++kind)
        if (step.transfer_count[kind] > 1)
          return problem_at(ProblemCode::transfer_repeated,
                            "a transfer is listed twice; keep one send and one receive per activation or gradient",
                            rank, {static_cast<ActionKind>(static_cast<int>(ActionKind::send_forward) + kind), s, mb});
      if (!sends_forward && step.transfer_count[0] + forward_receives > 0)
        return problem_at(ProblemCode::transfer_within_rank,
                          "a forward send or receive between stages that need none (the last stage, or the next on "
                          "the same rank); remove it",
                          rank, {ActionKind::send_forward, s, mb});
      if (!sends_backward && step.transfer_count[2] + backward_receives > 0)
        return problem_at(ProblemCode::transfer_within_rank,
                          "a backward send or receive between stages that need none (the first stage, or the "
                          "previous on the same rank); remove it",
                          rank, {ActionKind::send_backward, s, mb});
      if (sends_forward && step.transfer_count[0] == 0)
        return problem_at(ProblemCode::send_missing,
                          "a forward output is never sent to the next stage's rank; add SEND_F after the F", rank,
                          {ActionKind::send_forward, s, mb});
      if (sends_forward && forward_receives == 0)
        return problem_at(ProblemCode::receive_missing,
                          "a forward send has no receive on the next stage's rank; add RECV_F before that stage's F",
                          shape.rank_of_stage(s + 1), {ActionKind::receive_forward, s + 1, mb});
      if (sends_backward && step.transfer_count[2] == 0)
        return problem_at(ProblemCode::send_missing,
                          "an input gradient is never sent to the previous stage's rank; add SEND_B after the "
                          "backward",
                          rank, {ActionKind::send_backward, s, mb});
      if (sends_backward && backward_receives == 0)
        return problem_at(ProblemCode::receive_missing,
                          "a backward send has no receive on the previous stage's rank; add RECV_B before that "
                          "stage's backward",
                          shape.rank_of_stage(s - 1), {ActionKind::receive_backward, s - 1, mb});
      if (sends_forward && step.send_forward < step.forward)
        return problem_at(ProblemCode::send_before_compute,
                          "a stage sends a forward output before computing it; move SEND_F after the F", rank,
                          {ActionKind::send_forward, s, mb});
      if (sends_backward && step.send_backward < first_backward)
        return problem_at(ProblemCode::send_before_compute,
                          "a stage sends an input gradient before computing it; move SEND_B after the backward", rank,
                          {ActionKind::send_backward, s, mb});
      if (s > 0 && shape.rank_of_stage(s - 1) != rank && step.receive_forward > step.forward)
        return problem_at(ProblemCode::receive_after_use,
                          "a stage receives its input after running forward on it; move RECV_F before the F", rank,
                          {ActionKind::receive_forward, s, mb});
      if (s < last && shape.rank_of_stage(s + 1) != rank && step.receive_backward > first_backward)
        return problem_at(ProblemCode::receive_after_use,
                          "a stage receives its output's gradient after running backward on it; move RECV_B before "
                          "the backward",
                          rank, {ActionKind::receive_backward, s, mb});
    }
  }

  // FSDP's stage gathers: with stage_gathers, each stage a rank holds is gathered once (UNSHARD)
  // before its first compute action and freed once (RESHARD) after its last; without, none.
  for (int rank = 0; rank < shape.ranks; ++rank) {
    const std::vector<Action>& program = table.programs[rank];
    std::vector<int> unshard_at(static_cast<std::size_t>(stages), -1), reshard_at = unshard_at;
    for (int position = 0; position < static_cast<int>(program.size()); ++position) {
      const Action& action = program[position];
      if (action.kind != ActionKind::unshard && action.kind != ActionKind::reshard) continue;
      if (action.stage < 0 || action.stage >= stages)
        return problem_at(ProblemCode::stage_out_of_range,
                          "an UNSHARD or RESHARD names a stage the pipeline does not have; use stages 0 to ranks x "
                          "stages per rank - 1",
                          rank, action);
      if (shape.rank_of_stage(action.stage) != rank)
        return problem_at(
            ProblemCode::stage_on_wrong_rank,
            "an UNSHARD or RESHARD is on a rank that does not hold its stage; move it to the stage's rank", rank,
            action);
      if (!shape.stage_gathers)
        return problem_at(ProblemCode::gather_repeated,
                          "an UNSHARD or RESHARD in a table that gathers layer by layer (stage_gathers off); remove "
                          "it, or build the table with stage_gathers",
                          rank, action);
      int& at = (action.kind == ActionKind::unshard ? unshard_at : reshard_at)[static_cast<std::size_t>(action.stage)];
      if (at >= 0)
        return problem_at(ProblemCode::gather_repeated,
                          "a stage is gathered (UNSHARD) or freed (RESHARD) twice in a step; keep one of each", rank,
                          action);
      at = position;
    }
    if (!shape.stage_gathers) continue;
    for (int position = 0; position < static_cast<int>(program.size()); ++position) {
      const Action& action = program[position];
      if (!is_compute(action.kind)) continue;
      const int unshard = unshard_at[static_cast<std::size_t>(action.stage)];
      const int reshard = reshard_at[static_cast<std::size_t>(action.stage)];
      if (unshard < 0 || reshard < 0)
        return problem_at(ProblemCode::gather_missing,
                          "a stage computes without its UNSHARD and RESHARD in the step; add an UNSHARD before its "
                          "first compute action and a RESHARD after its last",
                          rank, action);
      if (position < unshard || position > reshard)
        return problem_at(ProblemCode::compute_outside_gather,
                          "a stage computes before its UNSHARD or after its RESHARD; move the UNSHARD before its first "
                          "compute action and the RESHARD after its last",
                          rank, action);
    }
  }

  // Simulate: at each tick every rank first makes the sends and receives it can (a receive only
  // once its send has happened), then runs its next compute action if that is what comes next.
  for (std::vector<Action>& program : table.programs)
    for (Action& action : program) action.tick = -1;
  std::vector<char> sent_forward(steps.size(), 0), sent_backward(steps.size(), 0);
  std::vector<int> next(shape.ranks, 0);
  std::vector<int> forward_tick(steps.size(), -1), backward_tick(steps.size(), -1);
  int finished = 0;
  for (int rank = 0; rank < shape.ranks; ++rank)
    if (table.programs[rank].empty()) ++finished;
  int tick = 0;
  while (finished < shape.ranks) {
    bool progress = false;
    for (bool moved = true; moved;) {
      moved = false;
      for (int rank = 0; rank < shape.ranks; ++rank) {
        std::vector<Action>& program = table.programs[rank];
        while (next[rank] < static_cast<int>(program.size())) {
          Action& action = program[next[rank]];
          const std::size_t key = static_cast<std::size_t>(action.stage) * m + action.microbatch;
          if (action.kind == ActionKind::send_forward) {
            sent_forward[key] = 1;
          } else if (action.kind == ActionKind::send_backward) {
            sent_backward[key] = 1;
          } else if (action.kind == ActionKind::receive_forward) {
            if (!sent_forward[key - m]) break;
          } else if (action.kind == ActionKind::receive_backward) {
            if (!sent_backward[key + m]) break;
          } else if (action.kind != ActionKind::unshard && action.kind != ActionKind::reshard) {
            break;
          }
          action.tick = tick;
          if (++next[rank] == static_cast<int>(program.size())) ++finished;
          moved = progress = true;
        }
      }
    }
    for (int rank = 0; rank < shape.ranks; ++rank) {
      std::vector<Action>& program = table.programs[rank];
      if (next[rank] == static_cast<int>(program.size())) continue;
      Action& action = program[next[rank]];
      if (!is_compute(action.kind)) continue;
      const std::size_t key = static_cast<std::size_t>(action.stage) * m + action.microbatch;
      action.tick = tick;
      if (action.kind == ActionKind::forward) forward_tick[key] = tick;
      if (is_input_backward(action.kind)) backward_tick[key] = tick;
      if (++next[rank] == static_cast<int>(program.size())) ++finished;
      progress = true;
    }
    if (!progress) {
      for (int rank = 0; rank < shape.ranks; ++rank)
        if (next[rank] < static_cast<int>(table.programs[rank].size())) {
          Action waiting = table.programs[rank][next[rank]];
          waiting.tick = tick;
          return problem_at(ProblemCode::deadlock,
                            "the schedule deadlocks: every unfinished rank waits on a receive whose send comes later "
                            "on a rank that waits too; move that send before the receive it unblocks",
                            rank, waiting);
        }
    }
    ++tick;
  }
  table.ticks = 0;
  for (const std::vector<Action>& program : table.programs)
    for (const Action& action : program)
      if (is_compute(action.kind)) table.ticks = std::max(table.ticks, action.tick + 1);

  // Data dependencies in time: stage s+1 computes a micro-batch after stage s, and its gradient
  // flows back the other way. Across ranks the receives enforce it; on one rank, the order does.
  for (int s = 0; s + 1 < stages; ++s)
    for (int mb = 0; mb < m; ++mb) {
      const std::size_t here = static_cast<std::size_t>(s) * m + mb, after = here + m;
      if (forward_tick[after] <= forward_tick[here])
        return problem_at(ProblemCode::forward_before_previous_stage,
                          "a stage runs forward for a micro-batch before the previous stage has; order that F after "
                          "the previous stage's",
                          shape.rank_of_stage(s + 1), {ActionKind::forward, s + 1, mb, forward_tick[after]});
      if (backward_tick[here] <= backward_tick[after])
        return problem_at(ProblemCode::backward_before_next_stage,
                          "a stage runs backward for a micro-batch before the next stage has; order that backward "
                          "after the next stage's",
                          shape.rank_of_stage(s), {ActionKind::backward, s, mb, backward_tick[here]});
    }
  return {};
}

// Idle share of a checked table: the compute slots (ranks x ticks) in which a rank runs nothing.
// Cost model: every compute action takes one tick (F = B; for ZBV F = I = W), transfers none.
// For GPipe and 1F1B this is (p - 1) / (m + p - 1).
constexpr double bubble_fraction(const ScheduleTable& table) {
  long busy = 0;
  for (const std::vector<Action>& program : table.programs)
    busy += std::ranges::count_if(program, [](const Action& action) { return is_compute(action.kind); });
  const long slots = static_cast<long>(table.shape.ranks) * table.ticks;
  return slots == 0 ? 0.0 : static_cast<double>(slots - busy) / static_cast<double>(slots);
}

}  // namespace meshtorch::pp
