// Context parallel's attention on N ranks, by each --cp-rotate method, against causal attention in
// one process: every rank draws the same whole q, k and v, keeps its head-tail chunks, and its
// outputs and the gradients of its chunks must be the whole computation's.
#include <cmath>
#include <utility>

#include <catch2/catch.hpp>

#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>

namespace context_parallel_tests {
namespace mt = meshtorch;

// Rank r's chunks r and 2N-1-r of a [B, H, S, D] tensor, concatenated.
torch::Tensor held_chunks(const torch::Tensor& whole, int rank, int ranks) {
  const std::int64_t chunk = whole.size(2) / (2 * ranks);
  const auto held = mt::cp::chunks_of(rank, ranks);
  return torch::cat({whole.narrow(2, held[0] * chunk, chunk), whole.narrow(2, held[1] * chunk, chunk)}, 2);
}

double relative(const torch::Tensor& got, const torch::Tensor& expected) {
  return ((got - expected).abs().max() / expected.abs().max()).item<double>();
}

TEST_CASE("rank body: context parallel ring and all-gather attention equal causal attention", "[.][cp_attention]") {
  auto mesh = mt::comm::init<mt::Mesh<mt::CP<mt::dynamic>>>({.timeout = std::chrono::seconds(60)});
  const auto& group = mesh.group<mt::CP>();
  const int ranks = group.size(), rank = group.rank();
  for (const auto rotate : {mt::cp::Rotate::ring, mt::cp::Rotate::allgather})
    // Query and key/value heads: equal, grouped (GQA), and an odd count over one key/value head.
    for (const auto [heads, kv_heads] : {std::pair<std::int64_t, std::int64_t>{4, 4}, {4, 2}, {3, 1}})
      for (const std::int64_t chunk : {1, 6}) {
        INFO(mt::cp::to_string(rotate) << " on " << ranks << " ranks, rank " << rank << ", " << heads << " heads, "
                                       << kv_heads << " key/value heads, chunks of " << chunk);
        torch::manual_seed(5);  // the same whole tensors on every rank
        const std::int64_t batch = 2, dim = 16, seq = 2 * ranks * chunk;
        const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
        const auto q = torch::randn({batch, heads, seq, dim}).requires_grad_(true);
        const auto k = torch::randn({batch, kv_heads, seq, dim}).requires_grad_(true);
        const auto v = torch::randn({batch, kv_heads, seq, dim}).requires_grad_(true);
        const auto grad = torch::randn({batch, heads, seq, dim});
        const auto expected =
            at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale, kv_heads < heads);
        expected.backward(grad);

        const auto local_q = held_chunks(q.detach(), rank, ranks).requires_grad_(true);
        const auto local_k = held_chunks(k.detach(), rank, ranks).requires_grad_(true);
        const auto local_v = held_chunks(v.detach(), rank, ranks).requires_grad_(true);
        const auto out = rotate == mt::cp::Rotate::ring
                             ? mt::cp::ring_attention(local_q, local_k, local_v, group, scale)
                             : mt::cp::allgather_attention(local_q, local_k, local_v, group, scale);
        out.backward(held_chunks(grad, rank, ranks));
        CHECK(relative(out, held_chunks(expected.detach(), rank, ranks)) < 1e-6);
        CHECK(relative(local_q.grad(), held_chunks(q.grad(), rank, ranks)) < 1e-6);
        // The keys' and values' gradients come from every rank's queries, summed back to their holder
        // in another order than one process sums them: 1.1e-6 at worst measured.
        CHECK(relative(local_k.grad(), held_chunks(k.grad(), rank, ranks)) < 2e-6);
        CHECK(relative(local_v.grad(), held_chunks(v.grad(), rank, ranks)) < 2e-6);
      }
}

}  // namespace context_parallel_tests
