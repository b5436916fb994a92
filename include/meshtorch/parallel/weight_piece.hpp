#pragma once
// Where this rank's piece of a weight lies in the whole, under tensor parallel and FSDP: TP's
// chunk along the dim the plan cut the weight (none: all of it), then FSDP's rows of that chunk.
// ParallelLlama and PipelineLlama both cut weights so, and checkpoints, initialisation and loading
// all ask this one function.
#include <cstdint>
#include <string>
#include <vector>

#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// `tp` and `fsdp` may be null (the layout has no such axis).
MESHTORCH_DECL io::Box tp_fsdp_piece(const std::string& name, const std::vector<std::int64_t>& global_shape,
                                     const TensorParallelRuntime* tp, const FullyShardedDataParallel* fsdp);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
namespace meshtorch {

MESHTORCH_DECL io::Box tp_fsdp_piece(const std::string& name, const std::vector<std::int64_t>& global_shape,
                                     const TensorParallelRuntime* tp, const FullyShardedDataParallel* fsdp) {
  auto box = io::whole(global_shape);
  if (tp)
    if (const auto dim = tp->shard_dim(name)) box = io::chunk(box, *dim, tp->group().rank(), tp->group().size());
  if (fsdp) {
    const auto [first_row, rows] = fsdp->rows_of(name);
    box = io::rows(box, first_row, first_row + rows);
  }
  return box;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
