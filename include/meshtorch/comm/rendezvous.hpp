#pragma once
// TCPStore rendezvous: rank 0 serves the store at MASTER_ADDR:MASTER_PORT, every rank connects,
// and nobody waits longer than the timeout for a rank that never comes.
#include <chrono>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(programs)
#include <exception>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <meshtorch/error.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL c10::intrusive_ptr<c10d::Store> rendezvous(const LaunchEnv& env,
                                                           std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = env.rank == 0;
  options.numWorkers = static_cast<std::size_t>(env.world_size);
  // Rank 0 returns only once every rank has connected, or throws after the timeout.
  options.waitWorkers = true;
  options.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    // c10's message carries a C++ backtrace after its first line; the first line says it all.
    const std::string why = e.what();
    throw CommError(fmt::format("rank {} of {}: rendezvous at {}:{} failed within {} ms (is every rank started, and "
                                "MASTER_ADDR/MASTER_PORT the same on all?): {}",
                                env.rank, env.world_size, env.master_addr, env.master_port, timeout.count(),
                                why.substr(0, why.find('\n'))));
  }
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(programs)
