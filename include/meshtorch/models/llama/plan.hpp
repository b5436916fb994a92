#pragma once
// meshtorch::llama::Plan<Mesh, Preset, Styles>: how a Llama model is split over a mesh, generated
// from the mesh type and checked at compile time. No LibTorch here: parallel/tensor_parallel.hpp
// applies a plan to a model.
//
//   Plan<Mesh<DP<dynamic>, TP<4>>>                            config known at run time: validate(config)
//   Plan<Mesh<FSDP<dynamic>, TP<8>>, presets::llama_3_1_70b>  TP 8 must divide the model: checked now
//
// Styles gives one ParallelStyle per module role of a decoder block and of the model around it
// (HF's module names). The decoder block's dataflow is checked here, each module's output
// placement against the next one's input: a plan whose residual stream placements disagree does
// not compile, and the message names the module.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/parallel_style.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

// The guide's chapter-6 plan (torchtitan's): sequence-parallel norms, the residual stream sharded
// along the sequence, attention and MLP inputs gathered once per block, the embedding sharded
// over the vocabulary (RowwiseParallel, as torchtitan does: its partial sums reduce-scatter
// straight into sequence shards), and loss parallel (logits stay sharded over the vocabulary).
struct SequenceParallelStyles {
  using embed_tokens = RowwiseParallel<Replicate, Shard<1>>;
  using input_layernorm = SequenceParallel<1>;
  using self_attn = PrepareModuleInput<Shard<1>, Replicate>;
  using q_proj = ColwiseParallel<>;
  using k_proj = ColwiseParallel<>;
  using v_proj = ColwiseParallel<>;
  using o_proj = RowwiseParallel<Shard<-1>, Shard<1>>;
  using post_attention_layernorm = SequenceParallel<1>;
  using mlp = PrepareModuleInput<Shard<1>, Replicate>;
  using gate_proj = ColwiseParallel<>;
  using up_proj = ColwiseParallel<>;
  using down_proj = RowwiseParallel<Shard<-1>, Shard<1>>;
  using norm = SequenceParallel<1>;
  using lm_head = ColwiseParallel<Shard<1>, Shard<-1>>;
};

// Megatron-LM's tensor parallel without sequence parallel: replicated activations between blocks
// (norms computed redundantly), one all-reduce after attention and one after the MLP.
struct TensorParallelStyles {
  using embed_tokens = RowwiseParallel<Replicate, Replicate>;
  using input_layernorm = NoParallel;
  using self_attn = PrepareModuleInput<Replicate, Replicate>;
  using q_proj = ColwiseParallel<>;
  using k_proj = ColwiseParallel<>;
  using v_proj = ColwiseParallel<>;
  using o_proj = RowwiseParallel<Shard<-1>, Replicate>;
  using post_attention_layernorm = NoParallel;
  using mlp = PrepareModuleInput<Replicate, Replicate>;
  using gate_proj = ColwiseParallel<>;
  using up_proj = ColwiseParallel<>;
  using down_proj = RowwiseParallel<Shard<-1>, Replicate>;
  using norm = NoParallel;
  using lm_head = ColwiseParallel<Replicate, Replicate>;
};

// No tensor parallelism (a mesh without a TP axis).
struct NoTensorParallelStyles {
  using embed_tokens = NoParallel;
  using input_layernorm = NoParallel;
  using self_attn = NoParallel;
  using q_proj = NoParallel;
  using k_proj = NoParallel;
  using v_proj = NoParallel;
  using o_proj = NoParallel;
  using post_attention_layernorm = NoParallel;
  using mlp = NoParallel;
  using gate_proj = NoParallel;
  using up_proj = NoParallel;
  using down_proj = NoParallel;
  using norm = NoParallel;
  using lm_head = NoParallel;
};

// A module role of the Llama model (HF's module name) and the style a plan gives it.
template <std::size_t N>
struct RoleName {
  char text[N]{};
  constexpr RoleName(const char (&name)[N]) {
    for (std::size_t i = 0; i < N; ++i) text[i] = name[i];
  }
  constexpr std::string_view view() const { return {text, N - 1}; }
};

template <RoleName Name, class Style>
struct Role {
  static constexpr std::string_view name = Name.view();
  using style = Style;
};

// The one list of the model's module roles, in dataflow order: what a styles struct must
// define, what describe() prints and what for_each_role() visits.
template <class S>
using LlamaRoles = std::tuple<
    Role<"embed_tokens", typename S::embed_tokens>, Role<"input_layernorm", typename S::input_layernorm>,
    Role<"self_attn", typename S::self_attn>, Role<"q_proj", typename S::q_proj>, Role<"k_proj", typename S::k_proj>,
    Role<"v_proj", typename S::v_proj>, Role<"o_proj", typename S::o_proj>,
    Role<"post_attention_layernorm", typename S::post_attention_layernorm>, Role<"mlp", typename S::mlp>,
    Role<"gate_proj", typename S::gate_proj>, Role<"up_proj", typename S::up_proj>,
    Role<"down_proj", typename S::down_proj>, Role<"norm", typename S::norm>, Role<"lm_head", typename S::lm_head>>;

namespace detail {
template <class Roles>
struct AllStyles;
template <class... R>
struct AllStyles<std::tuple<R...>> : std::bool_constant<(ParallelStyle<typename R::style> && ...)> {};
}  // namespace detail

template <class S>
concept LlamaStyles = requires {
  typename LlamaRoles<S>;
}
&&detail::AllStyles<LlamaRoles<S>>::value;

// Calls f.template operator()<Role>() for every role of S, in dataflow order.
template <LlamaStyles S, class F>
constexpr void for_each_role(F&& f) {
  [&]<class... R>(std::tuple<R...>*) { (f.template operator()<R>(), ...); }(static_cast<LlamaRoles<S>*>(nullptr));
}

namespace detail {

template <class A, class B>
inline constexpr bool same_placement = std::is_same_v<A, B>;

// What a module that is a container (self_attn, mlp) hands its children: the prepared input, or
// its input unchanged.
template <class Style>
using handed_to_children = typename Style::output;

// The decoder block's dataflow, checked in order:
//   embed_tokens -> [input_layernorm -> self_attn(q,k,v -> o) -> +residual
//                    -> post_attention_layernorm -> mlp(gate,up -> down) -> +residual] -> norm -> lm_head
template <LlamaStyles S>
consteval bool check_dataflow() {
  using stream = typename S::embed_tokens::output;  // the residual stream between blocks
  static_assert(same_placement<typename S::input_layernorm::input, stream>,
                "Llama plan: input_layernorm's input placement differs from the residual stream's "
                "(embed_tokens' output); use SequenceParallel<1> norms with a Shard<1> stream, NoParallel with "
                "a Replicate one");
  static_assert(same_placement<typename S::self_attn::input, typename S::input_layernorm::output>,
                "Llama plan: self_attn's input placement differs from input_layernorm's output; give self_attn "
                "PrepareModuleInput<(the norm's output), Replicate>");
  using attention_in = handed_to_children<typename S::self_attn>;
  static_assert(same_placement<typename S::q_proj::input, attention_in> &&
                    same_placement<typename S::k_proj::input, attention_in> &&
                    same_placement<typename S::v_proj::input, attention_in>,
                "Llama plan: q_proj, k_proj and v_proj must accept what self_attn hands them (its "
                "PrepareModuleInput's second placement)");
  static_assert(same_placement<typename S::q_proj::output, typename S::k_proj::output> &&
                    same_placement<typename S::q_proj::output, typename S::v_proj::output>,
                "Llama plan: q_proj, k_proj and v_proj must return the same placement: attention pairs each "
                "query head with its key and value heads on the same rank");
  static_assert(same_placement<typename S::o_proj::input, typename S::q_proj::output>,
                "Llama plan: o_proj's input placement differs from the attention heads' (q_proj's output); "
                "ColwiseParallel q/k/v need RowwiseParallel<Shard<-1>, ...> o_proj");
  static_assert(same_placement<typename S::o_proj::output, stream>,
                "Llama plan: self_attn.o_proj's output placement differs from the residual stream's "
                "(embed_tokens' output), so the residual add would mix layouts; with SequenceParallel norms use "
                "RowwiseParallel<Shard<-1>, Shard<1>>, with NoParallel norms RowwiseParallel<Shard<-1>, Replicate>");
  static_assert(same_placement<typename S::post_attention_layernorm::input, stream>,
                "Llama plan: post_attention_layernorm's input placement differs from the residual stream's");
  static_assert(same_placement<typename S::mlp::input, typename S::post_attention_layernorm::output>,
                "Llama plan: mlp's input placement differs from post_attention_layernorm's output; give mlp "
                "PrepareModuleInput<(the norm's output), Replicate>");
  using mlp_in = handed_to_children<typename S::mlp>;
  static_assert(
      same_placement<typename S::gate_proj::input, mlp_in> && same_placement<typename S::up_proj::input, mlp_in>,
      "Llama plan: gate_proj and up_proj must accept what mlp hands them");
  static_assert(same_placement<typename S::gate_proj::output, typename S::up_proj::output>,
                "Llama plan: gate_proj and up_proj must return the same placement (they are multiplied "
                "element-wise)");
  static_assert(same_placement<typename S::down_proj::input, typename S::gate_proj::output>,
                "Llama plan: down_proj's input placement differs from gate_proj's output");
  static_assert(same_placement<typename S::down_proj::output, stream>,
                "Llama plan: mlp.down_proj's output placement differs from the residual stream's "
                "(embed_tokens' output), so the residual add would mix layouts");
  static_assert(same_placement<typename S::norm::input, stream>,
                "Llama plan: the final norm's input placement differs from the residual stream's");
  static_assert(same_placement<typename S::lm_head::input, typename S::norm::output>,
                "Llama plan: lm_head's input placement differs from the final norm's output");
  return true;
}

// Whether a module's weight is sharded over the vocabulary (the tied embedding/head case).
template <class EmbeddingStyle>
inline constexpr bool embedding_shards_vocab = RowwiseStyle<EmbeddingStyle>;
template <class HeadStyle>
inline constexpr bool head_shards_vocab = ColwiseStyle<HeadStyle>;

template <LlamaStyles S>
inline constexpr bool shards_anything =
    !(std::is_same_v<typename S::q_proj, NoParallel> && std::is_same_v<typename S::gate_proj, NoParallel> &&
      std::is_same_v<typename S::embed_tokens, NoParallel> && std::is_same_v<typename S::lm_head, NoParallel>);

struct RunTimeConfig {};

}  // namespace detail

// What can keep a TP size from sharding a model under a plan. The rules live in tp_problem()
// alone; Plan checks them at compile time for presets and at run time for loaded configs.
enum class TpProblem {
  none,
  attention_heads,
  key_value_heads,
  intermediate_size,
  vocab_size,
  hidden_size,
  tied_embeddings
};

constexpr std::string_view to_message(TpProblem p) {
  switch (p) {
    case TpProblem::none:
      return "";
    case TpProblem::attention_heads:
      return "num_attention_heads is not divisible by the TP size";
    case TpProblem::key_value_heads:
      return "num_key_value_heads is not divisible by the TP size";
    case TpProblem::intermediate_size:
      return "intermediate_size is not divisible by the TP size";
    case TpProblem::vocab_size:
      return "vocab_size is not divisible by the TP size (pad the vocabulary to a multiple of it)";
    case TpProblem::hidden_size:
      return "hidden_size is not divisible by the TP size";
    case TpProblem::tied_embeddings:
      return "tie_word_embeddings: embed_tokens and lm_head share one matrix, so both or neither must shard the "
             "vocabulary (RowwiseParallel embedding with ColwiseParallel lm_head)";
  }
  return "?";
}

template <LlamaStyles S>
constexpr TpProblem tp_problem(const Config& c, std::int64_t tp) {
  if (c.tie_word_embeddings &&
      detail::embedding_shards_vocab<typename S::embed_tokens> != detail::head_shards_vocab<typename S::lm_head>)
    return TpProblem::tied_embeddings;
  if (tp <= 1) return TpProblem::none;
  if (!std::is_same_v<typename S::q_proj, NoParallel> && c.num_attention_heads % tp != 0)
    return TpProblem::attention_heads;
  if (!std::is_same_v<typename S::k_proj, NoParallel> && c.num_key_value_heads % tp != 0)
    return TpProblem::key_value_heads;
  if (!std::is_same_v<typename S::gate_proj, NoParallel> && c.intermediate_size % tp != 0)
    return TpProblem::intermediate_size;
  if ((detail::embedding_shards_vocab<typename S::embed_tokens> ||
       detail::head_shards_vocab<typename S::lm_head>)&&c.vocab_size %
          tp !=
      0)
    return TpProblem::vocab_size;
  if (ColwiseStyle<typename S::embed_tokens> && c.hidden_size % tp != 0) return TpProblem::hidden_size;
  return TpProblem::none;
}

// The problem as text, or nothing.
template <LlamaStyles S>
constexpr std::optional<std::string_view> first_tp_problem(const Config& c, std::int64_t tp) {
  const TpProblem p = tp_problem<S>(c, tp);
  if (p == TpProblem::none) return std::nullopt;
  return to_message(p);
}

// The styles a mesh gets unless told otherwise: the guide's sequence-parallel plan where there is
// a TP axis, none where there is not.
template <MeshType M>
using default_styles = std::conditional_t<M::template has<TP>, SequenceParallelStyles, NoTensorParallelStyles>;

namespace detail {
template <class A>
inline constexpr bool wrapped_axis =
    is_axis_of_kind<A, DP> || is_axis_of_kind<A, FSDP> || is_axis_of_kind<A, CP> || is_axis_of_kind<A, TP>;
template <class M>
struct AllAxesWrapped;
template <class... Axes>
struct AllAxesWrapped<Mesh<Axes...>> : std::bool_constant<(wrapped_axis<Axes> && ...)> {};
template <class A>
inline constexpr bool pipelined_axis = is_axis_of_kind<A, DP> || is_axis_of_kind<A, PP> || is_axis_of_kind<A, FSDP> ||
                                       is_axis_of_kind<A, CP> || is_axis_of_kind<A, TP>;
template <class M>
struct AllAxesPipelined;
template <class... Axes>
struct AllAxesPipelined<Mesh<Axes...>> : std::bool_constant<(pipelined_axis<Axes> && ...)> {};
}  // namespace detail

// What parallelize() can build from a mesh type and a plan's styles, checked when it is named.
template <MeshType M, LlamaStyles Styles>
consteval bool check_parallelizable() {
  static_assert(detail::AllAxesWrapped<M>::value,
                "parallelize: the mesh has an axis that no wrapper applies (parallelize knows DP, FSDP, CP and TP); "
                "remove that axis from the Mesh, or apply its technique yourself");
  static_assert(M::template has<TP> || std::is_same_v<Styles, NoTensorParallelStyles>,
                "parallelize: tensor-parallel styles were given but the mesh has no TP axis; add TP<N> to the Mesh "
                "(e.g. Mesh<DP<2>, FSDP<2>, TP<2>>), or leave the styles to their default");
  return true;
}

// What parallelize() can build for a mesh with a PP axis (PipelineLlama), checked when it is named.
template <MeshType M>
consteval bool check_pipeline_parallelizable() {
  static_assert(M::template has<PP>, "check_pipeline_parallelizable: the mesh has no PP axis");
  static_assert(detail::AllAxesPipelined<M>::value,
                "parallelize: the mesh has an axis that no wrapper applies with PP (parallelize knows DP, FSDP, CP "
                "and TP there); remove that axis from the Mesh");
  return true;
}

namespace detail {

// A role and its style's name, for describe_styles().
struct RoleStyle {
  std::string_view role, style;
};

// The run-time side of Plan's checks and descriptions: compiled once per program, not once per plan.
[[noreturn]] MESHTORCH_DECL void throw_tp_problem(std::string_view source, std::string_view problem,
                                                  std::int64_t tp_size, std::string_view mesh_name);
[[noreturn]] MESHTORCH_DECL void throw_sequence_not_divisible(std::int64_t seq_length, std::int64_t tp_size);
MESHTORCH_DECL std::string describe_roles(std::span<const RoleStyle> roles);
MESHTORCH_DECL std::string describe_plan(std::string_view mesh_name, std::span<const RoleStyle> roles);

}  // namespace detail

template <MeshType M, auto Preset = detail::RunTimeConfig{}, LlamaStyles Styles = SequenceParallelStyles>
struct Plan {
  using mesh_type = M;
  static constexpr bool has_tp = M::template has<TP>;
  using styles = std::conditional_t<has_tp, Styles, NoTensorParallelStyles>;
  // A static_assert, not a member initialiser, so that naming the plan type runs the check.
  static_assert(detail::check_dataflow<styles>());
  // TP's static extent; meshtorch::dynamic when it comes from the world size, 1 without TP.
  static constexpr std::size_t tp_extent = [] {
    if constexpr (has_tp)
      return M::template static_extent<TP>;
    else
      return std::size_t{1};
  }();
  static constexpr bool has_preset = !std::is_same_v<std::remove_cv_t<decltype(Preset)>, detail::RunTimeConfig>;
  static constexpr bool sequence_parallel = SequenceParallelStyle<typename styles::norm>;
  static constexpr bool loss_parallel =
      ColwiseStyle<typename styles::lm_head> && std::is_same_v<typename styles::lm_head::output, Shard<-1>>;

 private:
  static constexpr bool check_preset() {
    if constexpr (has_preset) {
      static_assert(std::is_same_v<std::remove_cv_t<decltype(Preset)>, Config>,
                    "Plan<Mesh, Preset>: Preset must be a constexpr meshtorch::llama::Config, e.g. "
                    "meshtorch::llama::presets::llama_3_1_8b");
      if constexpr (std::is_same_v<std::remove_cv_t<decltype(Preset)>, Config>) {
        static_assert(!first_invalid_field(Preset), "Plan<Mesh, Preset>: the preset config is invalid");
        // One static_assert per problem, so that the compiler prints the one that applies.
        constexpr TpProblem problem =
            tp_problem<styles>(Preset, has_tp && tp_extent != dynamic ? static_cast<std::int64_t>(tp_extent) : 1);
        static_assert(problem != TpProblem::attention_heads,
                      "Plan<Mesh, Preset>: the mesh's TP extent does not divide the model's num_attention_heads; "
                      "choose a TP extent that divides it");
        static_assert(problem != TpProblem::key_value_heads,
                      "Plan<Mesh, Preset>: the mesh's TP extent does not divide the model's num_key_value_heads; "
                      "choose a TP extent that divides it (at most num_key_value_heads)");
        static_assert(problem != TpProblem::intermediate_size,
                      "Plan<Mesh, Preset>: the mesh's TP extent does not divide the model's intermediate_size");
        static_assert(problem != TpProblem::vocab_size,
                      "Plan<Mesh, Preset>: the mesh's TP extent does not divide the model's vocab_size; pad the "
                      "vocabulary to a multiple of it");
        static_assert(problem != TpProblem::hidden_size,
                      "Plan<Mesh, Preset>: the mesh's TP extent does not divide the model's hidden_size");
        static_assert(problem != TpProblem::tied_embeddings,
                      "Plan<Mesh, Preset>: tie_word_embeddings shares one matrix between embed_tokens and lm_head, "
                      "so both or neither must shard the vocabulary");
        // Pipeline stages: the decoder layers, the embedding and the head each count as one layer
        // (torchtitan's input and output weights), and every stage needs at least one.
        if constexpr (M::template has<PP>) {
          constexpr std::size_t stages = M::template static_extent<PP>;
          static_assert(stages == dynamic || Preset.num_hidden_layers + 2 >= static_cast<std::int64_t>(stages),
                        "Plan<Mesh, Preset>: the mesh's PP extent is more pipeline stages than the preset has "
                        "layers (num_hidden_layers, plus the embedding and the head); lower the PP extent or "
                        "choose a deeper model");
        }
      }
    }
    return true;
  }

 public:
  static_assert(check_preset());

  // The run-time check of a config against this plan at a TP size (the resolved extent);
  // throws ConfigError naming the field.
  static void validate(const Config& config, std::int64_t tp_size, std::string_view source = "model config") {
    meshtorch::llama::validate(config, source);
    if (auto problem = first_tp_problem<styles>(config, tp_size))
      detail::throw_tp_problem(source, *problem, tp_size, M::name);
  }
  // The sequence must split evenly over TP when the residual stream is sharded along it.
  static void validate_sequence(std::int64_t seq_length, std::int64_t tp_size) {
    if (sequence_parallel && tp_size > 1 && seq_length % tp_size != 0)
      detail::throw_sequence_not_divisible(seq_length, tp_size);
  }

  // One rank's device memory for a run of the preset on this mesh (models/llama/memory_plan.hpp):
  // FSDP over the FSDP axis (HSDP replicates it over DP), else DDP over DP; extents static.
  //   constexpr double peak = Plan<Mesh<FSDP<64>>, presets::llama_3_1_405b>::peak_bytes(run);
  //   static_assert(peak <= 80 * GiB, "does not fit an 80 GiB GPU");
  // A failed check's note shows both numbers ("the comparison reduces to '(4.6e+11 <= 8.6e+10)'").
  // With CP, each rank computes 1/CP of the positions (the ring's memory) and FSDP shards over
  // FSDP x CP; a run whose sequence does not split (splits_sequence) is not a constant expression,
  // so the compiler stops at the throw below, which names the rule.
  static constexpr MemoryEstimate memory(RunShape run) requires(has_preset&& M::is_static) {
    if (!splits_sequence(run.seq))  // the compiler quotes this line:
      throw std::invalid_argument("Plan::memory: run.seq does not split into 2 x CP equal chunks (sequence_unit())");
    LayoutSizes layout;
    if constexpr (M::template has<FSDP>)
      layout = {DataParallelKind::fsdp, static_cast<std::int64_t>(M::template static_extent<FSDP>)};
    else if constexpr (M::template has<DP>)
      layout = {DataParallelKind::ddp, static_cast<std::int64_t>(M::template static_extent<DP>)};
    layout.tp = static_cast<std::int64_t>(tp_extent);
    layout.cp = static_cast<std::int64_t>(cp_extent);
    layout.data_parallel_ranks *= layout.cp;  // the CP ranks of a replica hold different tokens
    return estimate_memory(Preset, layout, run);
  }

  // CP's static extent, 1 without CP.
  static constexpr std::size_t cp_extent = [] {
    if constexpr (M::template has<CP>)
      return M::template static_extent<CP>;
    else
      return std::size_t{1};
  }();
  // What every sequence length must be a multiple of on this mesh: 2 x CP chunks, each rank's
  // positions split over TP under sequence parallel (cp::sequence_split_problem's rule).
  static constexpr std::int64_t sequence_unit() requires(M::is_static) {
    const std::int64_t tp = sequence_parallel ? static_cast<std::int64_t>(tp_extent) : 1;
    return M::template has<CP> ? cp::sequence_unit(static_cast<std::int64_t>(cp_extent), tp) : tp;
  }
  //   static_assert(Plan<Mesh<FSDP<8>, CP<4>, TP<2>>, presets::llama_3_1_8b>::splits_sequence(131072));
  static constexpr bool splits_sequence(std::int64_t seq_length) requires(M::is_static) {
    return seq_length > 0 && seq_length % sequence_unit() == 0;
  }
  static constexpr double peak_bytes(RunShape run) requires(has_preset&& M::is_static) { return memory(run).peak(); }

  // Every role's name and style's name, in dataflow order: what describe_styles() prints.
  static constexpr auto role_styles = [] {
    std::array<detail::RoleStyle, std::tuple_size_v<LlamaRoles<styles>>> out{};
    std::size_t i = 0;
    for_each_role<styles>([&]<class R>() { out[i++] = {R::name, R::style::name}; });
    return out;
  }();

  // The mesh and every module's style on one line, for logs and for the fingerprint ranks
  // compare at start-up.
  static std::string describe() { return detail::describe_plan(M::name, role_styles); }
  // "embed_tokens=RowwiseParallel<Replicate, Shard<1>> input_layernorm=SequenceParallel<Shard<1>> ..."
  static std::string describe_styles() { return detail::describe_roles(role_styles); }
};

namespace detail {
template <class P>
struct IsPlan : std::false_type {};
template <MeshType M, auto Preset, LlamaStyles Styles>
struct IsPlan<Plan<M, Preset, Styles>> : std::true_type {};
}  // namespace detail

// A llama::Plan<...> type: what parallelize<P>() builds and launch<P>() puts in the fingerprint,
// so that the plan a program names is the plan it logs, compares across ranks and applies.
template <class P>
concept LlamaPlan = detail::IsPlan<P>::value;

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <iterator>

#include <fmt/format.h>

namespace meshtorch::llama::detail {

[[noreturn]] MESHTORCH_DECL void throw_tp_problem(std::string_view source, std::string_view problem,
                                                  std::int64_t tp_size, std::string_view mesh_name) {
  throw ConfigError(fmt::format("{}: {} ({}) of {}", source, problem, tp_size, mesh_name));
}

[[noreturn]] MESHTORCH_DECL void throw_sequence_not_divisible(std::int64_t seq_length, std::int64_t tp_size) {
  throw ConfigError(
      fmt::format("--seq-length {} is not divisible by the TP size {}: sequence parallel splits every "
                  "sequence over the TP ranks",
                  seq_length, tp_size));
}

MESHTORCH_DECL std::string describe_roles(std::span<const RoleStyle> roles) {
  std::string out;
  for (const auto& [role, style] : roles)
    fmt::format_to(std::back_inserter(out), "{}{}={}", out.empty() ? "" : " ", role, style);
  return out;
}

MESHTORCH_DECL std::string describe_plan(std::string_view mesh_name, std::span<const RoleStyle> roles) {
  return fmt::format("{}: {}", mesh_name, describe_roles(roles));
}

}  // namespace meshtorch::llama::detail
#endif  // MESHTORCH_DEFINES(core)
