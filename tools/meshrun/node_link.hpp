#pragma once
// The TCP link between the meshruns of a multi-node job. Node 0 listens; every other node
// connects, and they exchange newline-terminated, tab-separated text lines: a hello that must
// agree on the job's shape, "start" once all nodes are in, then per attempt "failed" (a node's
// first failing rank), "stop" (node 0 relays the job's first failure), "finished" (a node's
// ranks are all gone) and "end" (every node is finished; the next attempt may begin).
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
  Peer& operator=(Peer&&) = delete;
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

  // Reads what is available; returns false once the peer has closed the connection.
  bool receive(std::vector<std::string>& lines) {
    char chunk[4096];
    ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) return false;
    buffer_.append(chunk, static_cast<std::size_t>(n));
    for (std::size_t newline; (newline = buffer_.find('\n')) != std::string::npos;) {
      lines.push_back(buffer_.substr(0, newline));
      buffer_.erase(0, newline + 1);
    }
    return true;
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
  int nnodes = 1, nproc_per_node = 1, max_restarts = 0;
  std::string hello(int node_rank) const {
    return "hello\t" + std::to_string(node_rank) + "\t" + std::to_string(nnodes) + "\t" +
           std::to_string(nproc_per_node) + "\t" + std::to_string(max_restarts);
  }
};

// Node 0: waits until every other node has said hello with the same job shape.
inline std::vector<Peer> accept_nodes(int port, const JobShape& shape, Clock::time_point deadline) {
  int listener = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool ipv6 = listener >= 0;
  if (!ipv6) listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) throw std::runtime_error(std::string("cannot create a socket: ") + std::strerror(errno));
  Peer listener_guard(listener);
  int yes = 1, no = 0;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  int bound;
  if (ipv6) {
    ::setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof no);
    sockaddr_in6 address{};
    address.sin6_family = AF_INET6;
    address.sin6_addr = in6addr_any;
    address.sin6_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address);
  } else {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    address.sin_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address);
  }
  if (bound != 0 || ::listen(listener, 128) != 0)
    throw std::runtime_error("node 0 cannot listen on rendezvous port " + std::to_string(port) + ": " +
                             std::strerror(errno));
  std::vector<Peer> nodes;
  std::vector<bool> joined(static_cast<std::size_t>(shape.nnodes), false);
  joined[0] = true;
  while (static_cast<int>(nodes.size()) < shape.nnodes - 1) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{listener, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(std::max<long long>(left, 0))) == 0)
      throw std::runtime_error("rendezvous timed out: " + std::to_string(nodes.size() + 1) + " of " +
                               std::to_string(shape.nnodes) + " nodes joined on port " + std::to_string(port));
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Peer peer(fd);
    auto hello = peer.receive_line(std::min(deadline, Clock::now() + std::chrono::seconds(10)));
    if (!hello) continue;
    auto fields = split_fields(*hello);
    if (fields.size() != 5 || fields[0] != "hello") continue;  // not a meshrun: ignore it
    int node_rank = std::atoi(fields[1].c_str());
    std::string problem;
    if (*hello != shape.hello(node_rank) || node_rank <= 0 || node_rank >= shape.nnodes)
      problem = "node " + fields[1] + " was started with --nnodes " + fields[2] + " --nproc-per-node " +
                fields[3] + " --max-restarts " + fields[4] + ", node 0 with --nnodes " +
                std::to_string(shape.nnodes) + " --nproc-per-node " + std::to_string(shape.nproc_per_node) +
                " --max-restarts " + std::to_string(shape.max_restarts);
    else if (joined[static_cast<std::size_t>(node_rank)])
      problem = "two nodes were started with --node-rank " + fields[1];
    if (!problem.empty()) {
      peer.send("error\t" + problem);
      throw std::runtime_error(problem);
    }
    joined[static_cast<std::size_t>(node_rank)] = true;
    peer.set_node_rank(node_rank);
    nodes.push_back(std::move(peer));
  }
  for (auto& node : nodes) node.send("start");
  return nodes;
}

// Every other node: connects to node 0 (retrying until it listens) and waits for "start".
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
          found = nullptr;
          Peer peer(fd, 0);
          if (!peer.send(shape.hello(node_rank))) break;
          auto reply = peer.receive_line(deadline);
          if (!reply) throw std::runtime_error("node 0 at " + host + ":" + std::to_string(port) + " did not start the job in time");
          auto fields = split_fields(*reply);
          if (fields[0] == "error") throw std::runtime_error(fields.size() > 1 ? fields[1] : *reply);
          return peer;
        }
        ::close(fd);
      }
      if (found) ::freeaddrinfo(found);
    }
    if (Clock::now() >= deadline)
      throw std::runtime_error("rendezvous timed out: cannot reach node 0 at " + host + ":" + std::to_string(port));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace meshrun
