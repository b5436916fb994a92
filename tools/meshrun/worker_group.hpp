#pragma once
// The ranks of one node: started with torchrun's environment, each in its own process group so
// that a signal reaches everything a rank started, and read back when they exit.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

extern char** environ;

namespace meshrun {

namespace fs = std::filesystem;

inline std::string signal_name(int signo) {
  if (const char* abbreviation = ::sigabbrev_np(signo)) return std::string("SIG") + abbreviation;
  return "signal " + std::to_string(signo);
}

// The first failure of an attempt, as every node reports it.
struct Failure {
  int global_rank = -1;  // -1: not a rank (meshrun was interrupted or lost a node)
  int exit_code = 1;     // what meshrun exits with: the rank's code, or 128 + signal
  std::string how;       // "exited with code 3", "was killed by SIGKILL"
  std::string error_file, message, log_file;
  // From a meshtorch watchdog's error file: the rank(s) a stalled collective waited for.
  std::string culprit, flight_recorder;
  int node_rank = 0, local_rank = -1;

  // Set by node 0 only: another node's meshrun left (its link dropped, or it was interrupted),
  // or a node joined an elastic job. Both allow a restart with the nodes then present.
  bool node_left = false, membership_change = false;

  bool restartable() const { return global_rank >= 0 || node_left || membership_change; }
};

struct Worker {
  int local_rank = 0, global_rank = 0;
  pid_t pid = -1;
  bool running = false;
  std::string exec_error;
  fs::path dir, error_file;
  int output_pipe[3] = {-1, -1, -1};  // read ends of prefixed stdout (1) and stderr (2)
  std::string partial_line[3];
};

struct GroupSettings {
  int nproc_per_node = 1, nnodes = 1, node_rank = 0, max_restarts = 0;
  std::string master_addr;
  int master_port = 0;
  std::string job_token;  // the ranks present it to rank 0's store; empty: none
  int redirects = 0;      // torchrun's bits: 1 stdout to a file, 2 stderr to a file, 3 both
  bool prefix_output = false;
  fs::path run_dir;  // <run_dir>/<attempt>/<global rank>/{stdout.log,stderr.log,error.json}
  bool set_omp_num_threads = false;
  std::vector<std::string> command;
};

// The message of a torchelastic error file: {"message": {"message": ...}} or {"message": "..."}.
inline std::string read_error_message(const fs::path& path) {
  std::ifstream file(path);
  if (!file) return {};
  auto json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("message")) return {};
  const auto& message = json["message"];
  if (message.is_string()) return message.get<std::string>();
  if (message.is_object() && message.contains("message") && message["message"].is_string())
    return message["message"].get<std::string>();
  return message.dump();
}

// The culprit a meshtorch watchdog names in the error file's extraInfo ("culprit", and the
// folder of its flight recorder dumps), empty for other errors.
inline std::pair<std::string, std::string> read_error_culprit(const fs::path& path) {
  std::ifstream file(path);
  if (!file) return {};
  auto json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("message") || !json["message"].is_object()) return {};
  const auto& extra = json["message"].value("extraInfo", nlohmann::json::object());
  if (!extra.is_object()) return {};
  auto text = [&](const char* key) {
    return extra.contains(key) && extra[key].is_string() ? extra[key].get<std::string>() : std::string();
  };
  return {text("culprit"), text("flight_recorder")};
}

class WorkerGroup {
 public:
  explicit WorkerGroup(GroupSettings settings) : settings_(std::move(settings)) {}

  std::vector<Worker>& workers() { return workers_; }
  const GroupSettings& settings() const { return settings_; }
  // Elastic jobs number the nodes again at each rendezvous.
  void set_membership(int node_rank, int nnodes) {
    settings_.node_rank = node_rank;
    settings_.nnodes = nnodes;
  }
  bool any_running() const {
    for (auto& w : workers_)
      if (w.running) return true;
    return false;
  }

  void start(int attempt) {
    workers_.assign(static_cast<std::size_t>(settings_.nproc_per_node), Worker{});
    for (int local = 0; local < settings_.nproc_per_node; ++local) {
      auto& w = workers_[static_cast<std::size_t>(local)];
      w.local_rank = local;
      w.global_rank = settings_.node_rank * settings_.nproc_per_node + local;
      w.dir = settings_.run_dir / std::to_string(attempt) / std::to_string(w.global_rank);
      w.error_file = w.dir / "error.json";
      fs::create_directories(w.dir);
      fs::remove(w.error_file);
      spawn(w, attempt);
    }
  }

  void signal_all(int signo) {
    for (auto& w : workers_)
      // Until the child's setsid() has run, its group does not exist yet: signal the child itself.
      if (w.running && ::kill(-w.pid, signo) != 0 && errno == ESRCH) ::kill(w.pid, signo);
  }

  // Reaps exited ranks; returns a Failure for each that exited non-zero or by a signal.
  std::vector<Failure> reap() {
    std::vector<Failure> failures;
    int status = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      for (auto& w : workers_) {
        if (w.pid != pid || !w.running) continue;
        w.running = false;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
        Failure failure;
        failure.global_rank = w.global_rank;
        failure.local_rank = w.local_rank;
        failure.node_rank = settings_.node_rank;
        if (WIFSIGNALED(status)) {
          failure.exit_code = 128 + WTERMSIG(status);
          failure.how = "was killed by " + signal_name(WTERMSIG(status));
        } else {
          failure.exit_code = WEXITSTATUS(status);
          failure.how = "exited with code " + std::to_string(failure.exit_code);
        }
        if (!w.exec_error.empty()) failure.how = "could not be started: " + w.exec_error;
        failure.error_file = w.error_file.string();
        failure.message = read_error_message(w.error_file);
        std::tie(failure.culprit, failure.flight_recorder) = read_error_culprit(w.error_file);
        if (settings_.redirects & 2) failure.log_file = (w.dir / "stderr.log").string();
        failures.push_back(failure);
        break;
      }
    }
    return failures;
  }

  // Read ends of the prefixed output pipes still open, with their worker and stream.
  std::vector<std::tuple<int, Worker*, int>> output_pipes() {
    std::vector<std::tuple<int, Worker*, int>> pipes;
    for (auto& w : workers_)
      for (int stream : {1, 2})
        if (w.output_pipe[stream] >= 0) pipes.emplace_back(w.output_pipe[stream], &w, stream);
    return pipes;
  }

  // Copies what a rank wrote to meshrun's own stream, each line prefixed with "[rankN]:".
  // Returns false when nothing more can be read now; at end of file the pipe is closed.
  bool forward_output(Worker& w, int stream) {
    char chunk[8192];
    ssize_t n = ::read(w.output_pipe[stream], chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) return true;
    if (n == 0) close_output(w, stream);
    if (n <= 0) return false;
    auto& partial = w.partial_line[stream];
    partial.append(chunk, static_cast<std::size_t>(n));
    std::string prefix = "[rank" + std::to_string(w.global_rank) + "]:", out;
    std::size_t start = 0;
    for (std::size_t newline; (newline = partial.find('\n', start)) != std::string::npos; start = newline + 1)
      out += prefix + partial.substr(start, newline + 1 - start);
    partial.erase(0, start);
    write_all(stream, out);
    return true;
  }

  // After every rank has exited: copies what is left, and closes the pipes even if something a
  // rank started in the background still holds them open.
  void drain_output() {
    for (auto& [fd, w, stream] : output_pipes()) {
      while (forward_output(*w, stream)) {
      }
      if (w->output_pipe[stream] >= 0) close_output(*w, stream);
    }
  }

 private:
  void close_output(Worker& w, int stream) {
    if (!w.partial_line[stream].empty())
      write_all(stream, "[rank" + std::to_string(w.global_rank) + "]:" + w.partial_line[stream] + "\n");
    w.partial_line[stream].clear();
    ::close(w.output_pipe[stream]);
    w.output_pipe[stream] = -1;
  }

  static void write_all(int fd, const std::string& text) {
    for (std::size_t done = 0; done < text.size();) {
      ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      done += static_cast<std::size_t>(n);
    }
  }

  std::vector<std::string> environment(const Worker& w, int attempt) const {
    std::map<std::string, std::string> variables;
    for (char** entry = environ; *entry; ++entry) {
      std::string text(*entry);
      auto equals = text.find('=');
      if (equals != std::string::npos) variables[text.substr(0, equals)] = text.substr(equals + 1);
    }
    int world_size = settings_.nnodes * settings_.nproc_per_node;
    variables["RANK"] = std::to_string(w.global_rank);
    variables["WORLD_SIZE"] = std::to_string(world_size);
    variables["LOCAL_RANK"] = std::to_string(w.local_rank);
    variables["LOCAL_WORLD_SIZE"] = std::to_string(settings_.nproc_per_node);
    variables["GROUP_RANK"] = std::to_string(settings_.node_rank);
    variables["GROUP_WORLD_SIZE"] = std::to_string(settings_.nnodes);
    variables["MASTER_ADDR"] = settings_.master_addr;
    variables["MASTER_PORT"] = std::to_string(settings_.master_port);
    if (!settings_.job_token.empty()) variables["MESHTORCH_JOB_TOKEN"] = settings_.job_token;
    variables["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    variables["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(settings_.max_restarts);
    variables["TORCHELASTIC_ERROR_FILE"] = w.error_file.string();
    // Where meshtorch ranks write their flight recorder on a timeout, beside their logs.
    if (!variables.count("MESHTORCH_FLIGHT_RECORDER_DIR"))
      variables["MESHTORCH_FLIGHT_RECORDER_DIR"] =
          (settings_.run_dir / std::to_string(attempt) / "flight_recorder").string();
    if (settings_.set_omp_num_threads) variables["OMP_NUM_THREADS"] = "1";
    std::vector<std::string> result;
    for (auto& [name, value] : variables) result.push_back(name + "=" + value);
    return result;
  }

  int open_log(const Worker& w, const char* name) const {
    auto path = w.dir / name;
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw std::runtime_error("cannot write " + path.string() + ": " + std::strerror(errno));
    return fd;
  }

  void spawn(Worker& w, int attempt) {
    auto env_strings = environment(w, attempt);
    std::vector<char*> argv, envp;
    for (auto& arg : settings_.command) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    for (auto& entry : env_strings) envp.push_back(const_cast<char*>(entry.c_str()));
    envp.push_back(nullptr);

    int child_fd[3] = {-1, -1, -1};
    for (int stream : {1, 2}) {
      if (settings_.redirects & stream) {
        child_fd[stream] = open_log(w, stream == 1 ? "stdout.log" : "stderr.log");
      } else if (settings_.prefix_output) {
        int ends[2];
        if (::pipe2(ends, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
        ::fcntl(ends[0], F_SETFL, O_NONBLOCK);
        w.output_pipe[stream] = ends[0];
        child_fd[stream] = ends[1];
      }
    }
    // The child writes errno here when exec fails; a successful exec closes it (O_CLOEXEC).
    int exec_status[2];
    if (::pipe2(exec_status, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      // Its own session (and so process group), as torchrun gives each rank: the scheduler's
      // autogroups then weigh ranks like torchrun's, and a signal to -pid reaches the whole rank.
      ::setsid();
#if defined(__linux__)
      // If meshrun itself is SIGKILLed, its ranks must not live on holding the GPUs and ports.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
#endif
      ::signal(SIGPIPE, SIG_DFL);
      for (int stream : {1, 2})
        if (child_fd[stream] >= 0) ::dup2(child_fd[stream], stream);
      ::execvpe(argv[0], argv.data(), envp.data());
      int error = errno;
      (void)!::write(exec_status[1], &error, sizeof error);
      ::_exit(127);
    }
    ::close(exec_status[1]);
    for (int stream : {1, 2})
      if (child_fd[stream] >= 0) ::close(child_fd[stream]);
    int error = 0;
    ssize_t n;
    while ((n = ::read(exec_status[0], &error, sizeof error)) < 0 && errno == EINTR) {
    }
    ::close(exec_status[0]);
    if (n == static_cast<ssize_t>(sizeof error))
      w.exec_error = "'" + settings_.command[0] + "': " + std::strerror(error);
    w.pid = pid;
    w.running = true;
  }

  GroupSettings settings_;
  std::vector<Worker> workers_;
};

}  // namespace meshrun
