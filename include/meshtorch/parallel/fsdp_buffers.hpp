#pragma once
// FSDP's flat buffers: a unit's shards packed into one, its full weights in one storage whose
// memory is given back and taken again while the tensors aliasing it stay (FSDP2's
// untyped_storage().resize_(0)), and the collectives between flat buffers (one per unit).
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

namespace fsdp_detail {

// A collective issued and not yet waited for: wait() waits (with the group's timeout, naming
// the collective and the ranks) and records completion in the flight recorder.
using PendingWork = comm::Work<std::monostate>;

// A unit's all-gather of its flat shard buffer into `output` (every rank's shard in rank order),
// and the reduce-scatter of its flat gradient buffer `input` into this rank's block of sums.
// Declared here for the tests of their memory use.
MESHTORCH_DECL PendingWork start_all_gather_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                 torch::Tensor& input, const std::string& what);
MESHTORCH_DECL PendingWork start_reduce_scatter_sum_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                         torch::Tensor& input, const std::string& what);

}  // namespace fsdp_detail

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/joined_work.hpp>

namespace meshtorch {

namespace fsdp_detail {

// Gives a storage's memory back while the storage object (and every tensor aliasing it) stays.
inline void free_storage(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

// Gives a freed storage fresh memory from the allocator it was created with (on CUDA the
// caching allocator, on the storage's device).
inline void allocate_storage(const c10::Storage& storage, std::size_t nbytes) {
  auto* impl = storage.unsafeGetStorageImpl();
  const c10::DeviceGuard guard(impl->device());
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// A tensor on `storage` that is no autograd view of anything and has its own version counter:
// writing through one alias does not invalidate what autograd saved of another. Built on the
// storage directly, since Tensor::set_ would allocate a freed storage to fit the sizes.
inline torch::Tensor alias(const c10::Storage& storage, torch::ScalarType dtype, std::int64_t offset,
                           torch::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::int64_t d = static_cast<std::int64_t>(sizes.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * sizes[d + 1];
  const auto key = c10::computeDispatchKey(dtype, c10::kStrided, storage.device());
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                         caffe2::TypeMeta::fromScalarType(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return tensor;
}

// Whether the group's CPU collectives go through shared memory (comm/shared_memory_backend.hpp),
// which has an all-gather and a reduce-scatter that allocate nothing, where Gloo's do.
inline bool through_shared_memory(const comm::AxisGroup& group) {
  return group.device() == comm::Device::cpu && group.size() > 1 && group.backend() &&
         group.backend()->getBackendName() == "shm";
}

// Issues a collective between two flat buffers (`issue_on` calls the backend); on a group of one
// rank the output is the input. `finish`, when given, runs once the collective is waited for.
template <class IssueOn>
PendingWork start_flat(const comm::AxisGroup& group, torch::Tensor& output, torch::Tensor& input,
                       const std::string& what, IssueOn issue_on, std::function<void()> finish = {}) {
  comm::detail::check_device(what, group, input);
  comm::detail::check_device(what, group, output);
  if (group.size() == 1) {
    output.copy_(input);
    return PendingWork::ready(std::monostate{});
  }
  return PendingWork(
      comm::detail::issue(what, group, input, [&] { return issue_on(*group.backend()); }),
      [finish = std::move(finish)] {
        if (finish) finish();
        return std::monostate{};
      },
      what, group);
}

// start_flat, with `on_success` run on the backend's thread as soon as the collective has
// succeeded (a failed one is reported by the wait and skips it); the wait returns once it has run.
template <class IssueOn, class OnSuccess>
PendingWork start_flat_then(const comm::AxisGroup& group, torch::Tensor& output, torch::Tensor& input,
                            const std::string& what, IssueOn issue_on, OnSuccess on_success) {
  auto continuation = std::make_shared<c10::intrusive_ptr<c10::ivalue::Future>>();
  return start_flat(
      group, output, input, what,
      [&](c10d::Backend& backend) {
        auto work = issue_on(backend);
        *continuation = work->getFuture()->then(
            [on_success = std::move(on_success)](c10::ivalue::Future& done) -> c10::IValue {
              if (!done.hasError()) on_success();
              return {};
            },
            c10::NoneType::get());
        return work;
      },
      [continuation] { (*continuation)->waitAndThrow(); });
}

// Issues the all-gather of the group's flat buffers, concatenated in rank order into output
// (group.size() x input.numel()).
//
// Gloo's all-gather receives into a fresh buffer the size of the whole output and then copies it
// into the output, so every gather in flight held its unit twice until it ended: at llama-100m
// 25 MiB more, at the checkpointed backward's peak whenever the prefetched gather waits there for
// a rank that is behind. Over Gloo each rank's block is instead broadcast by its owner straight
// into its place in the output: the same blocks cross the wire (each rank receives the others'
// once), written once, and nothing is allocated. The broadcasts are one collective to the caller
// and to the flight recorder (comm::JoinedWork).
MESHTORCH_DECL PendingWork start_all_gather_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                 torch::Tensor& input, const std::string& what) {
  if (through_shared_memory(group)) {
    // The shared-memory transport's all-gather writes each rank's block into its place itself.
    return start_flat(group, output, input, what, [&](c10d::Backend& backend) {
      std::vector<std::vector<torch::Tensor>> blocks{output.view({group.size(), -1}).unbind(0)};
      std::vector<torch::Tensor> inputs{input.view({-1})};
      c10d::AllgatherOptions options;
      options.timeout = group.timeout();
      return backend.allgather(blocks, inputs, options);
    });
  }
  if (group.device() == comm::Device::cpu) {
    return start_flat(group, output, input, what, [&](c10d::Backend& backend) {
      auto blocks = output.view({group.size(), -1});
      blocks[group.rank()].copy_(input.view({-1}));
      std::vector<c10::intrusive_ptr<c10d::Work>> broadcasts;
      for (int root = 0; root < group.size(); ++root) {
        c10d::BroadcastOptions options;
        options.rootRank = root;
        options.timeout = group.timeout();
        std::vector<torch::Tensor> block{blocks[root]};
        broadcasts.push_back(backend.broadcast(block, options));
      }
      return c10::make_intrusive<comm::JoinedWork>(std::move(broadcasts));
    });
  }
  c10d::AllgatherOptions options;
  options.timeout = group.timeout();
  return start_flat(group, output, input, what,
                    [&](c10d::Backend& backend) { return backend._allgather_base(output, input, options); });
}

// Issues the sum over the group of input's rank()-th block into output (Gloo has no AVG: the
// caller divides by the group size).
//
// Gloo has no reduce-scatter of its own: its _reduce_scatter_base clones the input and
// all-reduces the clone, so a unit's gradients were held twice from the issue until the wait (at
// llama-100m, 24 MiB more per reduce-scatter in flight). The send buffer is ours and read by
// nothing after this collective, so over Gloo it is all-reduced in place; when the sums arrive,
// Gloo's thread copies this rank's block out and gives the buffer's memory back (input keeps a
// storage of no bytes), so the buffer lives while the collective runs and not until the wait,
// which comes a layer later. The bytes on the wire are the same.
MESHTORCH_DECL PendingWork start_reduce_scatter_sum_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                         torch::Tensor& input, const std::string& what) {
  if (through_shared_memory(group)) {
    // The shared-memory transport adds only this rank's block, into output; the send buffer's
    // memory goes back as soon as the sums are in.
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = group.timeout();
    std::vector<torch::Tensor> outputs{output};
    std::vector<std::vector<torch::Tensor>> blocks{input.view({group.size(), -1}).unbind(0)};
    return start_flat_then(
        group, output, input, what,
        [&](c10d::Backend& backend) { return backend.reduce_scatter(outputs, blocks, options); },
        [input] { free_storage(input.storage()); });
  }
  if (group.device() == comm::Device::cpu) {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = group.timeout();
    std::vector<torch::Tensor> tensors{input};
    // A failed all-reduce is reported by the wait; its buffer is then freed with the tensor.
    return start_flat_then(
        group, output, input, what, [&](c10d::Backend& backend) { return backend.allreduce(tensors, options); },
        [output, input, rank = group.rank(), size = group.size()] {
          output.copy_(input.view({size, -1})[rank]);
          free_storage(input.storage());
        });
  }
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = group.timeout();
  return start_flat(group, output, input, what,
                    [&](c10d::Backend& backend) { return backend._reduce_scatter_base(output, input, options); });
}

// Whether the autograd engine is running a backward on this thread: a forward hook called then
// is a recomputation, not the forward whose order prefetching follows.
inline bool in_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

}  // namespace fsdp_detail

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
