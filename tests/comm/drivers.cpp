// Multi-process tests: each starts N ranks of this program on one rank body (rank_bodies.cpp)
// and requires every rank to succeed in time. A failure prints every rank's output.
#include <chrono>
#include <string>

#include <catch2/catch.hpp>

#include "multiprocess.hpp"

using meshtorch::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

void require_ranks_succeed(int nprocs, const std::string& body, std::chrono::seconds deadline = 60s) {
  const auto outcome = run_ranks(nprocs, body, deadline);
  INFO(outcome.report());
  REQUIRE(outcome.all_succeeded());
}

}  // namespace

TEST_CASE("every collective gives the expected values on 4 ranks of Mesh<DP<dynamic> TP<2>>",
          "[multiprocess][collectives_4]") {
  require_ranks_succeed(4, "[rank_collectives_dp_tp]");
}

TEST_CASE("every collective gives the expected values on 2 ranks of Mesh<DP<dynamic> TP<2>>",
          "[multiprocess][collectives_2]") {
  require_ranks_succeed(2, "[rank_collectives_dp_tp]");
}

TEST_CASE("groups of a 3-d mesh hold their slices on 4 ranks", "[multiprocess][collectives_3d]") {
  require_ranks_succeed(4, "[rank_collectives_3d]");
}

TEST_CASE("a mesh with every extent dynamic takes them from init and the world size",
          "[multiprocess][collectives_3d]") {
  require_ranks_succeed(4, "[rank_collectives_flexible]");
}

TEST_CASE("differentiable collectives have the adjoint gradients on 4 ranks", "[multiprocess][differentiable_4]") {
  require_ranks_succeed(4, "[rank_differentiable]");
}

TEST_CASE("differentiable collectives have the adjoint gradients on 2 ranks", "[multiprocess][differentiable_2]") {
  require_ranks_succeed(2, "[rank_differentiable]");
}

TEST_CASE("a rank with another mesh type fails init on every rank without a hang", "[multiprocess][mesh_mismatch]") {
  const auto outcome = run_ranks(4, "[rank_mesh_mismatch]", 30s);
  INFO(outcome.report());
  REQUIRE(outcome.all_succeeded());
  CHECK(outcome.seconds < 20);
  for (const auto& rank : outcome.ranks)
    CHECK_THAT(rank.output, Catch::Contains("rank 1 was started with 'Mesh<DP<dynamic>> on cpu' "
                                            "but rank 0 with 'Mesh<DP<dynamic>, TP<2>> on cpu'"));
}

TEST_CASE("a rank with other flags fails init on every rank", "[multiprocess][flags_mismatch]") {
  require_ranks_succeed(2, "[rank_flags_mismatch]", 30s);
}

TEST_CASE("a world size that does not fit the mesh fails init on every rank", "[multiprocess][world_mismatch]") {
  require_ranks_succeed(2, "[rank_world_mismatch]", 30s);
}

TEST_CASE("a collective that a peer never joins fails after its timeout", "[multiprocess][timeout]") {
  require_ranks_succeed(2, "[rank_timeout]", 30s);
}
