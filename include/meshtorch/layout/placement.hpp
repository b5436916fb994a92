#pragma once
// How a tensor is laid out along one mesh axis, as in PyTorch's DTensor:
//   Replicate  every rank of the axis holds the whole tensor;
//   Shard<D>   rank i holds the i-th of `extent` equal pieces along tensor dim D
//              (negative D counts from the last dim, as in Python);
//   Partial    every rank holds a full-shape addend, and the tensor is their sum.
#include <string_view>
#include <type_traits>

#include <meshtorch/layout/fixed_string.hpp>

namespace meshtorch {

struct Replicate {
  static constexpr std::string_view name = "Replicate";
};

template <int Dim>
struct Shard {
  static constexpr int dim = Dim;

 private:
  static constexpr auto name_storage = [] {
    FixedString<24> out;
    out.append("Shard<").append_number(Dim).append(">");
    return out;
  }();

 public:
  static constexpr std::string_view name = name_storage.view();
};

struct Partial {
  static constexpr std::string_view name = "Partial";
};

namespace detail {
template <class T>
struct IsShard : std::false_type {};
template <int Dim>
struct IsShard<Shard<Dim>> : std::true_type {};
}  // namespace detail

template <class T>
concept ShardPlacement = detail::IsShard<T>::value;

template <class T>
concept Placement = std::is_same_v<T, Replicate> || std::is_same_v<T, Partial> || ShardPlacement<T>;

// Shard<-1> on a 3-d tensor is Shard<2>. Returns -1 when dim is out of range for ndim.
constexpr int normalize_dim(int dim, int ndim) {
  const int d = dim < 0 ? dim + ndim : dim;
  return d >= 0 && d < ndim ? d : -1;
}

}  // namespace meshtorch
