#pragma once
// Pipeline schedules as values. A schedule is a table: for each rank, the ordered actions it runs
// (forward, backward, or backward split into input and weight gradients, of one stage and one
// micro-batch, and the sends and receives between neighbour stages). The same constexpr code
// builds the table and proves it: every stage runs forward and backward once per micro-batch, in
// dependency order, each send has its receive, and a simulation of all ranks finishes. So
// Schedule<Kind, Ranks, StagesPerRank, MicroBatches> is checked when it compiles, and
// make_schedule() runs the same checks at start-up for extents known only then.
//
// The orders are those of torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
// ScheduleInterleaved1F1B, ScheduleZBVZeroBubble), so a table printed here reads like theirs.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/extent.hpp>

namespace meshtorch::pp {

enum class ScheduleKind : std::uint8_t { gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_v };

// Fill and drain: every micro-batch's forward, then every backward. One stage per rank.
struct GPipe {
  static constexpr ScheduleKind kind = ScheduleKind::gpipe;
};
// One forward, one backward in the steady state: at most `ranks` micro-batches in flight.
struct OneFOneB {
  static constexpr ScheduleKind kind = ScheduleKind::one_f_one_b;
};
// 1F1B over several stages per rank (rank r holds stages r, r + p, ...): a smaller bubble.
struct Interleaved1F1B {
  static constexpr ScheduleKind kind = ScheduleKind::interleaved_1f1b;
};
// Zero-bubble V: two stages per rank in a V (rank r holds r and 2p-1-r), backward split into the
// input gradient (sent on at once) and the weight gradient (run where a rank would idle).
struct ZeroBubbleV {
  static constexpr ScheduleKind kind = ScheduleKind::zero_bubble_v;
};

template <class T>
concept ScheduleKindTag = requires {
  { T::kind } -> std::convertible_to<ScheduleKind>;
};

constexpr std::string_view to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe:
      return "GPipe";
    case ScheduleKind::one_f_one_b:
      return "1F1B";
    case ScheduleKind::interleaved_1f1b:
      return "Interleaved1F1B";
    case ScheduleKind::zero_bubble_v:
      return "ZBV";
  }
  return "?";
}

// Compute actions take one tick of the table each; sends and receives take none. A send does not
// wait (an isend); a receive waits until its send has happened. Unshard and reshard (FSDP's
// gather and free of a stage's parameters) are for the run time to add; no schedule makes them yet.
enum class ActionKind : std::uint8_t {
  forward,
  backward,
  backward_input,
  backward_weight,
  send_forward,
  receive_forward,
  send_backward,
  receive_backward,
  unshard,
  reshard,
};

// PyTorch's spelling, so that "1SEND_F0" means here what it means in its schedules.
constexpr std::string_view to_string(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward:
      return "F";
    case ActionKind::backward:
      return "B";
    case ActionKind::backward_input:
      return "I";
    case ActionKind::backward_weight:
      return "W";
    case ActionKind::send_forward:
      return "SEND_F";
    case ActionKind::receive_forward:
      return "RECV_F";
    case ActionKind::send_backward:
      return "SEND_B";
    case ActionKind::receive_backward:
      return "RECV_B";
    case ActionKind::unshard:
      return "UNSHARD";
    case ActionKind::reshard:
      return "RESHARD";
  }
  return "?";
}

constexpr bool is_compute(ActionKind kind) { return kind <= ActionKind::backward_weight; }

// The backward that sends a gradient to the previous stage: the whole one, or its input part.
constexpr bool is_input_backward(ActionKind kind) {
  return kind == ActionKind::backward || kind == ActionKind::backward_input;
}

// One step of a rank. A send names the sending stage, a receive the receiving one (as PyTorch's
// do): stage s's SEND_F pairs with stage s+1's RECV_F, stage s's SEND_B with stage s-1's RECV_B.
struct Action {
  ActionKind kind = ActionKind::forward;
  int stage = 0;
  int microbatch = 0;
  // Set by check_schedule(): the tick a compute action runs at, or a send or receive happens at.
  int tick = -1;

  friend constexpr bool operator==(const Action&, const Action&) = default;
};

inline std::string to_string(const Action& action) {
  std::string text = std::to_string(action.stage);
  text += to_string(action.kind);
  if (action.kind != ActionKind::unshard && action.kind != ActionKind::reshard)
    text += std::to_string(action.microbatch);
  return text;
}

struct ScheduleShape {
  ScheduleKind kind = ScheduleKind::gpipe;
  int ranks = 1;
  int stages_per_rank = 1;
  int microbatches = 1;

  constexpr int stages() const { return ranks * stages_per_rank; }
  // Loop placement (rank r holds r, r + p, r + 2p, ...) except ZBV's V (rank r holds r and 2p-1-r).
  constexpr int rank_of_stage(int stage) const {
    if (kind == ScheduleKind::zero_bubble_v) return stage < ranks ? stage : 2 * ranks - 1 - stage;
    return stage % ranks;
  }
  // ZBV runs backward as input gradient then weight gradient; the others run it whole.
  constexpr bool splits_backward() const { return kind == ScheduleKind::zero_bubble_v; }
};

// The actions of every rank, in the order each runs them; `ticks` is the table's length in ticks
// once check_schedule() has simulated it.
struct ScheduleTable {
  ScheduleShape shape;
  std::vector<std::vector<Action>> programs;
  int ticks = 0;
};

enum class ProblemCode : std::uint8_t {
  none,
  // Rules on the shape, checked before a table is made.
  no_ranks,
  no_stages_per_rank,
  no_microbatches,
  one_stage_schedule_with_more_stages,
  one_f_one_b_too_few_microbatches,
  interleaved_one_stage_per_rank,
  interleaved_microbatches_not_multiple_of_rounds,
  zero_bubble_v_not_two_stages,
  table_too_large,
  // Problems of a table.
  wrong_rank_count,
  stage_out_of_range,
  microbatch_out_of_range,
  stage_on_wrong_rank,
  forward_missing,
  forward_repeated,
  backward_missing,
  backward_repeated,
  backward_split_mixed,
  backward_before_forward,
  weight_before_input,
  send_missing,
  receive_missing,
  transfer_repeated,
  transfer_within_rank,
  send_before_compute,
  receive_after_use,
  deadlock,
  forward_before_previous_stage,
  backward_before_next_stage,
};

// The first problem found: what is wrong and the fix (`what`), and for a table's problem the rank
// and action at fault. describe() makes the full message.
struct Problem {
  ProblemCode code = ProblemCode::none;
  std::string_view what;
  int rank = -1;
  Action action{};

  constexpr explicit operator bool() const { return code != ProblemCode::none; }
};

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

// The compute actions of one rank in the order PyTorch's schedule of that kind runs them.
constexpr std::vector<Action> compute_order(const ScheduleShape& shape, int rank) {
  const int p = shape.ranks, m = shape.microbatches;
  std::vector<Action> order;
  const auto add = [&](ActionKind kind, int stage, int microbatch) { order.push_back({kind, stage, microbatch}); };
  switch (shape.kind) {
    case ScheduleKind::gpipe:
      for (int mb = 0; mb < m; ++mb) add(ActionKind::forward, rank, mb);
      for (int mb = 0; mb < m; ++mb) add(ActionKind::backward, rank, mb);
      break;
    case ScheduleKind::one_f_one_b: {
      // Warm up with the forwards that fill the pipeline below this rank, then alternate.
      const int warmup = std::min(m, p - 1 - rank);
      int forward = 0, backward = 0;
      for (; forward < warmup; ++forward) add(ActionKind::forward, rank, forward);
      while (forward < m) {
        add(ActionKind::forward, rank, forward++);
        add(ActionKind::backward, rank, backward++);
      }
      while (backward < m) add(ActionKind::backward, rank, backward++);
      break;
    }
    case ScheduleKind::interleaved_1f1b: {
      // Micro-batches go through a rank's stages in rounds of `per_round`; forwards run in order of
      // the rank's stages, backwards in reverse, each stage taking a round before the next.
      const int v = shape.stages_per_rank;
      const int rounds = std::max(1, m / p);
      const int per_round = m / rounds;
      const int total = v * m;
      const int warmup = std::min((v - 1) * per_round + 2 * (p - 1 - rank), total);
      std::vector<int> next_forward(v, 0), next_backward(v, 0);
      const auto forward_at = [&](int op) {
        const int local = (op / per_round) % v;
        add(ActionKind::forward, local * p + rank, next_forward[local]++);
      };
      const auto backward_at = [&](int op) {
        const int local = v - 1 - ((op - warmup) / per_round) % v;
        add(ActionKind::backward, local * p + rank, next_backward[local]++);
      };
      for (int op = 0; op < warmup; ++op) forward_at(op);
      for (int op = warmup; op < total; ++op) {
        forward_at(op);
        backward_at(op);
      }
      for (int op = total; op < total + warmup; ++op) backward_at(op);
      break;
    }
    case ScheduleKind::zero_bubble_v: {
      // Written for n >= 2p - 1 micro-batches; with fewer, the actions of the missing ones are dropped.
      const int n = std::max(2 * p - 1, m);
      const int first = rank, second = 2 * p - 1 - rank;
      int f0 = 0, f1 = 0, i0 = 0, i1 = 0;
      for (int k = 0; k < 2 * (p - rank) - 1; ++k) add(ActionKind::forward, first, f0++);
      for (int k = 0; k < rank; ++k) {
        add(ActionKind::forward, second, f1++);
        add(ActionKind::forward, first, f0++);
      }
      for (int k = 0; k < p - rank; ++k) {
        add(ActionKind::forward, second, f1++);
        add(ActionKind::backward_input, second, i1);
        add(ActionKind::backward_weight, second, i1++);
      }
      while (f1 < f0 || f0 < n) {
        if (f0 < n) add(ActionKind::forward, first, f0++);
        add(ActionKind::backward_input, first, i0);
        add(ActionKind::backward_weight, first, i0++);
        add(ActionKind::forward, second, f1++);
        add(ActionKind::backward_input, second, i1);
        add(ActionKind::backward_weight, second, i1++);
      }
      int w0 = i0, w1 = i1;
      for (int k = 0; k < rank; ++k) {
        add(ActionKind::backward_input, first, i0++);
        add(ActionKind::backward_input, second, i1++);
      }
      for (int k = 0; k < p - rank; ++k) {
        add(ActionKind::backward_input, first, i0++);
        add(ActionKind::backward_weight, first, w0++);
      }
      while (w1 < i1) add(ActionKind::backward_weight, second, w1++);
      while (w0 < i0) add(ActionKind::backward_weight, first, w0++);
      std::erase_if(order, [m](const Action& action) { return action.microbatch >= m; });
      break;
    }
  }
  return order;
}

// Each compute action with the receive it waits for before it and the send it makes after it,
// where the neighbour stage lives on another rank.
constexpr std::vector<Action> with_transfers(const ScheduleShape& shape, const std::vector<Action>& compute) {
  const int last = shape.stages() - 1;
  std::vector<Action> program;
  program.reserve(compute.size() * 3);
  for (const Action& action : compute) {
    const int s = action.stage, rank = shape.rank_of_stage(s);
    const bool forward = action.kind == ActionKind::forward;
    const bool input_backward = is_input_backward(action.kind);
    if (forward && s > 0 && shape.rank_of_stage(s - 1) != rank)
      program.push_back({ActionKind::receive_forward, s, action.microbatch});
    if (input_backward && s < last && shape.rank_of_stage(s + 1) != rank)
      program.push_back({ActionKind::receive_backward, s, action.microbatch});
    program.push_back(action);
    if (forward && s < last && shape.rank_of_stage(s + 1) != rank)
      program.push_back({ActionKind::send_forward, s, action.microbatch});
    if (input_backward && s > 0 && shape.rank_of_stage(s - 1) != rank)
      program.push_back({ActionKind::send_backward, s, action.microbatch});
  }
  return program;
}

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

// The table of a shape that passes check_rules(), without ticks (check_schedule() sets them).
constexpr ScheduleTable generate_schedule(const ScheduleShape& shape) {
  ScheduleTable table{shape, {}, 0};
  for (int rank = 0; rank < shape.ranks; ++rank)
    table.programs.push_back(detail::with_transfers(shape, detail::compute_order(shape, rank)));
  return table;
}

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

// "Interleaved1F1B over 4 ranks x 2 stages per rank, 8 micro-batches: <what> (rank 1, tick 3: 1F2)".
inline std::string describe(const Problem& problem, const ScheduleShape& shape) {
  std::string text = std::string(to_string(shape.kind)) + " over " + std::to_string(shape.ranks) + " ranks x " +
                     std::to_string(shape.stages_per_rank) + " stages per rank, " + std::to_string(shape.microbatches) +
                     " micro-batches: " + std::string(problem.what);
  if (problem.code == ProblemCode::one_f_one_b_too_few_microbatches)
    text += " (" + std::to_string(shape.stages()) + " stages need --microbatches " + std::to_string(shape.stages()) +
            " or more)";
  if (problem.rank >= 0) {
    text += " (rank " + std::to_string(problem.rank);
    if (problem.action.tick >= 0) text += ", tick " + std::to_string(problem.action.tick);
    text += ": " + to_string(problem.action) + ")";
  }
  return text;
}

// The checked table of a schedule whose extents come at start-up (flags): throws ConfigError naming
// the flag to change. Takes milliseconds for the sizes training uses.
inline ScheduleTable make_schedule(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches) {
  const ScheduleShape shape{kind, ranks, stages_per_rank, microbatches};
  if (const Problem rules = check_rules(shape)) throw ConfigError("pipeline schedule " + describe(rules, shape));
  ScheduleTable table = generate_schedule(shape);
  if (const Problem problem = check_schedule(table)) throw ConfigError("pipeline schedule " + describe(problem, shape));
  return table;
}

// The grid of a checked table, a row per rank and a column per tick, like PyTorch's
// _format_pipeline_order turned on its side: "0F1" is stage 0's forward of micro-batch 1; "." idles.
inline std::string format_grid(const ScheduleTable& table) {
  const int ranks = table.shape.ranks, ticks = table.ticks;
  std::vector<std::string> cells(static_cast<std::size_t>(ranks) * ticks, ".");
  std::size_t width = std::to_string(ticks > 0 ? ticks - 1 : 0).size();
  for (int rank = 0; rank < ranks; ++rank)
    for (const Action& action : table.programs[rank])
      if (is_compute(action.kind) && action.tick >= 0 && action.tick < ticks) {
        std::string& cell = cells[static_cast<std::size_t>(rank) * ticks + action.tick];
        cell = to_string(action);
        width = std::max(width, cell.size());
      }
  const std::string label_pad(std::string("rank ").size() + std::to_string(ranks - 1).size(), ' ');
  const auto padded = [width](const std::string& text) { return text + std::string(width - text.size(), ' '); };
  std::string text = label_pad;
  for (int tick = 0; tick < ticks; ++tick) text += ' ' + padded(std::to_string(tick));
  while (!text.empty() && text.back() == ' ') text.pop_back();
  text += '\n';
  for (int rank = 0; rank < ranks; ++rank) {
    std::string row = "rank " + std::to_string(rank);
    row.resize(label_pad.size(), ' ');
    for (int tick = 0; tick < ticks; ++tick) row += ' ' + padded(cells[static_cast<std::size_t>(rank) * ticks + tick]);
    while (!row.empty() && row.back() == ' ') row.pop_back();
    text += row + '\n';
  }
  return text;
}

namespace detail {

constexpr std::size_t action_count(const ScheduleShape& shape) {
  if (check_rules(shape)) return 0;
  std::size_t count = 0;
  for (const std::vector<Action>& program : generate_schedule(shape).programs) count += program.size();
  return count;
}

// A checked table in arrays, so that it can be a compile-time value: the programs one after the
// other, rank r's from begin[r] to begin[r + 1].
template <std::size_t Actions, std::size_t Ranks>
struct StaticTable {
  std::array<Action, Actions> actions{};
  std::array<int, Ranks + 1> begin{};
  int ticks = 0;
  double bubble_fraction = 0;
  Problem problem{};
};

template <std::size_t Actions, std::size_t Ranks>
constexpr StaticTable<Actions, Ranks> build_static(const ScheduleShape& shape) {
  StaticTable<Actions, Ranks> built;
  if (const Problem rules = check_rules(shape)) {
    built.problem = rules;
    return built;
  }
  ScheduleTable table = generate_schedule(shape);
  built.problem = check_schedule(table);
  built.ticks = table.ticks;
  built.bubble_fraction = bubble_fraction(table);
  std::size_t next = 0;
  for (std::size_t rank = 0; rank < Ranks; ++rank) {
    built.begin[rank] = static_cast<int>(next);
    for (const Action& action : table.programs[rank]) built.actions[next++] = action;
  }
  built.begin[Ranks] = static_cast<int>(next);
  return built;
}

}  // namespace detail

// A schedule with static extents: its table is built and checked when the program compiles.
//   using S = pp::Schedule<pp::Interleaved1F1B, /*ranks*/ 4, /*stages per rank*/ 2, /*micro-batches*/ 8>;
//   static_assert(S::valid);
// For extents known only at start-up, make_schedule() runs the same code.
template <ScheduleKindTag Kind, std::size_t Ranks, std::size_t StagesPerRank, std::size_t MicroBatches>
requires(Ranks != dynamic && StagesPerRank != dynamic && MicroBatches != dynamic) struct Schedule {
  static constexpr ScheduleShape shape{Kind::kind, static_cast<int>(Ranks), static_cast<int>(StagesPerRank),
                                       static_cast<int>(MicroBatches)};

 private:
  static constexpr ProblemCode rule = check_rules(shape).code;
  static_assert(rule != ProblemCode::no_ranks, "pipeline schedule with 0 ranks; give Ranks (--pp) 1 or more");
  static_assert(rule != ProblemCode::no_stages_per_rank,
                "pipeline schedule with 0 stages per rank; give StagesPerRank (--stages-per-rank) 1 or more");
  static_assert(rule != ProblemCode::no_microbatches,
                "pipeline schedule with 0 micro-batches; give MicroBatches (--microbatches) 1 or more");
  static_assert(rule != ProblemCode::one_stage_schedule_with_more_stages,
                "GPipe and 1F1B run one stage per rank; set StagesPerRank (--stages-per-rank) to 1, or use "
                "pp::Interleaved1F1B for more");
  static_assert(rule != ProblemCode::one_f_one_b_too_few_microbatches,
                "1F1B needs at least as many micro-batches as stages; raise MicroBatches (--microbatches) to Ranks "
                "(--pp) or more, or use pp::GPipe");
  static_assert(rule != ProblemCode::interleaved_one_stage_per_rank,
                "Interleaved1F1B needs at least 2 stages per rank; raise StagesPerRank (--stages-per-rank) to 2, or "
                "use pp::OneFOneB for one stage per rank");
  static_assert(rule != ProblemCode::interleaved_microbatches_not_multiple_of_rounds,
                "Interleaved1F1B runs the micro-batches in rounds of max(1, MicroBatches / Ranks) and needs them to "
                "divide evenly; set MicroBatches (--microbatches) to a multiple of Ranks (--pp), or to fewer than "
                "twice Ranks");
  static_assert(rule != ProblemCode::zero_bubble_v_not_two_stages,
                "ZBV runs exactly 2 stages per rank; set StagesPerRank (--stages-per-rank) to 2");
  static_assert(rule != ProblemCode::table_too_large,
                "the schedule's table would pass two million actions; lower MicroBatches or Ranks");

  static constexpr auto built = detail::build_static<detail::action_count(shape), Ranks>(shape);
  static_assert(rule != ProblemCode::none || !built.problem,
                "the pipeline schedule fails its check (an action missing or out of order, a send without its "
                "receive, or a deadlock in the simulation of every rank); make_schedule() with the same arguments "
                "names the rank and the action");

 public:
  static constexpr Problem problem = built.problem;
  static constexpr bool valid = !problem;
  // Length of the table in ticks (one per compute action; see bubble_fraction()).
  static constexpr int ticks = built.ticks;
  static constexpr double bubble_fraction = built.bubble_fraction;

  // Rank r's actions in order, with their ticks.
  static constexpr std::span<const Action> program(int rank) {
    return std::span<const Action>(built.actions).subspan(built.begin[rank], built.begin[rank + 1] - built.begin[rank]);
  }

  // The same table as make_schedule() gives, for format_grid() and the run time.
  static ScheduleTable table() {
    ScheduleTable copy{shape, {}, ticks};
    for (int rank = 0; rank < shape.ranks; ++rank) {
      const std::span<const Action> actions = program(rank);
      copy.programs.emplace_back(actions.begin(), actions.end());
    }
    return copy;
  }
};

}  // namespace meshtorch::pp
