// The umbrella header plus a 2D (FSDP x TP) Llama plan checked at compile time for
// llama-3.1-8b: the compile-time work a chapter-7 program does.
#include <torch/torch.h>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using Mesh2D = mt::Mesh<mt::FSDP<4>, mt::TP<8>>;
using Plan2D = mt::llama::Plan<Mesh2D, mt::llama::presets::llama_3_1_8b>;

int main() { return sizeof(Plan2D) > 0 && torch::ones({1}).item<int>() == 1 ? 0 : 1; }
