// Multi-process tests: each starts N ranks of this program on one rank body (rank_bodies.cpp)
// and requires every rank to succeed in time. A failure prints every rank's output.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <stdlib.h>

#include <meshtorch/diagnostics/watchdog.hpp>

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

// The shared-memory transport's runs set MESHTORCH_CPU_TRANSPORT for their ranks only.
class TransportForRanks {
 public:
  explicit TransportForRanks(const char* value) {
    if (const char* before = std::getenv("MESHTORCH_CPU_TRANSPORT")) before_ = before;
    ::setenv("MESHTORCH_CPU_TRANSPORT", value, 1);
  }
  ~TransportForRanks() {
    if (before_.empty())
      ::unsetenv("MESHTORCH_CPU_TRANSPORT");
    else
      ::setenv("MESHTORCH_CPU_TRANSPORT", before_.c_str(), 1);
  }

 private:
  std::string before_;
};

TEST_CASE("collectives through shared memory give Gloo's values, over several steps, on 4 ranks",
          "[multiprocess][shared_memory]") {
  const TransportForRanks shm("shm");
  require_ranks_succeed(4, "[rank_shared_memory]", 120s);
}

TEST_CASE("collectives through shared memory on 2 ranks, and every collective of the transport-neutral test",
          "[multiprocess][shared_memory]") {
  const TransportForRanks shm("shm");
  require_ranks_succeed(2, "[rank_shared_memory]", 120s);
  require_ranks_succeed(2, "[rank_collectives_dp_tp]");
  require_ranks_succeed(2, "[rank_differentiable]");
}

TEST_CASE("MESHTORCH_CPU_TRANSPORT=gloo keeps every collective on Gloo's sockets, timeouts included",
          "[multiprocess][gloo_transport]") {
  const TransportForRanks gloo("gloo");
  require_ranks_succeed(4, "[rank_gloo_transport]");
  require_ranks_succeed(2, "[rank_differentiable]");
  require_ranks_succeed(2, "[rank_timeout]", 30s);
}

TEST_CASE("through shared memory, a mismatch fails both ranks at once, an exited peer is named, a timeout holds",
          "[multiprocess][shared_memory_faults]") {
  const TransportForRanks shm("shm");
  require_ranks_succeed(2, "[rank_shared_memory_mismatch]", 30s);
  require_ranks_succeed(2, "[rank_shared_memory_exit]", 30s);
  require_ranks_succeed(2, "[rank_shared_memory_gave_up]", 30s);
  require_ranks_succeed(2, "[rank_transport_mismatch]", 30s);
  require_ranks_succeed(2, "[rank_timeout]", 30s);
}

TEST_CASE("a fatal signal in the thread that holds the flight recorder's lock still leaves the dump, in the budget",
          "[multiprocess][fatal_signal]") {
  // Before, the watchdog's dump waited for that lock for ever, the handler gave up after 10 s and
  // the rank died with no dump, after its peers had timed out: the launcher named one of them.
  const auto dumps = std::filesystem::temp_directory_path() / ("meshtorch-fatal-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dumps);
  ::setenv("MESHTORCH_TEST_DUMP_DIR", dumps.c_str(), 1);
  const auto outcome = run_ranks(1, "[rank_fatal_signal]", 60s);
  ::unsetenv("MESHTORCH_TEST_DUMP_DIR");
  INFO(outcome.report());
  REQUIRE(outcome.ranks.at(0).signal == SIGABRT);
  // The budget for a 4 s timeout, and the start of a LibTorch program.
  const auto budget = meshtorch::diagnostics::Watchdog::fatal_budget(4s);
  CHECK(budget == 2s);
  CHECK(outcome.seconds < std::chrono::duration<double>(budget + 4s).count());
  std::ifstream file(dumps / "rank_1.json");
  REQUIRE(file);
  const auto dump = nlohmann::json::parse(file);
  CHECK(dump["reason"] == "fatal signal SIGABRT");
  REQUIRE(dump["entries"].size() == 1);
  CHECK(dump["entries"][0]["op"] == "all_reduce");
  CHECK(dump["entries"][0]["state"] == "waiting");
  // The stacks: the main thread's, and the silent thread's wait cut short by the deadline (half of
  // the time left goes to asking), not the 2 s a capture waits otherwise.
  const std::string& output = outcome.ranks[0].output;
  CHECK_THAT(output, Catch::Contains("the main thread:"));
  std::smatch silent;
  REQUIRE(std::regex_search(output, silent, std::regex("did not answer within ([0-9]+) ms")));
  CHECK(std::stoi(silent[1]) < 1000);
  CHECK_THAT(output, Catch::Contains("rank 1: end of stacks"));
  std::filesystem::remove_all(dumps);
}
