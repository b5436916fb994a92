// meshrun: starts the ranks of one node of a distributed job with torchrun's environment,
// watches them, and tears them all down as soon as one fails, saying which failed first.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "node_link.hpp"
#include "worker_group.hpp"

namespace meshrun {
namespace {

struct Options {
  int nproc_per_node = 1, nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500, rdzv_port = 0;
  double rdzv_timeout_s = 900, termination_grace_s = 5;
  std::string log_dir;
  std::optional<int> redirects;
  bool prefix_output = false;
  int max_restarts = 0;
  std::vector<std::string> command;
};

void say(const std::string& line) { std::cerr << "[meshrun] " + line + "\n" << std::flush; }

// Signal handlers only write the signal's number here; the main loop does the work.
int signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int signo) {
  int saved_errno = errno;
  char byte = static_cast<char>(signo);
  (void)!::write(signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

void install_signal_handlers() {
  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1}) ::sigaction(signo, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a node link that drops is seen by send(), not by a signal
}

std::string encode(const Failure& f) {
  return std::to_string(f.global_rank) + "\t" + std::to_string(f.exit_code) + "\t" + std::to_string(f.node_rank) +
         "\t" + std::to_string(f.local_rank) + "\t" + one_line(f.how) + "\t" + one_line(f.error_file) + "\t" +
         one_line(f.message) + "\t" + one_line(f.log_file) + "\t" + one_line(f.culprit) + "\t" +
         one_line(f.flight_recorder);
}

std::optional<Failure> decode(const std::vector<std::string>& fields, std::size_t first) {
  if (fields.size() < first + 8) return std::nullopt;
  Failure f;
  f.global_rank = std::atoi(fields[first].c_str());
  f.exit_code = std::atoi(fields[first + 1].c_str());
  f.node_rank = std::atoi(fields[first + 2].c_str());
  f.local_rank = std::atoi(fields[first + 3].c_str());
  f.how = fields[first + 4];
  f.error_file = fields[first + 5];
  f.message = fields[first + 6];
  f.log_file = fields[first + 7];
  if (fields.size() >= first + 10) {
    f.culprit = fields[first + 8];
    f.flight_recorder = fields[first + 9];
  }
  return f;
}

void report(const Failure& f, int attempt) {
  if (!f.restartable()) {
    say(f.how);
    return;
  }
  say("rank " + std::to_string(f.global_rank) + " (node " + std::to_string(f.node_rank) + ", local rank " +
      std::to_string(f.local_rank) + ", attempt " + std::to_string(attempt) + ") failed first: it " + f.how);
  if (!f.message.empty())
    say("  error file " + f.error_file + ": " + f.message);
  else
    say("  no error file at " + f.error_file + " (a program records one with meshtorch::comm::run_recorded)");
  if (!f.log_file.empty()) say("  its stderr: " + f.log_file);
  // A rank that ended on a stalled collective names who stalled it: that is the rank to look at.
  if (!f.culprit.empty()) {
    say("the job stalled: " + f.culprit + " (named by rank " + std::to_string(f.global_rank) + ")");
    if (!f.flight_recorder.empty())
      say("  flight recorder dumps: " + f.flight_recorder + " (meshtorch-diagnose " + f.flight_recorder + ")");
  }
}

class Supervisor {
 public:
  Supervisor(Options options, GroupSettings settings)
      : options_(std::move(options)), group_(std::move(settings)) {}

  int run() {
    connect_nodes();
    for (int attempt = 0;; ++attempt) {
      auto started = Clock::now();
      auto failure = run_attempt(attempt);
      double seconds = std::chrono::duration<double>(Clock::now() - started).count();
      if (!failure) {
        char elapsed[32];
        std::snprintf(elapsed, sizeof elapsed, "%.2f", seconds);
        int world = options_.nnodes * options_.nproc_per_node;
        say("all " + std::to_string(world) + " ranks" +
            (options_.nnodes > 1 ? " (" + std::to_string(options_.nnodes) + " nodes)" : "") +
            " finished successfully in " + elapsed + " s" +
            (attempt > 0 ? " after " + std::to_string(attempt) + " restart(s)" : ""));
        return 0;
      }
      report(*failure, attempt);
      if (!failure->restartable() || attempt >= options_.max_restarts) {
        say("exiting with code " + std::to_string(failure->exit_code));
        return failure->exit_code;
      }
      say("restarting all ranks (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(options_.max_restarts) + ")");
    }
  }

 private:
  void connect_nodes() {
    if (options_.nnodes == 1) return;
    JobShape shape{options_.nnodes, options_.nproc_per_node, options_.max_restarts};
    auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.rdzv_timeout_s * 1000));
    int port = options_.rdzv_port ? options_.rdzv_port : options_.master_port + 1;
    if (options_.node_rank == 0) {
      say("waiting for " + std::to_string(options_.nnodes - 1) + " more node(s) on port " + std::to_string(port));
      nodes_ = accept_nodes(port, shape, deadline);
      node_lost_.assign(nodes_.size(), false);
    } else {
      node_zero_.emplace(join_node_zero(options_.master_addr, port, options_.node_rank, shape, deadline));
    }
  }

  // Runs one attempt of the whole job; returns its first failure, or nothing on success.
  std::optional<Failure> run_attempt(int attempt) {
    failure_.reset();
    stopping_ = killed_ = false;
    interrupts_ = 0;
    std::vector<bool> node_finished(nodes_.size(), false);
    bool sent_finished = false, ended = false;
    group_.start(attempt);

    while (true) {
      if (!group_.any_running()) {
        group_.drain_output();
        if (options_.nnodes == 1) break;
        if (options_.node_rank == 0) {
          if (std::find(node_finished.begin(), node_finished.end(), false) == node_finished.end()) {
            for (auto& node : nodes_) node.send("end");
            break;
          }
        } else {
          if (!node_zero_) break;
          if (!sent_finished) node_zero_->send("finished");
          sent_finished = true;
          if (ended) break;
        }
      }

      std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
      auto pipes = group_.output_pipes();
      for (auto& [fd, worker, stream] : pipes) fds.push_back({fd, POLLIN, 0});
      std::size_t first_node_fd = fds.size();
      if (node_zero_) fds.push_back({node_zero_->fd(), POLLIN, 0});
      // A lost node's socket stays readable (end of file): poll it no more.
      for (std::size_t i = 0; i < nodes_.size(); ++i) fds.push_back({node_lost_[i] ? -1 : nodes_[i].fd(), POLLIN, 0});
      int timeout_ms = -1;
      if (stopping_ && !killed_)
        timeout_ms = static_cast<int>(std::max<long long>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline_ - Clock::now()).count() + 1));
      ::poll(fds.data(), fds.size(), timeout_ms);

      if (stopping_ && !killed_ && Clock::now() >= kill_deadline_) {
        group_.signal_all(SIGKILL);
        killed_ = true;
      }
      if (fds[0].revents & POLLIN) handle_signals();
      for (std::size_t i = 0; i < pipes.size(); ++i)
        if (fds[i + 1].revents) group_.forward_output(*std::get<1>(pipes[i]), std::get<2>(pipes[i]));
      if (node_zero_ && fds[first_node_fd].revents) ended = handle_node_zero() || ended;
      for (std::size_t i = 0; i < nodes_.size(); ++i)
        if (!node_lost_[i] && fds[first_node_fd + i].revents) handle_node(i, node_finished);
    }
    return failure_;
  }

  void begin_stop(int signo) {
    if (!stopping_) kill_deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.termination_grace_s * 1000));
    stopping_ = true;
    group_.signal_all(signo);
    // A stopped rank (SIGSTOP, a debugger's stop) acts on no signal but SIGKILL until continued.
    if (signo != SIGKILL) group_.signal_all(SIGCONT);
  }

  // Records the job's first failure and stops every rank, on every node.
  void note_failure(const Failure& failure, int stop_signal = SIGTERM) {
    if (failure_) return;
    failure_ = failure;
    begin_stop(stop_signal);
    for (auto& node : nodes_) node.send("stop\t" + encode(failure));
    if (node_zero_) node_zero_->send("failed\t" + encode(failure));
  }

  void handle_signals() {
    char signals[64];
    ssize_t n;
    while ((n = ::read(signal_pipe[0], signals, sizeof signals)) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        int signo = signals[i];
        if (signo == SIGCHLD) {
          for (auto& failure : group_.reap()) note_failure(failure);
          continue;
        }
        if (signo == SIGUSR1) {
          request_stacks("received SIGUSR1");
          continue;
        }
        if (++interrupts_ > 1) {
          say("received " + signal_name(signo) + " again; killing all ranks");
          group_.signal_all(SIGKILL);
          killed_ = true;
          continue;
        }
        say("received " + signal_name(signo) + "; passing it to all ranks");
        Failure interrupted;
        interrupted.exit_code = 128 + signo;
        interrupted.node_rank = options_.node_rank;
        interrupted.how = "meshrun on node " + std::to_string(options_.node_rank) + " received " + signal_name(signo);
        if (failure_) {
          begin_stop(signo);
        } else {
          note_failure(interrupted, signo);
        }
      }
    }
  }

  // Every rank of the job writes the stacks of its threads to its log (SIGUSR1, which launch()
  // handles: comm/stack_dump.hpp). Node 0 passes the request to every node; another node asks
  // node 0, so that each rank is asked once.
  void request_stacks(const std::string& why) {
    if (node_zero_) {
      say(why + ": asking node 0 to have every rank write its stacks");
      node_zero_->send("stacks");
      return;
    }
    say(why + ": every rank writes the stacks of its threads to its log");
    group_.signal_all(SIGUSR1);
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (!node_lost_[i]) nodes_[i].send("stacks");
  }

  // A line from node 0; returns true once it says the attempt has ended on every node.
  bool handle_node_zero() {
    std::vector<std::string> lines;
    if (!node_zero_->receive(lines)) {
      Failure lost;
      lost.node_rank = options_.node_rank;
      lost.how = "lost contact with meshrun on node 0 (" + options_.master_addr + ")";
      note_failure(lost);
      failure_ = lost;  // this node cannot take part in a restart
      node_zero_.reset();
      return true;
    }
    bool ended = false;
    for (auto& line : lines) {
      auto fields = split_fields(line);
      if (fields[0] == "stop") {
        auto failure = decode(fields, 1);
        if (!failure) continue;
        if (!failure_) note_failure(*failure);
        failure_ = failure;  // node 0's first failure is the job's, so every node agrees
        begin_stop(SIGTERM);
      } else if (fields[0] == "end") {
        ended = true;
      } else if (fields[0] == "stacks") {
        say("node 0 asks every rank for its stacks");
        group_.signal_all(SIGUSR1);
      }
    }
    return ended;
  }

  void handle_node(std::size_t index, std::vector<bool>& node_finished) {
    std::vector<std::string> lines;
    auto& node = nodes_[index];
    if (!node.receive(lines)) {
      if (node_finished[index] && !failure_) return;
      Failure lost;
      lost.node_rank = node.node_rank();
      lost.how = "lost contact with meshrun on node " + std::to_string(node.node_rank());
      note_failure(lost);
      node_finished[index] = true;
      node_lost_[index] = true;
      return;
    }
    for (auto& line : lines) {
      auto fields = split_fields(line);
      if (fields[0] == "failed") {
        if (auto failure = decode(fields, 1)) note_failure(*failure);
      } else if (fields[0] == "finished") {
        node_finished[index] = true;
      } else if (fields[0] == "stacks") {
        request_stacks("node " + std::to_string(node.node_rank()) + " received SIGUSR1");
      }
    }
  }

  Options options_;
  WorkerGroup group_;
  std::vector<Peer> nodes_;         // on node 0: the other nodes
  std::vector<bool> node_lost_;
  std::optional<Peer> node_zero_;   // on the other nodes
  std::optional<Failure> failure_;
  bool stopping_ = false, killed_ = false;
  int interrupts_ = 0;
  Clock::time_point kill_deadline_;
};

// `meshrun --dump-stacks [--pid P]`: sends SIGUSR1 to every meshrun of this user on this node
// (the same executable; or only P), each of which has its job's ranks write their threads'
// stacks to their logs.
int dump_stacks(pid_t only) {
  std::error_code error;
  const auto self = fs::read_symlink("/proc/self/exe", error);
  if (error) throw std::runtime_error("cannot read /proc/self/exe: " + error.message());
  int signalled = 0;
  for (const auto& entry : fs::directory_iterator("/proc", error)) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::atoi(name.c_str());
    if (pid == ::getpid() || (only != 0 && pid != only)) continue;
    std::error_code unreadable;
    if (fs::read_symlink(entry.path() / "exe", unreadable) != self || unreadable) continue;
    std::ifstream cmdline_file(entry.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(cmdline_file)), std::istreambuf_iterator<char>());
    if (cmdline.find(std::string("--dump-stacks\0", 14)) != std::string::npos) continue;  // another request
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (::kill(pid, SIGUSR1) != 0) {
      say("cannot signal meshrun pid " + std::to_string(pid) + ": " + std::strerror(errno));
      continue;
    }
    say("asked meshrun pid " + std::to_string(pid) + " (" + cmdline.substr(0, 120) +
        ") for its ranks' stacks; they appear in the ranks' logs");
    ++signalled;
  }
  if (signalled == 0) {
    say(only ? "pid " + std::to_string(only) + " is not a meshrun of this user on this node"
             : "no meshrun of this user runs on this node");
    return 1;
  }
  return 0;
}

int run(int argc, char** argv) {
  Options options;
  CLI::App app{"meshrun --nproc-per-node N [options] -- PROGRAM [ARGS...]\n\nStarts PROGRAM once per rank of this node with torchrun's environment (RANK, WORLD_SIZE, "
               "LOCAL_RANK, MASTER_ADDR, ...), and stops every rank as soon as one fails.",
               "meshrun"};
  bool dump_stacks_only = false;
  app.add_flag("--dump-stacks", dump_stacks_only,
               "do not start a job: have the ranks of every meshrun on this node write the stacks of their threads "
               "to their logs (as SIGUSR1 to a meshrun does), then exit");
  int dump_stacks_pid = 0;
  app.add_option("--pid", dump_stacks_pid, "with --dump-stacks: only the meshrun with this process id")
      ->check(CLI::PositiveNumber);
  auto* nproc = app.add_option("--nproc-per-node,--nproc_per_node", options.nproc_per_node, "ranks on this node")
                    ->check(CLI::PositiveNumber);
  app.add_option("--nnodes", options.nnodes, "number of nodes, each running its own meshrun")
      ->check(CLI::PositiveNumber);
  app.add_option("--node-rank,--node_rank", options.node_rank, "this node's index, 0 .. nnodes-1")
      ->check(CLI::NonNegativeNumber);
  auto* master_addr = app.add_option("--master-addr,--master_addr", options.master_addr,
                                     "host of node 0, where rank 0 serves the rendezvous store");
  app.add_option("--master-port,--master_port", options.master_port, "port of rank 0's rendezvous store")
      ->check(CLI::Range(1, 65535));
  app.add_option("--rdzv-port", options.rdzv_port, "port on node 0 where the meshruns meet (default: master port + 1)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--rdzv-timeout", options.rdzv_timeout_s, "seconds to wait for all nodes to join")
      ->check(CLI::PositiveNumber);
  app.add_option("--log-dir", options.log_dir, "write LOG_DIR/<attempt>/<rank>/{stdout,stderr}.log and error.json");
  app.add_option("--redirects", options.redirects,
                 "with --log-dir, which streams go to files: 0 none, 1 stdout, 2 stderr, 3 both (default 3)")
      ->check(CLI::Range(0, 3));
  app.add_flag("--prefix-output", options.prefix_output, "prefix each line a rank prints with [rankN]:");
  app.add_option("--max-restarts,--max_restarts", options.max_restarts, "restart the whole group this many times")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--termination-grace", options.termination_grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::NonNegativeNumber);
  app.prefix_command();
  try {
    app.parse(argc, argv);
    if (dump_stacks_only) return dump_stacks(dump_stacks_pid);
    if (nproc->count() == 0) throw CLI::RequiredError("--nproc-per-node");
    options.command = app.remaining();
    if (!options.command.empty() && options.command.front() == "--") options.command.erase(options.command.begin());
    if (options.command.empty()) throw CLI::ValidationError("PROGRAM", "no program to run; put it after --");
    if (options.node_rank >= options.nnodes)
      throw CLI::ValidationError("--node-rank", "must be below --nnodes " + std::to_string(options.nnodes));
    if (options.nnodes > 1 && master_addr->count() == 0)
      throw CLI::ValidationError("--master-addr", "--nnodes > 1 needs the host of node 0");
    if (options.redirects.value_or(0) != 0 && options.log_dir.empty())
      throw CLI::ValidationError("--redirects", "needs --log-dir for the files");
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  GroupSettings settings;
  settings.nproc_per_node = options.nproc_per_node;
  settings.nnodes = options.nnodes;
  settings.node_rank = options.node_rank;
  settings.max_restarts = options.max_restarts;
  settings.master_addr = options.master_addr;
  settings.master_port = options.master_port;
  settings.redirects = options.log_dir.empty() ? 0 : options.redirects.value_or(3);
  settings.prefix_output = options.prefix_output;
  settings.command = options.command;
  bool temporary_run_dir = options.log_dir.empty();
  if (temporary_run_dir) {
    // Error files need a home even without --log-dir; kept after a failure for inspection.
    auto pattern = (fs::temp_directory_path() / "meshrun-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("cannot create a temporary folder in " + fs::temp_directory_path().string());
    settings.run_dir = pattern;
  } else {
    settings.run_dir = options.log_dir;
  }
  if (!std::getenv("OMP_NUM_THREADS")) {
    settings.set_omp_num_threads = true;
    if (options.nproc_per_node > 1)
      say("OMP_NUM_THREADS is not set: setting it to 1 for each rank so that " +
          std::to_string(options.nproc_per_node) + " ranks do not overload the CPUs; set it to tune");
  }

  install_signal_handlers();
  Supervisor supervisor(options, settings);
  int code = supervisor.run();
  if (temporary_run_dir && code == 0) {
    std::error_code ignored;
    fs::remove_all(settings.run_dir, ignored);
  }
  return code;
}

}  // namespace
}  // namespace meshrun

int main(int argc, char** argv) {
  try {
    return meshrun::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "[meshrun] error: " << e.what() << "\n";
    return 1;
  }
}
