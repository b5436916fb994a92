#pragma once
// The parts of LibTorch meshtorch uses: tensors and their operators (ATen), autograd, torch::nn's
// Module, ModuleList and loss functions, and the CUDA queries. Not <torch/torch.h>, which adds
// the rest of torch::nn, optim, data, serialize and the JIT: GCC instantiates the templates that
// their inline functions name at the end of every translation unit that includes them, precompiled
// header or not, which cost each unit about 1.8 s more (docs/performance.md#build-time). A program
// that uses those parts includes <torch/torch.h> itself.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/types.h>
#include <torch/utils.h>
