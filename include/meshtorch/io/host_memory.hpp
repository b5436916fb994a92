#pragma once
// How much memory this process may still take on this machine: what the kernel says is available
// (/proc/meminfo's MemAvailable + SwapFree), lowered to what the process's cgroup (v2 memory.max,
// or v1 memory.limit_in_bytes) leaves, so that a container's limit counts, not the host's RAM.
// Checked before a large allocation, so that asking for too much is a named error instead of the
// kernel's out-of-memory kill.
#include <cstdint>
#include <optional>
#include <string>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

struct HostMemory {
  std::uint64_t available_bytes = 0;
  std::string source;  // what the figure comes from, for messages: "MemAvailable + SwapFree", "cgroup memory.max"
};

// Nothing where /proc/meminfo cannot be read (not Linux): the caller then checks nothing.
MESHTORCH_DECL std::optional<HostMemory> available_host_memory();

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <charconv>
#include <fstream>

namespace meshtorch::io {

namespace host_memory_detail {

// The first number of a small kernel file ("max" and anything unreadable: nothing).
inline std::optional<std::uint64_t> read_number(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return std::nullopt;
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// The memory cgroup's folder of this process, from /proc/self/cgroup ("0::/path" for v2,
// "N:memory:/path" for v1).
inline std::optional<std::string> cgroup_folder() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const auto controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
    if (controllers.empty()) return "/sys/fs/cgroup" + path;  // v2
    if (controllers == "memory") return "/sys/fs/cgroup/memory" + path;
  }
  return std::nullopt;
}

}  // namespace host_memory_detail

MESHTORCH_DECL std::optional<HostMemory> available_host_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::optional<std::uint64_t> available_kib, swap_free_kib;
  std::string key;
  std::uint64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value) {
    if (key == "MemAvailable:") available_kib = value;
    if (key == "SwapFree:") swap_free_kib = value;
    std::getline(meminfo, unit);
  }
  if (!available_kib) return std::nullopt;
  HostMemory memory{(*available_kib + swap_free_kib.value_or(0)) * 1024, "MemAvailable + SwapFree"};
  if (const auto folder = host_memory_detail::cgroup_folder()) {
    using host_memory_detail::read_number;
    // v2 names, then v1's; a limit of "max" (v2) or near 2^63 (v1) reads as no limit.
    auto limit = read_number(*folder + "/memory.max");
    auto usage = read_number(*folder + "/memory.current");
    if (!limit)
      limit = read_number(*folder + "/memory.limit_in_bytes"), usage = read_number(*folder + "/memory.usage_in_bytes");
    if (limit && usage && *limit < (std::uint64_t{1} << 62)) {
      const auto left = *limit > *usage ? *limit - *usage : 0;
      if (left < memory.available_bytes) memory = {left, "the cgroup's memory limit less its usage"};
    }
  }
  return memory;
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
