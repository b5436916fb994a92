#include <meshtorch/models/llama/plan.hpp>
// PP<N> composes with DP and TP; FSDP inside the pipeline stages is not built yet.
using Mesh = meshtorch::Mesh<meshtorch::FSDP<2>, meshtorch::PP<2>, meshtorch::TP<2>>;
static_assert(meshtorch::llama::check_pipeline_parallelizable<Mesh>());
