#pragma once
// The definitions of meshtorch's non-template functions, for a program built with
// MESHTORCH_SEPARATE_COMPILATION (separate_compilation.hpp): include this in exactly one of its
// source files. meshtorch_compiled_library() (cmake/meshtorchSeparateCompilation.cmake) builds a
// library of it.
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src.hpp> needs MESHTORCH_SEPARATE_COMPILATION; a header-only program adds no source file"
#endif
#define MESHTORCH_SOURCE
#include <meshtorch/meshtorch.hpp>
