#include <meshtorch/models/llama/plan.hpp>
// PP<N> composes with DP; FSDP and TP inside the pipeline stages are not built yet.
using Mesh = meshtorch::Mesh<meshtorch::FSDP<2>, meshtorch::PP<2>, meshtorch::TP<2>>;
static_assert(meshtorch::llama::check_pipeline_parallelizable<Mesh>());
