#pragma once
// The definitions of the core part (the umbrella header's reach) and fmt's engine, for a program
// built with MESHTORCH_SEPARATE_COMPILATION (separate_compilation.hpp): include this in exactly
// one of its source files, and nothing else there. meshtorch_compiled_library()
// (cmake/meshtorchSeparateCompilation.cmake) builds a library of the parts.
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src/core.hpp> needs MESHTORCH_SEPARATE_COMPILATION; a header-only program adds no source file"
#endif
#if defined(MESHTORCH_SOURCE)
#error "one part of meshtorch per source file: <meshtorch/src/core.hpp> found MESHTORCH_SOURCE already defined"
#endif
#define MESHTORCH_SOURCE MESHTORCH_PART_core
#include <meshtorch/meshtorch.hpp>

// fmt's engine, compiled once too where the program's units do not use fmt header-only
// (meshtorch_compiled_library() leaves FMT_HEADER_ONLY out): LibTorch ships fmt's headers but no
// library to link, so this is what fmt's own source file compiles: its out-of-line functions
// (format-inl.h) and the templates its headers declare `extern`. Header-only, every unit that
// formats a message generates that engine again (about 90 KB of code and 2.5 s at -O2).
#if !defined(FMT_HEADER_ONLY)
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {
template FMT_API auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template FMT_API auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<wchar_t>;
template FMT_API auto decimal_point_impl(locale_ref) -> wchar_t;
}  // namespace detail
FMT_END_NAMESPACE
#endif
