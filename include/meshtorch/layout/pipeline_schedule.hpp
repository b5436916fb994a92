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
//
// This header holds pp::Schedule, make_schedule(), describe() and format_grid(), and includes the
// parts they join: pipeline_action.hpp (kinds, actions, tables, problem codes),
// pipeline_generate.hpp (the tables in PyTorch's orders) and pipeline_check.hpp (the rules, the
// check and its simulation, the bubble).
#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/extent.hpp>
#include <meshtorch/layout/pipeline_action.hpp>
#include <meshtorch/layout/pipeline_check.hpp>
#include <meshtorch/layout/pipeline_generate.hpp>

namespace meshtorch::pp {

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
// `stage_gathers`: FSDP inside the stages gathers each stage once a step (ScheduleShape).
inline ScheduleTable make_schedule(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches,
                                   bool stage_gathers = false) {
  const ScheduleShape shape{kind, ranks, stages_per_rank, microbatches, stage_gathers};
  if (const Problem rules = check_rules(shape)) throw ConfigError("pipeline schedule " + describe(rules, shape));
  ScheduleTable table = generate_schedule(shape);
  if (const Problem problem = check_schedule(table)) throw ConfigError("pipeline schedule " + describe(problem, shape));
  return table;
}

// For each stage, the most micro-batches whose activations it holds at once: forwards run whose
// backward (ZBV: weight gradient) has not. What the schedule costs in activation memory: GPipe's
// first stage holds every micro-batch, 1F1B's at most as many as there are stages.
constexpr std::vector<int> microbatches_in_flight(const ScheduleTable& table) {
  std::vector<int> held(static_cast<std::size_t>(table.shape.stages()), 0), most = held;
  for (const std::vector<Action>& program : table.programs)
    for (const Action& action : program) {
      auto& count = held[static_cast<std::size_t>(action.stage)];
      if (action.kind == ActionKind::forward) {
        ++count;
        most[static_cast<std::size_t>(action.stage)] = std::max(most[static_cast<std::size_t>(action.stage)], count);
      } else if (action.kind == ActionKind::backward || action.kind == ActionKind::backward_weight) {
        --count;
      }
    }
  return most;
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
  // FSDP's stage gathers take no tick: said under the grid, at the tick each is issued.
  for (int rank = 0; table.shape.stage_gathers && rank < ranks; ++rank) {
    std::string row = "rank " + std::to_string(rank) + ":";
    for (const Action& action : table.programs[rank])
      if (action.kind == ActionKind::unshard)
        row += " gathers stage " + std::to_string(action.stage) + " at tick " + std::to_string(action.tick) + ",";
      else if (action.kind == ActionKind::reshard)
        row += " frees stage " + std::to_string(action.stage) + " after tick " + std::to_string(action.tick - 1) + ",";
    row.back() = '\n';
    text += row;
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
