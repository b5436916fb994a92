#pragma once
// The vocabulary of pipeline schedules (namespace meshtorch::pp): the schedule kinds and their tags,
// the actions a rank runs (ActionKind, Action, in PyTorch's spelling), a schedule's shape and its
// table (with the placement of stages on ranks), and the codes of the problems a check can find.
// Data and names only, so that the generator (pipeline_generate.hpp) and the checks
// (pipeline_check.hpp) share it without depending on each other; pipeline_schedule.hpp joins them.
#include <array>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// The --schedule spelling of each kind (chapter 11, meshtorch-plan).
inline constexpr std::array<std::pair<ScheduleKind, std::string_view>, 4> schedule_flag_names{
    {{ScheduleKind::gpipe, "gpipe"},
     {ScheduleKind::one_f_one_b, "1f1b"},
     {ScheduleKind::interleaved_1f1b, "interleaved-1f1b"},
     {ScheduleKind::zero_bubble_v, "zbv"}}};

constexpr std::string_view schedule_flag(ScheduleKind kind) {
  for (const auto& [value, name] : schedule_flag_names)
    if (value == kind) return name;
  return "?";
}

constexpr std::optional<ScheduleKind> parse_schedule_flag(std::string_view name) {
  for (const auto& [value, flag] : schedule_flag_names)
    if (flag == name) return value;
  return std::nullopt;
}

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
// gather and free of a stage's weights, over the FSDP group, not the pipeline's) take no tick
// either: a table with ScheduleShape::stage_gathers has one of each per stage of a rank, around
// every compute action of that stage in the step.
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
  // Whether each rank gathers its stages' FSDP weights once a step: an UNSHARD before a stage's
  // first compute action (one compute action ahead, so the gather runs behind it) and a RESHARD
  // after its last, as PyTorch's pipelining adds them for FSDP (_add_unshard_reshard). Without,
  // FSDP gathers layer by layer at every micro-batch's forward and backward, and the table has none.
  bool stage_gathers = false;

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
  gather_missing,
  gather_repeated,
  compute_outside_gather,
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

}  // namespace meshtorch::pp
