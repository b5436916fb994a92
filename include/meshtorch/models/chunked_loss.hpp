#pragma once
// The output projection and the loss over chunks of positions, so that the logits of the whole
// batch never exist at once: for a vocabulary of 128256 at 4096 positions their fp32 copy alone
// is 2.1 GB per sequence. Forward takes each chunk's logits, its loss, and at once its gradients
// with respect to the rows and the weight (as Liger's fused linear cross entropy does), then drops
// the logits; backward only scales the kept gradients. The projection costs what it costs
// unchunked (one forward and two gradient products per chunk, the weight's accumulated in
// place); what is held from forward to backward is a gradient the size of the rows and one the
// size of the weight, not the logits.
// The weight and the rows come in as inputs, so their gradients leave through this function
// once, whatever wrapper produced them (FSDP's gather, a tensor-parallel shard, a tied embedding).
#include <cstdint>
#include <functional>

#include <meshtorch/torch.hpp>

#include <meshtorch/models/loss_chunk.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// logits -> what the loss sees (the output projection's post-hooks: tensor parallel's
// all-gather of the vocabulary, or nothing under loss parallel).
using LogitsHook = std::function<torch::Tensor(const torch::Tensor& logits)>;
// (logits [n, vocab or this rank's slice], targets [n], -100 ignored) -> the sum of their losses.
using TokenLossSum = std::function<torch::Tensor(const torch::Tensor& logits, const torch::Tensor& targets)>;

// The sum over all rows of loss(after(rows @ weight^T), targets), `chunk` rows at a time.
MESHTORCH_DECL torch::Tensor chunked_linear_loss(const torch::Tensor& rows, const torch::Tensor& weight,
                                                 const torch::Tensor& targets, std::int64_t chunk,
                                                 const LogitsHook& after, const TokenLossSum& loss);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <utility>

namespace meshtorch {

namespace chunked_loss_detail {

struct ChunkedLinearLoss : torch::autograd::Function<ChunkedLinearLoss> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& rows,
                               const torch::Tensor& weight, const torch::Tensor& targets, std::int64_t chunk,
                               const LogitsHook& after, const TokenLossSum& loss) {
    const bool want_rows = rows.requires_grad(), want_weight = weight.requires_grad();
    auto total = torch::zeros({}, rows.options().dtype(torch::kFloat));
    // The gradients, in the inputs' dtypes (no weight-sized fp32 buffer).
    torch::Tensor grad_rows = want_rows ? torch::empty_like(rows) : torch::Tensor();
    torch::Tensor grad_weight = want_weight ? torch::zeros_like(weight) : torch::Tensor();
    const auto w = weight.detach();
    const bool want_logits_grad = want_rows || want_weight;
    for (std::int64_t start = 0; start < rows.size(0); start += chunk) {
      const auto n = std::min(chunk, rows.size(0) - start);
      const auto r = rows.narrow(0, start, n).detach();
      // Autograd runs only from the logits on (the hook and the loss, which may hold collectives);
      // the projection's two gradient products are written here, into their places: the weight's
      // accumulates inside the GEMM (addmm_), instead of a weight-sized product per chunk that
      // add_ then reads again.
      const auto logits = at::linear(r, w).requires_grad_(want_logits_grad);
      torch::AutoGradMode enable(want_logits_grad);
      const auto chunk_loss = loss(after(logits), targets.narrow(0, start, n)).to(torch::kFloat);
      total += chunk_loss.detach();
      if (!want_logits_grad) continue;
      const auto grad_logits = torch::autograd::grad({chunk_loss}, {logits}).front();
      if (want_rows) {
        auto grad_rows_chunk = grad_rows.narrow(0, start, n);
        at::mm_out(grad_rows_chunk, grad_logits, w);
      }
      if (want_weight) grad_weight.addmm_(grad_logits.t(), r);
    }
    ctx->save_for_backward({grad_rows, grad_weight});
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& scale = grads[0];  // d(result)/d(loss sum): a scalar
    auto scaled = [&](const torch::Tensor& g) { return g.defined() ? g * scale.to(g.scalar_type()) : g; };
    return {scaled(saved[0]), scaled(saved[1]), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace chunked_loss_detail

MESHTORCH_DECL torch::Tensor chunked_linear_loss(const torch::Tensor& rows, const torch::Tensor& weight,
                                                 const torch::Tensor& targets, std::int64_t chunk,
                                                 const LogitsHook& after, const TokenLossSum& loss) {
  return chunked_loss_detail::ChunkedLinearLoss::apply(rows, weight, targets, chunk, after, loss);
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
