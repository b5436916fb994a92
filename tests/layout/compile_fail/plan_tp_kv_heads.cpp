// TP 8 divides llama-tiny's 8 query heads but not its 4 key/value heads.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
using Plan = mt::llama::Plan<mt::Mesh<mt::TP<8>>, mt::llama::presets::llama_tiny>;
static_assert(Plan::has_tp);
