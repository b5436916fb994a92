#pragma once
// The groups a mesh's data-parallel axes (DP, FSDP, and CP, whose ranks hold different tokens of
// one batch) make, as parallelize() uses them with and without pipeline stages: who shards the
// weights, who averages gradients, whom the sampler splits the batch over and whose losses are
// averaged. One place for the rules, so ParallelLlama and PipelineLlama cannot drift apart.
#include <optional>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/layout/mesh.hpp>

namespace meshtorch {

struct DataParallelGroups {
  // FSDP and CP merged: the ranks that shard the weights; absent without FSDP.
  std::optional<comm::AxisGroup> fsdp;
  // The ranks whose gradients are averaged (DDP, or after a pipeline's schedule): DP, and CP
  // without FSDP; absent without either.
  std::optional<comm::AxisGroup> replicas;
  // DP and FSDP merged: the sampler's group (the CP ranks of a replica read the same batch).
  std::optional<comm::AxisGroup> data_parallel;
  // DP, FSDP and CP merged: the ranks whose losses are averaged.
  std::optional<comm::AxisGroup> loss_mean;
  int replica = 0;  // the rank in `replicas`: replicas other than 0 write nothing
};

template <MeshType M>
DataParallelGroups data_parallel_groups(const comm::DeviceMesh<M>& mesh) {
  constexpr bool has_dp = M::template has<DP>, has_fsdp = M::template has<FSDP>, has_cp = M::template has<CP>;
  DataParallelGroups groups;
  // The CP ranks of a replica hold different tokens: FSDP shards over them too, or, without
  // FSDP, their gradients are averaged with the replicas'.
  if constexpr (has_fsdp) groups.fsdp = mesh.group(M::template mask_of_present<FSDP, CP>);
  if constexpr (has_dp || (has_cp && !has_fsdp)) {
    groups.replicas = mesh.group(has_fsdp ? M::template mask_of_present<DP> : M::template mask_of_present<DP, CP>);
    groups.replica = groups.replicas->rank();
  }
  if constexpr (has_dp || has_fsdp) groups.data_parallel = mesh.group(M::template mask_of_present<DP, FSDP>);
  if constexpr (has_dp || has_fsdp || has_cp) groups.loss_mean = mesh.group(M::template mask_of_present<DP, FSDP, CP>);
  return groups;
}

}  // namespace meshtorch
