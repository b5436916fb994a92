#pragma once
// DistributedDataParallel: PyTorch's DDP for LibTorch modules, over one axis of a mesh (the DP
// axis; the whole world for Mesh<DP<dynamic>>).
//
// The engine is PyTorch's own, c10d::Reducer, the C++ class Python's DDP drives: gradients are
// packed into flat buckets as autograd produces them, each bucket's all-reduce starts as soon
// as its last gradient arrives (overlapping the rest of backward), gradients are averaged, the
// bucket buffers live across steps, and with gradient_as_bucket_view the parameters' .grad are
// views into them (no copy). This header only does what Python's DistributedDataParallel
// does around the Reducer: check that ranks hold the same parameters, broadcast rank 0's
// parameters and buffers, choose the buckets, and tell the Reducer when a forward pass needs
// its gradients reduced.
//
//   DistributedDataParallel ddp(model.ptr(), mesh.group<DP>());
//   auto loss = ddp([&] { return model->loss(ids, ids); });   // forward
//   loss.backward();                                           // reduced while it runs
//   { auto guard = ddp.no_sync(); ddp([&] { ... }).backward(); }  // accumulate locally
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/process_group.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace c10d {
class CommHookInterface;
class Reducer;
}  // namespace c10d

namespace meshtorch {

struct DdpOptions {
  // Bucket size, as torch's bucket_cap_mb (default 25). Larger buckets mean fewer, larger
  // all-reduces; smaller ones start communication earlier in backward.
  double bucket_cap_mb = 25;
  // The first bucket to be reduced (the last layers' gradients) is kept small so communication
  // starts early; torch's dist._DEFAULT_FIRST_BUCKET_BYTES is 1 MiB.
  double first_bucket_cap_mb = 1;
  // .grad of each parameter is a view into its bucket: no copy in or out, less memory.
  bool gradient_as_bucket_view = true;
  // Broadcast rank 0's buffers (not only parameters) at wrap.
  bool broadcast_buffers = true;
};

namespace detail {

// Every rank must hold the same parameters (names, shapes, dtypes, order), or the bucketed
// all-reduces would pair different tensors, or wait forever for one that does not exist: an
// error on every rank naming the first difference (ZeRO-2 checks its parameters the same way).
MESHTORCH_DECL void check_same_parameters(const comm::AxisGroup& group,
                                          const std::vector<std::pair<std::string, torch::Tensor>>& named);

}  // namespace detail

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, const comm::AxisGroup& group,
                          DdpOptions options = {})
      : DistributedDataParallel(trainable_parameters(*module), module, group, options) {}

  // Replicates a set of named tensors that are not a module's parameters, e.g. the FSDP shards
  // of an HSDP mesh, which are all-reduced over the DP axis after FSDP reduce-scattered them.
  DistributedDataParallel(std::vector<std::pair<std::string, torch::Tensor>> named, const comm::AxisGroup& group,
                          DdpOptions options = {})
      : DistributedDataParallel(std::move(named), nullptr, group, options) {}

 private:
  static std::vector<std::pair<std::string, torch::Tensor>> trainable_parameters(torch::nn::Module& module) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : module.named_parameters())
      if (item.value().requires_grad()) named.emplace_back(item.key(), item.value());
    return named;
  }

  MESHTORCH_DECL DistributedDataParallel(std::vector<std::pair<std::string, torch::Tensor>> named,
                                         std::shared_ptr<torch::nn::Module> module, const comm::AxisGroup& group,
                                         DdpOptions options);

 public:
  template <class Holder>
  DistributedDataParallel(torch::nn::ModuleHolder<Holder>& module, const comm::AxisGroup& group,
                          DdpOptions options = {})
      : DistributedDataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()), group, options) {}

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;
  MESHTORCH_DECL ~DistributedDataParallel();

  // Runs `forward` (any callable returning the outputs, usually the loss) as a DDP forward pass:
  // a backward through its outputs reduces the gradients, unless inside no_sync().
  template <class Forward>
  decltype(auto) operator()(Forward&& forward) {
    const bool grad = torch::GradMode::is_enabled();
    if (grad) before_forward();
    decltype(auto) outputs = std::forward<Forward>(forward)();
    if (grad && require_sync_) after_forward();
    return outputs;
  }

  // While the guard lives, forward passes do not ask for reduction: backward accumulates
  // gradients locally, and the next synchronised backward all-reduces the accumulated sum, as
  // torch's no_sync. Use it on all micro-batches of a step but the last.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(&ddp), previous_(ddp.require_sync_) {
      ddp.require_sync_ = false;
    }
    NoSync(NoSync&& other) noexcept : ddp_(std::exchange(other.ddp_, nullptr)), previous_(other.previous_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;
    ~NoSync() {
      if (ddp_) ddp_->require_sync_ = previous_;
    }

   private:
    DistributedDataParallel* ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  bool require_sync() const { return require_sync_; }

  // Replaces the all-reduce of each bucket (as torch's register_comm_hook): e.g. compression,
  // or instrumentation. Call before the first backward. A hook derives from c10d's
  // CommHookInterface (<torch/csrc/distributed/c10d/comm.hpp>); it is not recorded in the flight
  // recorder.
  MESHTORCH_DECL void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);

  // The buckets in the order they are reduced, as lists of parameter names.
  MESHTORCH_DECL std::vector<std::vector<std::string>> buckets() const;

  // The wrapped module; null when built from named tensors.
  torch::nn::Module* module() { return module_.get(); }
  const comm::AxisGroup& group() const { return group_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }
  const DdpOptions& options() const { return options_; }

 private:
  static constexpr std::size_t broadcast_bucket_bytes = 250u * 1024 * 1024;  // torch's default

  // The Reducer's part of a forward with gradients: the recording hook on first use, the
  // buckets rebuilt after the first step, and (unless in no_sync) the expected gradients reset.
  MESHTORCH_DECL void before_forward();
  // find_unused_parameters is off, so the Reducer needs no outputs to search.
  MESHTORCH_DECL void after_forward();

  std::shared_ptr<torch::nn::Module> module_;
  comm::AxisGroup group_;
  DdpOptions options_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<c10d::Reducer> reducer_;
  bool require_sync_ = true;
  bool comm_hook_registered_ = false;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <sstream>
#include <unordered_map>

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/diagnostics/collective_failure.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>

namespace meshtorch {

namespace detail {

// FNV-1a: a hash that is the same in every process and build, unlike std::hash.
inline std::int64_t stable_hash(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

inline std::string describe_tensor(const std::string& name, const torch::Tensor& t) {
  std::ostringstream out;
  out << "'" << name << "' " << t.sizes() << " " << t.dtype();
  return out.str();
}

// Two all-gathers of fixed size compare the parameters' signatures, over the group's CPU
// companion (they are CPU metadata; an NCCL group takes only GPU tensors).
MESHTORCH_DECL void check_same_parameters(const comm::AxisGroup& group,
                                          const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  if (group.size() == 1) return;
  const auto n = static_cast<std::int64_t>(named.size());
  const comm::AxisGroup metadata = group.metadata();
  const torch::Tensor counts = comm::all_gather(metadata, torch::tensor({n}, torch::kLong), 0);
  const std::int64_t most = counts.max().item<std::int64_t>();
  torch::Tensor hashes = torch::zeros({most}, torch::kLong);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto& [name, t] = named[i];
    std::ostringstream signature;
    signature << name << "|" << t.sizes() << "|" << t.dtype();
    hashes[i] = stable_hash(signature.str());
  }
  const torch::Tensor all = comm::all_gather(metadata, hashes, 0).view({group.size(), most});
  const torch::Tensor differs = (all != all[0]).any(0);
  const bool counts_differ = (counts != counts[0]).any().item<bool>();
  if (!differs.any().item<bool>() && !counts_differ) return;
  const std::int64_t first = differs.nonzero().numel() ? differs.nonzero()[0].item<std::int64_t>() : n;
  std::ostringstream message;
  message << "DistributedDataParallel: the ranks of the " << group.describe()
          << " do not hold the same parameters; the first difference is at parameter #" << first << ", which is "
          << (first < n ? describe_tensor(named[first].first, named[first].second) : std::string("absent"))
          << " here; parameter counts per rank: [";
  for (std::int64_t r = 0; r < counts.numel(); ++r) message << (r ? ", " : "") << counts[r].item<std::int64_t>();
  message << "]. Build the same model "
          << "with the same config on every rank.";
  throw ConfigError(message.str());
}

// The Reducer's bucket all-reduce, recorded in the flight recorder (the Reducer's own goes
// around comm::) with its failure handed to the watchdog. The Reducer's default arithmetic: the
// bucket divided by the group size, then summed (where the Reducer copies a gradient into the
// bucket it multiplies by 1/size instead: the same bits for power-of-two groups, the last bit
// otherwise).
class RecordedAllReduceHook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  RecordedAllReduceHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group, comm::AxisGroup group)
      : CppCommHookInterface(std::move(process_group)), group_(std::move(group)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    tensors[0].div_(state_->getSize());
    const auto record = comm::detail::record_collective("DDP all_reduce", group_, tensors[0]);
    auto future = state_->allreduce(tensors)->getFuture();
    // The Reducer waits for it at the end of backward; from here it is pending.
    diagnostics::FlightRecorder::instance().waiting(record);
    // On NCCL the callback runs once the all-reduce is queued, on a stream ordered after it.
    future->addCallback([record, group = group_,
                         what = "DDP all_reduce of gradient bucket " + std::to_string(bucket.getIndex()) +
                                " over the " + group_.describe()](c10::ivalue::Future& done) {
      if (done.hasError())
        diagnostics::report_collective_failure(record, what, done.tryRetrieveErrorMessage());
      else
        comm::detail::record_completion(record, group);
    });
    return future;
  }

 private:
  comm::AxisGroup group_;
};

}  // namespace detail

MESHTORCH_DECL DistributedDataParallel::DistributedDataParallel(
    std::vector<std::pair<std::string, torch::Tensor>> named, std::shared_ptr<torch::nn::Module> module,
    const comm::AxisGroup& group, DdpOptions options)
    : module_(std::move(module)), group_(group), options_(options), process_group_(comm::make_process_group(group)) {
  if (named.empty()) throw ConfigError("DistributedDataParallel: the module has no parameter that requires grad");
  detail::check_same_parameters(group_, named);

  // All replicas start from rank 0's state, as torch's _sync_module_states does.
  {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> states;
    for (const auto& [name, p] : named) states.push_back(p);
    if (options_.broadcast_buffers && module_)
      for (const auto& item : module_->named_buffers()) states.push_back(item.value());
    if (group_.size() > 1) c10d::broadcast_coalesced(process_group_, states, broadcast_bucket_bytes, 0);
  }

  std::vector<torch::Tensor> params;
  std::unordered_map<std::size_t, std::string> names;
  for (std::size_t i = 0; i < named.size(); ++i) {
    params.push_back(named[i].second);
    names[i] = named[i].first;
    names_.push_back(named[i].first);
    params_.push_back(named[i].second);
  }
  // Backward produces gradients roughly in reverse order of definition, so buckets are filled
  // in that order; the Reducer rebuilds them from the order it observes after the first step.
  std::vector<std::int64_t> ready_order(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) ready_order[i] = static_cast<std::int64_t>(params.size() - 1 - i);
  const std::vector<bool> sparse(params.size(), false);
  const auto bucket_bytes = static_cast<std::int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  const auto first_bucket_bytes = static_cast<std::int64_t>(options_.first_bucket_cap_mb * 1024 * 1024);
  auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<std::size_t>(first_bucket_bytes), static_cast<std::size_t>(bucket_bytes)}, sparse,
      ready_order, std::nullopt);
  reducer_ = std::make_unique<c10d::Reducer>(params, std::move(buckets), process_group_, sparse, bucket_bytes,
                                             /*find_unused_parameters=*/false, options_.gradient_as_bucket_view,
                                             std::move(names), first_bucket_bytes,
                                             /*skip_all_reduce_unused_params=*/false,
                                             /*use_python_reducer=*/false,
                                             /*bucket_bytes_cap_list=*/std::vector<std::int64_t>{});
}

MESHTORCH_DECL void DistributedDataParallel::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  reducer_->register_comm_hook(std::move(hook));
  comm_hook_registered_ = true;
}

MESHTORCH_DECL std::vector<std::vector<std::string>> DistributedDataParallel::buckets() const {
  std::vector<std::vector<std::string>> out;
  std::unordered_map<const void*, std::string> by_data;
  for (std::size_t i = 0; i < params_.size(); ++i) by_data[params_[i].unsafeGetTensorImpl()] = names_[i];
  for (const auto& bucket : reducer_->get_grad_buckets(/*return_zero_tensors=*/true)) {
    std::vector<std::string> names;
    for (const auto& p : bucket.getParameters()) names.push_back(by_data[p.unsafeGetTensorImpl()]);
    out.push_back(std::move(names));
  }
  return out;
}

MESHTORCH_DECL DistributedDataParallel::~DistributedDataParallel() = default;

MESHTORCH_DECL void DistributedDataParallel::before_forward() {
  // Unless the program brought its own hook, the buckets are all-reduced through the recording one.
  if (!comm_hook_registered_) {
    reducer_->register_comm_hook(std::make_unique<detail::RecordedAllReduceHook>(process_group_, group_));
    comm_hook_registered_ = true;
  }
  if (require_sync_) reducer_->prepare_for_forward();
  // After the first step the Reducer re-buckets by the order gradients actually arrived
  // (one broadcast so all ranks agree); afterwards this is a no-op.
  reducer_->rebuild_buckets();
}

MESHTORCH_DECL void DistributedDataParallel::after_forward() { reducer_->prepare_for_backward({}); }

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
