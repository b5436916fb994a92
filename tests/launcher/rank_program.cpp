// A stand-in for a training program, started by meshrun in the launcher tests. Each mode does one
// thing a real rank might: report its environment, fail, die by a signal, or throw.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/diagnostics/error_file.hpp>

namespace {

int variable(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : -1;
}

// Ranks that are not the failing one wait here, to be stopped by meshrun.
int sleep_long() {
  ::sleep(60);
  return 0;
}

}  // namespace

// Modes:
//   env DIR                     write DIR/rank<R>.txt with the launch environment as this rank sees it
//   exit-on-rank R CODE         rank R exits with CODE after a moment; the others sleep
//   kill-on-rank R              rank R kills itself with SIGKILL; the others sleep
//   throw-on-rank R MESSAGE     rank R throws std::runtime_error(MESSAGE) out of main; the others sleep
//   fail-first-attempt CODE     rank 0 exits with CODE on attempt 0; every rank succeeds on a restart
//   elastic DIR                 write DIR/attempt<A>-rank<R>.txt as env does; sleep on attempt 0, end on later ones
int main(int argc, char** argv) {
  return meshtorch::diagnostics::run_recorded([&]() -> int {
    std::string mode = argc > 1 ? argv[1] : "";
    auto env = meshtorch::comm::launch_env();
    auto argument = [&](int i) { return i < argc ? std::string(argv[i]) : std::string(); };
    if (mode == "env" || mode == "elastic") {
      const std::string name = mode == "env" ? "rank" + std::to_string(env.rank)
                                             : "attempt" + std::to_string(variable("TORCHELASTIC_RESTART_COUNT")) +
                                                   "-rank" + std::to_string(env.rank);
      std::ofstream out(argument(2) + "/" + name + ".txt");
      out << env.rank << ' ' << env.world_size << ' ' << env.local_rank << ' ' << env.local_world_size << ' '
          << env.master_addr << ' ' << env.master_port << ' ' << env.launcher << ' ' << variable("GROUP_RANK") << ' '
          << variable("TORCHELASTIC_RESTART_COUNT") << ' ' << variable("OMP_NUM_THREADS") << ' '
          << (std::getenv("TORCHELASTIC_ERROR_FILE") ? "error-file" : "none") << '\n';
      out.close();
      return mode == "elastic" && variable("TORCHELASTIC_RESTART_COUNT") == 0 ? sleep_long() : 0;
    }
    bool chosen = env.rank == std::atoi(argument(2).c_str());
    if (mode == "exit-on-rank") {
      if (!chosen) return sleep_long();
      ::usleep(200'000);
      return std::atoi(argument(3).c_str());
    }
    if (mode == "kill-on-rank") {
      if (!chosen) return sleep_long();
      ::usleep(200'000);
      ::raise(SIGKILL);
    }
    if (mode == "throw-on-rank") {
      if (!chosen) return sleep_long();
      ::usleep(200'000);
      throw std::runtime_error(argument(3));
    }
    if (mode == "fail-first-attempt") {
      std::cout << "attempt " << variable("TORCHELASTIC_RESTART_COUNT") << " rank " << env.rank << std::endl;
      if (variable("TORCHELASTIC_RESTART_COUNT") == 0 && env.rank == 0) return std::atoi(argument(2).c_str());
      return 0;
    }
    throw std::invalid_argument("unknown mode '" + mode + "'");
  });
}
