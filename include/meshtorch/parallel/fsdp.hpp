#pragma once
// FullyShardedDataParallel: PyTorch FSDP2's fully_shard for the Llama modules, over one axis of
// a mesh (the FSDP axis; the whole world for Mesh<FSDP<dynamic>>).
//
// Each call to fully_shard(module) makes a *unit* of the weights under `module` that no earlier
// unit took: one per decoder layer, then the root (embedding, final norm, lm_head). Every rank
// keeps only its rows of each weight (Shard<0>, the row count padded up to a multiple of the
// group size), packed into one flat buffer per unit; those row blocks are the leaf tensors the
// optimizer steps, so gradients and AdamW state are sharded too. Around a unit's forward:
//
//   pre-forward    all-gather the unit's flat shard buffer (one collective per unit) and copy
//                  it out into the full weights the leaves compute with
//   post-forward   free the full weights' memory (reshard_after_forward; never for the root,
//                  whose weights backward needs at once), keeping the tensors themselves, which
//                  autograd saved; and put an identity on the unit's output whose backward
//                  all-gathers them again before the unit's backward runs
//   post-backward  once autograd has every full weight's gradient: reduce-scatter them
//                  (averaged over the group, in the reduce dtype) into the shards' .grad, and
//                  free the full weights
//
// The full weights are outputs of one autograd node per unit (GatherUnitParameters) whose
// inputs are the shards: autograd runs its backward exactly once all of the unit's gradients
// are in, and accumulates what it returns into the shards' .grad, so gradient accumulation
// over micro-batches needs nothing more. Freeing memory keeps the storage object and swaps its
// allocation out (FSDP2's untyped_storage().resize_(0)), so the tensors autograd saved see the
// re-gathered values in backward.
//
// Overlap, as FSDP2 does it: while a unit computes, the all-gather of the next
// FsdpOptions::prefetch_layers units (in forward: the order they run; in backward: the reverse)
// is already on the wire, and each unit's reduce-scatter runs while the units before it
// compute their backward (reduce_scatters_in_flight at once); the last ones are waited for when
// the backward ends (the autograd engine's final callback), so the optimizer always sees every
// gradient. The copy into the gathered weights and out of the gradients is one op per unit
// (split_with_sizes_copy, _chunk_cat): the full weights are stored with each weight's rows padded
// to a multiple of the group size, so each is one strided block of the gathered buffer.
//
//   llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta));
//   FullyShardedDataParallel fsdp(model, mesh.group<FSDP>(), {.device = device});
//   for (auto& layer : model->model->decoder_layers) fsdp.fully_shard(layer);
//   fsdp.fully_shard(model);                       // the root, last
//   fsdp.init_weights();                           // only shards get memory
//   train::AdamW optimizer(fsdp.named_parameters(), {.lr = lr});
//   model->loss(ids, ids).backward();              // the hooks do the rest
//
// The hooks point into the FullyShardedDataParallel object: keep it alive while the model runs.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/layout/row_block.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/copy_in_flight.hpp>

namespace meshtorch {

// FSDP2's MixedPrecisionPolicy: the shards (and the optimizer) stay in the dtype the model was
// built with; the gathered weights are cast to param_dtype for forward and backward, and
// gradients are reduce-scattered in reduce_dtype.
struct MixedPrecision {
  std::optional<torch::ScalarType> param_dtype;   // unset: the shards' dtype
  std::optional<torch::ScalarType> reduce_dtype;  // unset: param_dtype
};

struct FsdpOptions {
  // Free every layer's full weights after its forward and all-gather them again for its
  // backward: less memory, one more all-gather per layer and step.
  bool reshard_after_forward = true;
  // Shards, gradients and optimizer state live in CPU memory and the optimizer steps there;
  // each gather copies the shard to `device`. Each reduce-scatter's mean is copied to pinned
  // host memory without blocking the host, and lands in .grad once the copies of
  // reduce_scatters_in_flight later units have started too, or when backward ends (at once with
  // reduce_scatters_in_flight 0). Optimizer offload alone, the shards staying on the device, is
  // train::AdamWOptions::offload.
  bool cpu_offload = false;
  MixedPrecision mixed_precision;
  // Where forward and backward compute.
  torch::Device device = torch::kCPU;
  // Units whose all-gather is issued ahead of their turn, in forward and in backward (FSDP2
  // prefetches one). Each costs one unit's gathered weights more memory. 0: a unit gathers
  // when it runs.
  std::int64_t prefetch_layers = 1;
  // Reduce-scatters left running while backward goes on (each holds one unit's gradients in
  // the reduce dtype; issuing one more waits for the oldest, as FSDP2 waits for the previous
  // one); 0: each waited for at once, its result handed to autograd (what a DDP Reducer over
  // the shards, HSDP, needs). Whatever the number, backward returns with every gradient in .grad.
  std::int64_t reduce_scatters_in_flight = 1;
};

class FullyShardedDataParallel;

namespace fsdp_detail {

// A collective issued and not yet waited for: wait() waits (with the group's timeout, naming
// the collective and the ranks) and records completion in the flight recorder.
using PendingWork = comm::Work<std::monostate>;

// A unit's all-gather of its flat shard buffer into `output` (every rank's shard in rank order),
// and the reduce-scatter of its flat gradient buffer `input` into this rank's block of sums.
// Declared here for the tests of their memory use; defined with FSDP below.
MESHTORCH_DECL PendingWork start_all_gather_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                 torch::Tensor& input, const std::string& what);
MESHTORCH_DECL PendingWork start_reduce_scatter_sum_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                         torch::Tensor& input, const std::string& what);

}  // namespace fsdp_detail

class FsdpUnit;

// A unit's reduce-scatter on the wire: its gradients arrive in the shards' .grad when finished.
struct FsdpReduction {
  FsdpUnit* unit = nullptr;
  fsdp_detail::PendingWork work;
  torch::Tensor send;    // what the collective reads; on Gloo summed in place and emptied when the sums arrive
  torch::Tensor output;  // this rank's block: the sum over the group
};

// A finished reduce-scatter's mean on its way to the shards' .grad: with cpu_offload on a GPU,
// copied to pinned host memory without blocking the host, which waits for it (`copy`) only
// when the gradients land (FSDP2 blocks on the copy only before the optimizer step).
struct FsdpGradientCopy {
  FsdpUnit* unit = nullptr;
  torch::Tensor flat;  // [shard_numel] in the shards' dtype, on their device
  train::CopyInFlight copy;
};

// What the units of one FullyShardedDataParallel share while forward and backward run: the
// order they run in (for prefetching) and the reduce-scatters in flight.
class FsdpSchedule {
 public:
  explicit FsdpSchedule(const FsdpOptions& options)
      : prefetch_(options.prefetch_layers), in_flight_(options.reduce_scatters_in_flight) {}

  // The root runs first (its hook wraps the whole model), then the layers in the order they
  // were sharded: parallelize shards them in the order they run.
  void add(FsdpUnit* unit, bool is_root) {
    if (is_root)
      order_.insert(order_.begin(), unit);
    else
      order_.push_back(unit);
  }

  MESHTORCH_DECL void before_forward(FsdpUnit& unit);
  MESHTORCH_DECL void before_backward(FsdpUnit& unit);
  // The unit's gradients: returned to autograd (reduce-scatters waited for at once), or left
  // in flight and accumulated into .grad later (returns no tensors).
  MESHTORCH_DECL std::vector<torch::Tensor> after_backward(FsdpUnit& unit,
                                                           const std::vector<torch::Tensor>& full_grads);
  // Waits for every reduce-scatter in flight (their results land in .grad) and drops gathers
  // prefetched for units that did not run. Backward calls it when it ends; call it before
  // reading .grad outside a backward that some other code drove.
  MESHTORCH_DECL void finish_gradients();

  // Called with a unit once a backward's gradients are in its shards' .grad (see
  // FullyShardedDataParallel::on_gradients_ready).
  std::function<void(FsdpUnit&)> gradients_ready;

 private:
  MESHTORCH_DECL void finish_oldest_reduction();
  // The oldest copy's gradients into .grad, then gradients_ready.
  MESHTORCH_DECL void land_oldest_gradients();
  // Backward ends before the optimizer steps: whatever reduce-scatters are left then are waited
  // for by the engine's final callback, queued once, in the outermost backward (a checkpointed
  // layer's recomputation runs a nested one, whose callbacks run when that layer is done).
  MESHTORCH_DECL void queue_final_callback_once();

  std::int64_t prefetch_;
  std::int64_t in_flight_;
  std::vector<FsdpUnit*> order_;
  std::deque<FsdpReduction> reductions_;
  // With cpu_offload: gradients copied (or being copied) to the host, not yet in .grad; at most
  // as many as reduce-scatters in flight.
  std::deque<FsdpGradientCopy> gradient_copies_;
  bool final_callback_queued_ = false;
};

// One fully_shard call's weights: their shards, the flat buffers and the hooks' work.
class FsdpUnit {
 public:
  struct Parameter {
    std::string name;  // HF name, e.g. "model.layers.0.mlp.up_proj.weight"
    llama::WeightModule* leaf = nullptr;
    std::vector<std::int64_t> full_shape;
    std::int64_t rows = 0;           // full_shape[0]
    std::int64_t row_numel = 1;      // elements per row
    RowBlock block;                  // this rank's rows of the weight (layout/row_block.hpp)
    std::int64_t shard_offset = 0;   // elements into the flat shard buffer
    std::int64_t full_offset = 0;    // elements into the full storage (rows padded to group size x block rows)
    torch::Tensor shard;             // leaf [block.count, ...]: what the optimizer steps
    std::int64_t block_numel() const { return block.rows_per_rank * row_numel; }  // one rank's part, padded
  };

  MESHTORCH_DECL FsdpUnit(std::string name, bool is_root,
                          std::vector<std::pair<std::string, llama::WeightModule*>> leaves,
                          const comm::AxisGroup& group, const FsdpOptions& options,
                          std::shared_ptr<FsdpSchedule> schedule);

  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  const std::string& name() const { return name_; }
  bool is_root() const { return is_root_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  // Elements of this rank's shard buffer (with padding), of the full weights, and of the
  // gathered storage (the full weights with each one's rows padded to group size x rows per rank).
  std::int64_t shard_numel() const { return shard_numel_; }
  std::int64_t full_numel() const { return full_numel_; }
  std::int64_t gathered_numel() const { return group_.size() * shard_numel_; }
  // Whether the full weights hold memory now, and whether an all-gather for them is on the wire.
  bool is_unsharded() const { return full_storage_.nbytes() > 0; }
  bool is_gathering() const { return gather_.has_value(); }
  const c10::Storage& full_storage() const { return full_storage_; }
  torch::ScalarType shard_dtype() const { return shard_dtype_; }
  torch::ScalarType param_dtype() const { return options_.mixed_precision.param_dtype.value_or(shard_dtype_); }
  torch::ScalarType reduce_dtype() const { return options_.mixed_precision.reduce_dtype.value_or(param_dtype()); }
  bool reshards_after_forward() const { return options_.reshard_after_forward && !is_root_; }

  // Issues the all-gather of the shards (cast to the compute dtype) without waiting for it,
  // unless the full weights already hold the current shards or a gather is on its way.
  MESHTORCH_DECL void start_unshard();

  // Waits for the issued all-gather and copies it into the full weights (one op for the unit).
  MESHTORCH_DECL void finish_unshard();

  // All-gathers the shards into the full weights, unless they already hold the current shards.
  void unshard() {
    start_unshard();
    finish_unshard();
  }

  // Frees the full weights; a prefetched gather that was never used is waited for and dropped.
  MESHTORCH_DECL void reshard();

  // Writes every full weight into `destination` (gathered_numel() elements on the compute
  // device, the weights at their full_offset): one all-gather of the flat shards cast to `dtype`.
  MESHTORCH_DECL void gather_full(torch::Tensor destination, torch::ScalarType dtype) const;

  // The pre-forward hook: gather, and hand the leaves full weights that are outputs of the
  // unit's autograd node (so its backward sees all their gradients at once).
  MESHTORCH_DECL void pre_forward();
  // The post-forward hook: free the full weights, and mark the output so that its gradient
  // re-gathers them first.
  MESHTORCH_DECL torch::Tensor post_forward(const torch::Tensor& output);
  // Called from the output's backward, before the unit's own backward.
  MESHTORCH_DECL void pre_backward();
  // Called once autograd has every full weight's gradient (undefined: unused in this forward,
  // a zero gradient).
  std::vector<torch::Tensor> post_backward(const std::vector<torch::Tensor>& full_grads) {
    return schedule_->after_backward(*this, full_grads);
  }

  // Issues the reduce-scatter of the full gradients (one copy into the send buffer for the
  // unit, each weight's rows padded to group size x rows per rank) and frees the full weights.
  MESHTORCH_DECL FsdpReduction start_reduce_scatter(const std::vector<torch::Tensor>& full_grads);

  // A finished reduce-scatter's result as one gradient per shard: the mean over the group, in
  // the shards' dtype and on their device.
  MESHTORCH_DECL std::vector<torch::Tensor> shard_gradients(FsdpReduction& reduction);

  // Waits for the reduce-scatter and starts taking its mean to the shards' dtype and device
  // (with cpu_offload on a GPU, a non_blocking copy into pinned host memory).
  MESHTORCH_DECL FsdpGradientCopy start_gradient_copy(FsdpReduction& reduction);

  // Waits for the copy and adds its gradients to the shards' .grad (or sets them), as
  // autograd's accumulation would.
  MESHTORCH_DECL void land_gradients(FsdpGradientCopy& copy);

  // Whether the shards live in host memory (cpu_offload).
  bool offloads() const { return options_.cpu_offload; }

  MESHTORCH_DECL std::string describe() const;

 private:
  struct Gather {
    fsdp_detail::PendingWork work;
    torch::Tensor input;     // read by the collective until it is done
    torch::Tensor gathered;  // [group size x shard_numel]
    std::int64_t version;    // of the shards it was issued from
  };

  // [group size, shard_numel] -> each weight's [group size, block]: one op for the unit.
  MESHTORCH_DECL void copy_out(const torch::Tensor& gathered, const std::vector<torch::Tensor>& targets) const;

  torch::TensorOptions compute_options() const {
    return torch::TensorOptions().device(options_.device).dtype(param_dtype());
  }
  MESHTORCH_DECL torch::Tensor full_weight(const Parameter& p) const;
  // One view per weight of a [shard_numel] buffer: its shard's shape.
  MESHTORCH_DECL std::vector<torch::Tensor> shard_views(const torch::Tensor& flat) const;

  std::string name_;
  bool is_root_;
  comm::AxisGroup group_;
  FsdpOptions options_;
  std::shared_ptr<FsdpSchedule> schedule_;
  torch::ScalarType shard_dtype_ = torch::kFloat;
  std::vector<Parameter> params_;
  std::int64_t shard_numel_ = 0, full_numel_ = 0;
  torch::Tensor shard_flat_;
  c10::Storage full_storage_;
  std::vector<torch::Tensor> gather_targets_;  // per weight: [group size, block] aliases of the full storage
  std::vector<std::int64_t> block_sizes_;
  std::optional<Gather> gather_;
  std::int64_t gathered_version_ = -1;
};

// The model-level state: the units, in the order they were made (layers, then the root).
class FullyShardedDataParallel {
 public:
  template <class Holder>
  FullyShardedDataParallel(torch::nn::ModuleHolder<Holder>& root, const comm::AxisGroup& group, FsdpOptions options = {})
      : root_(std::static_pointer_cast<torch::nn::Module>(root.ptr())),
        group_(group),
        options_(options),
        schedule_(std::make_shared<FsdpSchedule>(options_)) {
    for (auto& [name, leaf] : llama::weight_modules(*root_)) all_leaves_.emplace_back(name + ".weight", leaf);
    if (options_.prefetch_layers < 0)
      throw ConfigError(fmt::format("FullyShardedDataParallel: prefetch_layers {} is negative (0: no prefetching)",
                                    options_.prefetch_layers));
    if (options_.reduce_scatters_in_flight < 0)
      throw ConfigError(fmt::format("FullyShardedDataParallel: reduce_scatters_in_flight {} is negative (0: each "
                                    "waited for at once)",
                                    options_.reduce_scatters_in_flight));
    if (options_.cpu_offload && options_.device.is_cuda() && !torch::cuda::is_available())
      throw ConfigError(fmt::format("FullyShardedDataParallel: cpu_offload with device {}, but CUDA is not available",
                                    options_.device.str()));
  }

  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Makes a unit of the weights under `module` that no earlier unit holds, and hooks its
  // forward. Shard the decoder layers first, then the root (the model passed to the
  // constructor), which takes the rest. `reshard_after_forward` overrides the options' for this
  // unit (FSDP2's per-call argument); the root keeps its weights gathered whatever it says.
  template <class Impl>
  FsdpUnit& fully_shard(torch::nn::ModuleHolder<Impl>& module, std::optional<bool> reshard_after_forward = {}) {
    const bool is_root = module.ptr().get() == root_.get();
    const std::string name = module_name(module.ptr().get());
    if (root_sharded_)
      throw ConfigError(fmt::format("fully_shard('{}'): the root is already sharded; shard the layers first, then "
                                    "the root (rank {})",
                                    name, group_.global_rank()));
    if (name.empty() && !is_root)
      throw ConfigError(fmt::format("fully_shard: the module is not part of the model this FullyShardedDataParallel "
                                    "was built for (rank {})",
                                    group_.global_rank()));
    std::set<const llama::WeightModule*> inside;
    for (auto& [n, leaf] : llama::weight_modules(*module)) inside.insert(leaf);
    std::vector<std::pair<std::string, llama::WeightModule*>> leaves;
    for (auto& [n, leaf] : all_leaves_)
      if (inside.count(leaf) && !claimed_.count(leaf)) leaves.emplace_back(n, leaf);
    if (leaves.empty())
      throw ConfigError(fmt::format("fully_shard({}): it holds no weight that an earlier fully_shard did not take "
                                    "(rank {})",
                                    (is_root ? std::string("the root") : "'" + name + "'"), group_.global_rank()));
    for (auto& [n, leaf] : leaves) claimed_.insert(leaf);
    auto unit_options = options_;
    if (reshard_after_forward) unit_options.reshard_after_forward = *reshard_after_forward;
    units_.push_back(std::make_unique<FsdpUnit>(is_root ? std::string("root") : name, is_root, std::move(leaves), group_,
                                                unit_options, schedule_));
    FsdpUnit* unit = units_.back().get();
    schedule_->add(unit, is_root);
    module->hooks.pre.push_back([this, unit](const torch::Tensor& input) {
      check_root_sharded(*unit);
      unit->pre_forward();
      return input;
    });
    module->hooks.post.push_back(
        [unit](const torch::Tensor&, const torch::Tensor& output) { return unit->post_forward(output); });
    if (is_root) root_sharded_ = true;
    return *unit;
  }

  // The shards, named as the full weights: what the optimizer steps.
  MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;

  // Initialises the shards as llama::init_weights initialises a whole model from the same
  // seed: every rank draws each full weight in turn (one at a time on the compute device, so
  // only the biggest weight is ever whole) and keeps its rows.
  MESHTORCH_DECL void init_weights();

  // Copies this rank's rows of full (HF-named) weights into the shards: `tensors` must hold
  // every weight with its full shape. `source` names the file in errors.
  MESHTORCH_DECL void load_full_state_dict(const io::NamedTensors& tensors, const std::string& source);

  // This rank's rows of a weight: the first row and the row count (the last ranks may hold
  // fewer rows, or none).
  MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> rows_of(const std::string& name) const;

  // Loads an HF folder's model.safetensors (or the shards its index lists) into the shards.
  MESHTORCH_DECL void load_pretrained_weights(const std::filesystem::path& dir);
  MESHTORCH_DECL bool load_pretrained_weights_if_present(const std::filesystem::path& model_name_or_dir);

  // Every full weight, gathered (a collective: every rank of the group must call it) and
  // copied to the CPU in the shards' dtype, in the model's parameter order.
  MESHTORCH_DECL io::NamedTensors full_state_dict() const;

  // Waits for the reduce-scatters still in flight, so that every shard's .grad is complete. A
  // backward does it when it ends; a program that reads .grad after a backward that failed half
  // way calls it.
  void finish_gradients() { schedule_->finish_gradients(); }

  // Calls `ready` with a unit's shards (the leaves the optimizer steps) as soon as a backward's
  // reduce-scattered gradients are in their .grad, on the thread running the backward, before the
  // units after it in backward are done: what stepping the optimizer in backward needs (a unit
  // stepped and its gradients freed there, so the whole model's gradients never exist at once).
  // Only with reduce-scatters in flight: with none, gradients go back through autograd, which
  // calls nothing here.
  void on_gradients_ready(std::function<void(const std::vector<torch::Tensor>& shards)> ready) {
    if (options_.reduce_scatters_in_flight == 0)
      throw ConfigError(fmt::format("FullyShardedDataParallel::on_gradients_ready on rank {}: gradients go back "
                                    "through autograd when reduce_scatters_in_flight is 0 (as under HSDP); "
                                    "nothing would call it",
                                    group_.global_rank()));
    schedule_->gradients_ready = [ready = std::move(ready)](FsdpUnit& unit) {
      std::vector<torch::Tensor> shards;
      for (const auto& p : unit.parameters()) shards.push_back(p.shard);
      ready(shards);
    };
  }

  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  const comm::AxisGroup& group() const { return group_; }
  const FsdpOptions& options() const { return options_; }
  // Elements this rank holds in shards (with padding), and the model's weight elements.
  std::int64_t local_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->shard_numel();
    return n;
  }
  std::int64_t full_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->full_numel();
    return n;
  }
  // The biggest unit's full weights: what one rank must hold at once, sharding or not.
  std::int64_t largest_unit_numel() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n = std::max(n, u->full_numel());
    return n;
  }

 private:
  MESHTORCH_DECL const FsdpUnit::Parameter* find(const std::string& name) const;
  FsdpUnit::Parameter* find(const std::string& name) {
    return const_cast<FsdpUnit::Parameter*>(std::as_const(*this).find(name));
  }

  MESHTORCH_DECL std::string module_name(const torch::nn::Module* module) const;

  MESHTORCH_DECL void check_root_sharded(const FsdpUnit& unit) const;
  MESHTORCH_DECL void check_root_sharded_for(const std::string& what) const;

  std::shared_ptr<torch::nn::Module> root_;
  comm::AxisGroup group_;
  FsdpOptions options_;
  std::vector<std::pair<std::string, llama::WeightModule*>> all_leaves_;  // HF names, named_modules order
  std::set<const llama::WeightModule*> claimed_;
  std::shared_ptr<FsdpSchedule> schedule_;  // before units_: the units point into it
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  bool root_sharded_ = false;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/joined_work.hpp>
#include <meshtorch/models/llama/weights.hpp>

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

// Issues the all-gather of the group's flat buffers, concatenated in rank order into output
// (group.size() x input.numel()).
//
// Gloo's all-gather receives into a fresh buffer the size of the whole output and then copies it
// into the output, so every gather in flight held its unit twice until it ended: at llama-100m
// 25 MiB more, at the checkpointed backward's peak whenever the prefetched gather waits there for
// a rank that is behind. On the CPU each rank's block is instead broadcast by its owner straight
// into its place in the output: the same blocks cross the wire (each rank receives the others'
// once), written once, and nothing is allocated. The broadcasts are one collective to the caller
// and to the flight recorder (comm::JoinedWork).
MESHTORCH_DECL PendingWork start_all_gather_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                 torch::Tensor& input, const std::string& what) {
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
// nothing after this collective, so on the CPU it is all-reduced in place; when the sums arrive,
// Gloo's thread copies this rank's block out and gives the buffer's memory back (input keeps a
// storage of no bytes), so the buffer lives while the collective runs and not until the wait,
// which comes a layer later. The bytes on the wire are the same.
MESHTORCH_DECL PendingWork start_reduce_scatter_sum_flat(const comm::AxisGroup& group, torch::Tensor& output,
                                                         torch::Tensor& input, const std::string& what) {
  if (group.device() == comm::Device::cpu) {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = group.timeout();
    std::vector<torch::Tensor> tensors{input};
    auto block_copied = std::make_shared<c10::intrusive_ptr<c10::ivalue::Future>>();
    auto copy_block_and_free = [output, input, rank = group.rank(),
                                size = group.size()](c10::ivalue::Future& summed) -> c10::IValue {
      // A failed all-reduce is reported by the wait; its buffer is then freed with the tensor.
      if (summed.hasError()) return {};
      output.copy_(input.view({size, -1})[rank]);
      free_storage(input.storage());
      return {};
    };
    return start_flat(
        group, output, input, what,
        [&](c10d::Backend& backend) {
          auto work = backend.allreduce(tensors, options);
          *block_copied = work->getFuture()->then(std::move(copy_block_and_free), c10::NoneType::get());
          return work;
        },
        // The work's wait returns when the sums are in; the copy runs just after, on Gloo's thread.
        [block_copied] { (*block_copied)->waitAndThrow(); });
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

MESHTORCH_DECL void FsdpSchedule::queue_final_callback_once() {
  if (final_callback_queued_) return;
  final_callback_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_gradients(); });
}

MESHTORCH_DECL FsdpUnit::FsdpUnit(std::string name, bool is_root,
                                  std::vector<std::pair<std::string, llama::WeightModule*>> leaves,
                                  const comm::AxisGroup& group, const FsdpOptions& options,
                                  std::shared_ptr<FsdpSchedule> schedule)
    : name_(std::move(name)), is_root_(is_root), group_(group), options_(options), schedule_(std::move(schedule)) {
  const auto world = group_.size();
  const auto rank = group_.rank();
  shard_dtype_ = leaves.front().second->weight.scalar_type();
  for (auto& [leaf_name, leaf] : leaves) {
    const auto& w = leaf->weight;
    if (w.scalar_type() != shard_dtype_)
      throw ConfigError(fmt::format(
          "fully_shard({}): '{}' is {} but '{}' is {}; build the model in one dtype "
          "(mixed precision is FsdpOptions::mixed_precision)",
          describe(), leaf_name, c10::toString(w.scalar_type()), leaves.front().first, c10::toString(shard_dtype_)));
    if (w.dim() == 0) throw ConfigError(fmt::format("fully_shard({}): '{}' is a scalar", describe(), leaf_name));
    Parameter p;
    p.name = leaf_name;
    p.leaf = leaf;
    p.full_shape = w.sizes().vec();
    p.rows = w.size(0);
    p.row_numel = w.numel() / std::max<std::int64_t>(p.rows, 1);
    p.block = row_block(p.rows, world, rank);
    p.shard_offset = shard_numel_;
    p.full_offset = world * shard_numel_;
    shard_numel_ += p.block_numel();
    full_numel_ += w.numel();
    params_.push_back(std::move(p));
  }
  const auto shard_device = options_.cpu_offload ? torch::Device(torch::kCPU) : options_.device;
  // Padding rows stay zero: they are part of no shard view, so nothing ever writes them.
  shard_flat_ = torch::zeros({shard_numel_}, torch::TensorOptions().device(shard_device).dtype(shard_dtype_));
  if (options_.cpu_offload && options_.device.is_cuda()) shard_flat_ = shard_flat_.pin_memory();
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto local_shape = p.full_shape;
    local_shape[0] = p.block.count;
    p.shard = shard_flat_.narrow(0, p.shard_offset, p.block.count * p.row_numel).view(local_shape);
    // A module that already has real weights (not built on the meta device) keeps its values.
    if (!p.leaf->weight.is_meta()) p.shard.copy_(p.leaf->weight.narrow(0, p.block.first, p.block.count));
    p.shard.set_requires_grad(true);
  }
  // The full weights: one storage for the unit, freed until a forward needs it. The gather
  // writes through per-weight [group size, block] aliases, never through the leaves'.
  full_storage_ = torch::empty({gathered_numel()}, compute_options()).storage();
  fsdp_detail::free_storage(full_storage_);
  for (auto& p : params_) {
    gather_targets_.push_back(
        fsdp_detail::alias(full_storage_, param_dtype(), p.full_offset, {world, p.block_numel()}));
    block_sizes_.push_back(p.block_numel());
    p.leaf->replace_weight(full_weight(p));
  }
}

MESHTORCH_DECL void FsdpUnit::start_unshard() {
  torch::NoGradGuard no_grad;
  const auto version = shard_flat_._version();
  if (gather_ || (is_unsharded() && gathered_version_ == version)) return;
  auto input = shard_flat_.to(options_.device, param_dtype(), /*non_blocking=*/true);
  auto gathered = torch::empty({gathered_numel()}, input.options());
  auto work = fsdp_detail::start_all_gather_flat(group_, gathered, input, "FSDP all_gather of " + describe());
  gather_.emplace(Gather{std::move(work), std::move(input), std::move(gathered), version});
}

MESHTORCH_DECL void FsdpUnit::finish_unshard() {
  if (!gather_) return;
  torch::NoGradGuard no_grad;
  gather_->work.wait();
  if (!is_unsharded())
    fsdp_detail::allocate_storage(full_storage_,
                                  static_cast<std::size_t>(gathered_numel()) * c10::elementSize(param_dtype()));
  copy_out(gather_->gathered, gather_targets_);
  gathered_version_ = gather_->version;
  gather_.reset();
}

MESHTORCH_DECL void FsdpUnit::reshard() {
  if (gather_) {
    gather_->work.wait();
    gather_.reset();
  }
  fsdp_detail::free_storage(full_storage_);
}

MESHTORCH_DECL void FsdpUnit::gather_full(torch::Tensor destination, torch::ScalarType dtype) const {
  torch::NoGradGuard no_grad;
  auto input = shard_flat_.to(options_.device, dtype);
  auto gathered = torch::empty({gathered_numel()}, input.options());
  fsdp_detail::start_all_gather_flat(group_, gathered, input, "FSDP all_gather of " + describe()).wait();
  std::vector<torch::Tensor> targets;
  for (const auto& p : params_)
    targets.push_back(destination.narrow(0, p.full_offset, group_.size() * p.block_numel()).view({group_.size(), -1}));
  copy_out(gathered, targets);
}

MESHTORCH_DECL FsdpReduction FsdpUnit::start_reduce_scatter(const std::vector<torch::Tensor>& full_grads) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto grad = full_grads[i].defined() ? full_grads[i] : torch::zeros(p.full_shape, compute_options());
    grads.push_back(grad.to(reduce_dtype()).reshape({p.rows, p.row_numel}));
  }
  auto send = at::_chunk_cat(grads, /*dim=*/0, /*num_chunks=*/group_.size()).view({-1});
  auto output = torch::empty({shard_numel_}, send.options());
  auto work = fsdp_detail::start_reduce_scatter_sum_flat(group_, output, send, "FSDP reduce_scatter of " + describe());
  reshard();
  return {this, std::move(work), std::move(send), std::move(output)};
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpUnit::shard_gradients(FsdpReduction& reduction) {
  auto copy = start_gradient_copy(reduction);
  copy.copy.wait();
  return shard_views(copy.flat);
}

MESHTORCH_DECL FsdpGradientCopy FsdpUnit::start_gradient_copy(FsdpReduction& reduction) {
  torch::NoGradGuard no_grad;
  reduction.work.wait();
  reduction.output.div_(group_.size());
  FsdpGradientCopy result{this, reduction.output.to(shard_dtype_), {}};
  if (shard_flat_.device() != result.flat.device()) {
    const auto from = result.flat.device();
    auto host = torch::empty({shard_numel_}, train::host_options_for(from, shard_dtype_));
    host.copy_(result.flat, /*non_blocking=*/true);
    result.flat = std::move(host);
    result.copy = train::CopyInFlight::after_copies_on(from);
  }
  return result;
}

MESHTORCH_DECL void FsdpUnit::land_gradients(FsdpGradientCopy& copy) {
  copy.copy.wait();
  torch::NoGradGuard no_grad;
  auto grads = shard_views(copy.flat);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& slot = params_[i].shard.mutable_grad();
    if (slot.defined())
      slot.add_(grads[i]);
    else
      slot = grads[i];
  }
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpUnit::shard_views(const torch::Tensor& flat) const {
  std::vector<torch::Tensor> views;
  for (const auto& p : params_)
    views.push_back(flat.narrow(0, p.shard_offset, p.block.count * p.row_numel).view(p.shard.sizes()));
  return views;
}

MESHTORCH_DECL std::string FsdpUnit::describe() const {
  return fmt::format("{} on rank {}", is_root_ ? std::string("the root") : fmt::format("'{}'", name_),
                     group_.global_rank());
}

MESHTORCH_DECL void FsdpUnit::copy_out(const torch::Tensor& gathered, const std::vector<torch::Tensor>& targets) const {
  at::split_with_sizes_copy_out(targets, gathered.view({group_.size(), shard_numel_}), block_sizes_, /*dim=*/1);
}

MESHTORCH_DECL torch::Tensor FsdpUnit::full_weight(const Parameter& p) const {
  return fsdp_detail::alias(full_storage_, param_dtype(), p.full_offset, p.full_shape);
}

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> FullyShardedDataParallel::named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& [name, leaf] : all_leaves_)
    if (const auto* p = find(name)) named.emplace_back(name, p->shard);
  return named;
}

MESHTORCH_DECL void FullyShardedDataParallel::init_weights() {
  check_root_sharded_for("init_weights");
  torch::NoGradGuard no_grad;
  const auto* lm = dynamic_cast<llama::LlamaForCausalLMImpl*>(root_.get());
  const double std = lm ? lm->config.initializer_range : 0.02;
  for (const auto& [name, leaf] : all_leaves_) {
    auto& p = *find(name);
    auto full = torch::empty(p.full_shape, torch::TensorOptions().device(options_.device).dtype(p.shard.scalar_type()));
    if (dynamic_cast<llama::RMSNormImpl*>(leaf))
      full.fill_(1.0);
    else
      full.normal_(0.0, std);
    p.shard.copy_(full.narrow(0, p.block.first, p.block.count));
  }
}

MESHTORCH_DECL void FullyShardedDataParallel::load_full_state_dict(const io::NamedTensors& tensors,
                                                                   const std::string& source) {
  torch::NoGradGuard no_grad;
  std::set<std::string> loaded;
  const auto* lm = dynamic_cast<llama::LlamaForCausalLMImpl*>(root_.get());
  for (const auto& [name, tensor] : tensors) {
    auto* p = find(name);
    if (!p) {
      if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
      if (name == "lm_head.weight" && lm && lm->config.tie_word_embeddings) continue;
      throw DataError(fmt::format("{}: tensor '{}' is not a weight of this model", source, name));
    }
    if (tensor.sizes().vec() != p->full_shape)
      throw DataError(fmt::format("{}: tensor '{}' has shape {}, the model needs {}", source, name,
                                  c10::str(tensor.sizes()), c10::str(c10::IntArrayRef(p->full_shape))));
    p->shard.copy_(tensor.narrow(0, p->block.first, p->block.count));
    loaded.insert(name);
  }
  for (const auto& [name, leaf] : all_leaves_)
    if (!loaded.count(name)) throw DataError(fmt::format("{}: weight '{}' is missing", source, name));
}

MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> FullyShardedDataParallel::rows_of(const std::string& name) const {
  const auto* p = find(name);
  if (!p) throw ConfigError(fmt::format("FullyShardedDataParallel: no weight named '{}'", name));
  return {p->block.first, p->block.count};
}

MESHTORCH_DECL void FullyShardedDataParallel::load_pretrained_weights(const std::filesystem::path& dir) {
  check_root_sharded_for("load_pretrained_weights");
  io::NamedTensors all;
  for (const auto& file : llama::weight_files(dir)) {
    auto contents = io::load_safetensors(file);
    for (auto& item : contents.tensors) all.push_back(std::move(item));
  }
  load_full_state_dict(all, dir.string());
}

MESHTORCH_DECL bool FullyShardedDataParallel::load_pretrained_weights_if_present(
    const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_directory(model_name_or_dir) || !llama::has_pretrained_weights(model_name_or_dir))
    return false;
  load_pretrained_weights(model_name_or_dir);
  return true;
}

MESHTORCH_DECL io::NamedTensors FullyShardedDataParallel::full_state_dict() const {
  check_root_sharded_for("full_state_dict");
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& unit : units_) {
    auto flat = torch::empty({unit->gathered_numel()},
                             torch::TensorOptions().device(options_.device).dtype(unit->shard_dtype()));
    unit->gather_full(flat, unit->shard_dtype());  // lossless, whatever the compute dtype
    for (const auto& p : unit->parameters())
      by_name[p.name] = flat.narrow(0, p.full_offset, p.rows * p.row_numel).view(p.full_shape).to(torch::kCPU).clone();
  }
  io::NamedTensors out;
  for (const auto& [name, leaf] : all_leaves_) out.emplace_back(name, by_name.at(name));
  return out;
}

MESHTORCH_DECL const FsdpUnit::Parameter* FullyShardedDataParallel::find(const std::string& name) const {
  for (const auto& unit : units_)
    for (const auto& p : unit->parameters())
      if (p.name == name) return &p;
  return nullptr;
}

MESHTORCH_DECL std::string FullyShardedDataParallel::module_name(const torch::nn::Module* module) const {
  for (const auto& item : root_->named_modules())
    if (item.value().get() == module) return item.key();
  return "";
}

MESHTORCH_DECL void FullyShardedDataParallel::check_root_sharded(const FsdpUnit& unit) const {
  if (!root_sharded_)
    throw ConfigError(
        fmt::format("FullyShardedDataParallel: forward of {} before the root was sharded; call "
                    "fully_shard(model) after the layers",
                    unit.describe()));
}

MESHTORCH_DECL void FullyShardedDataParallel::check_root_sharded_for(const std::string& what) const {
  if (!root_sharded_)
    throw ConfigError(
        fmt::format("FullyShardedDataParallel::{} on rank {}: call fully_shard on the layers and "
                    "then on the root (the model) first",
                    what, group_.global_rank()));
}

MESHTORCH_DECL void FsdpSchedule::before_forward(FsdpUnit& unit) {
  const bool recomputing = fsdp_detail::in_backward();
  // A new forward: gradients of the last backward are all in (the final callback saw to it,
  // unless that backward failed half way).
  if (unit.is_root() && !recomputing) finish_gradients();
  unit.start_unshard();
  // The next units' gathers queue behind this one's and run while this unit computes.
  const auto here = std::find(order_.begin(), order_.end(), &unit);
  if (!recomputing && here != order_.end())
    for (auto next = here + 1; next != order_.end() && next - here <= prefetch_; ++next) (*next)->start_unshard();
  unit.finish_unshard();
}

MESHTORCH_DECL void FsdpSchedule::before_backward(FsdpUnit& unit) {
  queue_final_callback_once();  // here, in the outermost backward
  unit.start_unshard();
  const auto here = std::find(order_.begin(), order_.end(), &unit);
  std::int64_t issued = 0;
  for (auto previous = here; here != order_.end() && previous != order_.begin() && issued < prefetch_;) {
    --previous;
    if (!(*previous)->reshards_after_forward()) continue;  // kept gathered since forward
    (*previous)->start_unshard();
    ++issued;
  }
  unit.finish_unshard();
}

MESHTORCH_DECL std::vector<torch::Tensor> FsdpSchedule::after_backward(FsdpUnit& unit,
                                                                       const std::vector<torch::Tensor>& full_grads) {
  auto reduction = unit.start_reduce_scatter(full_grads);
  if (in_flight_ == 0) return unit.shard_gradients(reduction);
  queue_final_callback_once();
  reductions_.push_back(std::move(reduction));
  while (static_cast<std::int64_t>(reductions_.size()) > in_flight_) finish_oldest_reduction();
  return std::vector<torch::Tensor>(full_grads.size());
}

MESHTORCH_DECL void FsdpSchedule::finish_oldest_reduction() {
  auto reduction = std::move(reductions_.front());
  reductions_.pop_front();
  auto* unit = reduction.unit;
  gradient_copies_.push_back(unit->start_gradient_copy(reduction));
  // Offloaded gradients land later, so the host does not wait for the copy while backward goes
  // on; the shards' .grad is host memory that nothing on the device waits for.
  const std::int64_t left_in_flight = unit->offloads() ? in_flight_ : 0;
  while (static_cast<std::int64_t>(gradient_copies_.size()) > left_in_flight) land_oldest_gradients();
}

MESHTORCH_DECL void FsdpSchedule::land_oldest_gradients() {
  auto copy = std::move(gradient_copies_.front());
  gradient_copies_.pop_front();
  copy.unit->land_gradients(copy);
  if (gradients_ready) gradients_ready(*copy.unit);
}

MESHTORCH_DECL void FsdpSchedule::finish_gradients() {
  final_callback_queued_ = false;
  while (!reductions_.empty()) finish_oldest_reduction();
  while (!gradient_copies_.empty()) land_oldest_gradients();
  for (auto* unit : order_)
    if (unit->is_gathering()) unit->reshard();
}

namespace fsdp_detail {

struct UnitCapsule : torch::CustomClassHolder {
  explicit UnitCapsule(FsdpUnit* u) : unit(u) {}
  FsdpUnit* unit;
};

inline FsdpUnit* saved_unit(torch::autograd::AutogradContext* ctx) {
  return static_cast<UnitCapsule*>(ctx->saved_data["unit"].toCapsule().get())->unit;
}

// shards -> the full weights (already gathered into the unit's storage); backward: the
// reduce-scatter of their gradients.
struct GatherUnitParameters : torch::autograd::Function<GatherUnitParameters> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList shards,
                                                FsdpUnit* unit, std::vector<torch::Tensor> fulls) {
    (void)shards;
    ctx->saved_data["unit"] = c10::IValue::make_capsule(c10::make_intrusive<UnitCapsule>(unit));
    ctx->set_materialize_grads(false);
    return fulls;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto shard_grads = saved_unit(ctx)->post_backward(grads);
    shard_grads.emplace_back();  // unit
    shard_grads.emplace_back();  // fulls
    return shard_grads;
  }
};

// Identity on a unit's output; its backward re-gathers the unit's weights, and it runs before
// any of the unit's own backward, which needs the output's gradient first.
struct UnshardBeforeBackward : torch::autograd::Function<UnshardBeforeBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& output, FsdpUnit* unit) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(c10::make_intrusive<UnitCapsule>(unit));
    return output.view_as(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    saved_unit(ctx)->pre_backward();
    return {grads[0], torch::Tensor()};
  }
};

}  // namespace fsdp_detail

MESHTORCH_DECL void FsdpUnit::pre_forward() {
  schedule_->before_forward(*this);
  std::vector<torch::Tensor> shards, fulls;
  for (const auto& p : params_) {
    shards.push_back(p.shard);
    fulls.push_back(full_weight(p));
  }
  auto weights = fsdp_detail::GatherUnitParameters::apply(at::TensorList(shards), this, std::move(fulls));
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].leaf->replace_weight(weights[i]);
}

MESHTORCH_DECL void FsdpUnit::pre_backward() { schedule_->before_backward(*this); }

MESHTORCH_DECL torch::Tensor FsdpUnit::post_forward(const torch::Tensor& output) {
  if (!reshards_after_forward()) return output;
  reshard();
  if (!torch::GradMode::is_enabled() || !output.requires_grad()) return output;
  return fsdp_detail::UnshardBeforeBackward::apply(output, this);
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
