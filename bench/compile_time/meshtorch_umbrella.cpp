// The umbrella header on top of <torch/torch.h>: what including meshtorch adds.
#include <torch/torch.h>

#include <meshtorch/meshtorch.hpp>

int main() { return torch::ones({1}).item<int>() == 1 ? 0 : 1; }
