// meshtorch-doctor: the guide's checklist for a job that hangs or fails to start, run as checks.
// Start it like the training run, with the same launcher and flags, and it reports per check:
//
//   build/bin/meshrun --nproc-per-node 8 -- build/bin/meshtorch-doctor -m llama-3.1-8b -e run1 --save-dir /shared/runs
//
//   rendezvous   every rank met, and how long it took against --timeout
//   clocks       how far the ranks' wall clocks disagree (logs are merged by timestamp)
//   open files   the soft limit of open files per rank (each peer connection takes some)
//   threads      intra-op threads x ranks per node against the node's CPUs
//   save folder  one folder every rank sees (resuming needs it), and room for two checkpoints
//   NCCL, GPUs   NCCL_* variables, and each GPU's peer access where there are GPUs
//   timeout      --timeout against the slowest step of the experiment's metrics.jsonl
//
// Flags it does not know (a chapter's own, such as --tp) are ignored, so the training command's
// flags can be passed as they are. Exit code 1 when a check fails, else 0 (warnings included).
#include <sched.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/train/args.hpp>

#if MESHTORCH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mt = meshtorch;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

enum class Level { ok, info, warn, fail };

struct Finding {
  Level level;
  std::string check, detail;
};

std::string tag(Level level) {
  switch (level) {
    case Level::ok:
      return "[ok]  ";
    case Level::info:
      return "[info]";
    case Level::warn:
      return "[warn]";
    case Level::fail:
      return "[FAIL]";
  }
  return "";
}

std::string gigabytes(double bytes) { return fmt::format("{:.2f} GB", bytes / 1e9); }

// The nearest existing folder at or above `path` (the save folder may not exist yet).
fs::path existing_ancestor(fs::path path) {
  path = fs::absolute(path);
  while (!fs::exists(path) && path.has_parent_path() && path != path.parent_path()) path = path.parent_path();
  return path;
}

int usable_cpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// What one rank sees of its machine.
json local_facts(const mt::train::TrainArgs& args) {
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  json facts = {{"host", mt::comm::host_name()},
                {"pid", static_cast<long>(::getpid())},
                {"open_files_soft", static_cast<long long>(files.rlim_cur)},
                {"open_files_hard", static_cast<long long>(files.rlim_max)},
                {"threads", torch::get_num_threads()},
                {"cpus", usable_cpus()}};
  const auto folder = existing_ancestor(args.save_dir);
  struct statvfs space {};
  if (::statvfs(folder.c_str(), &space) == 0)
    facts["save_free_bytes"] = static_cast<double>(space.f_bavail) * static_cast<double>(space.f_frsize);
  facts["save_folder"] = folder.string();
  json nccl = json::object();
  for (char** variable = environ; *variable; ++variable) {
    const std::string text = *variable;
    if (text.rfind("NCCL_", 0) == 0) nccl[text.substr(0, text.find('='))] = text.substr(text.find('=') + 1);
  }
  facts["nccl"] = nccl;
  json gpus = json::array();
#if MESHTORCH_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess)
    for (int a = 0; a < count; ++a) {
      json peers = json::array();
      for (int b = 0; b < count; ++b) {
        int can = 0;
        if (a != b) cudaDeviceCanAccessPeer(&can, a, b);
        peers.push_back(a == b || can != 0);
      }
      gpus.push_back(peers);
    }
#endif
  facts["gpu_peer_access"] = gpus;
  return facts;
}

std::vector<json> gather(const mt::comm::AxisGroup& world, const json& mine) {
  std::vector<json> all;
  for (const auto& text : mt::comm::all_gather_object(world, mine.dump())) all.push_back(json::parse(text));
  return all;
}

std::string ranks_list(const std::vector<int>& ranks) { return fmt::format("{}", fmt::join(ranks, ", ")); }

// The smallest spread of the ranks' wall clocks read right after a barrier, over a few rounds:
// an upper bound of their disagreement (the barrier's exit jitter is included).
double clock_spread_ms(const mt::comm::AxisGroup& world) {
  double best = 1e300;
  for (int round = 0; round < 5; ++round) {
    mt::comm::barrier(world);
    const auto now =
        std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
    const auto all = mt::comm::all_gather(world, torch::tensor({now}, torch::kDouble), 0);
    best = std::min(best, (all.max() - all.min()).item<double>());
  }
  return best;
}

// Whether every rank sees the file rank 0 writes into the save folder: resuming needs one folder
// that all ranks share.
std::vector<int> ranks_not_sharing(const mt::comm::AxisGroup& world, const fs::path& save_dir, int port) {
  const auto probe = fs::absolute(save_dir) / fmt::format(".meshtorch-doctor-{}-{}", port, ::getpid());
  std::string path = world.rank() == 0 ? probe.string() : std::string();
  path = mt::comm::all_gather_object(world, path)[0];
  if (world.rank() == 0) {
    fs::create_directories(save_dir);
    std::ofstream(path) << "meshtorch-doctor\n";
  }
  mt::comm::barrier(world);
  const bool seen = fs::exists(path);
  const auto seen_by = mt::comm::all_gather_object(world, seen ? "1" : "0");
  mt::comm::barrier(world);
  if (world.rank() == 0) fs::remove(path);
  std::vector<int> missing;
  for (int r = 0; r < world.size(); ++r)
    if (seen_by[static_cast<std::size_t>(r)] != "1") missing.push_back(r);
  return missing;
}

// The slowest step (ms) of a metrics.jsonl, or a negative value when there is none.
double slowest_step_ms(const fs::path& metrics) {
  std::ifstream in(metrics);
  double slowest = -1;
  std::string line;
  while (std::getline(in, line)) {
    const auto record = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.contains("time/total") && record["time/total"].is_number())
      slowest = std::max(slowest, record["time/total"].get<double>());
  }
  return slowest;
}

std::vector<Finding> examine(const mt::train::TrainArgs& args, const std::string& metrics_flag,
                             const mt::comm::AxisGroup& world, const std::vector<json>& facts, double met_s,
                             double spread_ms, const std::vector<int>& not_sharing, torch::ScalarType dtype) {
  std::vector<Finding> out;
  const double timeout_s = std::chrono::duration<double>(mt::comm::collective_timeout(args.timeout_s)).count();
  std::map<std::string, std::vector<int>> ranks_of_host;
  for (int r = 0; r < world.size(); ++r) ranks_of_host[facts[r]["host"].get<std::string>()].push_back(r);

  out.push_back({Level::ok, "rendezvous",
                 fmt::format("{} ranks on {} node(s) met {:.1f} s after this rank started (timeout {:.0f} s)",
                             world.size(), ranks_of_host.size(), met_s, timeout_s)});

  const Level clock_level = spread_ms > 1000 ? Level::fail : spread_ms > 100 ? Level::warn : Level::ok;
  out.push_back({clock_level, "clocks",
                 fmt::format("the ranks' wall clocks agree within {:.1f} ms{}", spread_ms,
                             clock_level == Level::ok ? ""
                                                      : "; logs merged by timestamp will be out of order: sync the "
                                                        "nodes' clocks (chrony or ntpd)")});

  std::vector<int> low_files;
  long long lowest = 0, hard = 0;
  for (int r = 0; r < world.size(); ++r) {
    const auto soft = facts[r]["open_files_soft"].get<long long>();
    if (soft < 65536) {
      low_files.push_back(r);
      if (!lowest || soft < lowest) lowest = soft, hard = facts[r]["open_files_hard"].get<long long>();
    }
  }
  out.push_back(low_files.empty()
                    ? Finding{Level::ok, "open files", "the soft limit is at least 65536 on every rank"}
                    : Finding{Level::warn, "open files",
                              fmt::format("rank(s) {} may open only {} files; each peer connection, data file and "
                                          "checkpoint piece takes one: {}",
                                          ranks_list(low_files), lowest,
                                          hard > lowest ? fmt::format("raise it before launching (ulimit -n {})", hard)
                                                        : "the hard limit is the same: raise both (limits.conf, or "
                                                          "the job scheduler's settings)")});

  for (const auto& [host, ranks] : ranks_of_host) {
    int threads = 0;
    for (int r : ranks) threads += facts[r]["threads"].get<int>();
    const int cpus = facts[ranks.front()]["cpus"].get<int>();
    out.push_back(
        {threads > cpus ? Level::warn : Level::ok, "threads",
         fmt::format("{}: {} rank(s) with {} intra-op threads in all, on {} CPUs{}", host, ranks.size(), threads, cpus,
                     threads > cpus ? "; oversubscribed: set OMP_NUM_THREADS or --threads to CPUs / ranks" : "")});
  }

  if (!not_sharing.empty()) {
    out.push_back({Level::fail, "save folder",
                   fmt::format("rank(s) {} do not see the file rank 0 wrote into {}: checkpoints need one folder every "
                               "rank sees (a shared file system)",
                               ranks_list(not_sharing), args.save_dir)});
  } else {
    double least = 1e300;
    int poorest = 0;
    for (int r = 0; r < world.size(); ++r)
      if (facts[r].contains("save_free_bytes") && facts[r]["save_free_bytes"].get<double>() < least)
        least = facts[r]["save_free_bytes"].get<double>(), poorest = r;
    std::string need_text;
    Level level = Level::ok;
    try {
      const auto config = mt::llama::resolve_model(args.model_name);
      // Weights and AdamW's two moments; while a save runs the previous checkpoint still exists.
      const double checkpoint =
          static_cast<double>(config.num_parameters()) * 3 * static_cast<double>(torch::elementSize(dtype));
      need_text = fmt::format("; a checkpoint of {} with AdamW takes {}, and a save needs room for two",
                              args.model_name, gigabytes(checkpoint));
      if (least < 2 * checkpoint) level = Level::fail;
    } catch (const std::exception& e) {
      need_text = fmt::format("; -m {}: {}", args.model_name, e.what());
      level = Level::warn;
    }
    out.push_back({level, "save folder",
                   fmt::format("{} is seen by every rank; {} free (least: rank {}){}", args.save_dir, gigabytes(least),
                               poorest, need_text)});
  }

  std::set<std::string> nccl;
  for (const auto& f : facts)
    for (const auto& [name, value] : f["nccl"].items()) nccl.insert(name + "=" + value.get<std::string>());
  out.push_back({Level::info, "NCCL",
                 nccl.empty() ? std::string("no NCCL_* variables set")
                              : fmt::format("set on some rank: {}", fmt::join(nccl, " "))});
  for (const auto& [host, ranks] : ranks_of_host) {
    const auto& peers = facts[ranks.front()]["gpu_peer_access"];
    if (peers.empty()) {
      out.push_back({Level::info, "GPUs", fmt::format("{}: none visible (a CPU run, or a CPU build)", host)});
      continue;
    }
    std::vector<std::string> missing;
    for (std::size_t a = 0; a < peers.size(); ++a)
      for (std::size_t b = 0; b < peers.size(); ++b)
        if (!peers[a][b].get<bool>()) missing.push_back(fmt::format("{}->{}", a, b));
    out.push_back({missing.empty() ? Level::ok : Level::warn, "GPUs",
                   missing.empty()
                       ? fmt::format("{}: {} GPUs, each reaches every other directly (peer access)", host, peers.size())
                       : fmt::format("{}: {} GPUs; no peer access {} (collectives go through host memory: "
                                     "check nvidia-smi topo -m)",
                                     host, peers.size(), fmt::join(missing, " "))});
  }

  fs::path metrics = metrics_flag;
  if (metrics.empty() && !args.experiment_name.empty())
    metrics = fs::path(args.save_dir) / args.experiment_name / "metrics.jsonl";
  const double slowest = metrics.empty() ? -1 : slowest_step_ms(metrics);
  if (slowest <= 0) {
    out.push_back({Level::info, "timeout",
                   fmt::format("{:.0f} s; no step times to compare with (give --metrics, or -e of a run that logged)",
                               timeout_s)});
  } else {
    const double ratio = timeout_s * 1000 / slowest;
    out.push_back(
        {ratio < 10 ? Level::warn : Level::ok, "timeout",
         fmt::format("{:.0f} s is {:.0f}x the slowest step in {} ({:.0f} ms){}", timeout_s, ratio, metrics.string(),
                     slowest,
                     ratio < 10 ? "; a slow step or a checkpoint save may end the run: raise --timeout" : "")});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const auto started = Clock::now();
  CLI::App app{
      "meshtorch-doctor: the checklist of a job that hangs or fails to start, as checks. Start it with the "
      "training run's launcher and flags."};
  mt::train::TrainArgs args;
  args.add_to(app);
  std::string metrics;
  app.add_option("--metrics", metrics, "a metrics.jsonl whose step times --timeout is compared with (default: -e's)");
  app.allow_extras();  // a chapter's own flags, passed along with the rest
  CLI11_PARSE(app, argc, argv);
  return mt::diagnostics::run_recorded([&] {
    using Mesh = mt::Mesh<mt::DP<mt::dynamic>>;
    auto run = mt::launch<Mesh>(args, {mt::from_world_size});
    const auto& world = run.mesh.world();
    const double met_s = std::chrono::duration<double>(Clock::now() - started).count();
    const auto facts = gather(world, local_facts(args));
    const double spread_ms = clock_spread_ms(world);
    const auto not_sharing = ranks_not_sharing(world, args.save_dir, run.env.master_port);
    if (world.rank() != 0) return 0;
    const auto findings = examine(args, metrics, world, facts, met_s, spread_ms, not_sharing, run.dtype);
    bool failed = false;
    for (const auto& f : findings) {
      std::cout << fmt::format("{} {:<12} {}\n", tag(f.level), f.check, f.detail);
      failed = failed || f.level == Level::fail;
    }
    std::cout << std::flush;
    return failed ? 1 : 0;
  });
}
