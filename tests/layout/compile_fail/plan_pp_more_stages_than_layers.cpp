#include <meshtorch/models/llama/plan.hpp>
// llama-tiny has 4 decoder layers: with the embedding and the head, 6 layers for 8 pipeline stages.
using Plan = meshtorch::llama::Plan<meshtorch::Mesh<meshtorch::FSDP<2>, meshtorch::PP<8>>,
                                    meshtorch::llama::presets::llama_tiny>;
static_assert(Plan::has_preset);
