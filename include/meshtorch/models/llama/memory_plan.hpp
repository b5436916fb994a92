#pragma once
// What one rank of a Llama training run holds in device memory at its peak, from the config, the
// layout and the run's shape: arithmetic only (constexpr), so meshtorch-plan prints it before
// anything launches and a preset can static_assert that it fits.
//
// The parts, in bytes per rank:
//   weights, gradients, optimizer   the trained state: replicated (DDP), AdamW state sharded
//                                   (ZeRO-1), gradients too (ZeRO-2) or everything (FSDP) over the
//                                   data-parallel ranks; on the host with cpu_offload (FSDP); with
//                                   optimizer_in_backward (FSDP) one unit's gradient shards, not
//                                   the model's; with optimizer_offload the AdamW state on the
//                                   host, beside a copy of the weights it steps and their gradients
//   gathered                        FSDP: the unit running, the prefetched ones and the root kept
//                                   from forward to backward, in the compute dtype
//   reductions                      FSDP: a unit's full gradients and the reduce-scatters' buffers
//   activations                     what autograd keeps from forward to backward: per decoder
//                                   layer per token, counted from the model's ops (below); a
//                                   checkpointed layer keeps only its input
//   loss                            the loss's own: fp32 log-probabilities of every position, or,
//                                   chunked, the gradients of the rows and the output weight
//   backward_peak                   what backward adds at once on top, the larger of: the loss's
//                                   gradient (or one chunk's logits), and a layer's backward (the
//                                   gradients of its largest activations; the last layer recomputed
//                                   when it is checkpointed)
// The peak is what stays (weights, AdamW state, gathered units, reductions) plus the larger of
// activations + loss + backward_peak (backward's start) and the gradients (its end).
//
// What a decoder layer keeps per token (h hidden, q and kv the query and key/value widths, i the
// intermediate size, d the compute dtype's bytes), from LlamaDecoderLayer's forward:
//   each RMSNorm     its input in fp32 (4h) and the normalised rows (h d)
//   attention        the normed input of q/k/v (h d); SDPA's q, k, v and output (2q + 2kv) d
//                    and log-sum-exp (4 per head); o_proj's input (q d)
//   MLP              the normed input of gate/up (h d); gate, silu(gate), up, their product (4i d)
// With tensor parallel, q, kv and i are a rank's slice; with sequence parallel the norms see a
// sequence shard, while the projections' inputs are gathered whole. Other buffers (rotary
// tables, the allocator's rounding, communication staging) are not counted. Measured on the CPU
// (tests/core, a counting allocator), what autograd holds after forward and the step's peak are
// within 10% of these figures, with and without checkpointing and the chunked loss.
#include <algorithm>
#include <cstdint>

#include <meshtorch/layout/row_block.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/loss_chunk.hpp>

namespace meshtorch::llama {

inline constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

enum class DataParallelKind { ddp, zero1, zero2, fsdp };

// The shape of one training step and the options that change what a rank holds.
struct RunShape {
  std::int64_t batch = 1;  // sequences per data-parallel rank and micro-batch
  std::int64_t seq = 2048;
  std::int64_t compute_bytes = 2;              // bf16 forward and backward
  std::int64_t state_bytes = 4;                // weights, gradients and AdamW state (fp32 shards)
  std::int64_t checkpoint_every = 0;           // 0 none, 1 every decoder layer, k every k-th
  std::int64_t loss_chunk = -1;                // as LlamaForCausalLM::loss_chunk (-1 automatic)
  std::int64_t prefetch_layers = 1;            // FSDP
  std::int64_t reduce_scatters_in_flight = 1;  // FSDP
  bool cpu_offload = false;                    // FSDP: the trained state on the host
  bool reshard_after_forward = true;           // FSDP
  bool optimizer_in_backward = false;          // FSDP: each unit stepped as its gradients arrive, then freed
  bool optimizer_offload = false;              // any layout: AdamW's state and step on the host (not with cpu_offload)
};

// Ranks of each kind; tensor parallel with sequence and loss parallel (chapter 6's plan).
struct LayoutSizes {
  DataParallelKind data_parallel = DataParallelKind::fsdp;
  std::int64_t data_parallel_ranks = 1;  // FSDP (or DP for ddp/zero) ranks
  std::int64_t tp = 1;
};

struct MemoryEstimate {
  double weights = 0, gradients = 0, optimizer = 0;  // on the device
  double host = 0;                                   // offloaded trained state (or AdamW's part of it)
  double gathered = 0, reductions = 0;
  double activations = 0, loss = 0, backward_peak = 0;
  constexpr double trained_state() const { return weights + gradients + optimizer; }
  // What a step holds on top of what stays: backward frees a layer's activations as it makes
  // that layer's gradients, so the two peak at opposite ends of it (activations at its start,
  // gradients at its end) and the step's peak is the larger.
  constexpr double step_peak() const {
    const double forward_and_backward = activations + loss + backward_peak;
    return forward_and_backward > gradients ? forward_and_backward : gradients;
  }
  constexpr double peak() const { return weights + optimizer + gathered + reductions + step_peak(); }
};

// Bytes one decoder layer keeps per token of this rank (see the header comment).
constexpr double layer_activation_bytes_per_token(const llama::Config& c, std::int64_t tp, std::int64_t d) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.q_size()) / tp,
               kv = static_cast<double>(c.kv_size()) / tp, i = static_cast<double>(c.intermediate_size) / tp,
               heads = static_cast<double>(c.num_attention_heads) / tp, bytes = static_cast<double>(d);
  const double norms = 2 * (4 * h + h * bytes) / static_cast<double>(tp);  // sequence shards under SP
  const double attention = (h + 3 * q + 2 * kv) * bytes + 4 * heads;
  const double mlp = (h + 4 * i) * bytes;
  return norms + attention + mlp;
}

// Parameters one TP rank holds under the sequence-parallel plan: q/k/v/o, gate/up/down, the
// embedding and the head split by tp; the norms whole.
struct TpRankParameters {
  std::int64_t layer = 0;      // one decoder layer's
  std::int64_t embedding = 0;  // embed_tokens
  std::int64_t head = 0;       // lm_head (0 when tied)
  std::int64_t final_norm = 0;
  constexpr std::int64_t root() const { return embedding + head + final_norm; }
  friend constexpr bool operator==(const TpRankParameters&, const TpRankParameters&) = default;
};

constexpr TpRankParameters tp_rank_parameters(const llama::Config::ParameterCounts& counts, std::int64_t tp) {
  return {.layer = counts.attention / tp + counts.mlp / tp + counts.layer_norms,
          .embedding = counts.embedding / tp,
          .head = counts.head / tp,
          .final_norm = counts.final_norm};
}

// What the first of n FSDP (or ZeRO-2) ranks holds of one TP rank's parameters: each tensor's
// rows split as row_block splits them, whose first rank holds the most (ceil(rows / n) of every
// tensor), so the largest shard, not the average, is what must fit.
constexpr TpRankParameters largest_row_shards(const llama::Config& c, std::int64_t tp, std::int64_t n) {
  const std::int64_t h = c.hidden_size, q = c.q_size() / tp, kv = c.kv_size() / tp, i = c.intermediate_size / tp;
  const std::int64_t vocab = c.vocab_size / tp;
  const auto rows = [n](std::int64_t rows, std::int64_t row_numel) { return row_block(rows, n, 0).count * row_numel; };
  return {.layer = rows(q, h) + 2 * rows(kv, h) + rows(h, q)  // q, k, v (colwise), o (rowwise)
                   + 2 * rows(i, h) + rows(h, i)              // gate, up (colwise), down (rowwise)
                   + 2 * rows(h, 1),                          // the two norms
          .embedding = rows(vocab, h),
          .head = c.tie_word_embeddings ? 0 : rows(vocab, h),
          .final_norm = rows(h, 1)};
}

constexpr MemoryEstimate estimate_memory(const llama::Config& c, LayoutSizes layout, RunShape run) {
  MemoryEstimate m;
  const auto counts = c.parameter_counts().value_or(llama::Config::ParameterCounts{});
  const double tp = static_cast<double>(layout.tp), n = static_cast<double>(layout.data_parallel_ranks);
  const double state = static_cast<double>(run.state_bytes), d = static_cast<double>(run.compute_bytes);
  const auto rank_parameters = tp_rank_parameters(counts, layout.tp);
  const double layer = static_cast<double>(rank_parameters.layer);
  const double root = static_cast<double>(rank_parameters.root());
  const double params = layer * static_cast<double>(c.num_hidden_layers) + root;

  // The trained state: FSDP and ZeRO-2 hold their largest row shards; ZeRO-1 owns whole
  // parameters, balanced by size (PyTorch's greedy rule), about an n-th.
  const bool fsdp = layout.data_parallel == DataParallelKind::fsdp;
  const bool rows_sharded = fsdp || layout.data_parallel == DataParallelKind::zero2;
  const auto shard = largest_row_shards(c, layout.tp, layout.data_parallel_ranks);
  const double shard_params =
      static_cast<double>(shard.layer) * static_cast<double>(c.num_hidden_layers) + static_cast<double>(shard.root());
  m.weights = (fsdp ? shard_params : params) * state;
  m.gradients = (rows_sharded ? shard_params : params) * state;
  m.optimizer = 2 * state *
                (rows_sharded                                      ? shard_params
                 : layout.data_parallel == DataParallelKind::zero1 ? params / n
                                                                   : params);
  if (fsdp && run.optimizer_in_backward) m.gradients = static_cast<double>(std::max(shard.layer, shard.root())) * state;
  if (fsdp && run.cpu_offload) {
    m.host = m.trained_state();
    m.weights = m.gradients = m.optimizer = 0;
  } else if (run.optimizer_offload) {
    // The moments, and a host copy of each weight AdamW steps and of its gradient: as much again.
    m.host = 2 * m.optimizer;
    m.optimizer = 0;
  }

  // FSDP's gathered units (when there is more than one rank, or offload moves them) and their
  // gradients: the root kept from forward to backward, the running layer and the prefetched
  // ones; in backward a layer's full gradients (autograd's, in the compute dtype) and the send
  // buffers in the reduce dtype (fp32) of the reduce-scatters in flight plus the one being issued.
  if (fsdp && (n > 1 || run.cpu_offload)) {
    const double layers_gathered =
        run.reshard_after_forward
            ? 1 + static_cast<double>(std::min<std::int64_t>(run.prefetch_layers, c.num_hidden_layers - 1))
            : static_cast<double>(c.num_hidden_layers);
    m.gathered = (root + layers_gathered * layer) * d;
    m.reductions = layer * d + static_cast<double>(run.reduce_scatters_in_flight + 1) * layer * 4;
  }

  // Activations of the tokens this rank computes.
  const double tokens = static_cast<double>(run.batch) * static_cast<double>(run.seq);
  const double h = static_cast<double>(c.hidden_size);
  const double per_layer = layer_activation_bytes_per_token(c, layout.tp, run.compute_bytes) * tokens;
  const double layer_input = h * d * tokens / tp;  // what a checkpointed layer keeps (a sequence shard)
  const std::int64_t checkpointed =
      run.checkpoint_every > 0 ? (c.num_hidden_layers + run.checkpoint_every - 1) / run.checkpoint_every : 0;
  // The loss: vocab-parallel logits under TP (loss parallel).
  const double vocab = static_cast<double>(c.vocab_size) / tp;
  const std::int64_t rows = run.batch * run.seq;
  const std::int64_t chunk = loss_chunk_positions(run.loss_chunk, rows, static_cast<std::int64_t>(vocab));
  m.activations = static_cast<double>(checkpointed) * layer_input +
                  static_cast<double>(c.num_hidden_layers - checkpointed) * per_layer +
                  (4 * h + h * d) * tokens / tp  // the final norm (sequence shard)
                  // its output, which the whole loss's output projection (at::linear) saves; the
                  // chunked loss saves only the gradients it computed in forward
                  + (chunk >= rows ? h * d * tokens : 0);
  // While a layer's backward runs: the gradients of its largest activations, and, when the last
  // layer is checkpointed, its recomputed activations (a checkpointed layer further down is
  // recomputed after later layers freed theirs).
  const double layer_working_set =
      (h + 2 * static_cast<double>(c.intermediate_size) / tp) * d * tokens +
      (run.checkpoint_every > 0 && (c.num_hidden_layers - 1) % run.checkpoint_every == 0 ? per_layer : 0);

  double loss_working_set = 0;
  if (chunk >= rows) {
    m.loss = 4 * vocab * tokens;                // log_softmax's output, fp32
    loss_working_set = 2 * 4 * vocab * tokens;  // its gradient and the logits' gradient
  } else {
    m.loss = h * d * tokens + (static_cast<double>(counts.head ? counts.head : counts.embedding) / tp) * d;
    loss_working_set = 3 * 4 * vocab * static_cast<double>(chunk);  // one chunk's logits, forward and backward
  }
  m.backward_peak = std::max(loss_working_set, layer_working_set);
  return m;
}

}  // namespace meshtorch::llama
