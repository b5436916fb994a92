// Pipeline schedules: the tables of every kind pass their checks at compile time, their bubbles
// are the known ones, two small tables equal ones written out by hand, a hand-edited table names
// its problem, and the start-up form names the flag to change.
#include <array>
#include <chrono>
#include <cstdio>
#include <ranges>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <meshtorch/layout/layout.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/models/llama/plan.hpp>

using namespace meshtorch;
using pp::Action;
using pp::ActionKind;
using pp::ScheduleKind;

namespace {

// PP is an axis like the others: it composes with DP, FSDP and TP in one mesh.
using PipelineMesh = Mesh<DP<2>, FSDP<2>, PP<4>, TP<2>>;
static_assert(PipelineMesh::size == 32 && PipelineMesh::index_of<PP> == 2);
static_assert(PipelineMesh::name == "Mesh<DP<2>, FSDP<2>, PP<4>, TP<2>>");
static_assert(MeshShape<PipelineMesh>{}.slice_ranks<PP>(1) == std::vector{1, 3, 5, 7});
static_assert(Mesh<PP<dynamic>, TP<2>>::dynamic_count == 1);
// parallelize builds every axis of it inside the stages, and of the five-axis mesh.
static_assert(llama::check_pipeline_parallelizable<PipelineMesh>());
static_assert(llama::check_pipeline_parallelizable<Mesh<DP<2>, FSDP<2>, PP<2>, CP<2>, TP<2>>>());

// The spelling of the issue and the design.
using S = pp::Schedule<pp::Interleaved1F1B, /*ranks*/ 4, /*stages per rank*/ 2, /*micro-batches*/ 8>;
static_assert(S::valid);
constexpr double bubble = S::bubble_fraction;

// Every kind, at several sizes, including PyTorch's edge cases: fewer micro-batches than ranks for
// GPipe, interleaved and ZBV; 1F1B with exactly as many as stages; interleaved rounds of 1 and 2.
static_assert(pp::Schedule<pp::GPipe, 1, 1, 1>::valid);
static_assert(pp::Schedule<pp::GPipe, 2, 1, 4>::valid);
static_assert(pp::Schedule<pp::GPipe, 4, 1, 8>::valid);
static_assert(pp::Schedule<pp::GPipe, 8, 1, 3>::valid);
static_assert(pp::Schedule<pp::OneFOneB, 1, 1, 1>::valid);
static_assert(pp::Schedule<pp::OneFOneB, 2, 1, 2>::valid);
static_assert(pp::Schedule<pp::OneFOneB, 4, 1, 4>::valid);
static_assert(pp::Schedule<pp::OneFOneB, 4, 1, 9>::valid);
static_assert(pp::Schedule<pp::OneFOneB, 8, 1, 32>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 1, 2, 1>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 2, 2, 4>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 2, 4, 1>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 4, 2, 3>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 4, 2, 6>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 4, 2, 10>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 4, 3, 12>::valid);
static_assert(pp::Schedule<pp::Interleaved1F1B, 8, 2, 32>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 1, 2, 1>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 2, 2, 1>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 2, 2, 4>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 4, 2, 3>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 4, 2, 8>::valid);
static_assert(pp::Schedule<pp::ZeroBubbleV, 8, 2, 32>::valid);

// GPipe and 1F1B idle (p - 1) / (m + p - 1) of the table, exactly: both sides are the same ratio
// of integers, rounded once.
template <class Kind, int P, int M>
constexpr bool has_textbook_bubble = pp::Schedule<Kind, P, 1, M>::bubble_fraction == double(P - 1) / (M + P - 1);
static_assert(has_textbook_bubble<pp::GPipe, 1, 1>);
static_assert(has_textbook_bubble<pp::GPipe, 2, 4>);
static_assert(has_textbook_bubble<pp::GPipe, 4, 8>);
static_assert(has_textbook_bubble<pp::GPipe, 8, 3>);
static_assert(has_textbook_bubble<pp::GPipe, 8, 32>);
static_assert(has_textbook_bubble<pp::OneFOneB, 2, 4>);
static_assert(has_textbook_bubble<pp::OneFOneB, 4, 4>);
static_assert(has_textbook_bubble<pp::OneFOneB, 4, 8>);
static_assert(has_textbook_bubble<pp::OneFOneB, 4, 9>);
static_assert(has_textbook_bubble<pp::OneFOneB, 8, 32>);

// Interleaved 1F1B with m a multiple of p idles (p - 1) / (v m + p - 1): v times the work per rank,
// the same ramp.
template <int P, int V, int M>
constexpr bool has_interleaved_bubble = pp::Schedule<pp::Interleaved1F1B, P, V, M>::bubble_fraction ==
                                        double(P - 1) / (V * M + P - 1);
static_assert(has_interleaved_bubble<2, 2, 4>);
static_assert(has_interleaved_bubble<4, 2, 8>);
static_assert(has_interleaved_bubble<4, 3, 12>);
static_assert(has_interleaved_bubble<8, 2, 32>);

// Interleaving shrinks the bubble; ZBV's weight gradients fill most of what is left.
static_assert(bubble < pp::Schedule<pp::OneFOneB, 4, 1, 8>::bubble_fraction);
static_assert(pp::Schedule<pp::Interleaved1F1B, 8, 2, 32>::bubble_fraction <
              pp::Schedule<pp::OneFOneB, 8, 1, 32>::bubble_fraction);
static_assert(pp::Schedule<pp::ZeroBubbleV, 4, 2, 8>::bubble_fraction < bubble);

constexpr Action act(ActionKind kind, int stage, int microbatch, int tick) { return {kind, stage, microbatch, tick}; }
constexpr ActionKind F = ActionKind::forward, B = ActionKind::backward, SEND_F = ActionKind::send_forward,
                     RECV_F = ActionKind::receive_forward, SEND_B = ActionKind::send_backward,
                     RECV_B = ActionKind::receive_backward;

// GPipe on 2 ranks, 4 micro-batches: rank 1's backwards start once its last forward is done, and
// each of rank 0's waits for the gradient rank 1 sends a tick before.
constexpr std::array gpipe_rank0{
    act(F, 0, 0, 0),      act(SEND_F, 0, 0, 1), act(F, 0, 1, 1),      act(SEND_F, 0, 1, 2),
    act(F, 0, 2, 2),      act(SEND_F, 0, 2, 3), act(F, 0, 3, 3),      act(SEND_F, 0, 3, 4),
    act(RECV_B, 0, 0, 6), act(B, 0, 0, 6),      act(RECV_B, 0, 1, 7), act(B, 0, 1, 7),
    act(RECV_B, 0, 2, 8), act(B, 0, 2, 8),      act(RECV_B, 0, 3, 9), act(B, 0, 3, 9),
};
constexpr std::array gpipe_rank1{
    act(RECV_F, 1, 0, 1), act(F, 1, 0, 1),      act(RECV_F, 1, 1, 2), act(F, 1, 1, 2),
    act(RECV_F, 1, 2, 3), act(F, 1, 2, 3),      act(RECV_F, 1, 3, 4), act(F, 1, 3, 4),
    act(B, 1, 0, 5),      act(SEND_B, 1, 0, 6), act(B, 1, 1, 6),      act(SEND_B, 1, 1, 7),
    act(B, 1, 2, 7),      act(SEND_B, 1, 2, 8), act(B, 1, 3, 8),      act(SEND_B, 1, 3, 9),
};

// 1F1B on 2 ranks, 4 micro-batches: rank 0 warms up with one forward, then each rank alternates.
constexpr std::array one_f_one_b_rank0{
    act(F, 0, 0, 0),      act(SEND_F, 0, 0, 1), act(F, 0, 1, 1),      act(SEND_F, 0, 1, 2),
    act(RECV_B, 0, 0, 3), act(B, 0, 0, 3),      act(F, 0, 2, 4),      act(SEND_F, 0, 2, 5),
    act(RECV_B, 0, 1, 5), act(B, 0, 1, 5),      act(F, 0, 3, 6),      act(SEND_F, 0, 3, 7),
    act(RECV_B, 0, 2, 7), act(B, 0, 2, 7),      act(RECV_B, 0, 3, 9), act(B, 0, 3, 9),
};
constexpr std::array one_f_one_b_rank1{
    act(RECV_F, 1, 0, 1), act(F, 1, 0, 1), act(B, 1, 0, 2), act(SEND_B, 1, 0, 3),
    act(RECV_F, 1, 1, 3), act(F, 1, 1, 3), act(B, 1, 1, 4), act(SEND_B, 1, 1, 5),
    act(RECV_F, 1, 2, 5), act(F, 1, 2, 5), act(B, 1, 2, 6), act(SEND_B, 1, 2, 7),
    act(RECV_F, 1, 3, 7), act(F, 1, 3, 7), act(B, 1, 3, 8), act(SEND_B, 1, 3, 9),
};

template <class Schedule, std::size_t N>
constexpr bool program_is(int rank, const std::array<Action, N>& expected) {
  const auto program = Schedule::program(rank);
  return program.size() == N && std::equal(program.begin(), program.end(), expected.begin());
}
using GPipe2x4 = pp::Schedule<pp::GPipe, 2, 1, 4>;
using OneFOneB2x4 = pp::Schedule<pp::OneFOneB, 2, 1, 4>;
static_assert(GPipe2x4::ticks == 10 && OneFOneB2x4::ticks == 10);
static_assert(program_is<GPipe2x4>(0, gpipe_rank0) && program_is<GPipe2x4>(1, gpipe_rank1));
static_assert(program_is<OneFOneB2x4>(0, one_f_one_b_rank0) && program_is<OneFOneB2x4>(1, one_f_one_b_rank1));

std::string program_text(const std::vector<Action>& program) {
  std::string text;
  for (const Action& action : program) text += pp::to_string(action) + "@" + std::to_string(action.tick) + " ";
  return text;
}

// The error message of make_schedule(), or "" when it succeeds.
std::string schedule_error(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches) {
  try {
    pp::make_schedule(kind, ranks, stages_per_rank, microbatches);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("pipeline schedules: the tables of GPipe and 1F1B on 2 ranks equal the hand-written ones") {
  const pp::ScheduleTable gpipe = GPipe2x4::table();
  INFO("GPipe rank 0: " << program_text(gpipe.programs[0]));
  INFO("GPipe rank 1: " << program_text(gpipe.programs[1]));
  CHECK(gpipe.programs[0] == std::vector<Action>(gpipe_rank0.begin(), gpipe_rank0.end()));
  CHECK(gpipe.programs[1] == std::vector<Action>(gpipe_rank1.begin(), gpipe_rank1.end()));
  const pp::ScheduleTable one_f_one_b = OneFOneB2x4::table();
  INFO("1F1B rank 0: " << program_text(one_f_one_b.programs[0]));
  INFO("1F1B rank 1: " << program_text(one_f_one_b.programs[1]));
  CHECK(one_f_one_b.programs[0] == std::vector<Action>(one_f_one_b_rank0.begin(), one_f_one_b_rank0.end()));
  CHECK(one_f_one_b.programs[1] == std::vector<Action>(one_f_one_b_rank1.begin(), one_f_one_b_rank1.end()));
}

TEST_CASE("pipeline schedules: make_schedule gives the compile-time table and bubble") {
  const pp::ScheduleTable table = pp::make_schedule(ScheduleKind::interleaved_1f1b, 4, 2, 8);
  CHECK(table.ticks == S::ticks);
  CHECK(pp::bubble_fraction(table) == S::bubble_fraction);
  CHECK(table.programs == S::table().programs);
  // ZBV on 4 ranks, 8 micro-batches: 8 stages x 8 micro-batches x (F, I, W) in 4 ranks x 51 ticks.
  using Zbv = pp::Schedule<pp::ZeroBubbleV, 4, 2, 8>;
  CHECK(Zbv::ticks == 51);
  CHECK(Zbv::bubble_fraction == double(4 * 51 - 8 * 8 * 3) / (4 * 51));
}

TEST_CASE("pipeline schedules: the grid shows ranks by ticks like PyTorch's pipeline order") {
  CHECK(pp::format_grid(GPipe2x4::table()) ==
        "       0   1   2   3   4   5   6   7   8   9\n"
        "rank 0 0F0 0F1 0F2 0F3 .   .   0B0 0B1 0B2 0B3\n"
        "rank 1 .   1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 .\n");
}

TEST_CASE("pipeline schedules: the start-up form names the flag to change") {
  using Catch::Matchers::Contains;
  CHECK_THAT(schedule_error(ScheduleKind::one_f_one_b, 4, 1, 2),
             Contains("1F1B needs at least as many micro-batches as stages; raise --microbatches") &&
                 Contains("4 stages need --microbatches 4 or more"));
  CHECK_THAT(schedule_error(ScheduleKind::zero_bubble_v, 4, 3, 8),
             Contains("ZBV runs exactly 2 stages per rank; set --stages-per-rank 2"));
  CHECK_THAT(schedule_error(ScheduleKind::interleaved_1f1b, 4, 1, 8),
             Contains("Interleaved1F1B needs at least 2 stages per rank; raise --stages-per-rank to 2"));
  CHECK_THAT(schedule_error(ScheduleKind::interleaved_1f1b, 4, 2, 9),
             Contains("set --microbatches to a multiple of --pp"));
  CHECK_THAT(schedule_error(ScheduleKind::gpipe, 4, 1, 0), Contains("set --microbatches to 1 or more"));
  CHECK_THAT(schedule_error(ScheduleKind::gpipe, 0, 1, 4), Contains("set --pp to 1 or more"));
  CHECK_THAT(schedule_error(ScheduleKind::gpipe, 4, 2, 4), Contains("set --stages-per-rank 1"));
  CHECK(schedule_error(ScheduleKind::interleaved_1f1b, 4, 2, 6).empty());  // one round of 6 micro-batches
}

TEST_CASE("pipeline schedules: a large schedule is built and checked at start-up in well under a second") {
  const auto start = std::chrono::steady_clock::now();
  const pp::ScheduleTable table = pp::make_schedule(ScheduleKind::interleaved_1f1b, 64, 4, 256);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("64 ranks x 4 stages x 256 micro-batches took " << seconds << " s");
  CHECK(seconds < 0.5);
  CHECK(pp::bubble_fraction(table) < 0.2);
}

TEST_CASE("pipeline schedules: a hand-edited table names its problem") {
  pp::ScheduleTable table = OneFOneB2x4::table();
  REQUIRE_FALSE(pp::check_schedule(table));

  SECTION("a receive moved before the send that its peer waits for deadlocks the simulation") {
    // Rank 0 now waits for micro-batch 0's gradient before sending micro-batch 0's activation,
    // which rank 1 waits for to compute that gradient.
    std::vector<Action>& rank0 = table.programs[0];
    const auto send = std::ranges::find(rank0, Action{SEND_F, 0, 0, 1});
    const auto receive = std::ranges::find(rank0, Action{RECV_B, 0, 0, 3});
    REQUIRE((send != rank0.end() && receive != rank0.end()));
    std::iter_swap(send, receive);
    const pp::Problem problem = pp::check_schedule(table);
    CHECK(problem.code == pp::ProblemCode::deadlock);
    CHECK_THAT(pp::describe(problem, table.shape), Catch::Matchers::Contains("the schedule deadlocks") &&
                                                       Catch::Matchers::Contains("(rank 0, tick 1: 0RECV_B0)"));
  }
  SECTION("a dropped backward is named with its stage and micro-batch") {
    std::erase(table.programs[1], Action{B, 1, 2, 6});
    const pp::Problem problem = pp::check_schedule(table);
    CHECK(problem.code == pp::ProblemCode::backward_missing);
    CHECK(problem.action.stage == 1);
    CHECK(problem.action.microbatch == 2);
    CHECK_THAT(pp::describe(problem, table.shape),
               Catch::Matchers::Contains("never runs backward for a micro-batch; add its B action") &&
                   Catch::Matchers::Contains("rank 1: 1B2"));
  }
  SECTION("a dropped receive leaves its send unmatched") {
    std::erase(table.programs[1], Action{RECV_F, 1, 3, 7});
    const pp::Problem problem = pp::check_schedule(table);
    CHECK(problem.code == pp::ProblemCode::receive_missing);
    CHECK(problem.rank == 1);
  }
  SECTION("a receive into the first stage, which has no previous one, is refused") {
    table.programs[0].insert(table.programs[0].begin(), Action{RECV_F, 0, 0});
    CHECK(pp::check_schedule(table).code == pp::ProblemCode::transfer_within_rank);
  }
  SECTION("a stage moved to another rank is refused") {
    table.programs[0][0].stage = 1;
    CHECK(pp::check_schedule(table).code == pp::ProblemCode::stage_on_wrong_rank);
  }
  SECTION("a weight gradient before its input gradient is refused") {
    pp::ScheduleTable zbv = pp::Schedule<pp::ZeroBubbleV, 2, 2, 4>::table();
    std::vector<Action>& rank0 = zbv.programs[0];
    const auto input =
        std::ranges::find_if(rank0, [](const Action& a) { return a.kind == ActionKind::backward_input; });
    REQUIRE(input != rank0.end());
    const auto weight =
        std::ranges::find(rank0, Action{ActionKind::backward_weight, input->stage, input->microbatch, input->tick + 1});
    REQUIRE(weight != rank0.end());
    std::iter_swap(input, weight);
    CHECK(pp::check_schedule(zbv).code == pp::ProblemCode::weight_before_input);
  }
}

namespace {

// Every stage of every rank gathered once before its first compute action and freed once after
// its last; the gathers take no tick, so the table keeps its ticks.
constexpr bool gathers_each_stage_once(pp::ScheduleKind kind, int ranks, int stages_per_rank, int microbatches) {
  pp::ScheduleShape shape{kind, ranks, stages_per_rank, microbatches};
  pp::ScheduleTable plain = pp::generate_schedule(shape);
  shape.stage_gathers = true;
  pp::ScheduleTable gathered = pp::generate_schedule(shape);
  if (pp::check_schedule(plain) || pp::check_schedule(gathered) || gathered.ticks != plain.ticks) return false;
  for (int rank = 0; rank < ranks; ++rank) {
    const auto& program = gathered.programs[static_cast<std::size_t>(rank)];
    int unshards = 0, reshards = 0;
    for (const Action& action : program) {
      unshards += action.kind == ActionKind::unshard;
      reshards += action.kind == ActionKind::reshard;
    }
    if (unshards != stages_per_rank || reshards != stages_per_rank ||
        program.size() != plain.programs[static_cast<std::size_t>(rank)].size() + 2 * stages_per_rank)
      return false;
  }
  return true;
}
static_assert(gathers_each_stage_once(ScheduleKind::gpipe, 2, 1, 4));
static_assert(gathers_each_stage_once(ScheduleKind::one_f_one_b, 4, 1, 8));
static_assert(gathers_each_stage_once(ScheduleKind::interleaved_1f1b, 4, 2, 8));
static_assert(gathers_each_stage_once(ScheduleKind::zero_bubble_v, 4, 2, 8));
static_assert(gathers_each_stage_once(ScheduleKind::one_f_one_b, 1, 1, 1));

}  // namespace

TEST_CASE("pipeline schedules: FSDP's stage gathers sit one compute action ahead and after the last") {
  // 1F1B on 2 ranks, 4 micro-batches: rank 0 gathers stage 0 first thing, rank 1 before its first
  // receive; each frees its stage after its last backward.
  const pp::ScheduleTable table = pp::make_schedule(ScheduleKind::one_f_one_b, 2, 1, 4, /*stage_gathers=*/true);
  const auto actions = [](const std::vector<Action>& program) {
    std::string text;
    for (const Action& action : program) text += (text.empty() ? "" : " ") + pp::to_string(action);
    return text;
  };
  INFO(actions(table.programs[0]) << "\n" << actions(table.programs[1]));
  CHECK(actions(table.programs[0]).starts_with("0UNSHARD 0F0 0SEND_F0"));
  CHECK(actions(table.programs[0]).ends_with("0RECV_B3 0B3 0RESHARD"));
  CHECK(actions(table.programs[1]).starts_with("1UNSHARD 1RECV_F0 1F0"));
  CHECK(actions(table.programs[1]).ends_with("1B3 1RESHARD 1SEND_B3"));
  const int last_tick = std::ranges::max(table.programs[0] | std::views::transform(&Action::tick));
  CHECK_THAT(pp::format_grid(table),
             Catch::Matchers::Contains("rank 0: gathers stage 0 at tick 0, frees stage 0 after tick " +
                                       std::to_string(last_tick - 1) + "\n"));
  // Interleaved: a rank's second stage is gathered while its first computes.
  const pp::ScheduleTable interleaved = pp::make_schedule(ScheduleKind::interleaved_1f1b, 2, 2, 4, true);
  const auto& rank0 = interleaved.programs[0];
  const auto second =
      std::ranges::find_if(rank0, [](const Action& a) { return a.kind == ActionKind::unshard && a.stage == 2; });
  REQUIRE(second != rank0.end());
  const auto first_use =
      std::ranges::find_if(rank0, [](const Action& a) { return pp::is_compute(a.kind) && a.stage == 2; });
  CHECK(second < first_use);
  CHECK(std::ranges::count_if(second, first_use, [](const Action& a) { return pp::is_compute(a.kind); }) == 1);
}

TEST_CASE("pipeline schedules: a hand-edited table's stage gathers name their problem") {
  pp::ScheduleTable table = pp::make_schedule(ScheduleKind::one_f_one_b, 2, 1, 4, /*stage_gathers=*/true);
  std::vector<Action>& rank1 = table.programs[1];
  const auto unshard = std::ranges::find_if(rank1, [](const Action& a) { return a.kind == ActionKind::unshard; });
  const auto reshard = std::ranges::find_if(rank1, [](const Action& a) { return a.kind == ActionKind::reshard; });
  REQUIRE((unshard != rank1.end() && reshard != rank1.end()));
  SECTION("a RESHARD before the stage's last backward") {
    std::iter_swap(reshard, reshard - 1);  // 1F3 1RESHARD 1B3
    const pp::Problem problem = pp::check_schedule(table);
    CHECK(problem.code == pp::ProblemCode::compute_outside_gather);
    CHECK_THAT(pp::describe(problem, table.shape), Catch::Matchers::Contains("move the UNSHARD before its first"));
  }
  SECTION("a dropped UNSHARD") {
    rank1.erase(unshard);
    CHECK(pp::check_schedule(table).code == pp::ProblemCode::gather_missing);
  }
  SECTION("an UNSHARD twice") {
    rank1.insert(reshard, Action{ActionKind::unshard, 1, 0});
    CHECK(pp::check_schedule(table).code == pp::ProblemCode::gather_repeated);
  }
  SECTION("an UNSHARD of another rank's stage") {
    unshard->stage = 0;
    CHECK(pp::check_schedule(table).code == pp::ProblemCode::stage_on_wrong_rank);
  }
  SECTION("an UNSHARD in a table that gathers layer by layer") {
    pp::ScheduleTable plain = pp::make_schedule(ScheduleKind::one_f_one_b, 2, 1, 4);
    plain.programs[0].insert(plain.programs[0].begin(), Action{ActionKind::unshard, 0, 0});
    CHECK(pp::check_schedule(plain).code == pp::ProblemCode::gather_repeated);
  }
}

// Prints the grids of docs/pipeline.md: layout_tests "[.grids]".
TEST_CASE("pipeline schedules: print the grids of the documentation", "[.grids]") {
  const auto print = [](const char* title, const pp::ScheduleTable& table) {
    std::printf("%s: %d ticks, bubble %.3f\n%s\n", title, table.ticks, pp::bubble_fraction(table),
                pp::format_grid(table).c_str());
  };
  print("GPipe, 2 ranks, 4 micro-batches", pp::make_schedule(ScheduleKind::gpipe, 2, 1, 4));
  print("1F1B, 2 ranks, 4 micro-batches", pp::make_schedule(ScheduleKind::one_f_one_b, 2, 1, 4));
  print("Interleaved1F1B, 2 ranks x 2 stages, 4 micro-batches",
        pp::make_schedule(ScheduleKind::interleaved_1f1b, 2, 2, 4));
  print("ZBV, 2 ranks x 2 stages, 4 micro-batches", pp::make_schedule(ScheduleKind::zero_bubble_v, 2, 2, 4));
  for (const int ranks : {2, 4, 8})
    for (const int microbatches : {ranks, 2 * ranks, 4 * ranks})
      std::printf("| %d | %d | %.3f | %.3f | %.3f | %.3f |\n", ranks, microbatches,
                  pp::bubble_fraction(pp::make_schedule(ScheduleKind::gpipe, ranks, 1, microbatches)),
                  pp::bubble_fraction(pp::make_schedule(ScheduleKind::one_f_one_b, ranks, 1, microbatches)),
                  pp::bubble_fraction(pp::make_schedule(ScheduleKind::interleaved_1f1b, ranks, 2, microbatches)),
                  pp::bubble_fraction(pp::make_schedule(ScheduleKind::zero_bubble_v, ranks, 2, microbatches)));
}
