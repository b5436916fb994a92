// The flight recorder and the hang analysis on synthetic dumps: what the watchdog and
// meshtorch-diagnose conclude for a stopped rank, a desync, and a rank blocked by another.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/diagnostics/collective_failure.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>
#include <meshtorch/diagnostics/hang_analysis.hpp>

using namespace meshtorch::diagnostics;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::vector<std::int64_t> shape{4, 8};

// Issues `count` collectives named `op` on the group `backend`, completing all but `pending`
// of the last ones; the last pending one is being waited on.
void run(FlightRecorder& recorder, const void* backend, const std::string& axis, const std::vector<int>& ranks,
         const std::string& op, int count, int pending = 0, const std::vector<std::int64_t>& tensor_shape = shape,
         const char* dtype = "Float") {
  for (int i = 0; i < count; ++i) {
    auto id = recorder.record(backend, axis, ranks, "gloo", op, tensor_shape, dtype);
    if (i < count - pending)
      recorder.completed(id);
    else
      recorder.waiting(id);
  }
}

json dump_of(int rank, int world_size, const FlightRecorder& recorder, json peers = nullptr) {
  json out = {{"format", "meshtorch-flight-recorder"},
              {"version", 1},
              {"rank", rank},
              {"world_size", world_size},
              {"progress", recorder.progress()},
              {"entries", recorder.entries()}};
  if (!peers.is_null()) out["peers"] = peers;
  return out;
}

// A unique empty folder under the temporary directory.
fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / fmt::format("meshtorch-diagnose-{}-{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string run_tool(const fs::path& dir, int& code) {
  const auto out = dir / "tool.out";
  code = std::system(fmt::format("{} {} > {} 2>&1", MESHTORCH_DIAGNOSE_PATH, dir.string(), out.string()).c_str());
  code = WIFEXITED(code) ? WEXITSTATUS(code) : -1;
  std::ifstream in(out);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

TEST_CASE("the flight recorder numbers collectives per group and keeps the last N", "[recorder]") {
  FlightRecorder recorder(4);
  int world = 0, tp = 0;
  run(recorder, &world, "world", {0, 1}, "all_reduce", 3);
  run(recorder, &tp, "TP", {0, 1}, "all_gather", 3, 1);
  const json progress = recorder.progress();
  REQUIRE(progress["groups"].size() == 2);
  CHECK(progress["groups"][0]["group"] == "world group [0, 1] (gloo)");
  CHECK(progress["groups"][0]["issued"] == 3);
  CHECK(progress["groups"][0]["completed"] == 3);
  CHECK(progress["groups"][1]["issued"] == 3);
  CHECK(progress["groups"][1]["completed"] == 2);
  CHECK(progress["waiting"]["seq"] == 3);
  CHECK(progress["waiting"]["op"] == "all_gather");
  CHECK(progress["last"]["group"] == "TP group [0, 1] (gloo)");
  const json entries = recorder.entries();
  REQUIRE(entries.size() == 4);  // the ring holds the last 4 of 6
  CHECK(entries[0]["op"] == "all_reduce");
  CHECK(entries[0]["seq"] == 3);
  CHECK(entries[3]["seq"] == 3);
  CHECK(entries[3]["state"] == "waiting");
  CHECK(entries[3]["shape"] == json::array({4, 8}));
  CHECK(entries[3]["dtype"] == "Float");
  CHECK(entries[3]["ended_s"].is_null());
  CHECK(entries[2]["ended_s"].get<double>() >= entries[2]["issued_s"].get<double>());
  REQUIRE(recorder.longest_wait());
  CHECK(recorder.longest_wait()->op == "all_gather");
}

TEST_CASE("a collective a GPU stream waits for stays waiting until the device has run it", "[recorder]") {
  // NCCL's wait returns once the stream is ordered after the collective; the recorder asks the
  // device (here, flags standing for two events) before calling it completed.
  FlightRecorder recorder(3);
  int nccl = 0;
  bool first_ran = false, second_ran = false;
  const auto first = recorder.record(&nccl, "FSDP", {0, 1}, "nccl", "all_gather", shape, "BFloat16");
  const auto second = recorder.record(&nccl, "FSDP", {0, 1}, "nccl", "reduce_scatter", shape, "Float");
  for (auto [id, ran] : {std::pair{first, &first_ran}, std::pair{second, &second_ran}}) {
    recorder.waiting(id);
    recorder.completes_when(id, [ran] { return *ran; });
  }
  CHECK(recorder.poll_device_completions() == 0);
  json progress = recorder.progress();
  CHECK(progress["groups"][0]["completed"] == 0);
  CHECK(progress["waiting"]["op"] == "all_gather");  // the oldest, what a hang report names
  REQUIRE(recorder.longest_wait());
  CHECK(recorder.longest_wait()->op == "all_gather");

  first_ran = true;
  CHECK(recorder.poll_device_completions() == 1);
  progress = recorder.progress();
  CHECK(progress["groups"][0]["completed"] == 1);
  CHECK(progress["waiting"]["op"] == "reduce_scatter");
  CHECK(recorder.entries()[0]["state"] == "completed");
  CHECK(recorder.poll_device_completions() == 0);  // asked once, then forgotten

  // A device that cannot answer (a broken context throws) leaves it waiting, and polling goes on.
  const auto third = recorder.record(&nccl, "FSDP", {0, 1}, "nccl", "all_gather", shape, "BFloat16");
  recorder.waiting(third);
  bool context_broken = true;
  recorder.completes_when(third, [&context_broken] {
    if (context_broken) throw std::runtime_error("CUDA error: an illegal memory access");
    return true;
  });
  second_ran = true;
  CHECK(recorder.poll_device_completions() == 1);
  CHECK(recorder.progress()["waiting"]["seq"] == 3);

  // A failure reported meanwhile is not turned into a completion.
  recorder.failed(third);
  context_broken = false;
  CHECK(recorder.poll_device_completions() == 0);
  CHECK(recorder.entries()[2]["state"] == "failed");
  CHECK(recorder.progress()["groups"][0]["completed"] == 2);

  // A slot the ring gives to a newer collective drops the old one's question.
  const auto fourth = recorder.record(&nccl, "FSDP", {0, 1}, "nccl", "all_gather", shape, "BFloat16");
  recorder.waiting(fourth);
  recorder.completes_when(fourth, [] { return true; });
  for (int i = 0; i < 3; ++i) recorder.record(&nccl, "FSDP", {0, 1}, "nccl", "all_gather", shape, "BFloat16");
  CHECK(recorder.poll_device_completions() == 0);
  CHECK(recorder.progress()["groups"][0]["completed"] == 2);
}

TEST_CASE("a failed collective goes to the handler the watchdog installs, else is marked failed", "[recorder]") {
  auto& recorder = FlightRecorder::instance();
  REQUIRE(recorder.enabled());
  int group = 0;
  const auto state_of = [&](std::uint64_t id) {
    for (const auto& entry : recorder.entries())
      if (entry["id"] == id) return entry["state"].get<std::string>();
    return std::string("not recorded");
  };

  // No watchdog in this process: the collective is marked failed and the caller goes on.
  set_collective_failure_handler(nullptr);
  const auto unwatched = recorder.record(&group, "TP", {0, 1}, "gloo", "all_reduce", shape, "Float");
  recorder.waiting(unwatched);
  report_collective_failure(unwatched, "all_reduce over the TP group [0, 1]", "Connection closed by peer");
  CHECK(state_of(unwatched) == "failed");

  // With a handler installed (Watchdog::arm does that), it gets the collective.
  static std::uint64_t handled_record = 0;
  static std::string handled_collective, handled_what;
  set_collective_failure_handler([](std::uint64_t record, const std::string& collective, const std::string& what) {
    handled_record = record;
    handled_collective = collective;
    handled_what = what;
  });
  const auto watched = recorder.record(&group, "TP", {0, 1}, "gloo", "all_gather", shape, "Float");
  recorder.waiting(watched);
  report_collective_failure(watched, "all_gather over the TP group [0, 1]", "Timed out waiting 1000ms");
  set_collective_failure_handler(nullptr);
  CHECK(handled_record == watched);
  CHECK(handled_collective == "all_gather over the TP group [0, 1]");
  CHECK(handled_what == "Timed out waiting 1000ms");
  CHECK(state_of(watched) == "waiting");  // the handler decides what becomes of it
}

TEST_CASE("recording a collective costs well under a microsecond", "[recorder]") {
  FlightRecorder recorder(2000);
  int group = 0;
  const std::vector<int> ranks{0, 1, 2, 3};
  constexpr int n = 200'000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    auto id = recorder.record(&group, "FSDP", ranks, "gloo", "all_gather", shape, "Float");
    recorder.waiting(id);
    recorder.completed(id);
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / n;
  WARN(fmt::format("record + wait + complete: {:.0f} ns per collective", ns));
  CHECK(ns < 2000);
}

TEST_CASE("a stopped rank is named with the collective it missed and its last one", "[analysis]") {
  // Rank 0 waits in all_reduce #57; rank 1 published #50 before it stopped (its last report is
  // up to a second old), but rank 0 completed #56 with it.
  FlightRecorder zero(100), one(100);
  int group = 0;
  run(zero, &group, "world", {0, 1}, "all_reduce", 57, 1);
  run(one, &group, "world", {0, 1}, "all_reduce", 50);
  const json peers = {{"1", {{"responsive", false}, {"progress", one.progress()}}}};
  const auto dir = fresh_dir("stopped");
  std::ofstream(dir / "rank_0.json") << dump_of(0, 2, zero, peers).dump();

  const auto verdict = analyse_hang(rank_reports_from_dumps({dump_of(0, 2, zero, peers)}));
  INFO(verdict.text());
  CHECK(verdict.culprits == std::vector<int>{1});
  CHECK_THAT(verdict.summary, Catch::Contains("rank 1 did not arrive at all_reduce #57 over the world group [0, 1] "
                                              "(gloo), where rank 0 is waiting"));
  CHECK_THAT(verdict.summary, Catch::Contains("it stopped responding"));
  CHECK_THAT(verdict.summary,
             Catch::Contains("its last collective was all_reduce #56 over the world group [0, 1] (gloo)"));

  int code = 0;
  const auto output = run_tool(dir, code);
  INFO(output);
  CHECK(code == 0);
  CHECK_THAT(output, Catch::Contains("no dump from rank(s) 1"));
  CHECK_THAT(output, Catch::Contains("culprit: rank 1 did not arrive at all_reduce #57"));
}

TEST_CASE("a desync names the rank that issued another collective under the same number", "[analysis]") {
  // Ranks 0-2 are in reduce_scatter #812 of the FSDP group, rank 3 in all_gather #812.
  std::vector<json> dumps;
  int group = 0;
  const std::vector<int> ranks{0, 1, 2, 3};
  const auto dir = fresh_dir("desync");
  for (int r = 0; r < 4; ++r) {
    FlightRecorder recorder(16);
    // Descriptions that name the rank are no desync: ranks compare the collective.
    run(recorder, &group, "FSDP", ranks, fmt::format("FSDP all_gather of 'layers.0' on rank {}", r), 811);
    run(recorder, &group, "FSDP", ranks, r == 3 ? "all_gather" : "reduce_scatter", 1, 1);
    dumps.push_back(dump_of(r, 4, recorder));
    std::ofstream(dir / fmt::format("rank_{}.json", r)) << dumps.back().dump();
  }
  const auto verdict = analyse_hang(rank_reports_from_dumps(dumps));
  INFO(verdict.text());
  CHECK(verdict.culprits == std::vector<int>{3});
  CHECK_THAT(verdict.summary, Catch::Contains("rank 3 is in all_gather #812 over the FSDP group [0, 1, 2, 3] (gloo) "
                                              "while ranks 0, 1, 2 are in reduce_scatter #812"));
  int code = 0;
  const auto output = run_tool(dir, code);
  INFO(output);
  CHECK(code == 0);
  CHECK_THAT(output, Catch::Contains("rank 3 is in all_gather #812"));
}

TEST_CASE("a desync of shapes or dtypes under the same collective names the rank and both tensors", "[analysis]") {
  // Three ranks wait in all_reduce #5 of the world group; rank 2's tensor has another shape (NCCL
  // would hang or read past the buffer; the watchdog sees only the wait). Then a dtype desync.
  int group = 0;
  const std::vector<int> ranks{0, 1, 2};
  for (const bool dtype_differs : {false, true}) {
    std::map<int, RankReport> reports;
    for (int r = 0; r < 3; ++r) {
      FlightRecorder recorder(16);
      run(recorder, &group, "world", ranks, "all_reduce", 4);
      const bool odd = r == 2;
      run(recorder, &group, "world", ranks, "all_reduce", 1, 1,
          odd && !dtype_differs ? std::vector<std::int64_t>{4, 16} : shape,
          odd && dtype_differs ? "BFloat16" : "Float");
      // As the watchdog sees them: progress only, no ring.
      reports[r] = rank_report_from_progress(r, recorder.progress());
    }
    const auto verdict = analyse_hang(reports);
    INFO(verdict.text());
    CHECK(verdict.culprits == std::vector<int>{2});
    CHECK_THAT(verdict.summary,
               Catch::StartsWith("desync: ranks issued a collective on tensors of different shapes or dtypes"));
    CHECK_THAT(verdict.summary, Catch::Contains(fmt::format(
                                    "rank 2 is in all_reduce #5 over the world group [0, 1, 2] (gloo) on {} while "
                                    "ranks 0, 1 are in all_reduce #5 on Float[4, 8]",
                                    dtype_differs ? "BFloat16[4, 8]" : "Float[4, 16]")));
  }
  // The same tensors everywhere: no desync, a collective nobody completed.
  std::map<int, RankReport> agreeing;
  for (int r = 0; r < 3; ++r) {
    FlightRecorder recorder(16);
    run(recorder, &group, "world", ranks, "all_reduce", 5, 1);
    agreeing[r] = rank_report_from_progress(r, recorder.progress());
  }
  CHECK(analyse_hang(agreeing).culprits.empty());
}

TEST_CASE("a rank waiting for a stopped one is not blamed: the wait is followed to its root", "[analysis]") {
  // 2D mesh: rank 0 waits in FSDP #10 for rank 2, which waits in TP #20 for rank 3 (stopped).
  FlightRecorder r0(64), r1(64), r2(64), r3(64);
  int fsdp02 = 0, fsdp13 = 0, tp01 = 0, tp23 = 0;
  run(r0, &fsdp02, "FSDP", {0, 2}, "all_gather", 10, 1);
  run(r0, &tp01, "TP", {0, 1}, "all_reduce", 20);
  run(r1, &fsdp13, "FSDP", {1, 3}, "all_gather", 10, 1);
  run(r1, &tp01, "TP", {0, 1}, "all_reduce", 20);
  run(r2, &fsdp02, "FSDP", {0, 2}, "all_gather", 9);
  run(r2, &tp23, "TP", {2, 3}, "all_reduce", 20, 1);
  run(r3, &fsdp13, "FSDP", {1, 3}, "all_gather", 9);
  run(r3, &tp23, "TP", {2, 3}, "all_reduce", 19);
  const json peers = {{"3", {{"responsive", false}, {"progress", r3.progress()}}}};
  const auto verdict = analyse_hang(
      rank_reports_from_dumps({dump_of(0, 4, r0, peers), dump_of(1, 4, r1, peers), dump_of(2, 4, r2, peers)}));
  INFO(verdict.text());
  CHECK(verdict.culprits == std::vector<int>{3});
  CHECK_THAT(verdict.summary,
             Catch::Contains("rank 3 did not arrive at all_gather #10 over the FSDP group [1, 3] (gloo), "
                             "where rank 1 is waiting"));
  CHECK_THAT(verdict.summary,
             Catch::Contains("nor at all_reduce #20 over the TP group [2, 3] (gloo), where rank 2 is waiting"));
  CHECK_THAT(verdict.text(), Catch::Contains("rank 0 waits in all_gather #10 over the FSDP group [0, 2] (gloo)"));
}

TEST_CASE("a rank that died of a signal is the culprit, not the peer it was waiting for", "[analysis]") {
  FlightRecorder one(16);
  int group = 0;
  run(one, &group, "DP", {0, 1}, "all_reduce", 12, 1);
  json dump = dump_of(1, 2, one);
  dump["reason"] = "fatal signal SIGSEGV";
  const auto verdict = analyse_hang(rank_reports_from_dumps({dump}));
  INFO(verdict.text());
  CHECK(verdict.culprits == std::vector<int>{1});
  CHECK(verdict.summary ==
        "rank 1 ended on a fatal signal SIGSEGV; it was in all_reduce #12 over the DP group [0, 1] (gloo)");
}

TEST_CASE("a collective every member reached but none completed blames no rank", "[analysis]") {
  FlightRecorder zero(16), one(16);
  int group = 0;
  run(zero, &group, "world", {0, 1}, "all_reduce", 5, 1);
  run(one, &group, "world", {0, 1}, "all_reduce", 5, 1);
  const auto verdict = analyse_hang(rank_reports_from_dumps({dump_of(0, 2, zero), dump_of(1, 2, one)}));
  INFO(verdict.text());
  CHECK(verdict.culprits.empty());
  CHECK_THAT(verdict.summary,
             Catch::StartsWith("no rank is missing from all_reduce #5 over the world group [0, 1] (gloo)"));
}

TEST_CASE("a stopped pipeline stage is named by the receive that waits for it; a send and its receive are no desync",
          "[analysis]") {
  // Three stages: rank 0 sent 6 activations to rank 1 and waits for nothing; rank 1 received them,
  // sent 4 on to rank 2 and stopped; rank 2 waits for the 5th. Each rank numbers its own messages,
  // so rank 1's count (10) passes rank 2's wait (#5) although rank 1 never sent it.
  FlightRecorder r0(64), r1(64), r2(64);
  int messages = 0;
  const std::vector<int> stages{0, 1, 2};
  run(r0, &messages, "PP send/recv", stages, "send to 1", 6);
  run(r1, &messages, "PP send/recv", stages, "recv from 0", 6);
  run(r1, &messages, "PP send/recv", stages, "send to 2", 4);
  run(r2, &messages, "PP send/recv", stages, "recv from 1", 5, 1);
  const json stopped = {{"1", {{"responsive", false}, {"progress", r1.progress()}}}};
  const auto verdict = analyse_hang(rank_reports_from_dumps({dump_of(0, 3, r0, stopped), dump_of(2, 3, r2, stopped)}));
  INFO(verdict.text());
  CHECK(verdict.culprits == std::vector<int>{1});
  CHECK_THAT(verdict.summary, Catch::StartsWith("rank 1 did not arrive at its side of recv from 1 #5 over the PP "
                                                "send/recv group [0, 1, 2] (gloo), where rank 2 is waiting"));
  CHECK_THAT(verdict.summary, Catch::Contains("it stopped responding"));

  // Every rank's dump, rank 1 alive but busy: still rank 1, and no desync from the messages' names.
  const auto busy = analyse_hang(rank_reports_from_dumps({dump_of(0, 3, r0), dump_of(1, 3, r1), dump_of(2, 3, r2)}));
  INFO(busy.text());
  CHECK(busy.culprits == std::vector<int>{1});
  CHECK_THAT(busy.summary, Catch::StartsWith("rank 1 did not arrive at its side of recv from 1 #5"));
  CHECK_THAT(busy.summary, !Catch::Contains("desync"));
}

TEST_CASE("meshtorch-diagnose says when there is nothing to read", "[analysis]") {
  const auto dir = fresh_dir("empty");
  int code = 0;
  const auto output = run_tool(dir, code);
  CHECK(code == 2);
  CHECK_THAT(output, Catch::Contains("no flight recorder dump"));
}

TEST_CASE("the timeout comes from the flag, else MESHTORCH_TIMEOUT, else 600 s", "[recorder]") {
  using std::chrono::milliseconds;
  ::unsetenv("MESHTORCH_TIMEOUT");
  CHECK(meshtorch::comm::collective_timeout() == milliseconds(600'000));
  CHECK(meshtorch::comm::collective_timeout(20) == milliseconds(20'000));
  ::setenv("MESHTORCH_TIMEOUT", "2.5", 1);
  CHECK(meshtorch::comm::collective_timeout() == milliseconds(2'500));
  CHECK(meshtorch::comm::collective_timeout(20) == milliseconds(20'000));  // the flag wins
  ::setenv("MESHTORCH_TIMEOUT", "soon", 1);
  CHECK_THROWS_WITH(meshtorch::comm::collective_timeout(),
                    Catch::Contains("MESHTORCH_TIMEOUT='soon' is not a positive number of seconds"));
  ::setenv("MESHTORCH_TIMEOUT", "0", 1);
  CHECK_THROWS_AS(meshtorch::comm::collective_timeout(), meshtorch::EnvError);
  ::unsetenv("MESHTORCH_TIMEOUT");
}
