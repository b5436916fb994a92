#pragma once
// Who may reach rank 0's rendezvous store. c10d's TCPStore listens on every interface and serves
// whoever connects; its protocol has no field for a secret. So the store listens only on the
// address the job names (a socket we bind and hand to it), and with a job token
// (MESHTORCH_JOB_TOKEN) it listens on loopback behind a gate: rank 0 accepts on the job's address,
// reads the token that each connection must send first, refuses a connection without it (naming
// its address) and relays the others to the store; every other rank's store client connects to a
// relay on its own loopback that opens each connection with the token. Writing a store of our own
// would have done the same with more code on the path every collective's set-up takes.
#include <chrono>
#include <string>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

// The job token from MESHTORCH_JOB_TOKEN (meshrun sets it from --job-token); empty: none.
MESHTORCH_DECL std::string job_token();

namespace detail {

// A socket listening on `host`'s address only (port 0: a free port), for the store; `what` names
// the setting the address came from in the error.
MESHTORCH_DECL int listen_on(const std::string& host, int port, const std::string& what);

// The port a listening socket got.
MESHTORCH_DECL int bound_port(int fd);

// Whether a socket is bound to a loopback address (127.0.0.0/8, ::1).
MESHTORCH_DECL bool bound_to_loopback(int fd);

// Rank 0: accepts on `listen_fd`, and relays each connection that sends `token` first to the
// store at 127.0.0.1:`store_port`; refuses the others within a second, saying so on stderr.
// Runs for the life of the process.
MESHTORCH_DECL void start_store_gate(int listen_fd, int store_port, std::string token, int rank);

// Other ranks: presents `token` to the gate at host:port once (retrying until it listens, up to
// `timeout`), so that a refusal is an error at once, naming why; then opens a port on loopback
// whose connections are relayed to the gate, each opened with the token. Returns the port.
MESHTORCH_DECL int start_store_relay(const std::string& host, int port, std::string token, int rank,
                                     std::chrono::milliseconds timeout);

}  // namespace detail
}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(programs)
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL std::string job_token() {
  const char* token = std::getenv("MESHTORCH_JOB_TOKEN");
  return token ? std::string(token) : std::string();
}

namespace detail {

namespace gate_detail {

using Clock = std::chrono::steady_clock;
// A store client sends its token at once; a stranger that sends nothing is refused in time.
inline constexpr auto token_wait = std::chrono::milliseconds(800);
inline constexpr const char* token_greeting = "meshtorch-job-token ";

inline std::string peer_text(const sockaddr* address, socklen_t length) {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  ::getnameinfo(address, length, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
  std::string text = host;
  if (text.rfind("::ffff:", 0) == 0) text.erase(0, 7);
  if (text.find(':') != std::string::npos) text = fmt::format("[{}]", text);  // IPv6
  return fmt::format("{}:{}", text, port);
}

inline bool send_all(int fd, const char* data, std::size_t size) {
  for (std::size_t sent = 0; sent < size;) {
    ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// Reads one line (without its newline) until `deadline`; nothing if the peer closed, sent too
// much or was too slow. With `prefix`, returns what came as soon as it cannot start with it.
inline std::optional<std::string> read_line(int fd, Clock::time_point deadline, const std::string& prefix = {}) {
  std::string line;
  while (line.size() < 4096) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return std::nullopt;
    char c;
    ssize_t n = ::recv(fd, &c, 1, 0);  // byte by byte: what follows the line belongs to the store
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    if (c == '\n') return line;
    line += c;
    if (line.size() <= prefix.size() && prefix.compare(0, line.size(), line) != 0) return line;
  }
  return std::nullopt;
}

inline bool same_token(const std::string& a, const std::string& b) {
  unsigned char differ = a.size() != b.size();
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i)
    differ |= static_cast<unsigned char>(i < a.size() ? a[i] : 0) ^ static_cast<unsigned char>(i < b.size() ? b[i] : 0);
  return differ == 0;
}

inline int connect_to(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (auto* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

// Copies bytes both ways until either side closes. A store connection is request and answer, so
// one thread per connection never blocks on a full buffer the other side is not reading.
inline void pump(int a, int b) {
  std::thread([a, b] {
    char chunk[65536];
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    while (::poll(fds, 2, -1) >= 0) {
      bool open = true;
      for (int i = 0; i < 2 && open; ++i) {
        if (!fds[i].revents) continue;
        ssize_t n = ::recv(fds[i].fd, chunk, sizeof chunk, 0);
        if (n < 0 && errno == EINTR) continue;
        open = n > 0 && send_all(fds[1 - i].fd, chunk, static_cast<std::size_t>(n));
      }
      if (!open) break;
    }
    ::close(a);
    ::close(b);
  }).detach();
}

inline void refuse(int fd, const std::string& peer, const std::string& why, int rank, const std::string& where) {
  const std::string answer = fmt::format("refused: {}\n", why);
  send_all(fd, answer.data(), answer.size());
  // Closing with unread bytes would reset the connection and lose the answer: read them first.
  ::shutdown(fd, SHUT_WR);
  char discard[4096];
  for (pollfd p{fd, POLLIN, 0}; ::poll(&p, 1, 200) > 0 && ::recv(fd, discard, sizeof discard, 0) > 0;) {
  }
  ::close(fd);
  std::fputs(
      fmt::format("rank {}: the rendezvous store at {} refused a connection from {}: {}\n", rank, where, peer, why)
          .c_str(),
      stderr);
}

}  // namespace gate_detail

MESHTORCH_DECL int listen_on(const std::string& host, int port, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); resolved != 0)
    throw CommError(fmt::format("cannot resolve {}={}: {}", what, host, ::gai_strerror(resolved)));
  std::string failure = "no usable address";
  for (auto* a = found; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      ::freeaddrinfo(found);
      return fd;
    }
    const int error = errno;
    failure = std::strerror(error);
    if (error == EADDRNOTAVAIL) failure += " (it is not an address of this host)";
    ::close(fd);
  }
  ::freeaddrinfo(found);
  throw CommError(fmt::format("the rendezvous store cannot listen on {}={} port {}: {}", what, host, port, failure));
}

MESHTORCH_DECL int bound_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return address.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

MESHTORCH_DECL bool bound_to_loopback(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  if (address.ss_family == AF_INET)
    return (ntohl(reinterpret_cast<sockaddr_in*>(&address)->sin_addr.s_addr) >> 24) == 127;
  const auto& v6 = reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
}

MESHTORCH_DECL void start_store_gate(int listen_fd, int store_port, std::string token, int rank) {
  using namespace gate_detail;
  sockaddr_storage own{};
  socklen_t own_length = sizeof own;
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&own), &own_length);
  const std::string where = peer_text(reinterpret_cast<sockaddr*>(&own), own_length);
  std::thread([=] {
    for (;;) {
      sockaddr_storage from{};
      socklen_t length = sizeof from;
      int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &length, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
        return;
      }
      const std::string peer = peer_text(reinterpret_cast<sockaddr*>(&from), length);
      // Each handshake on its own thread: a stranger that sends nothing does not hold up ranks.
      std::thread([=] {
        const std::string greeting = token_greeting;
        auto line = read_line(fd, Clock::now() + token_wait, greeting);
        if (!line)
          return refuse(fd, peer,
                        fmt::format("it sent no job token within {} ms (MESHTORCH_JOB_TOKEN)", token_wait.count()),
                        rank, where);
        if (line->rfind(greeting, 0) != 0)
          return refuse(fd, peer, "it presented no job token (MESHTORCH_JOB_TOKEN)", rank, where);
        if (!same_token(line->substr(greeting.size()), token))
          return refuse(fd, peer, "it presented a wrong job token (MESHTORCH_JOB_TOKEN)", rank, where);
        int store = connect_to("127.0.0.1", store_port);
        if (store < 0 || !send_all(fd, "ok\n", 3)) {
          if (store >= 0) ::close(store);
          ::close(fd);
          return;
        }
        pump(fd, store);
      }).detach();
    }
  }).detach();
}

MESHTORCH_DECL int start_store_relay(const std::string& host, int port, std::string token, int rank,
                                     std::chrono::milliseconds timeout) {
  using namespace gate_detail;
  const std::string greeting = fmt::format("{}{}\n", token_greeting, token);
  // Connects and presents the token, waiting for rank 0 to listen; the gate's answer, or nothing.
  auto open = [=](Clock::time_point deadline, int& remote) -> std::optional<std::string> {
    while (true) {
      remote = connect_to(host, port);
      if (remote >= 0) break;
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!send_all(remote, greeting.data(), greeting.size())) return std::nullopt;
    return read_line(remote, deadline);
  };
  int probe = -1;
  auto answer = open(Clock::now() + timeout, probe);
  if (probe >= 0) ::close(probe);
  if (!answer)
    throw CommError(
        fmt::format("rank {}: the rendezvous store at {}:{} did not answer within {} ms (is rank 0 "
                    "started, and MASTER_ADDR/MASTER_PORT the same on all?)",
                    rank, host, port, timeout.count()));
  if (*answer != "ok")
    throw CommError(
        fmt::format("rank {}: the rendezvous store at {}:{} {}; every rank must have the job's "
                    "MESHTORCH_JOB_TOKEN (meshrun --job-token passes it on)",
                    rank, host, port, *answer));
  const int listen_fd = listen_on("127.0.0.1", 0, "the store relay's address");
  std::thread([=] {
    for (;;) {
      int local = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (local < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
        return;
      }
      int remote = -1;
      auto answer = open(Clock::now() + timeout, remote);
      if (answer && *answer == "ok") {
        pump(local, remote);
        continue;
      }
      // The store client sees its connection close and fails with its own message.
      if (remote >= 0) ::close(remote);
      ::close(local);
    }
  }).detach();
  return bound_port(listen_fd);
}

}  // namespace detail
}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(programs)
