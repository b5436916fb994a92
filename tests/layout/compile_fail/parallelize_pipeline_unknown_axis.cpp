#include <meshtorch/models/llama/plan.hpp>
// An axis kind that no wrapper applies inside pipeline stages (expert parallel: not built).
template <std::size_t N>
struct EP : meshtorch::AxisExtent<N> {
  static constexpr std::string_view name = "EP";
};
using Mesh = meshtorch::Mesh<meshtorch::PP<2>, meshtorch::CP<2>, EP<2>>;
static_assert(meshtorch::llama::check_pipeline_parallelizable<Mesh>());
