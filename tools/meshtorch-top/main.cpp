// meshtorch-top: the guide's cluster top. Per node: CPU use, memory, every rank process (rank,
// state, CPU, resident memory) and, where an NVIDIA driver is present, each GPU's utilisation,
// memory and power. A hang shows as every rank asleep at 0% CPU and GPU power near idle; a
// stopped rank as state "stopped".
//
//   meshtorch-top --hosts hosts.txt         every host over ssh, refreshed every --interval s
//   meshtorch-top --local                   this node only
//   meshtorch-top --local --json --once     one sample as JSON (what --hosts reads from each host)
//
// A rank process is one whose environment holds RANK (meshrun, torchrun) or SLURM_PROCID or
// OMPI_COMM_WORLD_RANK, and that belongs to this user. No LibTorch: it runs on any node.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/env.hpp>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Busy and total jiffies of all CPUs (/proc/stat's first line).
std::pair<double, double> cpu_jiffies() {
  std::istringstream line(read_file("/proc/stat"));
  std::string cpu;
  line >> cpu;
  double value, busy = 0, total = 0;
  for (int field = 0; line >> value && field < 8; ++field) {
    total += value;
    if (field != 3 && field != 4) busy += value;  // idle, iowait
  }
  return {busy, total};
}

struct RankProcess {
  long pid;
  std::string rank, local_rank, state, command;
  double cpu_ticks, rss_bytes;
};

std::string state_name(char state) {
  switch (state) {
    case 'R':
      return "running";
    case 'S':
      return "sleeping";
    case 'D':
      return "disk wait";
    case 'T':
      return "stopped";
    case 't':
      return "traced";
    case 'Z':
      return "zombie";
    default:
      return std::string(1, state);
  }
}

std::vector<RankProcess> rank_processes() {
  std::vector<RankProcess> out;
  const auto uid = ::getuid();
  const long page = ::sysconf(_SC_PAGESIZE);
  std::error_code error;
  for (const auto& entry : fs::directory_iterator("/proc", error)) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    struct stat info {};
    if (::stat(entry.path().c_str(), &info) != 0 || info.st_uid != uid) continue;
    const std::string environ = read_file(entry.path() / "environ");
    std::map<std::string, std::string> env;
    for (std::size_t start = 0; start < environ.size();) {
      const auto end = std::min(environ.find('\0', start), environ.size());
      const auto item = environ.substr(start, end - start);
      if (const auto eq = item.find('='); eq != std::string::npos) env[item.substr(0, eq)] = item.substr(eq + 1);
      start = end + 1;
    }
    std::string rank;
    for (const char* variable : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"})
      if (env.count(variable)) {
        rank = env[variable];
        break;
      }
    if (rank.empty()) continue;
    // /proc/<pid>/stat: "pid (comm) state ... utime(14) stime(15) ... rss(24)"; comm may hold spaces.
    const std::string stat_text = read_file(entry.path() / "stat");
    const auto close = stat_text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat_text.substr(close + 2));
    std::vector<std::string> f{std::istream_iterator<std::string>(fields), std::istream_iterator<std::string>()};
    if (f.size() < 22) continue;
    std::string local_rank = env.count("LOCAL_RANK")      ? env["LOCAL_RANK"]
                             : env.count("SLURM_LOCALID") ? env["SLURM_LOCALID"]
                                                          : "";
    out.push_back({std::atol(name.c_str()), rank, local_rank, state_name(f[0][0]),
                   stat_text.substr(stat_text.find('(') + 1, close - stat_text.find('(') - 1),
                   std::stod(f[11]) + std::stod(f[12]), std::stod(f[21]) * static_cast<double>(page)});
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return std::atoi(a.rank.c_str()) < std::atoi(b.rank.c_str()); });
  return out;
}

// NVML, loaded at run time so that the tool runs on nodes without an NVIDIA driver. The few entry
// points used are declared here as nvml.h declares them.
struct Nvml {
  using Device = void*;
  struct Utilization {
    unsigned gpu, memory;
  };
  struct Memory {
    unsigned long long total, free, used;
  };
  int (*init)() = nullptr;
  int (*count)(unsigned*) = nullptr;
  int (*handle)(unsigned, Device*) = nullptr;
  int (*utilization)(Device, Utilization*) = nullptr;
  int (*memory)(Device, Memory*) = nullptr;
  int (*power)(Device, unsigned*) = nullptr;

  static const Nvml* load() {
    static const Nvml* loaded = []() -> const Nvml* {
      void* library = ::dlopen("libnvidia-ml.so.1", RTLD_NOW);
      if (!library) return nullptr;
      static Nvml nvml;
      nvml.init = reinterpret_cast<int (*)()>(::dlsym(library, "nvmlInit_v2"));
      nvml.count = reinterpret_cast<int (*)(unsigned*)>(::dlsym(library, "nvmlDeviceGetCount_v2"));
      nvml.handle = reinterpret_cast<int (*)(unsigned, Device*)>(::dlsym(library, "nvmlDeviceGetHandleByIndex_v2"));
      nvml.utilization =
          reinterpret_cast<int (*)(Device, Utilization*)>(::dlsym(library, "nvmlDeviceGetUtilizationRates"));
      nvml.memory = reinterpret_cast<int (*)(Device, Memory*)>(::dlsym(library, "nvmlDeviceGetMemoryInfo"));
      nvml.power = reinterpret_cast<int (*)(Device, unsigned*)>(::dlsym(library, "nvmlDeviceGetPowerUsage"));
      if (!nvml.init || !nvml.count || !nvml.handle || !nvml.utilization || !nvml.memory || !nvml.power ||
          nvml.init() != 0)
        return nullptr;
      return &nvml;
    }();
    return loaded;
  }
};

json gpus() {
  json out = json::array();
  const Nvml* nvml = Nvml::load();
  unsigned count = 0;
  if (!nvml || nvml->count(&count) != 0) return out;
  for (unsigned i = 0; i < count; ++i) {
    Nvml::Device device = nullptr;
    Nvml::Utilization use{};
    Nvml::Memory memory{};
    unsigned milliwatts = 0;
    if (nvml->handle(i, &device) != 0) continue;
    nvml->utilization(device, &use);
    nvml->memory(device, &memory);
    nvml->power(device, &milliwatts);
    out.push_back({{"index", i},
                   {"util_percent", use.gpu},
                   {"memory_used_bytes", memory.used},
                   {"memory_total_bytes", memory.total},
                   {"power_watts", milliwatts / 1000.0}});
  }
  return out;
}

// One sample of this node, over `interval` (CPU use is a difference of two readings).
json sample_local(std::chrono::milliseconds interval) {
  const auto [busy0, total0] = cpu_jiffies();
  std::map<long, double> ticks0;
  for (const auto& p : rank_processes()) ticks0[p.pid] = p.cpu_ticks;
  std::this_thread::sleep_for(interval);
  const auto [busy1, total1] = cpu_jiffies();
  const double ticks_per_s = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double seconds = std::chrono::duration<double>(interval).count();
  json ranks = json::array();
  for (const auto& p : rank_processes()) {
    const double used = ticks0.count(p.pid) ? p.cpu_ticks - ticks0[p.pid] : 0;
    ranks.push_back({{"pid", p.pid},
                     {"rank", p.rank},
                     {"local_rank", p.local_rank},
                     {"state", p.state},
                     {"command", p.command},
                     {"cpu_percent", 100 * used / ticks_per_s / seconds},
                     {"rss_bytes", p.rss_bytes}});
  }
  double mem_total = 0, mem_available = 0;
  std::istringstream meminfo(read_file("/proc/meminfo"));
  for (std::string key, unit; meminfo >> key;) {
    double kb = 0;
    meminfo >> kb;
    std::getline(meminfo, unit);
    if (key == "MemTotal:") mem_total = kb * 1024;
    if (key == "MemAvailable:") mem_available = kb * 1024;
  }
  return {{"host", meshtorch::comm::host_name()},
          {"cpus", std::thread::hardware_concurrency()},
          {"cpu_percent", total1 > total0 ? 100 * (busy1 - busy0) / (total1 - total0) : 0.0},
          {"memory_used_bytes", mem_total - mem_available},
          {"memory_total_bytes", mem_total},
          {"ranks", ranks},
          {"gpus", gpus()}};
}

// One host's sample over ssh (the same tool, --local --json --once, on the same path there).
json sample_remote(const std::string& host, const std::string& self, double interval_s) {
  const std::string command =
      fmt::format("ssh -o BatchMode=yes -o ConnectTimeout=5 {} '{} --local --json --once --interval {}' 2>&1", host,
                  self, interval_s);
  std::string output;
  if (FILE* pipe = ::popen(command.c_str(), "r")) {
    char buffer[4096];
    while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
    const int status = ::pclose(pipe);
    auto parsed = json::parse(output, nullptr, /*allow_exceptions=*/false);
    if (status == 0 && parsed.is_object()) return parsed;
  }
  return {{"host", host}, {"error", output.substr(0, output.find('\n'))}};
}

std::string gb(double bytes) { return fmt::format("{:.1f}G", bytes / 1e9); }

std::string render(const std::vector<json>& nodes) {
  std::string out;
  for (const auto& node : nodes) {
    if (node.contains("error")) {
      out += fmt::format("{}: unreachable ({})\n", node.value("host", "?"), node["error"].get<std::string>());
      continue;
    }
    out += fmt::format("{}: cpu {:.0f}% of {}, memory {} / {}\n", node["host"].get<std::string>(),
                       node["cpu_percent"].get<double>(), node["cpus"].get<int>(),
                       gb(node["memory_used_bytes"].get<double>()), gb(node["memory_total_bytes"].get<double>()));
    for (const auto& g : node["gpus"])
      out += fmt::format("  gpu {}: util {}%, memory {} / {}, power {:.0f} W\n", g["index"].get<int>(),
                         g["util_percent"].get<int>(), gb(g["memory_used_bytes"].get<double>()),
                         gb(g["memory_total_bytes"].get<double>()), g["power_watts"].get<double>());
    if (node["ranks"].empty()) out += "  no rank processes\n";
    for (const auto& r : node["ranks"])
      out += fmt::format("  rank {:>4} (local {:>2}) pid {:>7} {:<9} cpu {:>5.0f}%  rss {:>7}  {}\n",
                         r["rank"].get<std::string>(), r["local_rank"].get<std::string>(), r["pid"].get<long>(),
                         r["state"].get<std::string>(), r["cpu_percent"].get<double>(),
                         gb(r["rss_bytes"].get<double>()), r["command"].get<std::string>());
  }
  return out;
}

std::vector<std::string> read_hosts(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error(fmt::format("--hosts {}: cannot open", file));
  std::vector<std::string> hosts;
  for (std::string line; std::getline(in, line);) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    if (std::string host; words >> host) hosts.push_back(host);  // "host slots=8" as mpirun writes it
  }
  if (hosts.empty()) throw std::runtime_error(fmt::format("--hosts {}: no host in it", file));
  return hosts;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtorch-top: CPU, memory, rank processes and GPUs of every node of a job"};
  std::string hosts_file;
  bool local = false, as_json = false, once = false;
  double interval_s = 2;
  auto* hosts_option =
      app.add_option("--hosts", hosts_file, "a hosts file (one host per line, as for mpirun or the launch scripts)");
  app.add_flag("--local", local, "this node only")->excludes(hosts_option);
  app.add_flag("--json", as_json, "print JSON instead of the table");
  app.add_flag("--once", once, "one sample, then exit");
  app.add_option("--interval", interval_s, "seconds per sample")
      ->check(CLI::Range(0.05, 3600.0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (!local && hosts_file.empty()) {
    std::cerr << "meshtorch-top: give --local or --hosts FILE\n";
    return 2;
  }
  try {
    const auto interval = std::chrono::milliseconds(static_cast<long long>(interval_s * 1000));
    const std::string self = fs::canonical("/proc/self/exe").string();
    for (;;) {
      std::vector<json> nodes;
      if (local) {
        nodes.push_back(sample_local(interval));
      } else {
        std::vector<std::future<json>> pending;
        for (const auto& host : read_hosts(hosts_file))
          pending.push_back(std::async(std::launch::async, sample_remote, host, self, interval_s));
        for (auto& p : pending) nodes.push_back(p.get());
      }
      const std::string text = as_json ? (local ? nodes.front().dump() : json(nodes).dump()) + "\n" : render(nodes);
      if (!once && !as_json) std::cout << "\033[H\033[2J";  // clear the screen, as top does
      std::cout << text << std::flush;
      if (once) return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "meshtorch-top: " << e.what() << "\n";
    return 1;
  }
}
