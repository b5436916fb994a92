#pragma once
// The definitions of meshtorch's non-template functions, for a program built with
// MESHTORCH_SEPARATE_COMPILATION (separate_compilation.hpp): include this in exactly one of its
// source files. The CMake option MESHTORCH_SEPARATE_COMPILATION builds it as the library
// meshtorch::compiled.
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src.hpp> is for programs built with MESHTORCH_SEPARATE_COMPILATION; header-only programs need no source file"
#endif
#define MESHTORCH_SOURCE
#include <meshtorch/meshtorch.hpp>
