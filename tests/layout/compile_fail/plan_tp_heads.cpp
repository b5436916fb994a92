// TP 3 does not divide llama-tiny's 8 attention heads.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
using Plan = mt::llama::Plan<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<3>>, mt::llama::presets::llama_tiny>;
static_assert(Plan::has_tp);
