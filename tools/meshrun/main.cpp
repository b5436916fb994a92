// meshrun: starts the ranks of one node of a distributed job with torchrun's environment,
// watches them, and tears them all down as soon as one fails, saying which failed first.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <stdlib.h>

#include "node_link.hpp"
#include "worker_group.hpp"

namespace meshrun {
namespace {

struct Options {
  int nproc_per_node = 1, node_rank = 0;
  JobShape shape;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500, rdzv_port = 0;
  double rdzv_timeout_s = 900, rdzv_last_call_s = 30, termination_grace_s = 5;
  std::string log_dir;
  std::optional<int> redirects;
  bool prefix_output = false;
  int max_restarts = 0;
  std::string job_token;  // --job-token or MESHTORCH_JOB_TOKEN; empty: none asked
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
  if (f.global_rank < 0) {
    say(f.how);
    return;
  }
  say("rank " + std::to_string(f.global_rank) + " (node " + std::to_string(f.node_rank) + ", local rank " +
      std::to_string(f.local_rank) + ", attempt " + std::to_string(attempt) + ") failed first: it " + f.how);
  if (!f.message.empty())
    say("  error file " + f.error_file + ": " + f.message);
  else
    say("  no error file at " + f.error_file + " (a program records one with meshtorch::diagnostics::run_recorded)");
  if (!f.log_file.empty()) say("  its stderr: " + f.log_file);
  // A rank that ended on a stalled collective names who stalled it: that is the rank to look at.
  if (!f.culprit.empty()) {
    say("the job stalled: " + f.culprit + " (named by rank " + std::to_string(f.global_rank) + ")");
    if (!f.flight_recorder.empty())
      say("  flight recorder dumps: " + f.flight_recorder + " (meshtorch-diagnose " + f.flight_recorder + ")");
  }
}

// A terminating signal while no ranks run (during a rendezvous round): the job ends.
struct Interrupted {
  int signo;
};

// --nnodes N, or MIN:MAX for an elastic job.
JobShape parse_nnodes(const std::string& text) {
  auto number = [&](std::string_view part) {
    int value = 0;
    auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (error != std::errc{} || end != part.data() + part.size() || value < 1)
      throw CLI::ValidationError("--nnodes", "'" + text + "' is not N or MIN:MAX with 1 <= MIN <= MAX");
    return value;
  };
  JobShape shape;
  auto colon = text.find(':');
  if (colon == std::string::npos) {
    shape.min_nodes = shape.max_nodes = number(text);
    return shape;
  }
  shape.elastic = true;
  shape.min_nodes = number(std::string_view(text).substr(0, colon));
  shape.max_nodes = number(std::string_view(text).substr(colon + 1));
  if (shape.min_nodes > shape.max_nodes) throw CLI::ValidationError("--nnodes", "'" + text + "': MIN is above MAX");
  return shape;
}

class Supervisor {
 public:
  Supervisor(Options options, GroupSettings settings) : options_(std::move(options)), group_(std::move(settings)) {}

  int run() {
    try {
      return supervise();
    } catch (const Interrupted& interrupted) {
      say("received " + signal_name(interrupted.signo) + " while no ranks were running; exiting");
      tell_nodes("exit\t" + std::to_string(128 + interrupted.signo));
      return 128 + interrupted.signo;
    }
  }

 private:
  const JobShape& shape() const { return options_.shape; }
  Clock::time_point rendezvous_deadline() const {
    return Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.rdzv_timeout_s * 1000));
  }
  Clock::duration heartbeat() const {
    return std::chrono::milliseconds(std::max<long long>(1, static_cast<long long>(shape().heartbeat_s * 1000)));
  }
  // A poll over node links wakes at least once per heartbeat, to send one and to notice silence.
  int heartbeat_ms() const {
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(heartbeat()).count());
  }
  // What to say of a link that has been silent for --node-timeout, or nothing while it beats.
  std::optional<std::string> silent(const Peer& peer, const std::string& who) const {
    const double quiet = std::chrono::duration<double>(Clock::now() - peer.last_heard()).count();
    if (quiet < shape().node_timeout_s) return std::nullopt;
    // Unread bytes are not silence: this meshrun may itself have been stopped, or its poll cut
    // short by a signal; the caller reads them on its next round.
    pollfd readable{peer.fd(), POLLIN, 0};
    if (peer.has_line() || ::poll(&readable, 1, 0) > 0) return std::nullopt;
    return who + " (meshrun at " + peer.address() + ") sent nothing for " + seconds_text(std::round(quiet * 10) / 10) +
           " s (--node-timeout " + seconds_text(shape().node_timeout_s) + "): declaring it lost";
  }

  int supervise() {
    connect_nodes();
    int counted_restarts = 0;
    for (int attempt = 0;; ++attempt) {
      int nnodes = 1;
      if (coordinator_) {
        nnodes = gather_nodes(attempt);
      } else {
        auto start = await_start();
        if (!start) return job_exit_code_;
        nnodes = start->nnodes;
        attempt = start->attempt;
      }
      auto started = Clock::now();
      auto failure = run_attempt(attempt);
      double seconds = std::chrono::duration<double>(Clock::now() - started).count();
      if (!failure) {
        char elapsed[32];
        std::snprintf(elapsed, sizeof elapsed, "%.2f", seconds);
        say("all " + std::to_string(nnodes * options_.nproc_per_node) + " ranks" +
            (nnodes > 1 ? " (" + std::to_string(nnodes) + " nodes)" : "") + " finished successfully in " + elapsed +
            " s" + (attempt > 0 ? " after " + std::to_string(attempt) + " restart(s)" : ""));
        tell_nodes("exit\t0");  // nodes waiting to join
        return 0;
      }
      report(*failure, attempt);
      if (!coordinator_) {
        // Node 0 decides whether and with whom the job restarts; a node that was interrupted
        // or lost node 0 cannot take part.
        if (!leaving_) continue;
        say("exiting with code " + std::to_string(failure->exit_code));
        return failure->exit_code;
      }
      const bool counted = !failure->membership_change;
      if (!failure->restartable() || interrupted_ || (counted && counted_restarts >= options_.max_restarts)) {
        say("exiting with code " + std::to_string(failure->exit_code));
        tell_nodes("exit\t" + std::to_string(failure->exit_code));
        return failure->exit_code;
      }
      if (counted) {
        ++counted_restarts;
        say("restarting all ranks (restart " + std::to_string(counted_restarts) + " of " +
            std::to_string(options_.max_restarts) + ")");
      } else {
        say("restarting all ranks with the nodes now in the job (not counted against --max-restarts)");
      }
    }
  }

  // Node 0 listens (static jobs: the node started with --node-rank 0; elastic jobs: the meshrun
  // that can listen on --master-addr's rendezvous port), every other node connects to it.
  void connect_nodes() {
    if (!shape().elastic && shape().max_nodes == 1) return;
    int port = options_.rdzv_port ? options_.rdzv_port : options_.master_port + 1;
    if (shape().elastic)
      listener_ = Listener::open(port, options_.master_addr, /*required=*/false);
    else if (options_.node_rank == 0)
      listener_ = Listener::open(port, options_.master_addr, /*required=*/true);
    const auto& host = options_.master_addr;
    if (listener_ && listener_->on_loopback() && host != "localhost" && host != "::1" && host.rfind("127.", 0) != 0)
      // A host's own name mapped to loopback (Debian's 127.0.1.1): nodes elsewhere could not reach it.
      throw std::runtime_error("--master-addr " + host +
                               " is a loopback address on this host, which the other nodes "
                               "cannot reach; give the address they use for it");
    if (listener_) {
      if (shape().elastic)
        say("node 0 of an elastic job of " + std::to_string(shape().min_nodes) + " to " +
            std::to_string(shape().max_nodes) + " nodes: waiting on port " + std::to_string(port) + " for nodes");
      else
        say("waiting for " + std::to_string(shape().max_nodes - 1) + " more node(s) on port " + std::to_string(port));
      return;
    }
    coordinator_ = false;
    node_zero_.emplace(join_node_zero(options_.master_addr, port, options_.node_rank, shape(), options_.job_token,
                                      rendezvous_deadline()));
  }

  // Node 0, before each attempt: the nodes that take part. A static job waits for every
  // --node-rank; an elastic one for at least MIN nodes, and once MIN are in, up to
  // --rdzv-last-call seconds more for others (at most MAX). Nodes of the previous attempt whose
  // link still stands stay in; nodes that joined during it come in now. Returns the node count.
  int gather_nodes(int attempt) {
    if (!listener_) return 1;
    std::vector<JoinedNode> candidates;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (node_lost_[i]) continue;
      const int asked_rank = shape().elastic ? -1 : nodes_[i].node_rank();
      candidates.push_back({std::move(nodes_[i]), asked_rank});
    }
    for (auto& node : waiting_) candidates.push_back(std::move(node));
    nodes_.clear();
    node_lost_.clear();
    waiting_.clear();

    const auto deadline = rendezvous_deadline();
    std::optional<Clock::time_point> last_call;
    while (true) {
      const int count = static_cast<int>(candidates.size()) + 1;
      if (count >= shape().min_nodes && !last_call)
        last_call = Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.rdzv_last_call_s * 1000));
      if (count >= shape().max_nodes || (shape().elastic && last_call && Clock::now() >= *last_call)) break;
      if (Clock::now() >= deadline) throw std::runtime_error(rendezvous_timeout(candidates));

      std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}, {listener_->fd(), POLLIN, 0}};
      for (auto& node : candidates) {
        node.peer.beat(heartbeat());
        fds.push_back({node.peer.fd(), POLLIN, 0});
      }
      auto until = last_call ? std::min(deadline, *last_call) : deadline;
      auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count() + 1;
      if (!candidates.empty()) wait_ms = std::min<long long>(wait_ms, heartbeat_ms());
      ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait_ms, 0)));
      if (fds[0].revents & POLLIN) handle_signals_between_attempts();
      // A candidate sends only heartbeats before "start": it has left when its link closes or
      // falls silent.
      for (std::size_t i = candidates.size(); i-- > 0;) {
        std::vector<std::string> ignored;
        auto quiet = silent(candidates[i].peer, "a node");
        if ((fds[i + 2].revents && !candidates[i].peer.receive(ignored)) || quiet) {
          say(quiet ? *quiet : "a node left before attempt " + std::to_string(attempt) + " started");
          candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      if (fds[1].revents & POLLIN) {
        std::string problem, refused;
        auto joined = listener_->accept(shape(), options_.job_token, problem, refused);
        if (!refused.empty()) say(refused);
        if (joined && !shape().elastic)
          for (auto& node : candidates)
            if (node.asked_rank == joined->asked_rank)
              problem = "two nodes were started with --node-rank " + std::to_string(node.asked_rank);
        if (!problem.empty()) {
          if (joined) joined->peer.send("error\t" + problem);
          if (attempt == 0) throw std::runtime_error(problem);  // a job started wrongly fails at once
          say("refused a node: " + problem);
        } else if (joined) {
          candidates.push_back(std::move(*joined));
        }
      }
    }

    if (!shape().elastic)
      std::sort(candidates.begin(), candidates.end(), [](auto& a, auto& b) { return a.asked_rank < b.asked_rank; });
    const int count = static_cast<int>(candidates.size()) + 1;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      const int node_rank = static_cast<int>(i) + 1;
      candidates[i].peer.set_node_rank(node_rank);
      candidates[i].peer.send("start\t" + std::to_string(node_rank) + "\t" + std::to_string(count) + "\t" +
                              std::to_string(attempt));
      nodes_.push_back(std::move(candidates[i].peer));
    }
    node_lost_.assign(nodes_.size(), false);
    group_.set_membership(0, count);
    if (shape().elastic) say("attempt " + std::to_string(attempt) + " runs on " + std::to_string(count) + " node(s)");
    return count;
  }

  std::string rendezvous_timeout(const std::vector<JoinedNode>& candidates) const {
    const int count = static_cast<int>(candidates.size()) + 1;
    std::string text =
        "rendezvous timed out after " + std::to_string(static_cast<long long>(options_.rdzv_timeout_s)) +
        " s: " + std::to_string(count) + " of " +
        (shape().elastic ? "at least " + std::to_string(shape().min_nodes) : std::to_string(shape().max_nodes)) +
        " nodes joined";
    if (!shape().elastic) {
      std::string missing;
      for (int rank = 1; rank < shape().max_nodes; ++rank)
        if (std::none_of(candidates.begin(), candidates.end(), [&](auto& node) { return node.asked_rank == rank; }))
          missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
      text += " (missing node rank(s) " + missing + ")";
    }
    return text;
  }

  // Every other node, before each attempt: node 0's word on what comes next. Returns the
  // attempt to run, or nothing when the job ends (its exit code in job_exit_code_).
  struct Start {
    int node_rank, nnodes, attempt;
  };
  std::optional<Start> await_start() {
    const auto deadline = rendezvous_deadline();
    bool said_waiting = false;
    while (true) {
      std::vector<std::string> lines;
      if (node_zero_->has_line()) {
        node_zero_->receive(lines);
      } else {
        pollfd fds[2] = {{signal_pipe[0], POLLIN, 0}, {node_zero_->fd(), POLLIN, 0}};
        auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (wait_ms <= 0)
          throw std::runtime_error("node 0 (" + options_.master_addr + ") did not start the next attempt within " +
                                   std::to_string(static_cast<long long>(options_.rdzv_timeout_s)) + " s");
        if (auto quiet = silent(*node_zero_, "node 0")) throw std::runtime_error(*quiet);
        node_zero_->beat(heartbeat());
        ::poll(fds, 2, static_cast<int>(std::min<long long>(wait_ms, heartbeat_ms())));
        if (fds[0].revents & POLLIN) handle_signals_between_attempts();
        if (fds[1].revents && !node_zero_->receive(lines))
          throw std::runtime_error("lost contact with meshrun on node 0 (" + options_.master_addr +
                                   ") while waiting for the next attempt");
      }
      for (std::size_t i = 0; i < lines.size(); ++i) {
        auto fields = split_fields(lines[i]);
        const auto& line = lines[i];
        if (fields[0] == "start" && fields.size() == 4) {
          node_zero_->put_back(lines, i + 1);  // a quick "stop" belongs to the attempt
          Start start{std::atoi(fields[1].c_str()), std::atoi(fields[2].c_str()), std::atoi(fields[3].c_str())};
          group_.set_membership(start.node_rank, start.nnodes);
          if (shape().elastic)
            say("this is node " + std::to_string(start.node_rank) + " of " + std::to_string(start.nnodes) +
                " for attempt " + std::to_string(start.attempt));
          return start;
        }
        if (fields[0] == "exit" && fields.size() == 2) {
          job_exit_code_ = std::atoi(fields[1].c_str());
          say("node 0 ends the job with code " + fields[1]);
          return std::nullopt;
        }
        if (fields[0] == "error") throw std::runtime_error(fields.size() > 1 ? fields[1] : line);
        if (fields[0] == "waiting" && !said_waiting) {
          say("node 0 is running an attempt without this node; this node joins when it restarts");
          said_waiting = true;
        }
      }
    }
  }

  void handle_signals_between_attempts() {
    char signals[64];
    for (ssize_t n; (n = ::read(signal_pipe[0], signals, sizeof signals)) > 0;)
      for (ssize_t i = 0; i < n; ++i) {
        int signo = signals[i];
        if (signo == SIGCHLD) continue;
        if (signo == SIGUSR1) {
          say("received SIGUSR1 while no ranks are running: no stacks to write");
          continue;
        }
        throw Interrupted{signo};
      }
  }

  // Node 0: a line to every node of the job and every node waiting to join.
  void tell_nodes(const std::string& line) {
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (node_lost_.empty() || !node_lost_[i]) nodes_[i].send(line);
    for (auto& node : waiting_) node.peer.send(line);
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
        if (coordinator_) {
          if (std::find(node_finished.begin(), node_finished.end(), false) == node_finished.end()) {
            for (std::size_t i = 0; i < nodes_.size(); ++i)
              if (!node_lost_[i]) nodes_[i].send("end");
            break;
          }
        } else {
          if (!node_zero_) break;
          if (!sent_finished) node_zero_->send("finished");
          sent_finished = true;
          if (ended || leaving_) break;  // node 0 sends a leaving node nothing more
        }
      }

      std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
      auto pipes = group_.output_pipes();
      for (auto& [fd, worker, stream] : pipes) fds.push_back({fd, POLLIN, 0});
      std::size_t first_node_fd = fds.size();
      if (node_zero_) fds.push_back({node_zero_->fd(), POLLIN, 0});
      // A lost node's socket stays readable (end of file): poll it no more.
      for (std::size_t i = 0; i < nodes_.size(); ++i) fds.push_back({node_lost_[i] ? -1 : nodes_[i].fd(), POLLIN, 0});
      std::size_t listener_fd = fds.size();
      if (listener_) fds.push_back({listener_->fd(), POLLIN, 0});
      std::size_t first_waiting_fd = fds.size();
      for (auto& node : waiting_) fds.push_back({node.peer.fd(), POLLIN, 0});
      for (auto& peer : linked_peers()) peer->beat(heartbeat());
      int timeout_ms = node_zero_ && node_zero_->has_line() ? 0 : -1;
      if (timeout_ms != 0 && !linked_peers().empty()) timeout_ms = heartbeat_ms();
      if (stopping_ && !killed_ && timeout_ms != 0) {
        const auto to_kill = std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline_ - Clock::now());
        timeout_ms = std::min(timeout_ms < 0 ? INT_MAX : timeout_ms,
                              static_cast<int>(std::max<long long>(0, to_kill.count() + 1)));
      }
      ::poll(fds.data(), fds.size(), timeout_ms);

      if (stopping_ && !killed_ && Clock::now() >= kill_deadline_) {
        group_.signal_all(SIGKILL);
        killed_ = true;
      }
      if (fds[0].revents & POLLIN) handle_signals();
      for (std::size_t i = 0; i < pipes.size(); ++i)
        if (fds[i + 1].revents) group_.forward_output(*std::get<1>(pipes[i]), std::get<2>(pipes[i]));
      if (node_zero_ && (fds[first_node_fd].revents || node_zero_->has_line())) ended = handle_node_zero() || ended;
      for (std::size_t i = 0; i < nodes_.size(); ++i)
        if (!node_lost_[i] && fds[first_node_fd + i].revents) handle_node(i, node_finished);
      for (std::size_t i = waiting_.size(); i-- > 0;) {
        std::vector<std::string> ignored;
        auto quiet = silent(waiting_[i].peer, "a node waiting to join");
        if (quiet) say(*quiet);
        if ((fds[first_waiting_fd + i].revents && !waiting_[i].peer.receive(ignored)) || quiet)
          waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (listener_ && (fds[listener_fd].revents & POLLIN)) admit_node_during_attempt();
      check_silence(node_finished);
    }
    return failure_;
  }

  // The links this meshrun beats on while an attempt runs.
  std::vector<Peer*> linked_peers() {
    std::vector<Peer*> peers;
    if (node_zero_) peers.push_back(&*node_zero_);
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (!node_lost_[i]) peers.push_back(&nodes_[i]);
    for (auto& node : waiting_) peers.push_back(&node.peer);
    return peers;
  }

  // A frozen meshrun keeps its link open and says nothing: after --node-timeout it is lost, as
  // if its link had dropped. A node that has finished this attempt is not waited for: its
  // silence counts at the next rendezvous.
  void check_silence(std::vector<bool>& node_finished) {
    if (node_zero_) {
      // A node that is leaving has been let go: node 0 no longer beats on its link.
      if (auto quiet = leaving_ ? std::nullopt : silent(*node_zero_, "node 0")) lose_node_zero(*quiet);
      return;
    }
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (node_lost_[i] || node_finished[i]) continue;
      auto quiet = silent(nodes_[i], "node " + std::to_string(nodes_[i].node_rank()));
      if (!quiet) continue;
      Failure lost;
      lost.node_rank = nodes_[i].node_rank();
      lost.how = *quiet;
      lose_node(i, node_finished, lost);
      // Closed, so that the node, if it wakes, finds itself out of the job instead of waiting.
      nodes_[i] = Peer(-1, lost.node_rank, nodes_[i].address());
    }
  }

  void lose_node(std::size_t index, std::vector<bool>& node_finished, Failure failure) {
    failure.node_left = true;
    node_finished[index] = true;
    node_lost_[index] = true;
    note_failure(failure);
  }

  // This node cannot take part in a restart without node 0.
  void lose_node_zero(const std::string& how) {
    Failure lost;
    lost.node_rank = group_.settings().node_rank;
    lost.how = how;
    note_failure(lost);
    failure_ = lost;
    leaving_ = true;
    node_zero_.reset();
  }

  // Node 0, while an attempt runs: a node that joins waits for the next attempt. In an elastic
  // job below MAX nodes, the ranks restart at once to take it in (as torchrun does); a static
  // job only takes back a node rank it lost.
  void admit_node_during_attempt() {
    std::string problem, refused;
    auto joined = listener_->accept(shape(), options_.job_token, problem, refused);
    if (!joined) {
      if (!refused.empty()) say(refused);
      if (!problem.empty()) say("refused a node: " + problem);
      return;
    }
    int present = static_cast<int>(waiting_.size()) + 1;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (node_lost_[i]) continue;
      ++present;
      if (!shape().elastic && nodes_[i].node_rank() == joined->asked_rank)
        problem = "node rank " + std::to_string(joined->asked_rank) + " is already in the job";
    }
    for (auto& node : waiting_)
      if (!shape().elastic && node.asked_rank == joined->asked_rank)
        problem = "node rank " + std::to_string(joined->asked_rank) + " is already waiting to join";
    if (shape().elastic && present >= shape().max_nodes)
      problem = "the job already has its maximum of " + std::to_string(shape().max_nodes) + " nodes";
    if (!problem.empty()) {
      joined->peer.send("error\t" + problem);
      say("refused a node: " + problem);
      return;
    }
    joined->peer.send("waiting");
    waiting_.push_back(std::move(*joined));
    if (shape().elastic && !failure_) {
      Failure joining;
      joining.exit_code = 1;
      joining.membership_change = true;
      joining.how =
          "a node joined the job: stopping every rank to restart with " + std::to_string(present + 1) + " nodes";
      note_failure(joining);
    } else {
      say("a node joined; it takes part from the next attempt");
    }
  }

  void begin_stop(int signo) {
    if (!stopping_)
      kill_deadline_ =
          Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.termination_grace_s * 1000));
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
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (!node_lost_[i]) nodes_[i].send("stop\t" + encode(failure));
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
        interrupted_ = leaving_ = true;
        if (++interrupts_ > 1) {
          say("received " + signal_name(signo) + " again; killing all ranks");
          group_.signal_all(SIGKILL);
          killed_ = true;
          continue;
        }
        say("received " + signal_name(signo) + "; passing it to all ranks");
        Failure interrupted;
        interrupted.exit_code = 128 + signo;
        interrupted.node_rank = group_.settings().node_rank;
        interrupted.how =
            "meshrun on node " + std::to_string(interrupted.node_rank) + " received " + signal_name(signo);
        if (failure_) {
          begin_stop(signo);
        } else {
          note_failure(interrupted, signo);
        }
      }
    }
  }

  // Every rank of the job writes the stacks of its threads to its log (SIGUSR1, which launch()
  // handles: diagnostics/stack_dump.hpp). Node 0 passes the request to every node; another node asks
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
      if (leaving_) {  // node 0 has let this node go
        node_zero_.reset();
        return true;
      }
      lose_node_zero("lost contact with meshrun on node 0 (" + options_.master_addr + ")");
      return true;
    }
    bool ended = false;
    for (std::size_t i = 0; i < lines.size() && !ended; ++i) {
      auto fields = split_fields(lines[i]);
      if (fields[0] == "stop") {
        auto failure = decode(fields, 1);
        if (!failure) continue;
        failure_ = failure;  // node 0's first failure is the job's, so every node agrees
        begin_stop(SIGTERM);
      } else if (fields[0] == "end") {
        ended = true;
        node_zero_->put_back(lines, i + 1);  // node 0's word on the next attempt: for await_start()
      } else if (fields[0] == "stacks") {
        say("node 0 asks every rank for its stacks");
        group_.signal_all(SIGUSR1);
      }
    }
    return ended;
  }

  // A line from another node. A node whose meshrun failed itself (interrupted) or whose link
  // dropped has left the job: the failure allows a restart, which goes on without it (elastic)
  // or waits for it to come back (static).
  void handle_node(std::size_t index, std::vector<bool>& node_finished) {
    std::vector<std::string> lines;
    auto& node = nodes_[index];
    auto leave = [&](Failure failure) { lose_node(index, node_finished, std::move(failure)); };
    if (!node.receive(lines)) {
      if (node_finished[index] && !failure_) return;
      Failure lost;
      lost.node_rank = node.node_rank();
      lost.how = "lost contact with meshrun on node " + std::to_string(node.node_rank());
      leave(lost);
      return;
    }
    for (auto& line : lines) {
      auto fields = split_fields(line);
      if (fields[0] == "failed") {
        auto failure = decode(fields, 1);
        if (!failure) continue;
        if (failure->global_rank < 0 && failure->node_rank == node.node_rank()) {
          leave(*failure);
          return;
        }
        note_failure(*failure);
      } else if (fields[0] == "finished") {
        node_finished[index] = true;
      } else if (fields[0] == "stacks") {
        request_stacks("node " + std::to_string(node.node_rank()) + " received SIGUSR1");
      }
    }
  }

  Options options_;
  WorkerGroup group_;
  bool coordinator_ = true;  // node 0 (also a single-node job)
  std::optional<Listener> listener_;
  std::vector<Peer> nodes_;  // on node 0: the other nodes of this attempt
  std::vector<bool> node_lost_;
  std::vector<JoinedNode> waiting_;  // on node 0: nodes that joined during this attempt
  std::optional<Peer> node_zero_;    // on the other nodes
  std::optional<Failure> failure_;
  int job_exit_code_ = 1;
  bool stopping_ = false, killed_ = false;
  bool interrupted_ = false;  // this meshrun received a terminating signal: no restart
  bool leaving_ = false;      // another node that cannot take part in a restart
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
  CLI::App app{
      "meshrun --nproc-per-node N [options] -- PROGRAM [ARGS...]\n\nStarts PROGRAM once per rank of this node with "
      "torchrun's environment (RANK, WORLD_SIZE, "
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
  std::string nnodes = "1";
  app.add_option("--nnodes", nnodes,
                 "number of nodes, each running its own meshrun; MIN:MAX for an elastic job that runs on as many "
                 "nodes as are there (at least MIN) and restarts with the nodes present when one leaves or joins");
  auto* node_rank = app.add_option("--node-rank,--node_rank", options.node_rank, "this node's index, 0 .. nnodes-1")
                        ->check(CLI::NonNegativeNumber);
  auto* master_addr = app.add_option("--master-addr,--master_addr", options.master_addr,
                                     "host of node 0, where rank 0 serves the rendezvous store");
  app.add_option("--master-port,--master_port", options.master_port, "port of rank 0's rendezvous store")
      ->check(CLI::Range(1, 65535));
  app.add_option("--rdzv-port", options.rdzv_port, "port on node 0 where the meshruns meet (default: master port + 1)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--rdzv-timeout", options.rdzv_timeout_s, "seconds to wait for all nodes (elastic: MIN nodes) to join")
      ->check(CLI::PositiveNumber);
  app.add_option("--rdzv-last-call", options.rdzv_last_call_s,
                 "elastic jobs: once MIN nodes are in, seconds to wait for more before starting (default 30)")
      ->check(CLI::NonNegativeNumber);
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
  app.add_option("--heartbeat-interval", options.shape.heartbeat_s,
                 "multi-node jobs: seconds between heartbeats on the link between meshruns "
                 "(default 5)")
      ->check(CLI::PositiveNumber);
  auto* node_timeout = app.add_option("--node-timeout", options.shape.node_timeout_s,
                                      "multi-node jobs: a node whose meshrun sends nothing for this many seconds is "
                                      "lost (default 6 heartbeats)")
                           ->check(CLI::PositiveNumber);
  auto* job_token = app.add_option("--job-token", options.job_token,
                                   "a secret every node and rank must present to join the job (default: "
                                   "MESHTORCH_JOB_TOKEN); passed to the ranks as MESHTORCH_JOB_TOKEN");
  app.prefix_command();
  try {
    app.parse(argc, argv);
    if (dump_stacks_only) return dump_stacks(dump_stacks_pid);
    if (nproc->count() == 0) throw CLI::RequiredError("--nproc-per-node");
    options.command = app.remaining();
    if (!options.command.empty() && options.command.front() == "--") options.command.erase(options.command.begin());
    if (options.command.empty()) throw CLI::ValidationError("PROGRAM", "no program to run; put it after --");
    const JobShape links = options.shape;
    options.shape = parse_nnodes(nnodes);
    options.shape.heartbeat_s = links.heartbeat_s;
    options.shape.node_timeout_s = node_timeout->count() ? links.node_timeout_s : 6 * links.heartbeat_s;
    if (options.shape.node_timeout_s <= options.shape.heartbeat_s)
      throw CLI::ValidationError("--node-timeout", "must be longer than --heartbeat-interval " +
                                                       seconds_text(options.shape.heartbeat_s) +
                                                       " (a few heartbeats: a late one is not a lost node)");
    if (job_token->count() == 0)
      if (const char* token = std::getenv("MESHTORCH_JOB_TOKEN")) options.job_token = token;
    if (options.job_token.find_first_of("\t\n\r") != std::string::npos)
      throw CLI::ValidationError("--job-token", "must not contain tabs or line breaks");
    options.shape.nproc_per_node = options.nproc_per_node;
    options.shape.max_restarts = options.max_restarts;
    if (options.shape.elastic && node_rank->count() > 0)
      throw CLI::ValidationError("--node-rank", "an elastic job (--nnodes " + nnodes +
                                                    ") numbers its nodes at each rendezvous: the meshrun on "
                                                    "--master-addr is node 0; drop --node-rank");
    if (options.node_rank >= options.shape.max_nodes)
      throw CLI::ValidationError("--node-rank", "must be below --nnodes " + nnodes);
    if (options.shape.max_nodes > 1 && master_addr->count() == 0)
      throw CLI::ValidationError("--master-addr", "--nnodes " + nnodes + " needs the host of node 0");
    if (options.redirects.value_or(0) != 0 && options.log_dir.empty())
      throw CLI::ValidationError("--redirects", "needs --log-dir for the files");
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  GroupSettings settings;
  settings.nproc_per_node = options.nproc_per_node;
  settings.nnodes = options.shape.max_nodes;
  settings.node_rank = options.node_rank;
  settings.max_restarts = options.max_restarts;
  settings.master_addr = options.master_addr;
  settings.master_port = options.master_port;
  settings.job_token = options.job_token;
  settings.redirects = options.log_dir.empty() ? 0 : options.redirects.value_or(3);
  settings.prefix_output = options.prefix_output;
  settings.command = options.command;
  bool temporary_run_dir = options.log_dir.empty();
  if (temporary_run_dir) {
    // Error files need a home even without --log-dir; kept after a failure for inspection.
    auto pattern = (fs::temp_directory_path() / "meshrun-XXXXXX").string();
    if (!::mkdtemp(pattern.data()))
      throw std::runtime_error("cannot create a temporary folder in " + fs::temp_directory_path().string());
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
