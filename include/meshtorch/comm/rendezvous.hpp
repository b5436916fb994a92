#pragma once
// TCPStore rendezvous: rank 0 serves the store at MASTER_ADDR:MASTER_PORT (on that address only,
// and behind the job token's gate when MESHTORCH_JOB_TOKEN is set: comm/store_gate.hpp), every
// rank connects, and nobody waits longer than the timeout for a rank that never comes.
#include <chrono>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/store_gate.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(programs)
#include <cstdlib>
#include <exception>
#include <string_view>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <meshtorch/error.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  // Where this rank's store client connects: rank 0's store, or this rank's relay to its gate.
  std::string host = env.master_addr;
  const std::string token = job_token();
  // torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT when it says
  // TORCHELASTIC_USE_AGENT_STORE=True: every rank is its client, rank 0 included, as PyTorch's
  // env:// rendezvous does (rank 0 listening there too fails: the agent holds the port).
  const char* agent_store_flag = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent_store_flag && std::string_view(agent_store_flag) == "True";
  if (agent_store && !token.empty())
    throw ConfigError(
        fmt::format("rank {} of {}: MESHTORCH_JOB_TOKEN is set, but torchrun's agent serves the rendezvous store "
                    "(TORCHELASTIC_USE_AGENT_STORE=True) and cannot check a token; launch with meshrun --job-token, "
                    "or unset MESHTORCH_JOB_TOKEN",
                    env.rank, env.world_size));
  if (env.rank == 0 && !agent_store) {
    // TCPStore would listen on every interface: it gets a socket bound to MASTER_ADDR instead.
    int public_fd = -1;
    try {
      public_fd = detail::listen_on(env.master_addr, env.master_port, "MASTER_ADDR");
    } catch (const CommError& e) {
      throw CommError(fmt::format("rank 0 of {}: {}", env.world_size, e.what()));
    }
    // A host name that this host maps to loopback (Debian's 127.0.1.1 for its own name) would
    // keep out the ranks of other nodes, which reach it at its network address.
    const bool loopback_name =
        env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0 || env.master_addr == "::1";
    if (env.local_world_size < env.world_size && !loopback_name && detail::bound_to_loopback(public_fd))
      throw CommError(
          fmt::format("rank 0 of {}: MASTER_ADDR={} is a loopback address on this host, which ranks on "
                      "other nodes cannot reach; set MASTER_ADDR to the address they use for it",
                      env.world_size, env.master_addr));
    options.masterListenFd = public_fd;
    if (!token.empty()) {
      const int store_fd = detail::listen_on("127.0.0.1", 0, "the store's inner address");
      options.masterListenFd = store_fd;
      options.port = static_cast<std::uint16_t>(detail::bound_port(store_fd));
      host = "127.0.0.1";
      detail::start_store_gate(public_fd, options.port, token, env.rank);
    }
  } else if (!token.empty()) {
    options.port = static_cast<std::uint16_t>(
        detail::start_store_relay(env.master_addr, env.master_port, token, env.rank, timeout));
    host = "127.0.0.1";
  }
  options.isServer = env.rank == 0 && !agent_store;
  options.numWorkers = static_cast<std::size_t>(env.world_size);
  // Rank 0 returns only once every rank has connected, or throws after the timeout.
  options.waitWorkers = true;
  options.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    // c10's message carries a C++ backtrace after its first line; the first line says it all.
    const std::string why = e.what();
    throw CommError(fmt::format(
        "rank {} of {}: rendezvous at {}:{} failed within {} ms (is every rank started, and "
        "MASTER_ADDR/MASTER_PORT the same on all?): {}",
        env.rank, env.world_size, env.master_addr, env.master_port, timeout.count(), why.substr(0, why.find('\n'))));
  }
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(programs)
