// A vocabulary of 263 tokens cannot be sharded over 2 ranks.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
constexpr mt::llama::Config odd_vocab = [] {
  auto c = mt::llama::presets::llama_tiny;
  c.vocab_size = 263;
  return c;
}();
using Plan = mt::llama::Plan<mt::Mesh<mt::TP<2>>, odd_vocab>;
static_assert(Plan::has_tp);
