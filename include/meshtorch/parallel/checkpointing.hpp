#pragma once
// Checkpointing<ParallelLlama<M>>: how an Experiment (train/experiment.hpp) saves and resumes a
// model that parallelize() built, chosen from the mesh type's axes. Every rank calls save and
// load: both are collectives.
#include <filesystem>
#include <optional>

#include <meshtorch/error.hpp>
#include <meshtorch/parallel/checkpoint.hpp>
#include <meshtorch/parallel/fsdp_checkpoint.hpp>
#include <meshtorch/parallel/fsdp_tp_checkpoint.hpp>
#include <meshtorch/parallel/parallelize.hpp>
#include <meshtorch/parallel/tensor_parallel_checkpoint.hpp>
#include <meshtorch/train/experiment.hpp>

namespace meshtorch::train {

template <MeshType M, llama::LlamaStyles Styles>
struct Checkpointing<ParallelLlama<M, Styles>> {
  using Model = ParallelLlama<M, Styles>;

  template <class Optimizer>
  static void save(const std::filesystem::path& exp_dir, Model& model, const Optimizer& optimizer,
                   const TrainState& state, const RunIdentity& identity) {
    if constexpr (Model::has_fsdp && Model::has_tp) {
      parallel::save_checkpoint(exp_dir, *model.tensor_parallel(), *model.fully_sharded(), model.module()->config,
                                optimizer, state, identity, model.world());
    } else if constexpr (Model::has_fsdp) {
      refuse_replicated_shards(model);
      parallel::save_sharded_checkpoint(exp_dir, model.module()->config, *model.fully_sharded(), optimizer, state,
                                        identity);
    } else if constexpr (Model::has_tp) {
      parallel::save_checkpoint(exp_dir, *model.tensor_parallel(), model.module(), optimizer, state, identity,
                                model.world(), model.data_parallel_rank());
    } else {
      parallel::save_checkpoint(exp_dir, model.module(), optimizer, state, identity, model.world());
    }
  }

  template <class Optimizer>
  static std::optional<TrainState> load(const std::filesystem::path& exp_dir, Model& model, Optimizer& optimizer,
                                        const RunIdentity& identity) {
    if constexpr (Model::has_fsdp && Model::has_tp) {
      return parallel::load_checkpoint(exp_dir, *model.tensor_parallel(), *model.fully_sharded(), optimizer, identity,
                                       model.world());
    } else if constexpr (Model::has_fsdp) {
      refuse_replicated_shards(model);
      return parallel::load_sharded_checkpoint(exp_dir, *model.fully_sharded(), optimizer, identity);
    } else if constexpr (Model::has_tp) {
      return parallel::load_checkpoint(exp_dir, *model.tensor_parallel(), model.module(), optimizer, identity,
                                       model.world());
    } else {
      return parallel::load_checkpoint(exp_dir, model.module(), optimizer, identity, model.world());
    }
  }

 private:
  // The per-FSDP-rank shard files name the FSDP rank only: replicas over DP would write the same names.
  static void refuse_replicated_shards(const Model& model) {
    if (model.data_parallel_size() != model.fully_sharded()->group().size())
      throw ConfigError("checkpoints of an HSDP mesh without TP (" + std::string(M::name) +
                        ") are not supported yet; add a TP axis of extent 1 (Mesh<DP, FSDP, TP>) to save them");
  }
};

}  // namespace meshtorch::train
