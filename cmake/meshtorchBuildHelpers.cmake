# Build helpers for meshtorch's own tests, examples, tools and benchmarks.
#
# Every LibTorch program of the project is built with separate compilation: the library's
# non-template functions are compiled once, in meshtorch_compiled (one source file per part, built
# side by side), and each program's translation units see only their declarations. Header-only,
# each example compiled the whole library again (60-76 s a unit at -O2, three quarters of it
# generating code for the library's inline functions; docs/performance.md#build-time). The
# header-only mode is what tests/headers compiles, header by header, and what the LibTorch-free
# tools and tests use.

# The library's definitions, compiled once for every program below, and the precompiled header
# every translation unit that includes LibTorch shares: parsing LibTorch's headers (the parts
# meshtorch/torch.hpp names) dominates their compile time. The header is built with the library's
# definitions (MESHTORCH_SEPARATE_COMPILATION, fmt not header-only), which every program linking
# it shares, and by the library's own target,
# so that no empty carrier file is compiled for it (8 s: loading the 800 MB header alone costs a
# unit that much, most of it instantiating templates LibTorch's inline functions name). CLI11 is
# left out: held in the header it costs every unit 2.8 s more at its end, and only the programs'
# main files and the programs part include it.
meshtorch_compiled_library(meshtorch_compiled meshtorch::torch)
target_precompile_headers(meshtorch_compiled PRIVATE
  <meshtorch/torch.hpp>
  <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
  <torch/csrc/distributed/c10d/TCPStore.hpp>
  <nlohmann/json.hpp>)

# meshtorch_executable(NAME SOURCES...): a LibTorch program in build/bin linking the compiled
# library and sharing the PCH.
function(meshtorch_executable name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE meshtorch_compiled)
  target_precompile_headers(${name} REUSE_FROM meshtorch_compiled)
endfunction()

# meshtorch_compile_fail_test(NAME SOURCE EXPECTED_REGEX): SOURCE must not compile, and the
# compiler's output must match EXPECTED_REGEX (so a test passes only for the right error).
function(meshtorch_compile_fail_test name source expected)
  add_test(NAME ${name}
    COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only
            -I${PROJECT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR}/${source})
  set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${expected}" LABELS compile-fail)
endfunction()

# meshtorch_torch_compile_fail_test(NAME SOURCE EXPECTED_REGEX): the same for a SOURCE that
# includes LibTorch, compiled with the include paths, definitions and optimisation flags of every
# program (those of meshtorch_compiled) and its precompiled header, which spares each such test the
# 20 s of parsing <torch/torch.h> (were the header out of date, GCC would parse its text instead:
# -Winvalid-pch says so, and the test still holds).
function(meshtorch_torch_compile_fail_test name source expected)
  set(includes "$<TARGET_PROPERTY:meshtorch_compiled,INCLUDE_DIRECTORIES>")
  set(definitions "$<TARGET_PROPERTY:meshtorch_compiled,COMPILE_DEFINITIONS>")
  string(TOUPPER "${CMAKE_BUILD_TYPE}" build_type)
  separate_arguments(flags UNIX_COMMAND "${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${build_type}}")
  add_test(NAME ${name}
    COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only ${flags} -Winvalid-pch
            "$<$<BOOL:${includes}>:-I$<JOIN:${includes},;-I>>"
            "$<$<BOOL:${definitions}>:-D$<JOIN:${definitions},;-D>>"
            -include ${CMAKE_BINARY_DIR}/CMakeFiles/meshtorch_compiled.dir/cmake_pch.hxx
            ${CMAKE_CURRENT_SOURCE_DIR}/${source}
    COMMAND_EXPAND_LISTS)
  set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${expected}" LABELS compile-fail)
endfunction()
