#pragma once
// The TCP link between the meshruns of a multi-node job. Node 0 listens; every other node
// connects, and they exchange newline-terminated, tab-separated text lines: a hello that must
// agree on the job's shape; per attempt node 0's "start" (the node's rank, the number of nodes,
// the attempt), then "failed" (a node's first failing rank), "stop" (node 0 relays the job's
// first failure), "finished" (a node's ranks are all gone) and "end" (every node is finished);
// node 0 alone decides what follows: another "start" or "exit" with the job's exit code.
// Both ends also write "beat" every --heartbeat-interval: a meshrun that is frozen (SIGSTOP, a
// hung host) keeps its TCP connection open, so only its silence tells that it is gone.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace meshrun {

using Clock = std::chrono::steady_clock;

inline std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> fields;
  std::size_t start = 0;
  for (std::size_t tab; (tab = line.find('\t', start)) != std::string::npos; start = tab + 1)
    fields.push_back(line.substr(start, tab - start));
  fields.push_back(line.substr(start));
  return fields;
}

// Fields must stay on one line and keep their separators.
inline std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  return text;
}

// "host:port" of a socket address, numeric, for messages.
inline std::string address_text(const sockaddr* address, socklen_t length) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  ::getnameinfo(address, length, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
  std::string text = host;
  if (text.rfind("::ffff:", 0) == 0) text.erase(0, 7);  // an IPv4 peer of an IPv6 socket
  return (text.find(':') != std::string::npos ? "[" + text + "]" : text) + ":" + port;
}

inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

// Compares without stopping at the first difference, so that timing tells nothing of the token.
inline bool same_token(const std::string& a, const std::string& b) {
  unsigned char differ = a.size() != b.size();
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i)
    differ |= static_cast<unsigned char>(i < a.size() ? a[i] : 0) ^ static_cast<unsigned char>(i < b.size() ? b[i] : 0);
  return differ == 0;
}

// How long a hello may take after a connection is accepted: a meshrun sends it at once, and a
// stranger that sends nothing must be refused in under a second.
inline constexpr auto handshake_wait = std::chrono::milliseconds(800);

// One connected peer, reading whole lines. It swallows heartbeats ("beat") and remembers when it
// last heard from the other end and last wrote to it.
class Peer {
 public:
  explicit Peer(int fd, int node_rank = -1, std::string address = {})
      : fd_(fd), node_rank_(node_rank), address_(std::move(address)) {}
  Peer(Peer&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)),
        node_rank_(other.node_rank_),
        address_(std::move(other.address_)),
        buffer_(std::move(other.buffer_)),
        last_heard_(other.last_heard_),
        last_sent_(other.last_sent_) {}
  Peer& operator=(Peer&& other) noexcept {
    std::swap(fd_, other.fd_);
    std::swap(node_rank_, other.node_rank_);
    std::swap(address_, other.address_);
    std::swap(buffer_, other.buffer_);
    std::swap(last_heard_, other.last_heard_);
    std::swap(last_sent_, other.last_sent_);
    return *this;
  }
  ~Peer() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }
  int node_rank() const { return node_rank_; }
  void set_node_rank(int node_rank) { node_rank_ = node_rank; }
  // The other end's "host:port".
  const std::string& address() const { return address_; }
  Clock::time_point last_heard() const { return last_heard_; }

  // A heartbeat, if nothing was written for `interval`.
  void beat(Clock::duration interval) {
    if (Clock::now() - last_sent_ >= interval) send("beat");
  }

  bool send(const std::string& line) {
    std::string data = line + "\n";
    for (std::size_t sent = 0; sent < data.size();) {
      ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    last_sent_ = Clock::now();
    return true;
  }

  // Reads what is available (what was put back first, without reading the socket); returns
  // false once the peer has closed the connection.
  bool receive(std::vector<std::string>& lines) {
    if (!has_line()) {
      char chunk[4096];
      ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
      if (n <= 0) return false;
      heard(chunk, n);
    }
    for (std::size_t newline; (newline = buffer_.find('\n')) != std::string::npos;) {
      if (auto line = buffer_.substr(0, newline); line != "beat") lines.push_back(std::move(line));
      buffer_.erase(0, newline + 1);
    }
    return true;
  }

  // A whole line is waiting: poll() would not say so, the socket may have nothing more.
  bool has_line() const { return buffer_.find('\n') != std::string::npos; }

  // Puts lines[from..] back, for the next receive(): the lines after one that ends a phase.
  void put_back(const std::vector<std::string>& lines, std::size_t from) {
    std::string text;
    for (std::size_t i = from; i < lines.size(); ++i) text += lines[i] + "\n";
    buffer_.insert(0, text);
  }

  // Blocks for one line until `deadline`.
  std::optional<std::string> receive_line(Clock::time_point deadline) {
    std::vector<std::string> lines;
    while (true) {
      if (auto newline = buffer_.find('\n'); newline != std::string::npos) {
        auto line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        if (line == "beat") continue;
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char chunk[4096];
      ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n == 0) return std::nullopt;
      if (n > 0) heard(chunk, n);
    }
  }

 private:
  void heard(const char* chunk, ssize_t n) {
    buffer_.append(chunk, static_cast<std::size_t>(n));
    last_heard_ = Clock::now();
  }

  int fd_;
  int node_rank_;
  std::string address_;
  std::string buffer_;
  Clock::time_point last_heard_ = Clock::now(), last_sent_ = Clock::now();
};

struct JobShape {
  int min_nodes = 1, max_nodes = 1, nproc_per_node = 1, max_restarts = 0;
  bool elastic = false;  // --nnodes MIN:MAX: node 0 assigns node ranks at each rendezvous
  // Each end's heartbeat and the silence after which it takes the other for lost: they must agree,
  // or a node with a longer interval than node 0's timeout would be dropped while healthy.
  double heartbeat_s = 5, node_timeout_s = 30;

  std::string nnodes() const {
    return elastic ? std::to_string(min_nodes) + ":" + std::to_string(max_nodes) : std::to_string(max_nodes);
  }
  // An elastic node names no rank (-1): node 0 gives it one. The job token comes last.
  std::string hello(int node_rank) const {
    return "hello\t" + std::to_string(elastic ? -1 : node_rank) + "\t" + nnodes() + "\t" +
           std::to_string(nproc_per_node) + "\t" + std::to_string(max_restarts) + "\t" + seconds_text(heartbeat_s) +
           "\t" + seconds_text(node_timeout_s);
  }
};

// A node that has said hello to node 0; `asked_rank` is the --node-rank it was started with (-1
// for an elastic node).
struct JoinedNode {
  Peer peer;
  int asked_rank = -1;
};

// The flags a hello line stands for, to say how two nodes disagree.
inline std::string hello_flags(const std::vector<std::string>& fields) {
  return "--nnodes " + fields[2] + (fields[1] == "-1" ? "" : " --node-rank " + fields[1]) + " --nproc-per-node " +
         fields[3] + " --max-restarts " + fields[4] + " --heartbeat-interval " + fields[5] + " --node-timeout " +
         fields[6];
}

// Node 0's listening socket, open for the whole job so that nodes can join (or come back) at any
// time; they take part from the next rendezvous round.
class Listener {
 public:
  // Listens on `port` of `host`'s address only (the job's --master-addr: loopback for a job on
  // this machine), not on every interface. An elastic job's other meshruns on the host find the
  // port taken and join as other nodes (`required` false: nothing is returned); elsewhere they
  // cannot bind the address at all.
  static std::optional<Listener> open(int port, const std::string& host, bool required) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (resolved != 0)
      throw std::runtime_error("cannot resolve --master-addr '" + host + "': " + ::gai_strerror(resolved));
    std::string failure;
    for (auto* a = found; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      Peer guard(fd);
      int yes = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
        ::freeaddrinfo(found);
        return Listener(std::move(guard));
      }
      int error = errno;
      failure = std::strerror(error);
      if (error == EADDRNOTAVAIL) failure += " (it is not an address of this host)";
      if (!required && (error == EADDRINUSE || error == EADDRNOTAVAIL)) failure.clear();  // not ours to serve
    }
    ::freeaddrinfo(found);
    if (failure.empty() && !required) return std::nullopt;
    throw std::runtime_error("node 0 cannot listen on --master-addr " + host + " rendezvous port " +
                             std::to_string(port) + ": " + (failure.empty() ? "no usable address" : failure));
  }

  int fd() const { return socket_.fd(); }

  // Bound to a loopback address (127.0.0.0/8, ::1, or either mapped).
  bool on_loopback() const {
    sockaddr_storage address{};
    socklen_t length = sizeof address;
    ::getsockname(socket_.fd(), reinterpret_cast<sockaddr*>(&address), &length);
    if (address.ss_family == AF_INET)
      return (ntohl(reinterpret_cast<sockaddr_in*>(&address)->sin_addr.s_addr) >> 24) == 127;
    const auto& v6 = reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }

  // Accepts one connection and reads its hello (waiting at most `handshake_wait` for it). Returns
  // the node, or nothing for a connection that is refused: `refused` says why for one that is not
  // a meshrun of this job (no hello, or not this job's token), `problem` for a meshrun started
  // with another job shape (which also gets an error line).
  std::optional<JoinedNode> accept(const JobShape& shape, const std::string& token, std::string& problem,
                                   std::string& refused) {
    problem.clear();
    refused.clear();
    sockaddr_storage from{};
    socklen_t from_length = sizeof from;
    int fd = ::accept4(socket_.fd(), reinterpret_cast<sockaddr*>(&from), &from_length, SOCK_CLOEXEC);
    if (fd < 0) return std::nullopt;
    Peer peer(fd, -1, address_text(reinterpret_cast<sockaddr*>(&from), from_length));
    const std::string who = "refused a connection from " + peer.address() + ": ";
    auto hello = peer.receive_line(Clock::now() + handshake_wait);
    auto fields = hello ? split_fields(*hello) : std::vector<std::string>{};
    if (fields.size() != 8 || fields[0] != "hello") {
      refused = who + (hello ? "it is not a meshrun of this version (no hello)"
                             : "it sent no hello within " + std::to_string(handshake_wait.count()) + " ms");
      return std::nullopt;
    }
    if (!same_token(fields[7], token)) {
      refused = who + (fields[7].empty() ? "it presented no job token" : "it presented a wrong job token") +
                " (--job-token or MESHTORCH_JOB_TOKEN)";
      peer.send("error\tnode 0 refused this node: " + std::string(fields[7].empty() ? "no" : "a wrong") +
                " job token (--job-token or MESHTORCH_JOB_TOKEN must be the same on every node)");
      return std::nullopt;
    }
    fields.pop_back();
    int asked_rank = std::atoi(fields[1].c_str());
    std::string joined_hello = fields[0];
    for (std::size_t i = 1; i < fields.size(); ++i) joined_hello += "\t" + fields[i];
    if (joined_hello != shape.hello(asked_rank) ||
        (!shape.elastic && (asked_rank <= 0 || asked_rank >= shape.max_nodes))) {
      problem = "a node was started with " + hello_flags(fields) + ", node 0 with " +
                hello_flags(split_fields(shape.hello(0)));
      peer.send("error\t" + problem);
      return std::nullopt;
    }
    return JoinedNode{std::move(peer), asked_rank};
  }

 private:
  explicit Listener(Peer socket) : socket_(std::move(socket)) {}
  Peer socket_;
};

// Every other node: connects to node 0 (retrying until it listens) and says hello with the job
// token. What to do next comes from node 0: "start" lines (this node's rank, the number of nodes,
// the attempt), "waiting" while an attempt it is not part of ends, "exit" with the job's exit
// code, or "error".
inline Peer join_node_zero(const std::string& host, int port, int node_rank, const JobShape& shape,
                           const std::string& token, Clock::time_point deadline) {
  const std::string where = host + ":" + std::to_string(port);
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) == 0) {
      for (auto* a = found; a; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          Peer peer(fd, 0, address_text(a->ai_addr, a->ai_addrlen));
          ::freeaddrinfo(found);
          if (!peer.send(shape.hello(node_rank) + "\t" + one_line(token)))
            throw std::runtime_error("node 0 at " + where + " closed the connection");
          return peer;
        }
        ::close(fd);
      }
      ::freeaddrinfo(found);
    }
    if (Clock::now() >= deadline) throw std::runtime_error("rendezvous timed out: cannot reach node 0 at " + where);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace meshrun
