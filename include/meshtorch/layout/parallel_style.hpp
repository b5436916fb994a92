#pragma once
// Tensor-parallel styles as types, as in torch.distributed.tensor.parallel. Each style names the
// placement (along the TP axis) of the activation it accepts (`input`) and of the one it returns
// (`output`); a plan is checked by matching one module's output to the next one's input.
//
//   style                          weight          accepts        body sees / returns    returns
//   ColwiseParallel<In, Out>       Shard<0> rows   In             Replicate / Shard<-1>  Out
//   RowwiseParallel<In, Out>       Shard<1> cols*  In             Shard<-1> / Partial    Out
//   SequenceParallel<Dim>          replicated      Shard<Dim>     per token              Shard<Dim>
//   PrepareModuleInput<In, Want>   -               In             Want                   (module's)
//   NoParallel                     replicated      Replicate      Replicate              Replicate
//
//   * on an embedding, RowwiseParallel shards the vocabulary (weight Shard<0>) and ColwiseParallel
//     the embedding dim, as PyTorch does.
// The conversions a style makes (In -> what its body sees, what its body returns -> Out) are
// Redistributions (redistribution.hpp): `enter` and `leave` name the forward collective and
// the backward one of each, and tensor_parallel.hpp runs exactly those. A style asking for an
// impossible conversion does not compile.
#include <string_view>
#include <type_traits>

#include <meshtorch/layout/fixed_string.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/layout/redistribution.hpp>

namespace meshtorch {

namespace detail {

template <std::size_t N>
struct StyleName {
  FixedString<N> text;
  constexpr StyleName(std::string_view style, std::string_view a, std::string_view b) {
    text.append(style).append("<").append(a);
    if (!b.empty()) text.append(", ").append(b);
    text.append(">");
  }
};

}  // namespace detail

template <Placement In = Replicate, Placement Out = Shard<-1>>
struct ColwiseParallel {
  static_assert(!std::is_same_v<In, Partial>,
                "ColwiseParallel<Partial, ...>: a column-parallel layer needs its whole input; reduce it "
                "first (make the producer return Replicate or Shard<1>)");
  static_assert(std::is_same_v<Out, Shard<-1>> || std::is_same_v<Out, Replicate>,
                "ColwiseParallel<In, Out>: Out must be Shard<-1> (keep the feature dim sharded, e.g. for a "
                "following RowwiseParallel or loss parallel) or Replicate (all-gather it)");
  using input = In;
  using output = Out;
  using body_input = Replicate;
  using body_output = Shard<-1>;
  // The body multiplies by this rank's rows of the weight, so its input's gradient is partial.
  using enter = Redistribution<In, Replicate, Partial, gradient_placement<In>>;
  using leave = Redistribution<Shard<-1>, Out, gradient_placement<Out>, Shard<-1>>;

 private:
  static constexpr detail::StyleName<64> name_storage{"ColwiseParallel", In::name, Out::name};

 public:
  static constexpr std::string_view name = name_storage.text.view();
};

template <Placement In = Shard<-1>, Placement Out = Replicate>
struct RowwiseParallel {
  static_assert(!std::is_same_v<In, Partial>,
                "RowwiseParallel<Partial, ...>: a row-parallel layer needs its input sharded on the feature "
                "dim; make the producer return Shard<-1> (a ColwiseParallel) or Replicate");
  static_assert(!std::is_same_v<Out, Partial>,
                "RowwiseParallel<In, Partial>: the partial sums must be reduced; use Replicate (all-reduce) or "
                "Shard<1> (reduce-scatter along the sequence, for sequence parallel)");
  using input = In;
  using output = Out;
  using body_input = Shard<-1>;
  using body_output = Partial;
  using enter = Redistribution<In, Shard<-1>, Shard<-1>, gradient_placement<In>>;
  using leave = Redistribution<Partial, Out, gradient_placement<Out>, Replicate>;

 private:
  static constexpr detail::StyleName<64> name_storage{"RowwiseParallel", In::name, Out::name};

 public:
  static constexpr std::string_view name = name_storage.text.view();
};

// Per-token modules (norms) run on a sequence shard; their weight stays replicated, and its
// gradient, a partial sum over the shards, is all-reduced over the TP axis.
template <int Dim = 1>
struct SequenceParallel {
  using input = Shard<Dim>;
  using output = Shard<Dim>;
  using body_input = Shard<Dim>;
  using body_output = Shard<Dim>;
  using enter = Redistribution<Shard<Dim>, Shard<Dim>, Shard<Dim>, Shard<Dim>>;
  using leave = enter;
  // The replicated weight is used on every sequence shard: its gradient is a partial sum.
  using weight = CopyToParallelRegion;

 private:
  static constexpr detail::StyleName<48> name_storage{"SequenceParallel", Shard<Dim>::name, ""};

 public:
  static constexpr std::string_view name = name_storage.text.view();
};

// Redistributes a module's input before its body runs; the module's own children decide what it
// returns.
template <Placement In, Placement Want>
struct PrepareModuleInput {
  using input = In;
  using output = Want;  // what the module's first children receive
  using body_input = Want;
  using body_output = Want;
  // The children (q/k/v, gate/up) are column-parallel: a replicated input gets partial gradients.
  using enter = Redistribution<In, Want, gradient_placement<Want, true>, gradient_placement<In>>;
  using leave = Redistribution<Want, Want, Want, Want>;

 private:
  static constexpr detail::StyleName<64> name_storage{"PrepareModuleInput", In::name, Want::name};

 public:
  static constexpr std::string_view name = name_storage.text.view();
};

// Left as it is: replicated weight, replicated input and output.
struct NoParallel {
  using input = Replicate;
  using output = Replicate;
  using body_input = Replicate;
  using body_output = Replicate;
  using enter = Redistribution<Replicate, Replicate, Replicate, Replicate>;
  using leave = enter;
  static constexpr std::string_view name = "NoParallel";
};

namespace detail {
template <class T>
struct IsStyle : std::false_type {};
template <class I, class O>
struct IsStyle<ColwiseParallel<I, O>> : std::true_type {};
template <class I, class O>
struct IsStyle<RowwiseParallel<I, O>> : std::true_type {};
template <int D>
struct IsStyle<SequenceParallel<D>> : std::true_type {};
template <class I, class W>
struct IsStyle<PrepareModuleInput<I, W>> : std::true_type {};
template <>
struct IsStyle<NoParallel> : std::true_type {};

template <class T>
struct IsColwise : std::false_type {};
template <class I, class O>
struct IsColwise<ColwiseParallel<I, O>> : std::true_type {};
template <class T>
struct IsRowwise : std::false_type {};
template <class I, class O>
struct IsRowwise<RowwiseParallel<I, O>> : std::true_type {};
template <class T>
struct IsSequenceParallel : std::false_type {};
template <int D>
struct IsSequenceParallel<SequenceParallel<D>> : std::true_type {};
template <class T>
struct IsPrepareModuleInput : std::false_type {};
template <class I, class W>
struct IsPrepareModuleInput<PrepareModuleInput<I, W>> : std::true_type {};
}  // namespace detail

template <class T>
concept ParallelStyle = detail::IsStyle<T>::value;
template <class T>
concept ColwiseStyle = detail::IsColwise<T>::value;
template <class T>
concept RowwiseStyle = detail::IsRowwise<T>::value;
template <class T>
concept SequenceParallelStyle = detail::IsSequenceParallel<T>::value;
template <class T>
concept PrepareModuleInputStyle = detail::IsPrepareModuleInput<T>::value;

}  // namespace meshtorch
