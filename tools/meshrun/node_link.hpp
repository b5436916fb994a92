#pragma once
// The TCP link between the meshruns of a multi-node job. Node 0 listens; every other node
// connects, and they exchange newline-terminated, tab-separated text lines: a hello that must
// agree on the job's shape; per attempt node 0's "start" (the node's rank, the number of nodes,
// the attempt), then "failed" (a node's first failing rank), "stop" (node 0 relays the job's
// first failure), "finished" (a node's ranks are all gone) and "end" (every node is finished);
// node 0 alone decides what follows: another "start" or "exit" with the job's exit code.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
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

// One connected peer, reading whole lines.
class Peer {
 public:
  explicit Peer(int fd, int node_rank = -1) : fd_(fd), node_rank_(node_rank) {}
  Peer(Peer&& other) noexcept : fd_(std::exchange(other.fd_, -1)), node_rank_(other.node_rank_), buffer_(std::move(other.buffer_)) {}
  Peer& operator=(Peer&& other) noexcept {
    std::swap(fd_, other.fd_);
    std::swap(node_rank_, other.node_rank_);
    std::swap(buffer_, other.buffer_);
    return *this;
  }
  ~Peer() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }
  int node_rank() const { return node_rank_; }
  void set_node_rank(int node_rank) { node_rank_ = node_rank; }

  bool send(const std::string& line) {
    std::string data = line + "\n";
    for (std::size_t sent = 0; sent < data.size();) {
      ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
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
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
    for (std::size_t newline; (newline = buffer_.find('\n')) != std::string::npos;) {
      lines.push_back(buffer_.substr(0, newline));
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
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char chunk[4096];
      ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n == 0) return std::nullopt;
      if (n > 0) buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }

 private:
  int fd_;
  int node_rank_;
  std::string buffer_;
};

struct JobShape {
  int min_nodes = 1, max_nodes = 1, nproc_per_node = 1, max_restarts = 0;
  bool elastic = false;  // --nnodes MIN:MAX: node 0 assigns node ranks at each rendezvous

  std::string nnodes() const {
    return elastic ? std::to_string(min_nodes) + ":" + std::to_string(max_nodes) : std::to_string(max_nodes);
  }
  // An elastic node names no rank (-1): node 0 gives it one.
  std::string hello(int node_rank) const {
    return "hello\t" + std::to_string(elastic ? -1 : node_rank) + "\t" + nnodes() + "\t" +
           std::to_string(nproc_per_node) + "\t" + std::to_string(max_restarts);
  }
};

// A node that has said hello to node 0; `asked_rank` is the --node-rank it was started with (-1
// for an elastic node).
struct JoinedNode {
  Peer peer;
  int asked_rank = -1;
};

// Node 0's listening socket, open for the whole job so that nodes can join (or come back) at any
// time; they take part from the next rendezvous round.
class Listener {
 public:
  // Listens on `port` of every address, or, with `host`, only on that host's address: a meshrun
  // elsewhere, or a second one on the same host, gets nothing (and joins as another node).
  static std::optional<Listener> open(int port, const std::string& host = {}) {
    std::string failure;
    // Without a host: IPv6 with IPv4-mapped addresses where there is IPv6, else IPv4.
    for (int family : host.empty() ? std::vector<int>{AF_INET6, AF_INET} : std::vector<int>{AF_UNSPEC}) {
      addrinfo hints{};
      hints.ai_family = family;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* found = nullptr;
      int resolved = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found);
      if (resolved != 0) {
        if (host.empty()) continue;
        throw std::runtime_error("cannot resolve '" + host + "': " + ::gai_strerror(resolved));
      }
      for (auto* a = found; a; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        Peer guard(fd);
        int yes = 1, no = 0;
        ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
        if (a->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof no);
        if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
          ::freeaddrinfo(found);
          return Listener(std::move(guard));
        }
        int error = errno;
        if (!host.empty() && (error == EADDRINUSE || error == EADDRNOTAVAIL)) continue;  // not ours to serve
        failure = std::strerror(error);
      }
      ::freeaddrinfo(found);
    }
    if (failure.empty() && !host.empty()) return std::nullopt;
    throw std::runtime_error("node 0 cannot listen on rendezvous port " + std::to_string(port) + ": " +
                             (failure.empty() ? "no usable address" : failure));
  }

  int fd() const { return socket_.fd(); }

  // Accepts one connection and reads its hello (waiting at most a few seconds for it). Returns
  // the node, or nothing for a connection that is not a meshrun. A meshrun started with another
  // job shape gets an error line and `problem` says why.
  std::optional<JoinedNode> accept(const JobShape& shape, std::string& problem) {
    problem.clear();
    int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return std::nullopt;
    Peer peer(fd);
    auto hello = peer.receive_line(Clock::now() + std::chrono::seconds(5));
    if (!hello) return std::nullopt;
    auto fields = split_fields(*hello);
    if (fields.size() != 5 || fields[0] != "hello") return std::nullopt;  // not a meshrun: ignore it
    int asked_rank = std::atoi(fields[1].c_str());
    if (*hello != shape.hello(asked_rank) ||
        (!shape.elastic && (asked_rank <= 0 || asked_rank >= shape.max_nodes))) {
      problem = "a node was started with --nnodes " + fields[2] + (fields[1] == "-1" ? "" : " --node-rank " + fields[1]) +
                " --nproc-per-node " + fields[3] + " --max-restarts " + fields[4] + ", node 0 with --nnodes " +
                shape.nnodes() + " --nproc-per-node " + std::to_string(shape.nproc_per_node) + " --max-restarts " +
                std::to_string(shape.max_restarts);
      peer.send("error\t" + problem);
      return std::nullopt;
    }
    return JoinedNode{std::move(peer), asked_rank};
  }

 private:
  explicit Listener(Peer socket) : socket_(std::move(socket)) {}
  Peer socket_;
};

// Every other node: connects to node 0 (retrying until it listens) and says hello. What to do
// next comes from node 0: "start" lines (this node's rank, the number of nodes, the attempt),
// "waiting" while an attempt it is not part of ends, "exit" with the job's exit code, or "error".
inline Peer join_node_zero(const std::string& host, int port, int node_rank, const JobShape& shape,
                           Clock::time_point deadline) {
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
          ::freeaddrinfo(found);
          Peer peer(fd, 0);
          if (!peer.send(shape.hello(node_rank)))
            throw std::runtime_error("node 0 at " + host + ":" + std::to_string(port) + " closed the connection");
          return peer;
        }
        ::close(fd);
      }
      ::freeaddrinfo(found);
    }
    if (Clock::now() >= deadline)
      throw std::runtime_error("rendezvous timed out: cannot reach node 0 at " + host + ":" + std::to_string(port));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace meshrun
