#include <meshtorch/models/llama/plan.hpp>
// An axis kind that no wrapper applies (context parallel is not built yet).
template <std::size_t N>
struct CP : meshtorch::AxisExtent<N> {
  static constexpr std::string_view name = "CP";
};
using Mesh = meshtorch::Mesh<meshtorch::FSDP<2>, CP<2>>;
static_assert(meshtorch::llama::check_parallelizable<Mesh, meshtorch::llama::default_styles<Mesh>>());
