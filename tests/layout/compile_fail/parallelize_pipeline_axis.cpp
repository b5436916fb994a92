#include <meshtorch/models/llama/plan.hpp>
// PP<N> is an axis tag, but parallelize() does not build pipeline stages yet.
using Mesh = meshtorch::Mesh<meshtorch::FSDP<2>, meshtorch::PP<2>, meshtorch::TP<2>>;
static_assert(meshtorch::llama::check_parallelizable<Mesh, meshtorch::llama::default_styles<Mesh>>());
