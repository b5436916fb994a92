#pragma once
// launch<Mesh>(args): the start of every distributed chapter, in one call: intra-op threads,
// where this rank sits (torchrun, meshrun, Slurm or OpenMPI variables), its device and dtype, the
// mesh (rendezvous, every flag compared across ranks, one process group per axis) and the
// rank's banner; then the seed.
//
//   using Mesh = mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>;
//   auto run = mt::launch<Mesh>(args, {mt::from_world_size, args.tp});
//   run.mesh.group<mt::TP>() ... run.device ... run.log.info(...)
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/train/args.hpp>
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

// `extents` are the mesh's dynamic extents (see comm::InitOptions::extents). `plan` is added to
// the flags in the fingerprint: anything else all ranks must agree on.
template <MeshType M>
Launch<M> launch(const train::TrainArgs& args, std::vector<int> extents = {}, const std::string& plan = {}) {
  if (args.threads > 0) torch::set_num_threads(args.threads);
  auto env = comm::launch_env();
  const auto device = train::resolve_device(args.device, env.local_rank);
  const auto dtype = train::resolve_dtype(args.dtype, device);
  auto mesh = comm::init<M>({.device = device.is_cuda() ? comm::Device::cuda : comm::Device::cpu,
                             .fingerprint = args.fingerprint() + plan,
                             .env = env,
                             .extents = std::move(extents)});
  train::Logger log(mesh.rank());
  log.info(mesh.describe());
  torch::manual_seed(args.seed);
  return {std::move(env), device, dtype, std::move(mesh), log};
}

}  // namespace meshtorch
