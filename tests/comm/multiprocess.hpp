#pragma once
// Runs N ranks of this test program, each executing one hidden Catch2 test case chosen by tag,
// with the torchrun variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) and one compute thread. The rank bodies read nothing else, so any launcher can
// start them instead: meshrun --nproc-per-node N -- comm_tests "[rank_collectives]".
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace meshtorch::testing {

struct RankOutcome {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string output;  // stdout and stderr together
};

struct RanksOutcome {
  std::vector<RankOutcome> ranks;
  bool timed_out = false;
  double seconds = 0;

  bool all_succeeded() const {
    if (timed_out) return false;
    for (const auto& r : ranks)
      if (r.exit_code != 0) return false;
    return true;
  }

  // Every rank's status and output: printed when a multi-process test fails.
  std::string report() const {
    std::ostringstream out;
    out << (timed_out ? "TIMED OUT after " : "finished in ") << seconds << " s\n";
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      out << "---- rank " << r << ": exit " << ranks[r].exit_code;
      if (ranks[r].signal) out << " (signal " << ranks[r].signal << ")";
      out << "\n" << ranks[r].output << "\n";
    }
    return out.str();
  }
};

inline bool port_is_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  if (fd >= 0) ::close(fd);
  return free;
}

// A free port for the store, drawn at random below the kernel's ephemeral range: ports the
// kernel hands out for bind(0) come back soon after release, and two test runs side by side
// (or other programs' sockets) would then meet on one store.
inline int free_port() {
  static std::mt19937 draw(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
  std::uniform_int_distribution<int> port(20000, 32000);
  for (int attempt = 0; attempt < 100; ++attempt)
    if (const int p = port(draw); port_is_free(p)) return p;
  throw std::runtime_error("free_port: no free port in 20000-32000 on 127.0.0.1");
}

inline RanksOutcome run_ranks(int nprocs, const std::string& test_spec,
                              std::chrono::seconds deadline = std::chrono::seconds(60)) {
  const std::string program = std::filesystem::read_symlink("/proc/self/exe").string();
  const int port = free_port();
  const auto logs = std::filesystem::temp_directory_path() /
                    ("meshtorch-ranks-" + std::to_string(::getpid()) + "-" + std::to_string(port));
  std::filesystem::create_directories(logs);

  std::vector<std::string> base_env;
  for (char** e = environ; *e; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" && name != "LOCAL_WORLD_SIZE" &&
        name != "MASTER_ADDR" && name != "MASTER_PORT" && name != "OMP_NUM_THREADS" && name.rfind("SLURM_", 0) != 0 &&
        name.rfind("OMPI_", 0) != 0)
      base_env.push_back(entry);
  }

  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> pids(nprocs, -1);
  for (int rank = 0; rank < nprocs; ++rank) {
    std::vector<std::string> env = base_env;
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(nprocs));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nprocs));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("OMP_NUM_THREADS=1");
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args{program, test_spec, "--use-colour", "no"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    const std::string log = (logs / ("rank" + std::to_string(rank) + ".log")).string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int error = posix_spawn(&pids[rank], program.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (error != 0) throw std::runtime_error("run_ranks: cannot start " + program);
  }

  RanksOutcome outcome;
  outcome.ranks.resize(nprocs);
  int running = nprocs;
  while (running > 0) {
    for (int rank = 0; rank < nprocs; ++rank) {
      if (pids[rank] < 0) continue;
      int status = 0;
      if (::waitpid(pids[rank], &status, WNOHANG) == pids[rank]) {
        if (WIFEXITED(status)) outcome.ranks[rank].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) outcome.ranks[rank].signal = WTERMSIG(status);
        pids[rank] = -1;
        --running;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() - start > deadline) {
      outcome.timed_out = true;
      for (pid_t pid : pids)
        if (pid > 0) ::kill(pid, SIGKILL);
      for (int rank = 0; rank < nprocs; ++rank)
        if (pids[rank] > 0) {
          ::waitpid(pids[rank], nullptr, 0);
          outcome.ranks[rank].signal = SIGKILL;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < nprocs; ++rank) {
    std::ifstream in(logs / ("rank" + std::to_string(rank) + ".log"));
    outcome.ranks[rank].output.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::filesystem::remove_all(logs);
  return outcome;
}

}  // namespace meshtorch::testing
