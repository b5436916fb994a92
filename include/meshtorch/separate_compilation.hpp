#pragma once
// Header-only by default; optionally compiled once per program, as Boost.Asio and the stb
// libraries offer it. A header whose functions are not templates declares them with
// MESHTORCH_DECL and defines them below its declarations, inside `#if MESHTORCH_DEFINITIONS`:
//
// - by default MESHTORCH_DECL is `inline` and every header defines its functions: nothing to link;
// - a program that defines MESHTORCH_SEPARATE_COMPILATION in every translation unit (the CMake
//   option of the same name does) sees only the declarations, and what those definitions need
//   (nlohmann-json's parser, most of fmt's formatting) is never parsed; exactly one of its
//   source files includes <meshtorch/src.hpp>, which compiles the definitions.
//
// Why: each definition instantiates the templates it calls, whether or not the program calls it,
// so a translation unit that includes the umbrella header pays for every one of them.
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#define MESHTORCH_DECL inline
#define MESHTORCH_DEFINITIONS 1
#elif defined(MESHTORCH_SOURCE)
#define MESHTORCH_DECL
#define MESHTORCH_DEFINITIONS 1
#else
#define MESHTORCH_DECL
#define MESHTORCH_DEFINITIONS 0
#endif
