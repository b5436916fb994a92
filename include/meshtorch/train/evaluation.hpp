#pragma once
// The loss on the blocks --eval-split held out of training (data::TokenBlocks::hold_out): what
// the training loop logs every --eval-freq steps and meshtorch-eval-loss --eval-split prints.
//
// Every held-out block is evaluated once, whatever the number of ranks, so the figure is the same
// on one process and on any mesh. Data-parallel rank r takes the blocks [r n / dp, (r + 1) n / dp),
// in batches of -b rows, and every rank runs the same number of forwards (a forward of a sharded
// model is a collective): a rank whose share ran out runs one row more and counts none of it. The
// model's ranks inside one data-parallel coordinate (TP, CP) read the same rows.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/data/dataset.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::train {

// A model whose forward alone gives the loss: chapter 1's model->loss, a parallel model's loss.
// A pipeline runs forward and backward together and has none.
template <class Model>
concept HasForwardLoss = requires(Model& model, const torch::Tensor& ids) {
  model->loss(ids, ids);
}
|| requires(Model& model, const torch::Tensor& ids) { model.loss(ids, ids); };

// --eval-freq for a model that cannot evaluate: refused at start-up, before any data is read.
template <class Model>
void check_can_evaluate(std::int64_t eval_freq) {
  if constexpr (!HasForwardLoss<Model>)
    if (eval_freq > 0)
      throw ConfigError(
          "--eval-freq: this chapter's model has no forward-only pass to evaluate with (a pipeline runs forward and "
          "backward together); evaluate its checkpoints with meshtorch-eval-loss --eval-split instead");
}

// Every data-parallel rank needs a block of its own.
inline void check_enough_held_out(std::int64_t blocks, std::int64_t dp_size) {
  if (blocks < dp_size)
    throw ConfigError(
        fmt::format("--eval-split holds out {} block(s), fewer than the {} data-parallel ranks that evaluate them; "
                    "hold out more (a larger --eval-split)",
                    blocks, dp_size));
}

struct Evaluation {
  double loss = 0;          // mean next-token loss (nats) over every held-out block
  std::int64_t tokens = 0;  // next-token predictions evaluated
  std::int64_t blocks = 0;  // held-out blocks evaluated: all of them
  double seconds = 0;

  double perplexity() const { return std::exp(loss); }
};

// The mean loss over `held_out`: `mean_loss(input_ids)` gives a batch's mean next-token loss
// (input_ids on `device`, the labels the same ids); `mean_over_data_parallel(t)` the mean of a
// double scalar over the data-parallel ranks (the identity on one process).
template <class MeanLoss, class MeanOverDataParallel>
Evaluation evaluate_held_out(const data::TokenBlocks& held_out, std::int64_t batch_size, std::int64_t dp_size,
                             std::int64_t dp_rank, torch::Device device, MeanLoss&& mean_loss,
                             MeanOverDataParallel&& mean_over_data_parallel) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t count = held_out.size();
  check_enough_held_out(count, dp_size);
  const std::int64_t first = dp_rank * count / dp_size, last = (dp_rank + 1) * count / dp_size;
  const std::int64_t longest_share = (count + dp_size - 1) / dp_size;
  torch::NoGradGuard no_grad;
  auto summed = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
  for (std::int64_t offset = 0; offset < longest_share; offset += batch_size) {
    const auto begin = std::min(first + offset, last), end = std::min(first + offset + batch_size, last);
    std::vector<std::int64_t> indices(static_cast<std::size_t>(std::max<std::int64_t>(end - begin, 1)));
    std::iota(indices.begin(), indices.end(), end > begin ? begin : first);
    const auto loss = mean_loss(held_out.gather(indices).to(device)).detach().to(torch::kDouble);
    if (end > begin) summed += loss * static_cast<double>(end - begin);
  }
  Evaluation out;
  // The mean over ranks of (each rank's sum x ranks / blocks) is the sum over every block / blocks.
  out.loss = mean_over_data_parallel(summed * (static_cast<double>(dp_size) / static_cast<double>(count)))
                 .template item<double>();
  out.blocks = count;
  out.tokens = count * (held_out.seq_length() - 1);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace meshtorch::train
