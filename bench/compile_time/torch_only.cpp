// Baseline for the compile-time benchmark: what every LibTorch program pays.
#include <torch/torch.h>

int main() { return torch::ones({1}).item<int>() == 1 ? 0 : 1; }
