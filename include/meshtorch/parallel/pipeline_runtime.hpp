#pragma once
// The run time of a pipeline schedule: runs this rank's program of a checked table
// (layout/pipeline_schedule.hpp) action by action over the stages it holds, for any model that
// gives a forward per stage. Model-neutral: parallel/pipeline_llama.hpp cuts a Llama into stages
// and hands them here.
//
//   F  forward of a stage's micro-batch: its input is the micro-batch (first stage), the
//      activations received from the previous stage, or those a stage on this rank just made;
//      the last stage's forward returns the micro-batch's loss, already scaled.
//   B  backward: from the loss (last stage) or the gradient received from the next stage; the
//      gradient of the stage's input is what goes back.
//   I, W  backward split (ZBV): the input gradient at once, the weight gradients later, each part
//      of the graph run once (parallel/split_backward.hpp).
//   SEND_*, RECV_*  one tensor between neighbour stages on other ranks. Shapes are known to both
//      sides, so nothing but the data moves; sends are asynchronous and waited at the step's end,
//      receives are posted when the table says and waited where their data is used.
//
// A received tensor becomes a fresh leaf for each micro-batch (no hooks or graph carried over
// from the last step's use of a buffer), and every activation and gradient is released as soon
// as the backward that needed it has run.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/point_to_point.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/parallel/split_backward.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// The stages this rank holds, as the run time asks for them.
struct PipelineStages {
  // Forward of `stage` on micro-batch `microbatch`; see F above.
  std::function<torch::Tensor(int stage, const torch::Tensor& input, int microbatch)> forward;
  // The tensors `stage` trains: the inputs of its weight-gradient step (W).
  std::function<std::vector<torch::Tensor>(int stage)> parameters;
  // Dtype and device of the activations passed between stages.
  torch::TensorOptions activation_options;
  // Whether the weight-gradient step (W) is one backward from the stage's output, repeating the
  // input path's nodes (SplitBackward's repeat_input_path): under FSDP inside the stages.
  bool weight_step_repeats_input_path = false;
  // Called after a split backward's input step (I) of a stage, before its weight step (W).
  std::function<void(int stage)> after_input_step;
  // FSDP's gather of a stage's weights for the rest of the step, and their release: the table's
  // UNSHARD and RESHARD (ScheduleShape::stage_gathers). Needed only by such a table.
  std::function<void(int stage)> unshard, reshard;
};

class PipelineRunner {
 public:
  // `table` checked (make_schedule or pp::Schedule::table()); `group` the PP axis, whose rank r
  // runs the table's program r.
  MESHTORCH_DECL PipelineRunner(pp::ScheduleTable table, comm::AxisGroup group, PipelineStages stages);

  // One step: every action of this rank's program. `microbatches` are the step's inputs of the
  // first stage (token ids), one per micro-batch; ranks without the first stage may pass none.
  // `activation_shape` is the shape of what one stage passes the next for one micro-batch.
  // Returns the sum of the last stage's losses on the rank that holds it, and an undefined
  // tensor elsewhere.
  MESHTORCH_DECL torch::Tensor run(const std::vector<torch::Tensor>& microbatches,
                                   std::vector<std::int64_t> activation_shape);

  // Host seconds this rank spent computing each stage (F, B, I and W, not the waits for data)
  // and running whole steps, summed over the steps after the first: what balance and idle time
  // are measured from. On a GPU they are enqueue times unless the device is synchronised.
  struct Times {
    std::vector<double> stage_compute;  // indexed by stage; 0 for stages of other ranks
    double steps = 0;
    int step_count = 0;
  };
  const Times& times() const { return times_; }

  const pp::ScheduleTable& table() const { return table_; }
  const comm::AxisGroup& group() const { return group_; }
  // Whether this rank holds the stage.
  bool holds(int stage) const { return table_.shape.rank_of_stage(stage) == group_.rank(); }
  int stages() const { return table_.shape.stages(); }
  int microbatches() const { return table_.shape.microbatches; }

 private:
  struct Slot {            // one stage's state for one micro-batch
    torch::Tensor input;   // a leaf requiring grad, except on the first stage
    torch::Tensor output;  // activations, or the loss on the last stage
    std::optional<comm::Work<torch::Tensor>> forward_receive, backward_receive;
    torch::Tensor grad_output;             // of `output`, from the next stage
    torch::Tensor grad_input;              // of `input`, for the previous stage
    std::shared_ptr<SplitBackward> split;  // between I and W
  };

  Slot& slot(int stage, int microbatch) { return slots_[{stage, microbatch}]; }
  // The message tag of the transfer that `sender` stage makes for micro-batch `m`.
  int tag(bool backward, int sender, int microbatch) const {
    return ((backward ? stages() : 0) + sender) * microbatches() + microbatch;
  }
  int peer_of_stage(int stage) const { return table_.shape.rank_of_stage(stage); }
  void add_compute(int stage, std::chrono::steady_clock::time_point start) {
    times_.stage_compute[static_cast<std::size_t>(stage)] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  MESHTORCH_DECL void forward(int stage, int microbatch, const std::vector<torch::Tensor>& microbatches);
  MESHTORCH_DECL torch::Tensor grad_output_of(int stage, int microbatch);
  MESHTORCH_DECL void backward_whole(int stage, int microbatch);
  MESHTORCH_DECL void backward_input(int stage, int microbatch);
  MESHTORCH_DECL void backward_weight(int stage, int microbatch);

  pp::ScheduleTable table_;
  comm::AxisGroup group_;
  PipelineStages stages_;
  std::map<std::pair<int, int>, Slot> slots_;
  std::vector<comm::Work<torch::Tensor>> sends_;
  torch::Tensor loss_sum_;
  Times times_;  // of the steps after the first
  bool warmed_up_ = false;
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <stdexcept>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch {

MESHTORCH_DECL PipelineRunner::PipelineRunner(pp::ScheduleTable table, comm::AxisGroup group, PipelineStages stages)
    : table_(std::move(table)), group_(std::move(group)), stages_(std::move(stages)) {
  if (table_.shape.ranks != group_.size())
    throw ConfigError(fmt::format("a pipeline schedule over {} ranks cannot run on the {} of {} ranks",
                                  table_.shape.ranks, group_.describe(), group_.size()));
}

MESHTORCH_DECL torch::Tensor PipelineRunner::run(const std::vector<torch::Tensor>& microbatches,
                                                 std::vector<std::int64_t> activation_shape) {
  slots_.clear();
  sends_.clear();
  loss_sum_ = torch::Tensor();
  times_.stage_compute.resize(static_cast<std::size_t>(stages()), 0.0);
  const auto step_start = std::chrono::steady_clock::now();
  const int last = stages() - 1;
  for (const pp::Action& action : table_.programs.at(static_cast<std::size_t>(group_.rank()))) {
    const int s = action.stage, m = action.microbatch;
    switch (action.kind) {
      case pp::ActionKind::forward:
        forward(s, m, microbatches);
        break;
      case pp::ActionKind::backward:
        backward_whole(s, m);
        break;
      case pp::ActionKind::backward_input:
        backward_input(s, m);
        break;
      case pp::ActionKind::backward_weight:
        backward_weight(s, m);
        break;
      case pp::ActionKind::send_forward:
        sends_.push_back(comm::send_async(group_, slot(s, m).output.detach(), peer_of_stage(s + 1), tag(false, s, m)));
        break;
      case pp::ActionKind::send_backward:
        sends_.push_back(comm::send_async(group_, slot(s, m).grad_input, peer_of_stage(s - 1), tag(true, s, m)));
        slot(s, m).grad_input = torch::Tensor();  // the send holds it until it is waited
        break;
      case pp::ActionKind::receive_forward:
        slot(s, m).forward_receive.emplace(
            comm::receive_async(group_, torch::empty(activation_shape, stages_.activation_options),
                                peer_of_stage(s - 1), tag(false, s - 1, m)));
        break;
      case pp::ActionKind::receive_backward:
        if (s == last) throw std::logic_error("pipeline: a gradient received by the last stage");
        slot(s, m).backward_receive.emplace(
            comm::receive_async(group_, torch::empty(activation_shape, stages_.activation_options),
                                peer_of_stage(s + 1), tag(true, s + 1, m)));
        break;
      case pp::ActionKind::unshard:
      case pp::ActionKind::reshard: {
        const auto& gather = action.kind == pp::ActionKind::unshard ? stages_.unshard : stages_.reshard;
        if (!gather)
          throw std::logic_error(fmt::format("pipeline: the table gathers stage {} but the stages have no FSDP", s));
        gather(s);
        break;
      }
    }
  }
  for (auto& send : sends_) send.wait();
  sends_.clear();
  for (const auto& [key, left] : slots_)
    if (left.forward_receive || left.backward_receive || left.output.defined())
      throw std::logic_error(fmt::format("pipeline: stage {} micro-batch {} still holds {} after the step", key.first,
                                         key.second, left.output.defined() ? "its activations" : "a receive"));
  slots_.clear();
  if (!warmed_up_) {  // the first step's allocations and first touches are not the schedule's
    warmed_up_ = true;
    times_ = {};
  } else {
    times_.steps += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    ++times_.step_count;
  }
  return std::exchange(loss_sum_, torch::Tensor());
}

MESHTORCH_DECL void PipelineRunner::forward(int stage, int microbatch, const std::vector<torch::Tensor>& microbatches) {
  Slot& current = slot(stage, microbatch);
  if (stage == 0) {
    current.input = microbatches.at(static_cast<std::size_t>(microbatch));
  } else {
    torch::Tensor received;
    if (current.forward_receive) {
      received = current.forward_receive->wait();
      current.forward_receive.reset();
    } else {
      // The previous stage is on this rank (ZBV's turn): its output, cut from its graph.
      Slot& previous = slot(stage - 1, microbatch);
      if (!previous.output.defined())
        throw std::logic_error(
            fmt::format("pipeline: forward of stage {} micro-batch {} before its input exists", stage, microbatch));
      received = previous.output.detach();
    }
    current.input = received.requires_grad_(true);
  }
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor output = stages_.forward(stage, current.input, microbatch);
  add_compute(stage, start);
  if (stage == stages() - 1) {
    const torch::Tensor detached = output.detach();
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + detached : detached.clone();
  }
  current.output = std::move(output);
}

MESHTORCH_DECL torch::Tensor PipelineRunner::grad_output_of(int stage, int microbatch) {
  if (stage == stages() - 1) return torch::Tensor();  // the loss: d loss / d loss = 1
  Slot& current = slot(stage, microbatch);
  if (current.grad_output.defined()) return current.grad_output;
  if (current.backward_receive) {
    current.grad_output = current.backward_receive->wait();
    current.backward_receive.reset();
  } else {
    // The next stage is on this rank: the gradient its backward left for this one.
    Slot& next = slot(stage + 1, microbatch);
    if (!next.grad_input.defined())
      throw std::logic_error(
          fmt::format("pipeline: backward of stage {} micro-batch {} before its gradient exists", stage, microbatch));
    current.grad_output = std::exchange(next.grad_input, torch::Tensor());
  }
  return current.grad_output;
}

MESHTORCH_DECL void PipelineRunner::backward_whole(int stage, int microbatch) {
  const torch::Tensor grad = grad_output_of(stage, microbatch);
  Slot& current = slot(stage, microbatch);
  if (!current.output.defined())
    throw std::logic_error(
        fmt::format("pipeline: backward of stage {} micro-batch {} before its forward", stage, microbatch));
  const auto start = std::chrono::steady_clock::now();
  torch::autograd::backward({current.output}, {grad});
  add_compute(stage, start);
  if (stage > 0) current.grad_input = current.input.grad();
  current.input = current.output = current.grad_output = torch::Tensor();
}

MESHTORCH_DECL void PipelineRunner::backward_input(int stage, int microbatch) {
  const torch::Tensor grad = grad_output_of(stage, microbatch);
  Slot& current = slot(stage, microbatch);
  // The first stage's input is token ids: no gradient to pass on.
  const auto start = std::chrono::steady_clock::now();
  current.split = std::make_shared<SplitBackward>(current.output, grad, stage > 0 ? current.input : torch::Tensor(),
                                                  stages_.parameters(stage), stages_.weight_step_repeats_input_path);
  current.grad_input = current.split->input_gradient();
  if (stages_.after_input_step) stages_.after_input_step(stage);
  add_compute(stage, start);
}

MESHTORCH_DECL void PipelineRunner::backward_weight(int stage, int microbatch) {
  Slot& current = slot(stage, microbatch);
  if (!current.split)
    throw std::logic_error(fmt::format("pipeline: weight gradient of stage {} micro-batch {} before its input gradient",
                                       stage, microbatch));
  const auto start = std::chrono::steady_clock::now();
  current.split->weight_gradients();
  add_compute(stage, start);
  current.split.reset();
  current.input = current.output = current.grad_output = torch::Tensor();
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
