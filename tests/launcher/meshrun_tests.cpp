#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;

namespace {

const std::string meshrun = MESHRUN_PATH;
const std::string rank_program = RANK_PROGRAM_PATH;

// meshrun keeps a failed run's temporary folder for inspection: give this test process its own
// TMPDIR, removed at exit, so that the failure tests leave nothing behind.
struct PrivateTmpdir {
  fs::path path = fs::temp_directory_path() / ("meshrun-tests-" + std::to_string(::getpid()));
  PrivateTmpdir() {
    fs::create_directories(path);
    ::setenv("TMPDIR", path.c_str(), 1);
  }
  ~PrivateTmpdir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
} private_tmpdir;

struct Run {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

Run run(const std::string& command) {
  auto started = std::chrono::steady_clock::now();
  Run result;
  FILE* pipe = ::popen(("(" + command + ") 2>&1").c_str(), "r");
  REQUIRE(pipe);
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) result.output.append(buffer, n);
  int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  UNSCOPED_INFO("command: " << command << "\nexit code " << result.exit_code << " after " << result.seconds
                            << " s, output:\n"
                            << result.output);
  return result;
}

// A fresh folder per test, so that tests may run in parallel.
fs::path scratch_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("meshrun-test-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// Distinct per test process, away from 29500 where real jobs listen, and below the kernel's
// ephemeral range (32768-60999) with every offset the tests add (up to 7201): a node that connects
// before its peer listens could otherwise reach a socket another test's Gloo ranks were given
// there, and break their connections ("Connection reset by peer" in connectFullMesh).
int free_port_guess() { return 9000 + static_cast<int>(::getpid() % 1500) * 2; }

}  // namespace

TEST_CASE("every rank sees its rank, world size, local rank and master in the environment") {
  auto dir = scratch_dir("env");
  auto result = run("env -u OMP_NUM_THREADS " + meshrun + " --nproc-per-node 3 --master-port 4321 -- " + rank_program +
                    " env " + dir.string());
  REQUIRE(result.exit_code == 0);
  for (int rank = 0; rank < 3; ++rank) {
    auto expected =
        std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 127.0.0.1 4321 torchrun 0 0 1 error-file\n";
    CHECK(read_text(dir / ("rank" + std::to_string(rank) + ".txt")) == expected);
  }
  CHECK_THAT(result.output, Catch::Contains("OMP_NUM_THREADS is not set"));
  CHECK_THAT(result.output, Catch::Contains("all 3 ranks finished successfully"));
  fs::remove_all(dir);
}

TEST_CASE("a rank exiting with code 3 stops the sleeping ranks and meshrun exits 3 naming it") {
  auto result = run(meshrun + " --nproc-per-node 3 -- " + rank_program + " exit-on-rank 1 3");
  CHECK(result.exit_code == 3);
  CHECK(result.seconds < 5);
  CHECK_THAT(result.output,
             Catch::Contains("rank 1 (node 0, local rank 1, attempt 0) failed first: it exited with code 3"));
}

TEST_CASE("a rank killed by SIGKILL stops the others and meshrun exits 128 + 9") {
  auto result = run(meshrun + " --nproc-per-node 2 -- " + rank_program + " kill-on-rank 0");
  CHECK(result.exit_code == 137);
  CHECK(result.seconds < 5);
  CHECK_THAT(result.output,
             Catch::Contains("rank 0 (node 0, local rank 0, attempt 0) failed first: it was killed by SIGKILL"));
}

TEST_CASE("a rank that ignores SIGTERM is killed after the grace period") {
  auto result = run(meshrun +
                    " --nproc-per-node 2 --termination-grace 1 -- sh -c "
                    "'if [ $RANK = 1 ]; then sleep 0.2; exit 4; fi; trap \"\" TERM; sleep 30'");
  CHECK(result.exit_code == 4);
  CHECK(result.seconds > 1);
  CHECK(result.seconds < 5);
}

TEST_CASE("with --max-restarts 1 a failure restarts the whole group once") {
  auto result = run(meshrun + " --nproc-per-node 2 --max-restarts 1 --prefix-output -- " + rank_program +
                    " fail-first-attempt 2");
  CHECK(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("[rank0]:attempt 0 rank 0"));
  CHECK_THAT(result.output, Catch::Contains("[rank0]:attempt 1 rank 0"));
  CHECK_THAT(result.output, Catch::Contains("[rank1]:attempt 1 rank 1"));
  CHECK_THAT(result.output, Catch::Contains("restarting all ranks (restart 1 of 1)"));
  CHECK_THAT(result.output, Catch::Contains("finished successfully"));
}

TEST_CASE("without restarts left the first failure is final") {
  auto result = run(meshrun + " --nproc-per-node 2 -- " + rank_program + " fail-first-attempt 2");
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.output, !Catch::Contains("attempt 1"));
}

TEST_CASE("with --log-dir meshrun writes each rank's stdout and stderr to its own files") {
  auto dir = scratch_dir("logs");
  auto result =
      run(meshrun + " --nproc-per-node 2 --log-dir " + dir.string() + " -- sh -c 'echo out $RANK; echo err $RANK >&2'");
  REQUIRE(result.exit_code == 0);
  for (int rank = 0; rank < 2; ++rank) {
    auto rank_dir = dir / "0" / std::to_string(rank);
    CHECK(read_text(rank_dir / "stdout.log") == "out " + std::to_string(rank) + "\n");
    CHECK(read_text(rank_dir / "stderr.log") == "err " + std::to_string(rank) + "\n");
  }
  CHECK_THAT(result.output, !Catch::Contains("out 0"));
  fs::remove_all(dir);
}

TEST_CASE("an uncaught exception writes the error file and meshrun prints its message") {
  auto dir = scratch_dir("error-file");
  auto result = run(meshrun + " --nproc-per-node 2 --log-dir " + dir.string() + " -- " + rank_program +
                    " throw-on-rank 1 'disk on fire'");
  CHECK(result.exit_code == 1);
  auto error_file = dir / "0" / "1" / "error.json";
  REQUIRE(fs::exists(error_file));
  auto json = nlohmann::json::parse(read_text(error_file));
  CHECK(json["message"]["message"] == "std::runtime_error: disk on fire");
  CHECK(json["message"]["extraInfo"]["timestamp"].is_string());
  CHECK_THAT(result.output,
             Catch::Contains("error file " + error_file.string() + ": std::runtime_error: disk on fire"));
  CHECK_THAT(result.output, Catch::Contains("its stderr: " + (dir / "0" / "1" / "stderr.log").string()));
  fs::remove_all(dir);
}

TEST_CASE("two meshruns with --nnodes 2 on loopback give global ranks 0 to 3") {
  auto dir = scratch_dir("two-nodes");
  auto node = [&](int node_rank) {
    return meshrun + " --nnodes 2 --node-rank " + std::to_string(node_rank) +
           " --nproc-per-node 2 --master-addr 127.0.0.1 --rdzv-timeout 10 --master-port " +
           std::to_string(free_port_guess()) + " -- " + rank_program + " env " + dir.string();
  };
  auto result = run(node(1) + " & " + node(0) + "; first=$?; wait $!; second=$?; exit $((first + second))");
  REQUIRE(result.exit_code == 0);
  for (int rank = 0; rank < 4; ++rank) {
    auto expected = std::to_string(rank) + " 4 " + std::to_string(rank % 2) + " 2 127.0.0.1 " +
                    std::to_string(free_port_guess()) + " torchrun " + std::to_string(rank / 2);
    CHECK_THAT(read_text(dir / ("rank" + std::to_string(rank) + ".txt")), Catch::StartsWith(expected));
  }
  fs::remove_all(dir);
}

TEST_CASE("a failing rank on one node stops the ranks of the other node") {
  auto node = [&](int node_rank) {
    return meshrun + " --nnodes 2 --node-rank " + std::to_string(node_rank) +
           " --nproc-per-node 2 --master-addr 127.0.0.1 --rdzv-timeout 10 --master-port " +
           std::to_string(free_port_guess() + 1000) + " -- " + rank_program + " exit-on-rank 3 5";
  };
  auto result = run(node(1) + " & " + node(0) + "; first=$?; wait $!; second=$?; echo codes $first $second");
  CHECK_THAT(result.output, Catch::Contains("codes 5 5"));
  CHECK(result.seconds < 5);
  CHECK_THAT(result.output, Catch::Contains("rank 3 (node 1, local rank 1, attempt 0) failed first"));
}

TEST_CASE("SIGTERM sent to meshrun reaches the ranks and meshrun exits 128 + 15") {
  auto result = run(meshrun + " --nproc-per-node 2 -- sleep 30 & sleep 0.5; kill -TERM $!; wait $!");
  CHECK(result.exit_code == 143);
  CHECK(result.seconds < 5);
  CHECK_THAT(result.output, Catch::Contains("received SIGTERM"));
}

TEST_CASE("a program that cannot be started fails with exit code 127 and says why") {
  auto result = run(meshrun + " --nproc-per-node 1 -- /nonexistent/program");
  CHECK(result.exit_code == 127);
  CHECK_THAT(result.output, Catch::Contains("could not be started: '/nonexistent/program': No such file or directory"));
}

TEST_CASE("contradictory flags are refused before anything starts") {
  CHECK(run(meshrun + " --nproc-per-node 2 --nnodes 2 --node-rank 2 --master-addr h -- true").exit_code != 0);
  CHECK(run(meshrun + " --nproc-per-node 2 --nnodes 2 -- true").exit_code != 0);
  CHECK(run(meshrun + " --nproc-per-node 2 --redirects 3 -- true").exit_code != 0);
  CHECK(run(meshrun + " --nproc-per-node 2").exit_code != 0);
  auto refused = run(meshrun + " --nproc-per-node 1 --nnodes 1:2 --node-rank 1 --master-addr 127.0.0.1 -- true");
  CHECK(refused.exit_code != 0);
  CHECK_THAT(refused.output, Catch::Contains("drop --node-rank"));
  CHECK_THAT(run(meshrun + " --nproc-per-node 1 --nnodes 2:1 --master-addr 127.0.0.1 -- true").output,
             Catch::Contains("MIN is above MAX"));
  CHECK_THAT(run(meshrun + " --nproc-per-node 1 --nnodes 0:2 --master-addr 127.0.0.1 -- true").output,
             Catch::Contains("is not N or MIN:MAX"));
}

namespace {

// A meshrun of an elastic job on loopback, its rank program in `elastic` mode writing to `dir`.
std::string elastic_node(const std::string& nnodes, int port, const fs::path& dir, const std::string& extra = "") {
  return meshrun + " --nnodes " + nnodes + " --nproc-per-node 1 --master-addr 127.0.0.1 --rdzv-timeout 20 " +
         "--termination-grace 1 --master-port " + std::to_string(port) + " " + extra + " -- " + rank_program +
         " elastic " + dir.string();
}

// Shell: waits up to 20 s for a file.
std::string wait_for(const fs::path& file) {
  return "for i in $(seq 200); do [ -e " + file.string() + " ] && break; sleep 0.1; done; ";
}

}  // namespace

TEST_CASE("an elastic job starts on the nodes that come, numbered by node 0") {
  auto dir = scratch_dir("elastic-two");
  int port = free_port_guess() + 2000;
  auto node = elastic_node("1:2", port, dir, "--rdzv-last-call 10");
  // Both attempts' ranks sleep on attempt 0: SIGTERM to node 0 ends the job once both are in.
  auto result = run(node + " & first=$!; sleep 0.3; " + node + " & second=$!; " + wait_for(dir / "attempt0-rank0.txt") +
                    wait_for(dir / "attempt0-rank1.txt") + "kill -TERM $first; wait $first; a=$?; wait $second; " +
                    "echo codes $a $?");
  CHECK_THAT(result.output, Catch::Contains("codes 143 143"));
  CHECK_THAT(result.output, Catch::Contains("attempt 0 runs on 2 node(s)"));
  CHECK_THAT(result.output, Catch::Contains("this is node 1 of 2 for attempt 0"));
  CHECK_THAT(read_text(dir / "attempt0-rank0.txt"), Catch::StartsWith("0 2 0 1 127.0.0.1"));
  CHECK_THAT(read_text(dir / "attempt0-rank1.txt"), Catch::StartsWith("1 2 0 1 127.0.0.1"));
  CHECK(result.seconds < 10);  // two nodes of at most 2: no last call to wait for
  fs::remove_all(dir);
}

TEST_CASE("an elastic job that loses a node restarts on the nodes left") {
  auto dir = scratch_dir("elastic-lost");
  int port = free_port_guess() + 3000;
  auto node = elastic_node("1:2", port, dir, "--rdzv-last-call 1 --max-restarts 1");
  // The second node's meshrun is killed outright (its rank goes with it): node 0 restarts alone.
  auto result = run(node + " & first=$!; sleep 0.3; " + node + " & second=$!; " + wait_for(dir / "attempt0-rank0.txt") +
                    wait_for(dir / "attempt0-rank1.txt") + "kill -KILL $second; wait $first; echo code $?");
  CHECK_THAT(result.output, Catch::Contains("code 0"));
  CHECK_THAT(result.output, Catch::Contains("lost contact with meshrun on node 1"));
  CHECK_THAT(result.output, Catch::Contains("restarting all ranks (restart 1 of 1)"));
  CHECK_THAT(result.output, Catch::Contains("attempt 1 runs on 1 node(s)"));
  CHECK_THAT(read_text(dir / "attempt1-rank0.txt"), Catch::StartsWith("0 1 0 1 127.0.0.1"));
  CHECK_FALSE(fs::exists(dir / "attempt1-rank1.txt"));
  fs::remove_all(dir);
}

TEST_CASE("SIGTERM to a node of an elastic job: that node leaves, the others restart without it") {
  auto dir = scratch_dir("elastic-leave");
  int port = free_port_guess() + 6000;
  auto node = elastic_node("1:2", port, dir, "--rdzv-last-call 1 --max-restarts 1");
  auto result = run(node + " & first=$!; sleep 0.3; " + node + " & second=$!; " + wait_for(dir / "attempt0-rank0.txt") +
                    wait_for(dir / "attempt0-rank1.txt") + "kill -TERM $second; wait $second; b=$?; wait $first; " +
                    "echo codes $? $b");
  CHECK_THAT(result.output, Catch::Contains("codes 0 143"));
  CHECK_THAT(result.output, Catch::Contains("meshrun on node 1 received SIGTERM"));
  CHECK_THAT(read_text(dir / "attempt1-rank0.txt"), Catch::StartsWith("0 1 0 1"));
  CHECK(result.seconds < 10);
  fs::remove_all(dir);
}

TEST_CASE("a node joining an elastic job restarts the ranks with it, not counted as a restart") {
  auto dir = scratch_dir("elastic-join");
  int port = free_port_guess() + 4000;
  auto node = elastic_node("1:2", port, dir, "--rdzv-last-call 0");  // --max-restarts 0
  auto result = run(node + " & first=$!; " + wait_for(dir / "attempt0-rank0.txt") + node + " & second=$!; " +
                    "wait $first; a=$?; wait $second; echo codes $a $?");
  CHECK_THAT(result.output, Catch::Contains("codes 0 0"));
  CHECK_THAT(read_text(dir / "attempt0-rank0.txt"), Catch::StartsWith("0 1 0 1"));
  CHECK_THAT(result.output, Catch::Contains("a node joined the job: stopping every rank to restart with 2 nodes"));
  CHECK_THAT(result.output, Catch::Contains("not counted against --max-restarts"));
  CHECK_THAT(read_text(dir / "attempt1-rank0.txt"), Catch::StartsWith("0 2 0 1"));
  CHECK_THAT(read_text(dir / "attempt1-rank1.txt"), Catch::StartsWith("1 2 0 1"));
  fs::remove_all(dir);
}

TEST_CASE("an elastic job with fewer than MIN nodes fails at the rendezvous timeout, saying how many came") {
  auto result = run(meshrun + " --nnodes 2:3 --nproc-per-node 1 --master-addr 127.0.0.1 --rdzv-timeout 1 " +
                    "--master-port " + std::to_string(free_port_guess() + 5000) + " -- true");
  CHECK(result.exit_code != 0);
  CHECK_THAT(result.output, Catch::Contains("rendezvous timed out after 1 s: 1 of at least 2 nodes joined"));
  CHECK(result.seconds < 5);
}

namespace {

// Shell: seconds since the epoch, to time a step of a test.
const std::string now = "$(date +%s.%N)";

// A meshrun of an elastic job whose nodes beat every 0.2 s and are lost after 1 s of silence.
std::string beating_node(int port, const std::string& extra, const std::string& program) {
  return meshrun + " --nnodes 1:2 --nproc-per-node 1 --master-addr 127.0.0.1 --rdzv-timeout 20 --termination-grace 1 " +
         "--heartbeat-interval 0.2 --node-timeout 1 --master-port " + std::to_string(port) + " " + extra + " -- " +
         program;
}

double number_after(const std::string& text, const std::string& label) {
  auto at = text.find(label);
  return at == std::string::npos ? -1 : std::atof(text.c_str() + at + label.size());
}

}  // namespace

TEST_CASE("a frozen node (SIGSTOP) is declared lost after --node-timeout and node 0 restarts without it") {
  auto dir = scratch_dir("frozen-restart");
  int port = free_port_guess() + 7000;
  auto node = beating_node(port, "--rdzv-last-call 1 --max-restarts 1", rank_program + " elastic " + dir.string());
  // Attempt 0's ranks sleep; node 1's meshrun is stopped, its link stays open but silent.
  auto result = run(node + " & first=$!; sleep 0.3; " + node + " & second=$!; " + wait_for(dir / "attempt0-rank0.txt") +
                    wait_for(dir / "attempt0-rank1.txt") + "stopped=" + now + "; kill -STOP $second; wait $first; " +
                    "echo code $? after $(echo \"" + now + " - $stopped\" | bc); kill -CONT $second; wait $second; " +
                    "echo node 1 code $?");
  CHECK_THAT(result.output, Catch::Contains("node 1 (meshrun at 127.0.0.1:"));
  CHECK_THAT(result.output, Catch::Contains(") sent nothing for 1"));
  CHECK_THAT(result.output, Catch::Contains(" s (--node-timeout 1): declaring it lost"));
  CHECK_THAT(result.output, Catch::Contains("restarting all ranks (restart 1 of 1)"));
  CHECK_THAT(result.output, Catch::Contains("attempt 1 runs on 1 node(s)"));
  CHECK_THAT(result.output, Catch::Contains("code 0 after"));
  // Lost within the timeout (1 s), restarted alone and finished well before the 60 s sleep.
  CHECK(number_after(result.output, "code 0 after ") > 0);
  CHECK(number_after(result.output, "code 0 after ") < 4);
  // Woken up, the frozen node finds its link closed and leaves instead of waiting.
  CHECK_THAT(result.output, Catch::Contains("lost contact with meshrun on node 0"));
  CHECK_THAT(result.output, Catch::Contains("node 1 code 1"));
  fs::remove_all(dir);
}

TEST_CASE("node 0 whose ranks finished does not wait for a frozen node: it exits naming it") {
  auto dir = scratch_dir("frozen-exit");
  int port = free_port_guess() + 7100;
  // The ranks end after a second, as training does, while node 1's meshrun is stopped.
  auto program = "sh -c 'touch " + dir.string() + "/started-$RANK; sleep 1'";
  auto node = beating_node(port, "--rdzv-last-call 1", program);
  auto result = run(node + " & first=$!; sleep 0.3; " + node + " & second=$!; " + wait_for(dir / "started-0") +
                    wait_for(dir / "started-1") + "stopped=" + now + "; kill -STOP $second; wait $first; " +
                    "echo code $? after $(echo \"" + now + " - $stopped\" | bc); kill -CONT $second; wait $second");
  CHECK_THAT(result.output, Catch::Contains("sent nothing for 1"));
  CHECK_THAT(result.output, Catch::Contains("(--node-timeout 1): declaring it lost"));
  CHECK_THAT(result.output, Catch::Contains("node 1 (meshrun at 127.0.0.1:"));
  CHECK_THAT(result.output, Catch::Contains("code 1 after"));
  CHECK(number_after(result.output, "code 1 after ") < 4);
  fs::remove_all(dir);
}

TEST_CASE("meshrun refuses a --node-timeout not longer than --heartbeat-interval") {
  auto result = run(meshrun + " --nproc-per-node 1 --heartbeat-interval 2 --node-timeout 1 -- true");
  CHECK(result.exit_code != 0);
  CHECK_THAT(result.output, Catch::Contains("--node-timeout: must be longer than --heartbeat-interval 2"));
}

TEST_CASE("node 0 refuses a stranger, a meshrun without the job token and one with a wrong token, naming them") {
  int port = free_port_guess() + 7200;
  auto node_zero = beating_node(port, "--rdzv-last-call 4 --job-token s3cret", "true");
  auto node = beating_node(port, "--rdzv-last-call 4", "true");
  const std::string link = std::to_string(port + 1);
  // A stranger that sends nothing, one that speaks another protocol: each timed until refused.
  const std::string stranger =
      "python3 -c \"import socket, time\nfor data in [b'', b'GET / HTTP/1.0\\\\r\\\\n\\\\r\\\\n']:\n"
      "  s = socket.create_connection(('127.0.0.1', " +
      link +
      ")); t = time.monotonic(); s.sendall(data)\n"
      "  s.settimeout(5); s.recv(100)\n  print('stranger port', s.getsockname()[1], 'refused after', "
      "round(time.monotonic() - t, 2))\"; ";
  auto result = run(node_zero + " & first=$!; sleep 0.3; " + stranger + node +
                    "; echo no token code $?; MESHTORCH_JOB_TOKEN=wrong " + node + "; echo wrong token code $?; " +
                    "wait $first; echo node 0 code $?");
  CHECK_THAT(result.output, Catch::Contains("it sent no hello within 800 ms"));
  CHECK_THAT(result.output, Catch::Contains("it is not a meshrun of this version (no hello)"));
  CHECK_THAT(result.output, Catch::Contains("refused a connection from 127.0.0.1:"));
  CHECK_THAT(result.output, Catch::Contains("it presented no job token (--job-token or MESHTORCH_JOB_TOKEN)"));
  CHECK_THAT(result.output, Catch::Contains("it presented a wrong job token (--job-token or MESHTORCH_JOB_TOKEN)"));
  CHECK_THAT(result.output, Catch::Contains("node 0 refused this node: no job token"));
  CHECK_THAT(result.output, Catch::Contains("no token code 1"));
  CHECK_THAT(result.output, Catch::Contains("wrong token code 1"));
  CHECK_THAT(result.output, Catch::Contains("node 0 code 0"));  // strangers do not end the job
  // Each stranger is named by its address and refused in under a second.
  for (std::size_t at = 0; (at = result.output.find("stranger port ", at)) != std::string::npos; ++at) {
    const int stranger_port = std::atoi(result.output.c_str() + at + 14);
    CHECK_THAT(result.output, Catch::Contains("refused a connection from 127.0.0.1:" + std::to_string(stranger_port)));
    CHECK(number_after(result.output.substr(at), "refused after ") < 1.0);
  }
  CHECK(result.output.find("stranger port ") != std::string::npos);
}

TEST_CASE("the node link listens on --master-addr only, not on every interface") {
  int port = free_port_guess() + 7300;
  auto node = beating_node(port, "--rdzv-last-call 2", "true");
  const std::string link = std::to_string(port + 1);
  auto probe = [&](const std::string& host) {
    return "python3 -c \"import socket\ntry:\n  socket.create_connection(('" + host + "', " + link +
           "), timeout=1); print('" + host + " accepted')\nexcept OSError as e: print('" + host +
           " refused', e.errno)\"; ";
  };
  auto result = run(node + " & first=$!; sleep 0.3; " + probe("127.0.0.1") + probe("127.0.0.2") + "wait $first");
  CHECK_THAT(result.output, Catch::Contains("127.0.0.1 accepted"));
  CHECK_THAT(result.output, Catch::Contains("127.0.0.2 refused 111"));  // ECONNREFUSED: nobody listens there
}
