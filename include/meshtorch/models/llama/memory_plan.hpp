#pragma once
// What one rank of a Llama training run holds in device memory at its peak, from the config, the
// layout and the run's shape: arithmetic only (constexpr), so meshtorch-plan prints it before
// anything launches and a preset can static_assert that it fits.
//
// The memory is a timeline (for_each_memory_event, memory_timeline): the bytes the device holds
// after each event of one training step, in the order the code makes them (FSDP's gathers and
// frees per unit with prefetch, activations saved and freed layer by layer, the loss, gradients
// made, cast and reduce-scatters issued and waited for per unit, the optimizer's step); the peak
// is the most held at one moment, which is less than the sum of the parts, as they do not all
// live at once (backward frees a layer's activations as it makes its gradients; the root's
// gradients are reduced when the activations are gone).
//
// The parts each event holds (MemoryPart), in bytes per rank:
//   trained state       weights, gradients and AdamW state on the device: replicated (DDP), AdamW
//                       state sharded (ZeRO-1), gradients too (ZeRO-2) or everything (FSDP) over
//                       the data-parallel ranks; on the host with cpu_offload (FSDP); with
//                       optimizer_in_backward (FSDP) one unit's gradient shards, not the model's;
//                       with optimizer_offload the AdamW state on the host, beside a copy of the
//                       weights it steps and their gradients. Gradients appear as backward makes
//                       them (DDP's buckets on more than one rank keep them across steps)
//   gathered            FSDP: all-gather buffers in flight, the full weights of the unit running,
//                       and the root's, kept from forward to backward, in the compute dtype
//   reductions          FSDP: a unit's full gradients, the send buffers and outputs of the
//                       reduce-scatters in flight
//   activations         what autograd keeps from forward to backward: per decoder layer per token,
//                       counted from the model's ops (below); a checkpointed layer keeps only its
//                       input, and is recomputed in backward
//   loss                the loss's own: fp32 log-probabilities of every position, or, chunked, the
//                       gradients of the rows and the output weight
//   working             what an op needs while it runs: the loss's logits (a chunk's), a layer's
//                       backward (the gradients of its largest activations)
// MemoryEstimate keeps each part's size (the trained state) or its largest over the step (the
// others), and the timeline's peak event with the parts it holds.
//
// What a decoder layer keeps per token (h hidden, q and kv the query and key/value widths, i the
// intermediate size, d the compute dtype's bytes), from LlamaDecoderLayer's forward:
//   each RMSNorm     fused (kernels/rms_norm.hpp): its input, or the residual sum, (h d) and one
//                    fp32; composite (--fused off): its input in fp32 (4h) and the normalised rows (h d)
//   attention        the normed input of q/k/v (h d); SDPA's q, k, v and output (2q + 2kv) d
//                    and log-sum-exp (4 per head); o_proj's input (q d)
//   MLP              the normed input of gate/up (h d); gate, up and their SwiGLU product (3i d),
//                    and silu(gate) too when composite (4i d)
// With tensor parallel, q, kv and i are a rank's slice; with sequence parallel the norms see a
// sequence shard, while the projections' inputs are gathered whole. With context parallel a rank
// computes 1/CP of each sequence's positions; gathering the keys and values (allgather) keeps every
// rank's for backward, 2 kv d per position of the whole sequence, where the ring keeps its own. Other buffers (rotary
// tables, the allocator's rounding, communication staging, a forward's temporaries inside a
// layer, the device copy of a reduce-scatter's output in the shards' dtype on its way to the
// host with cpu_offload and bf16 shards, a 1/n-th of a unit for an instant) are not counted.
// Measured on the CPU (tests/core, a counting allocator), what autograd holds after forward and
// the step's peak are within 10% of the timeline's, with and without checkpointing and the
// chunked loss, and with FSDP on one rank (bf16 compute too), where a reduce-scatter's send
// buffer lives until it is waited for, as on a GPU.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

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
  // kernels/' fused CPU kernels (a CPU run's default), or the composite ops, which every other
  // device runs (and --fused off): what a GPU's plan counts, and the larger.
  bool fused_kernels = false;
  // The loss's fused CPU kernel (kernels/cross_entropy.hpp: fp32 logits on a CPU with AVX-512,
  // kernels::fused_cross_entropy_available()), which keeps no log-probabilities and whose backward
  // writes the logits' gradient alone. Not under tensor parallel, whose loss is vocab-parallel.
  bool fused_loss = false;
};

// Ranks of each kind; tensor parallel with sequence and loss parallel (chapter 6's plan).
struct LayoutSizes {
  DataParallelKind data_parallel = DataParallelKind::fsdp;
  std::int64_t data_parallel_ranks = 1;  // FSDP (or DP for ddp/zero) ranks: FSDP x CP under context parallel
  std::int64_t tp = 1;
  std::int64_t cp = 1;         // context parallel: the ranks each sequence is split over
  bool cp_gathers_kv = false;  // --cp-rotate allgather (else the ring)
};

// Bytes one RMSNorm keeps per token for backward (see the header comment).
constexpr double norm_activation_bytes_per_token(double h, std::int64_t d, bool fused) {
  return fused ? h * static_cast<double>(d) + 4 : 4 * h + h * static_cast<double>(d);
}

// Bytes one decoder layer keeps per token of this rank (see the header comment).
constexpr double layer_activation_bytes_per_token(const llama::Config& c, std::int64_t tp, std::int64_t d, bool fused) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.q_size()) / tp,
               kv = static_cast<double>(c.kv_size()) / tp, i = static_cast<double>(c.intermediate_size) / tp,
               heads = static_cast<double>(c.num_attention_heads) / tp, bytes = static_cast<double>(d);
  const double norms = 2 * norm_activation_bytes_per_token(h, d, fused) / static_cast<double>(tp);  // SP: shards
  // Qwen3's q/k norms keep their input, rows of head_dim: one rstd per head (fused), or the fp32 copy.
  const double kv_heads = static_cast<double>(c.num_key_value_heads) / tp;
  const auto per_head_norm = [&](double width, double rows) {
    return fused ? width * bytes + 4 * rows : (4 + bytes) * width;
  };
  const double qk_norms = c.qk_norm() ? per_head_norm(q, heads) + per_head_norm(kv, kv_heads) : 0;
  const double attention = (h + 3 * q + 2 * kv) * bytes + 4 * heads + qk_norms;
  const double mlp = (h + (fused ? 3 : 4) * i) * bytes;
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
  return {.layer = rows(q, h) + 2 * rows(kv, h) + rows(h, q)                 // q, k, v (colwise), o (rowwise)
                   + 2 * rows(i, h) + rows(h, i)                             // gate, up (colwise), down (rowwise)
                   + 2 * rows(h, 1)                                          // the two norms
                   + (c.qk_norm() ? 2 * rows(c.resolved_head_dim(), 1) : 0)  // Qwen3's q/k norms, whole under TP
                   + (c.qkv_bias() ? rows(q, 1) + 2 * rows(kv, 1) : 0),      // Qwen2's q/k/v biases, colwise
          .embedding = rows(vocab, h),
          .head = c.tie_word_embeddings ? 0 : rows(vocab, h),
          .final_norm = rows(h, 1)};
}

// What a rank holds, by part: each event of the timeline carries every part's live bytes.
enum class MemoryPart : std::size_t { trained_state, gathered, reductions, activations, loss, working };
inline constexpr std::size_t memory_part_count = 6;
inline constexpr std::array<std::string_view, memory_part_count> memory_part_names{
    "weights, gradients, AdamW", "gathered units", "gradients being reduced", "activations", "loss",
    "working set at once"};

// One moment of a training step: what just happened and what the rank's device holds after it.
struct MemoryEvent {
  std::string_view what;    // "forward: ...", "backward: ...", or the step's own ("optimizer step")
  std::int64_t layer = -1;  // the decoder layer whose forward or backward it belongs to; -1 for none
  std::array<double, memory_part_count> parts{};  // live bytes after the event, by MemoryPart
  constexpr double operator[](MemoryPart part) const { return parts[static_cast<std::size_t>(part)]; }
  constexpr double live() const {
    double sum = 0;
    for (const double bytes : parts) sum += bytes;
    return sum;
  }
};

struct MemoryEstimate {
  // The parts' sizes (bytes per rank), each on its own: the trained state wherever it lives...
  double weights = 0, gradients = 0, optimizer = 0;  // on the device
  double host = 0;                                   // offloaded trained state (or AdamW's part of it)
  // ... and what a step adds, each part at its largest over the step's timeline (not all at the
  // same moment): MemoryPart's gathered, reductions, activations, loss and working.
  double gathered = 0, reductions = 0;
  double activations = 0, loss = 0, backward_peak = 0;
  // From the timeline (memory_timeline): what the device holds when the step starts (the
  // trained state there) and when its forward ends, and the event after which it holds the
  // most, with what that is.
  double start = 0, after_forward = 0;
  MemoryEvent at_peak;
  constexpr double trained_state() const { return weights + gradients + optimizer; }
  // The step's peak: the most the device holds at one moment, not the sum of the parts, which do
  // not all live at once (backward frees a layer's activations as it makes its gradients).
  constexpr double peak() const { return at_peak.live(); }
  // What the step holds at its peak on top of what it started with.
  constexpr double step_peak() const { return peak() - start; }
};

namespace memory_detail {

// The trained state's parts (weights, gradients, optimizer, host) of estimate_memory.
constexpr MemoryEstimate trained_state(const llama::Config& c, LayoutSizes layout, RunShape run) {
  MemoryEstimate m;
  const auto counts = c.parameter_counts().value_or(llama::Config::ParameterCounts{});
  const double n = static_cast<double>(layout.data_parallel_ranks);
  const double state = static_cast<double>(run.state_bytes);
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
  return m;
}

// One FSDP unit's buffers in bytes (FsdpUnit, parallel/fsdp_unit.hpp). All-gather: the shard cast
// to the compute dtype or copied from the host (`input`; none when the shard already is that)
// into a buffer of every rank's padded shard (`gathered`), copied out into the full weights (the
// same size) before the buffer is freed. Reduce-scatter: autograd's full gradients in the
// compute dtype, packed into the send buffer (every rank's padded block) in the reduce dtype
// (fp32, parallelize's fsdp_options), cast as they are packed; the output is this
// rank's block, which lands as the shard's gradient in the shards' dtype (host memory with
// cpu_offload).
struct UnitBytes {
  double gathered = 0, input = 0, full_gradients = 0, send = 0, output = 0, landed = 0;
};

// Everything the timeline adds and removes, in bytes per rank, from the config and the run.
struct StepBytes {
  std::int64_t layers = 0;
  bool fsdp = false, cpu_offload = false, optimizer_in_backward = false, reshard_after_forward = true;
  bool gradients_throughout = false;  // DDP's Reducer (DDP, ZeRO-1 on n > 1): its buckets are the gradients
  bool gradient_shards = false;       // ZeRO-2 on n > 1: each gradient reduce-scattered into its rows at once
  std::int64_t prefetch = 0, in_flight = 0, checkpoint_every = 0;
  bool chunked_loss = false;
  double start = 0;  // the trained state on the device when the step starts
  UnitBytes layer_unit, root_unit;
  // Without FSDP: the gradients autograd accumulates (the parameters' dtype), whole and as ZeRO-2's rows.
  double layer_gradients = 0, layer_gradient_shard = 0;
  // The root's gradients (FSDP: autograd's full ones, waiting for the root's reduce-scatter).
  double head_gradient = 0, head_gradient_shard = 0;  // the loss's output weight's (the embedding's when tied)
  double embedding_gradient = 0, embedding_gradient_shard = 0;  // untied only: tied accumulates into the head's
  double final_norm_gradient = 0;
  // Activations and the loss.
  double per_layer = 0, layer_input = 0, final_norm = 0, head_input = 0;
  double loss_kept = 0, rows_gradient = 0, loss_forward_working = 0, loss_backward_working = 0;
  double layer_working = 0;
};

constexpr StepBytes step_bytes(const llama::Config& c, LayoutSizes layout, RunShape run) {
  StepBytes b;
  const auto counts = c.parameter_counts().value_or(llama::Config::ParameterCounts{});
  const double tp = static_cast<double>(layout.tp), n = static_cast<double>(layout.data_parallel_ranks);
  const double s = static_cast<double>(run.state_bytes), d = static_cast<double>(run.compute_bytes);
  constexpr double reduce = 4;  // FSDP reduces in fp32 (parallelize's fsdp_options)
  const auto rank_parameters = tp_rank_parameters(counts, layout.tp);
  const auto shard = largest_row_shards(c, layout.tp, layout.data_parallel_ranks);
  b.layers = c.num_hidden_layers;
  b.fsdp = layout.data_parallel == DataParallelKind::fsdp;
  b.cpu_offload = b.fsdp && run.cpu_offload;
  b.optimizer_in_backward = b.fsdp && run.optimizer_in_backward;
  b.reshard_after_forward = run.reshard_after_forward;
  b.gradients_throughout = !b.fsdp && layout.data_parallel != DataParallelKind::zero2 && n > 1;
  b.gradient_shards = layout.data_parallel == DataParallelKind::zero2 && n > 1;
  b.prefetch = std::max<std::int64_t>(run.prefetch_layers, 0);
  b.in_flight = std::max<std::int64_t>(run.reduce_scatters_in_flight, 0);
  b.checkpoint_every = run.checkpoint_every;

  const auto unit = [&](double full, double shard_numel) {
    UnitBytes u;
    u.gathered = n * shard_numel * d;
    u.input = (s != d || b.cpu_offload) ? shard_numel * d : 0;
    u.full_gradients = full * d;
    u.send = n * shard_numel * reduce;
    u.output = shard_numel * reduce;
    u.landed = b.cpu_offload ? 0 : shard_numel * s;
    return u;
  };
  b.layer_unit = unit(static_cast<double>(rank_parameters.layer), static_cast<double>(shard.layer));
  b.root_unit = unit(static_cast<double>(rank_parameters.root()), static_cast<double>(shard.root()));

  // Gradients: FSDP's in the compute dtype (autograd's, of the gathered weights), else in the
  // parameters' (the trained state's).
  const double g = b.fsdp ? d : s;
  const bool tied = counts.head == 0;
  b.layer_gradients = static_cast<double>(rank_parameters.layer) * s;
  b.layer_gradient_shard = static_cast<double>(shard.layer) * s;
  b.head_gradient = static_cast<double>(tied ? rank_parameters.embedding : rank_parameters.head) * g;
  b.head_gradient_shard = static_cast<double>(tied ? shard.embedding : shard.head) * s;
  b.embedding_gradient = tied ? 0 : static_cast<double>(rank_parameters.embedding) * g;
  b.embedding_gradient_shard = tied ? 0 : static_cast<double>(shard.embedding) * s;
  b.final_norm_gradient = static_cast<double>(rank_parameters.final_norm) * g;

  // Activations of the tokens this rank computes (1/CP of each sequence under context parallel).
  const double tokens = static_cast<double>(run.batch) * static_cast<double>(run.seq) / static_cast<double>(layout.cp);
  const double h = static_cast<double>(c.hidden_size);
  b.per_layer = layer_activation_bytes_per_token(c, layout.tp, run.compute_bytes, run.fused_kernels) * tokens;
  if (layout.cp > 1 && layout.cp_gathers_kv)  // the other ranks' keys and values, kept for backward
    b.per_layer += 2 * static_cast<double>(c.kv_size()) / tp * d * tokens * static_cast<double>(layout.cp - 1);
  b.layer_input = h * d * tokens / tp;  // what a checkpointed layer keeps (a sequence shard)
  b.final_norm = norm_activation_bytes_per_token(h, run.compute_bytes, run.fused_kernels) * tokens / tp;  // SP: a shard
  // While a layer's backward runs: the gradients of its largest activations.
  b.layer_working = (h + 2 * static_cast<double>(c.intermediate_size) / tp) * d * tokens;

  // The loss: vocab-parallel logits under TP (loss parallel), over the rows the head gathers whole.
  const double vocab = static_cast<double>(c.vocab_size) / tp;
  const std::int64_t rows = run.batch * run.seq / layout.cp;
  const std::int64_t chunk = loss_chunk_positions(run.loss_chunk, rows, static_cast<std::int64_t>(vocab));
  b.chunked_loss = chunk < rows;
  b.rows_gradient = h * d * tokens;
  const bool fused_loss = run.fused_loss && tp == 1;
  if (!b.chunked_loss) {
    b.head_input = h * d * tokens;  // at::linear saves the final norm's output
    // log_softmax's output, fp32 (fused: the fp32 logits themselves, and two floats a row).
    b.loss_kept = 4 * vocab * tokens;
    // Forward: the logits, their fp32 copy (cross_entropy_sum's .to(kFloat), none in fp32) and
    // log_softmax's output at once; backward: its gradient and the logits' gradient (fused: the
    // logits' gradient alone).
    b.loss_forward_working = (d + (d != 4 ? 4 : 0)) * vocab * tokens;
    b.loss_backward_working = (fused_loss ? 1 : 2) * 4 * vocab * tokens;
  } else {
    // ChunkedLinearLoss keeps the gradients of the rows and of the output weight from forward;
    // each chunk's logits, log-probabilities and gradient live only while it runs (fused: no
    // log-probabilities, but below fp32 the logits and their gradient in d bytes beside the fp32 ones).
    b.loss_kept = b.rows_gradient + b.head_gradient;
    const double chunk_bytes_per_logit = fused_loss ? 2 * 4 + (d != 4 ? 2 * d : 0) : 3 * 4;
    b.loss_forward_working = chunk_bytes_per_logit * vocab * static_cast<double>(chunk);
  }

  // The trained state on the device when the step starts: the weights, AdamW's state, and the
  // gradients where DDP's buckets keep them across steps (elsewhere zero_grad freed them).
  const auto state = trained_state(c, layout, run);
  b.start = state.weights + state.optimizer + (b.gradients_throughout ? state.gradients : 0);
  return b;
}

}  // namespace memory_detail

// The timeline of one training step (one micro-batch) on one rank: visit(event) after each event,
// in the order they happen, with the live bytes by part. The order is the code's:
//   FSDP (parallel/fsdp_schedule.hpp, fsdp_unit.hpp, parallelize.hpp): the root's pre-forward
//     gathers it and issues the first prefetch_layers layers' all-gathers; each layer's pre-forward
//     gathers its weights (its all-gather waited for and copied out into the full weights, then its
//     buffer freed), after issuing the all-gather of the layer prefetch_layers ahead; its post-forward
//     frees them, except the last layer's, which parallelize keeps for backward, which starts with
//     it. In backward each other layer's pre-backward (the gradient of its output) gathers it again
//     and issues the all-gathers of the prefetch_layers layers before it; once autograd has all of
//     a unit's gradients its post-backward, in FSDP2's order, first waits for the oldest
//     reduce-scatters until fewer than reduce_scatters_in_flight are in flight (their send buffers
//     freed), frees the full weights, and only then issues its own into a new send buffer, casting
//     each gradient to fp32 as it is packed; autograd frees the full gradients when that returns. The root's gradients
//     (the output weight's from the loss, the final norm's, the embedding's last) wait in autograd
//     until the embedding's arrive at the end of backward. Backward's final callback waits for
//     the reduce-scatters left.
//   Activations (the header comment): a layer's are saved in its forward (a checkpointed layer's
//     input only); in backward a checkpointed layer is recomputed, then the layer's backward runs
//     (its working set) and frees them as it makes the weights' gradients; a checkpointed layer's
//     input is freed when its recomputation's backward, the reduce-scatter included, is done.
//   The loss (models/llama/model.hpp, chunked_loss.hpp): the whole loss keeps log_softmax's fp32
//     output; the chunked one computes the gradients of the rows and the output weight in
//     forward, chunk by chunk, keeps them, and backward scales them into new tensors.
//   Without FSDP the gradients accumulate as autograd makes them, into DDP's buckets (allocated
//   across steps on more than one rank), ZeRO-2's rows, or the parameters' .grad; zero_grad
//   frees them after the optimizer's step (AdamW's fused kernel: no temporaries).
template <class Visit>
constexpr void for_each_memory_event(const llama::Config& c, LayoutSizes layout, RunShape run, Visit&& visit) {
  const memory_detail::StepBytes b = memory_detail::step_bytes(c, layout, run);
  MemoryEvent now;
  using enum MemoryPart;
  const auto add = [&](MemoryPart part, double bytes) { now.parts[static_cast<std::size_t>(part)] += bytes; };
  const auto event = [&](std::string_view what, std::int64_t layer) {
    now.what = what;
    now.layer = layer;
    visit(static_cast<const MemoryEvent&>(now));
  };
  const std::int64_t L = b.layers;
  const auto checkpointed = [&](std::int64_t i) { return b.checkpoint_every > 0 && i % b.checkpoint_every == 0; };
  // parallelize keeps the last layer gathered from its forward to its backward.
  const auto reshards = [&](std::int64_t i) { return b.reshard_after_forward && i != L - 1; };
  // Gradients outside FSDP: into DDP's buckets (already there), ZeRO-2's rows, or .grad.
  double device_gradients = 0;
  const auto gradient = [&](double whole, double rows) {
    if (b.gradients_throughout) return;
    const double bytes = b.gradient_shards ? rows : whole;
    add(trained_state, bytes);
    device_gradients += bytes;
  };
  // FSDP's reduce-scatters, in the order backward issues them: layers L-1 ... 0, then the root.
  std::int64_t issued = 0, finished = 0;
  const auto unit_of = [&](std::int64_t position) -> const memory_detail::UnitBytes& {
    return position == L ? b.root_unit : b.layer_unit;
  };
  const auto finish_oldest = [&](std::int64_t layer) {
    const auto& u = unit_of(finished++);
    add(reductions, -(u.send + u.output));
    add(trained_state, u.landed);
    device_gradients += u.landed;
    event("backward: the oldest reduce-scatter waited for, its gradients landed", layer);
    if (b.optimizer_in_backward && u.landed > 0) {
      add(trained_state, -u.landed);
      device_gradients -= u.landed;
      event("backward: AdamW stepped that unit and freed its gradients", layer);
    }
  };
  const auto reduce_scatter = [&](const memory_detail::UnitBytes& u, std::int64_t layer) {
    const bool root = layer < 0;
    if (b.in_flight > 0)
      while (issued - finished >= b.in_flight) finish_oldest(layer);
    add(gathered, -u.gathered);
    event(root ? "backward: the root's weights freed" : "backward: its weights freed", layer);
    add(reductions, u.send + u.output);
    ++issued;
    event(root ? "backward: the root's reduce-scatter issued" : "backward: its reduce-scatter issued", layer);
    while (issued - finished > b.in_flight) finish_oldest(layer);  // none in flight: waited at once
  };

  now.parts[static_cast<std::size_t>(trained_state)] = b.start;
  event("step starts: the trained state on the device", -1);

  // Forward. The root's pre-forward wraps the whole model: it gathers the root and issues the
  // first layers' all-gathers, which run while the root's gather is copied out.
  std::int64_t forward_issued = 0;  // layers 0 .. forward_issued-1 have their all-gather issued
  const auto& lu = b.layer_unit;
  const auto& ru = b.root_unit;
  if (b.fsdp) {
    add(gathered, ru.gathered + ru.input);
    event("forward: the root's all-gather issued", -1);
    for (; forward_issued < std::min(b.prefetch, L); ++forward_issued) {
      add(gathered, lu.gathered + lu.input);
      event("forward: a first layer's all-gather issued (prefetch)", -1);
    }
    add(gathered, ru.gathered);
    event("forward: the root's weights gathered", -1);
    add(gathered, -(ru.gathered + ru.input));
    event("forward: the root's all-gather buffer freed", -1);
  }
  for (std::int64_t i = 0; i < L; ++i) {
    if (b.fsdp) {
      if (forward_issued <= i) {
        add(gathered, lu.gathered + lu.input);
        forward_issued = i + 1;
        event("forward: its all-gather issued", i);
      }
      for (; forward_issued <= std::min(i + b.prefetch, L - 1); ++forward_issued) {
        add(gathered, lu.gathered + lu.input);
        event("forward: a later layer's all-gather issued (prefetch)", i);
      }
      add(gathered, lu.gathered);
      event("forward: its weights gathered", i);
      add(gathered, -(lu.gathered + lu.input));
      event("forward: its all-gather buffer freed", i);
    }
    if (checkpointed(i)) {
      add(activations, b.layer_input);
      event("forward: its input saved (checkpointed)", i);
    } else {
      add(activations, b.per_layer);
      event("forward: its activations saved", i);
    }
    if (b.fsdp && reshards(i)) {
      add(gathered, -lu.gathered);
      event("forward: its weights freed", i);
    }
  }
  add(activations, b.final_norm + b.head_input);
  event("forward: the final norm's activations saved", -1);
  add(working, b.loss_forward_working);
  event(b.chunked_loss ? "forward: the loss, one chunk's logits and their gradients at a time"
                       : "forward: the loss's logits, in fp32 and log-softmaxed",
        -1);
  add(working, -b.loss_forward_working);
  add(loss, b.loss_kept);
  event(b.chunked_loss ? "forward: the loss's gradients of the rows and the output weight kept"
                       : "forward: the loss's fp32 log-probabilities kept",
        -1);

  // Backward: the loss, then the final norm. The output weight's gradient is the root's: with
  // FSDP it waits for the root's reduce-scatter at the end; without, it is the weight's .grad.
  const auto head_gradient = [&] {
    if (b.fsdp)
      add(loss, b.head_gradient);
    else
      gradient(b.head_gradient, b.head_gradient_shard);
  };
  if (b.chunked_loss) {
    add(loss, b.rows_gradient);
    head_gradient();
    event("backward: the loss's kept gradients scaled into new ones", -1);
    add(loss, -b.loss_kept);
    event("backward: the loss's kept gradients freed", -1);
  } else {
    add(working, b.loss_backward_working);
    event("backward: the loss's gradient and the logits'", -1);
    add(working, -b.loss_backward_working);
    add(loss, b.rows_gradient - b.loss_kept);
    add(activations, -b.head_input);
    head_gradient();
    event("backward: the output projection's gradients (the log-probabilities freed)", -1);
  }
  add(activations, -b.final_norm);
  add(loss, -b.rows_gradient);
  if (b.fsdp)
    add(reductions, b.final_norm_gradient);
  else
    gradient(b.final_norm_gradient, 0);
  event("backward: the final norm's gradients (its activations freed)", -1);

  std::int64_t backward_issued = L;  // layers backward_issued .. L-1 have their backward all-gather issued
  for (std::int64_t i = L - 1; i >= 0; --i) {
    if (b.fsdp && reshards(i)) {
      // The pre-backward hook: gather this layer unless a later one prefetched it, and prefetch.
      if (backward_issued > i) {
        add(gathered, lu.gathered + lu.input);
        backward_issued = i;
        event("backward: its all-gather issued", i);
      }
      for (; backward_issued > std::max<std::int64_t>(i - b.prefetch, 0);) {
        --backward_issued;
        add(gathered, lu.gathered + lu.input);
        event("backward: an earlier layer's all-gather issued (prefetch)", i);
      }
      add(gathered, lu.gathered);
      event("backward: its weights gathered", i);
      add(gathered, -(lu.gathered + lu.input));
      event("backward: its all-gather buffer freed", i);
    }
    if (checkpointed(i)) {
      add(activations, b.per_layer);
      event("backward: its activations recomputed", i);
    }
    add(working, b.layer_working);
    event("backward: its working set", i);
    add(working, -b.layer_working);
    add(activations, -b.per_layer);
    if (b.fsdp)
      add(reductions, lu.full_gradients);
    else
      gradient(b.layer_gradients, b.layer_gradient_shard);
    event("backward: its weights' gradients (its activations freed)", i);
    if (b.fsdp) {
      reduce_scatter(lu, i);
      add(reductions, -lu.full_gradients);
      event("backward: its full gradients freed", i);
    }
    if (checkpointed(i)) {
      add(activations, -b.layer_input);
      event("backward: its input freed (checkpointed)", i);
    }
  }

  // The embedding's gradient completes the root's: with FSDP its reduce-scatter follows.
  if (b.fsdp)
    add(reductions, b.embedding_gradient);
  else
    gradient(b.embedding_gradient, b.embedding_gradient_shard);
  event("backward: the embedding's gradient", -1);
  if (b.fsdp) {
    reduce_scatter(ru, -1);
    add(loss, -b.head_gradient);
    add(reductions, -(b.final_norm_gradient + b.embedding_gradient));
    event("backward: the root's full gradients freed", -1);
    while (finished < issued) finish_oldest(-1);  // backward's final callback
  }
  event("optimizer step", -1);
  add(trained_state, -device_gradients);
  event("zero_grad: the gradients freed", -1);
}

// The timeline as a list (constexpr: a transient vector, e.g. memory_timeline(...).size()).
constexpr std::vector<MemoryEvent> memory_timeline(const llama::Config& c, LayoutSizes layout, RunShape run) {
  std::vector<MemoryEvent> events;
  for_each_memory_event(c, layout, run, [&](const MemoryEvent& e) { events.push_back(e); });
  return events;
}

// The parts' sizes, and the peak from the timeline.
constexpr MemoryEstimate estimate_memory(const llama::Config& c, LayoutSizes layout, RunShape run) {
  MemoryEstimate m = memory_detail::trained_state(c, layout, run);

  // What a step adds, each part at its largest over the timeline, and the timeline's peak.
  bool first = true, in_backward = false;
  double before = 0;
  for_each_memory_event(c, layout, run, [&](const MemoryEvent& e) {
    using enum MemoryPart;
    if (first) m.start = e.live();
    if (first || e.live() > m.at_peak.live()) m.at_peak = e;
    if (!in_backward && e.what.starts_with("backward")) m.after_forward = before, in_backward = true;
    before = e.live();
    m.gathered = std::max(m.gathered, e[gathered]);
    m.reductions = std::max(m.reductions, e[reductions]);
    m.activations = std::max(m.activations, e[activations]);
    m.loss = std::max(m.loss, e[loss]);
    m.backward_peak = std::max(m.backward_peak, e[working]);
    first = false;
  });
  return m;
}

}  // namespace meshtorch::llama
