#pragma once
// launch<Mesh>(args): the start of every distributed chapter, in one call: intra-op threads,
// where this rank sits (torchrun, meshrun, Slurm or OpenMPI variables), its device and dtype, the
// mesh (rendezvous, every flag compared across ranks, one process group per axis) and the
// rank's banner; then the seed. It arms the watchdog (diagnostics/watchdog.hpp): rendezvous and every
// collective are bounded by --timeout (or MESHTORCH_TIMEOUT, else 600 s), and a collective that
// stalls ends every rank with an error naming the rank that did not arrive, after writing the
// flight recorder to flight_recorder_dir(args) and every thread's stack to the log (also on
// SIGUSR1: diagnostics/stack_dump.hpp).
//
//   using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>;
//   auto run = mt::launch<Mesh>(args, {mt::from_world_size, args.tp});
//   run.mesh.group<mt::TP>() ... run.device ... run.log.info(...)
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/diagnostics/stack_dump.hpp>
#include <meshtorch/diagnostics/watchdog.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/caching_host_allocator.hpp>
#include <meshtorch/train/device.hpp>
#include <meshtorch/train/log.hpp>

namespace meshtorch {

template <MeshType M>
struct Launch {
  comm::LaunchEnv env;
  torch::Device device;
  torch::ScalarType dtype;
  comm::DeviceMesh<M> mesh;
  train::Logger log;
};

// Where ranks dump their flight recorder: MESHTORCH_FLIGHT_RECORDER_DIR, else the experiment's
// folder (<save-dir>/<name>/flight_recorder), else a folder in the temporary directory named by
// the rendezvous port, which all ranks of a job share.
MESHTORCH_DECL std::filesystem::path flight_recorder_dir(const train::TrainArgs& args, const comm::LaunchEnv& env);

// `extents` are the mesh's dynamic extents (see comm::InitOptions::extents). `plan` is added to
// the flags in the fingerprint: anything else all ranks must agree on.
template <MeshType M>
Launch<M> launch(const train::TrainArgs& args, std::vector<int> extents = {}, const std::string& plan = {}) {
  train::use_deterministic_algorithms(args.deterministic);
  auto env = comm::launch_env();
  const auto device = train::resolve_device(args.device, env.local_rank);
  // Before anything is allocated: CPU runs cache large host blocks (train/caching_host_allocator.hpp).
  const std::string host_allocator = device.is_cpu() ? train::use_host_allocator_from_environment() : "";
  // --threads, else on a GPU the node's CPUs shared among its ranks; on the CPU the launcher's
  // OMP_NUM_THREADS (LibTorch's default).
  if (args.threads > 0)
    torch::set_num_threads(args.threads);
  else if (device.is_cuda())
    torch::set_num_threads(train::host_threads_per_rank(env.local_world_size));
  const auto dtype = train::resolve_dtype(args.dtype, device, llama::weights_dtype(args.model_name));
  auto mesh = comm::init<M>({.device = device.is_cuda() ? comm::Device::cuda : comm::Device::cpu,
                             .timeout = comm::collective_timeout(args.timeout_s),
                             .fingerprint = args.fingerprint() + plan,
                             .env = env,
                             .extents = std::move(extents)});
  if (mesh.world_size() > 1) diagnostics::Watchdog::instance().arm(flight_recorder_dir(args, env));
  diagnostics::install_stack_dumps();  // SIGUSR1 (meshrun --dump-stacks) writes every thread's stack
  train::Logger log(mesh.rank());
  log.info(fmt::format("{}; {} intra-op thread(s){}", mesh.describe(), torch::get_num_threads(),
                       host_allocator.empty() ? "" : fmt::format("; {} CPU allocator", host_allocator)));
  torch::manual_seed(args.seed);
  return {std::move(env), device, dtype, std::move(mesh), log};
}

// The same for a plan type: its mesh, with the plan's description in the fingerprint, so that the
// ranks compare the plan that parallelize<P>() applies.
template <llama::LlamaPlan P>
Launch<typename P::mesh_type> launch(const train::TrainArgs& args, std::vector<int> extents = {}) {
  return launch<typename P::mesh_type>(args, std::move(extents), P::describe());
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(programs)
#include <cstdlib>

namespace meshtorch {

MESHTORCH_DECL std::filesystem::path flight_recorder_dir(const train::TrainArgs& args, const comm::LaunchEnv& env) {
  if (const char* dir = std::getenv("MESHTORCH_FLIGHT_RECORDER_DIR"); dir && *dir) return dir;
  if (!args.experiment_name.empty())
    return std::filesystem::path(args.save_dir) / args.experiment_name / "flight_recorder";
  return std::filesystem::temp_directory_path() / ("meshtorch-flight-recorder-" + std::to_string(env.master_port));
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(programs)
