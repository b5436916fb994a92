#include <meshtorch/models/llama/plan.hpp>
// Context parallel inside pipeline stages: not built yet, refused when the mesh is named.
using Mesh = meshtorch::Mesh<meshtorch::DP<2>, meshtorch::PP<2>, meshtorch::CP<2>>;
static_assert(meshtorch::llama::check_pipeline_parallelizable<Mesh>());
