#pragma once
// The generator of pipeline schedule tables: each rank's compute actions in the order PyTorch's
// schedule of that kind runs them (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
// ScheduleZBVZeroBubble), with the sends and receives between ranks around them. It trusts its
// shape to pass check_rules() and proves nothing; pipeline_check.hpp checks what it makes.
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <meshtorch/layout/pipeline_action.hpp>

namespace meshtorch::pp {

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

// A rank's program with an UNSHARD of each of its stages before the compute action that runs just
// before the stage's first (with the receives that action waits for), so that the gather is on the
// wire while that action computes, and a RESHARD right after the stage's last compute action.
constexpr std::vector<Action> with_stage_gathers(const ScheduleShape& shape, int rank,
                                                 const std::vector<Action>& program) {
  const int count = static_cast<int>(program.size());
  std::vector<std::vector<Action>> before(program.size()), after(program.size());
  for (int stage = 0; stage < shape.stages(); ++stage) {
    if (shape.rank_of_stage(stage) != rank) continue;
    int first = -1, last = -1;
    for (int i = 0; i < count; ++i)
      if (is_compute(program[i].kind) && program[i].stage == stage) {
        if (first < 0) first = i;
        last = i;
      }
    if (first < 0) continue;  // a stage with no action has nothing to gather
    int at = 0;
    for (int i = first - 1; i >= 0; --i)
      if (is_compute(program[i].kind)) {
        at = i;
        while (at > 0 && (program[at - 1].kind == ActionKind::receive_forward ||
                          program[at - 1].kind == ActionKind::receive_backward))
          --at;
        break;
      }
    before[at].push_back({ActionKind::unshard, stage, 0});
    after[last].push_back({ActionKind::reshard, stage, 0});
  }
  std::vector<Action> out;
  out.reserve(program.size() + 2 * static_cast<std::size_t>(shape.stages_per_rank));
  for (int i = 0; i < count; ++i) {
    for (const Action& action : before[i]) out.push_back(action);
    out.push_back(program[i]);
    for (const Action& action : after[i]) out.push_back(action);
  }
  return out;
}

}  // namespace detail

// The table of a shape that passes check_rules(), without ticks (check_schedule() sets them).
constexpr ScheduleTable generate_schedule(const ScheduleShape& shape) {
  ScheduleTable table{shape, {}, 0};
  for (int rank = 0; rank < shape.ranks; ++rank) {
    auto program = detail::with_transfers(shape, detail::compute_order(shape, rank));
    if (shape.stage_gathers) program = detail::with_stage_gathers(shape, rank, program);
    table.programs.push_back(std::move(program));
  }
  return table;
}

}  // namespace meshtorch::pp
