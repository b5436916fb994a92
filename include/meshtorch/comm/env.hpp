#pragma once
// Where this process sits in the job: rank, world size, local rank and the rendezvous address,
// read from whichever launcher started it (torchrun or meshrun, Slurm's srun, OpenMPI's mpirun).
// Standard library only, so the launcher and tools can use it without LibTorch.
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

struct LaunchEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher;  // "torchrun" (also meshrun), "slurm", "openmpi", "single"
};

using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;

// This node's name, as dumps, the doctor and the cluster top report it.
MESHTORCH_DECL std::string host_name();

namespace detail {

MESHTORCH_DECL std::optional<long long> parse_integer(std::string_view text);

MESHTORCH_DECL int integer_variable(std::string_view name, const std::string& text, long long min_value = 0,
                                    long long max_value = 1 << 30);

MESHTORCH_DECL std::string required(const EnvLookup& lookup, std::string_view name, std::string_view why);

inline int required_integer(const EnvLookup& lookup, std::string_view name, std::string_view why,
                            long long min_value = 0) {
  return integer_variable(name, required(lookup, name, why), min_value);
}

// Splits on commas that are not inside brackets: "a[1-2,4],b" -> "a[1-2,4]", "b".
MESHTORCH_DECL std::vector<std::string_view> split_top_level(std::string_view list);

}  // namespace detail

// Expands a Slurm host list such as "node[01-04,07],gpu[1-2]-ib" into host names, keeping
// zero padding. Written by hand because `scontrol show hostnames` may not exist where ranks run.
MESHTORCH_DECL std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist);

// Expands Slurm's per-node task counts, "2(x3),1" -> {2, 2, 2, 1}.
MESHTORCH_DECL std::vector<int> expand_slurm_tasks_per_node(std::string_view name, std::string_view counts);

namespace detail {

MESHTORCH_DECL void check_consistent(const LaunchEnv& env, std::string_view rank_name, std::string_view world_name,
                                     std::string_view local_rank_name, std::string_view local_world_name);

// MASTER_ADDR may be left out only when every rank runs on this host; MASTER_PORT defaults to
// 29500 as in torch.distributed, which is the same on every node.
MESHTORCH_DECL void read_master(const EnvLookup& lookup, LaunchEnv& env, std::string_view launcher_variables);

MESHTORCH_DECL LaunchEnv torchrun_env(const EnvLookup& lookup);
MESHTORCH_DECL LaunchEnv slurm_env(const EnvLookup& lookup);
MESHTORCH_DECL LaunchEnv openmpi_env(const EnvLookup& lookup);

}  // namespace detail

// Reads the launch environment through `lookup` (a variable's value, or nullopt when unset).
// torchrun/meshrun variables win over Slurm's, which win over OpenMPI's, so that torchrun or
// meshrun started inside an allocation describes its own children. Throws EnvError naming the
// variable and its value when one is missing, not a number, or contradicts another.
MESHTORCH_DECL LaunchEnv launch_env_from(const EnvLookup& lookup);

// The timeout of rendezvous and of every collective: `seconds` when positive (the --timeout
// flag), else MESHTORCH_TIMEOUT (seconds), else 600 s, torch.distributed's default for Gloo.
MESHTORCH_DECL std::chrono::milliseconds collective_timeout(double seconds = 0);

MESHTORCH_DECL LaunchEnv launch_env();

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <unistd.h>

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

namespace meshtorch::comm {

MESHTORCH_DECL std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

namespace detail {

MESHTORCH_DECL std::optional<long long> parse_integer(std::string_view text) {
  long long value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

MESHTORCH_DECL int integer_variable(std::string_view name, const std::string& text, long long min_value,
                                    long long max_value) {
  auto value = parse_integer(text);
  if (!value) throw EnvError(fmt::format("{}='{}' is not an integer", name, text));
  if (*value < min_value || *value > max_value)
    throw EnvError(fmt::format("{}={} is out of range [{}, {}]", name, text, min_value, max_value));
  return static_cast<int>(*value);
}

MESHTORCH_DECL std::string required(const EnvLookup& lookup, std::string_view name, std::string_view why) {
  if (auto value = lookup(name)) return *value;
  throw EnvError(fmt::format("{} is not set, but {}", name, why));
}

MESHTORCH_DECL std::vector<std::string_view> split_top_level(std::string_view list) {
  std::vector<std::string_view> parts;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list[i] == '[') ++depth;
    if (list[i] == ']') --depth;
    if (list[i] == ',' && depth == 0) {
      parts.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(list.substr(start));
  return parts;
}

}  // namespace detail

MESHTORCH_DECL std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist) {
  auto malformed = [&] { return EnvError(fmt::format("SLURM_JOB_NODELIST='{}' is malformed", nodelist)); };
  std::vector<std::string> hosts;
  for (auto entry : detail::split_top_level(nodelist)) {
    if (entry.empty()) throw malformed();
    std::vector<std::string> expanded{""};
    while (!entry.empty()) {
      auto open = entry.find('[');
      std::string_view literal = entry.substr(0, open);
      for (auto& host : expanded) host += literal;
      if (open == std::string_view::npos) break;
      auto close = entry.find(']', open);
      if (close == std::string_view::npos) throw malformed();
      std::vector<std::string> alternatives;
      for (auto range : detail::split_top_level(entry.substr(open + 1, close - open - 1))) {
        auto dash = range.find('-');
        auto first_text = range.substr(0, dash);
        auto first = detail::parse_integer(first_text);
        auto last = dash == std::string_view::npos ? first : detail::parse_integer(range.substr(dash + 1));
        if (!first || !last || *first < 0 || *last < *first || *last - *first > 1'000'000) throw malformed();
        for (auto n = *first; n <= *last; ++n) {
          auto digits = std::to_string(n);
          if (digits.size() < first_text.size()) digits.insert(0, first_text.size() - digits.size(), '0');
          alternatives.push_back(digits);
        }
      }
      std::vector<std::string> product;
      for (auto& prefix : expanded)
        for (auto& alternative : alternatives) product.push_back(prefix + alternative);
      expanded = std::move(product);
      entry = entry.substr(close + 1);
    }
    hosts.insert(hosts.end(), expanded.begin(), expanded.end());
  }
  return hosts;
}

MESHTORCH_DECL std::vector<int> expand_slurm_tasks_per_node(std::string_view name, std::string_view counts) {
  std::vector<int> per_node;
  for (auto entry : detail::split_top_level(counts)) {
    auto paren = entry.find("(x");
    int tasks = detail::integer_variable(name, std::string(entry.substr(0, paren)), 1);
    int repeat = 1;
    if (paren != std::string_view::npos) {
      if (entry.back() != ')') throw EnvError(fmt::format("{}='{}' is malformed", name, counts));
      repeat = detail::integer_variable(name, std::string(entry.substr(paren + 2, entry.size() - paren - 3)), 1);
    }
    per_node.insert(per_node.end(), repeat, tasks);
  }
  return per_node;
}

namespace detail {

MESHTORCH_DECL void check_consistent(const LaunchEnv& env, std::string_view rank_name, std::string_view world_name,
                                     std::string_view local_rank_name, std::string_view local_world_name) {
  auto say = [](std::string_view name, int value) { return std::string(name) + "=" + std::to_string(value); };
  if (env.rank >= env.world_size)
    throw EnvError(fmt::format("{} is not below {}", say(rank_name, env.rank), say(world_name, env.world_size)));
  if (env.local_rank >= env.local_world_size)
    throw EnvError(fmt::format("{} is not below {}", say(local_rank_name, env.local_rank),
                               say(local_world_name, env.local_world_size)));
  if (env.local_world_size > env.world_size)
    throw EnvError(
        fmt::format("{} exceeds {}", say(local_world_name, env.local_world_size), say(world_name, env.world_size)));
}

MESHTORCH_DECL void read_master(const EnvLookup& lookup, LaunchEnv& env, std::string_view launcher_variables) {
  if (auto addr = lookup("MASTER_ADDR"))
    env.master_addr = *addr;
  else if (env.local_world_size != env.world_size)
    throw EnvError(
        fmt::format("MASTER_ADDR is not set, but {} place ranks on more than one node; set it to the host "
                    "of rank 0",
                    launcher_variables));
  if (auto port = lookup("MASTER_PORT")) env.master_port = integer_variable("MASTER_PORT", *port, 1, 65535);
}

MESHTORCH_DECL LaunchEnv torchrun_env(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = "torchrun";
  env.rank = required_integer(lookup, "RANK", "WORLD_SIZE is set (torchrun-style launch)");
  env.world_size = required_integer(lookup, "WORLD_SIZE", "RANK is set (torchrun-style launch)", 1);
  // Hand-written env:// launches often set only RANK and WORLD_SIZE: then all ranks are local.
  auto local_rank = lookup("LOCAL_RANK");
  auto local_world = lookup("LOCAL_WORLD_SIZE");
  env.local_rank = local_rank ? integer_variable("LOCAL_RANK", *local_rank) : env.rank;
  env.local_world_size = local_world ? integer_variable("LOCAL_WORLD_SIZE", *local_world, 1) : env.world_size;
  check_consistent(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  read_master(lookup, env, "RANK/WORLD_SIZE/LOCAL_WORLD_SIZE");
  return env;
}

MESHTORCH_DECL LaunchEnv slurm_env(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = "slurm";
  constexpr std::string_view why = "SLURM_PROCID is set (srun launch)";
  env.rank = required_integer(lookup, "SLURM_PROCID", why);
  env.world_size = required_integer(lookup, "SLURM_NTASKS", why, 1);
  env.local_rank = required_integer(lookup, "SLURM_LOCALID", why);
  if (auto per_node = lookup("SLURM_NTASKS_PER_NODE")) {
    env.local_world_size = integer_variable("SLURM_NTASKS_PER_NODE", *per_node, 1);
  } else if (auto counts = lookup("SLURM_TASKS_PER_NODE")) {
    auto per_node_counts = expand_slurm_tasks_per_node("SLURM_TASKS_PER_NODE", *counts);
    int node = 0;
    if (auto node_id = lookup("SLURM_NODEID")) node = integer_variable("SLURM_NODEID", *node_id);
    if (node >= static_cast<int>(per_node_counts.size()))
      throw EnvError(fmt::format("SLURM_NODEID={} has no entry in SLURM_TASKS_PER_NODE='{}'", node, *counts));
    env.local_world_size = per_node_counts[node];
  } else {
    throw EnvError(fmt::format("neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set, but {}", why));
  }
  check_consistent(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  if (auto addr = lookup("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    auto nodelist = lookup("SLURM_JOB_NODELIST");
    if (!nodelist) nodelist = lookup("SLURM_NODELIST");
    if (!nodelist) throw EnvError(fmt::format("SLURM_JOB_NODELIST is not set, but {} and MASTER_ADDR is not", why));
    env.master_addr = expand_slurm_nodelist(*nodelist).front();
  }
  if (auto port = lookup("MASTER_PORT")) {
    env.master_port = integer_variable("MASTER_PORT", *port, 1, 65535);
  } else if (auto job_id = lookup("SLURM_JOB_ID")) {
    // Jobs sharing a node get different ports; the range stays below Linux's ephemeral ports.
    env.master_port = 10000 + integer_variable("SLURM_JOB_ID", *job_id) % 20000;
  }
  return env;
}

MESHTORCH_DECL LaunchEnv openmpi_env(const EnvLookup& lookup) {
  LaunchEnv env;
  env.launcher = "openmpi";
  constexpr std::string_view why = "OMPI_COMM_WORLD_RANK or OMPI_COMM_WORLD_SIZE is set (mpirun launch)";
  env.rank = required_integer(lookup, "OMPI_COMM_WORLD_RANK", why);
  env.world_size = required_integer(lookup, "OMPI_COMM_WORLD_SIZE", why, 1);
  env.local_rank = required_integer(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", why);
  env.local_world_size = required_integer(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE", why, 1);
  check_consistent(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE");
  read_master(lookup, env, "OMPI_COMM_WORLD_SIZE/OMPI_COMM_WORLD_LOCAL_SIZE");
  return env;
}

}  // namespace detail

MESHTORCH_DECL LaunchEnv launch_env_from(const EnvLookup& lookup) {
  if (lookup("RANK") || lookup("WORLD_SIZE")) return detail::torchrun_env(lookup);
  if (lookup("SLURM_PROCID")) return detail::slurm_env(lookup);
  if (lookup("OMPI_COMM_WORLD_RANK") || lookup("OMPI_COMM_WORLD_SIZE")) return detail::openmpi_env(lookup);
  LaunchEnv env;
  env.launcher = "single";
  if (auto addr = lookup("MASTER_ADDR")) env.master_addr = *addr;
  if (auto port = lookup("MASTER_PORT")) env.master_port = detail::integer_variable("MASTER_PORT", *port, 1, 65535);
  return env;
}

MESHTORCH_DECL std::chrono::milliseconds collective_timeout(double seconds) {
  if (!(seconds > 0)) {
    seconds = 600;
    if (const char* text = std::getenv("MESHTORCH_TIMEOUT"); text && *text) {
      char* end = nullptr;
      seconds = std::strtod(text, &end);
      if (*end != '\0' || !(seconds > 0) || seconds > 1e7)
        throw EnvError(std::string("MESHTORCH_TIMEOUT='") + text + "' is not a positive number of seconds");
    }
  }
  if (seconds > 1e7) throw EnvError("a timeout of " + std::to_string(seconds) + " s is longer than 10^7 s");
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000 + 0.5));
}

MESHTORCH_DECL LaunchEnv launch_env() {
  return launch_env_from([](std::string_view name) -> std::optional<std::string> {
    if (const char* value = std::getenv(std::string(name).c_str())) return std::string(value);
    return std::nullopt;
  });
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(core)
