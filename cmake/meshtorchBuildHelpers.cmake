# Build helpers for meshtorch's own tests, examples, tools and benchmarks.

# One precompiled header for every translation unit that includes LibTorch: parsing
# <torch/torch.h> dominates their compile time.
add_library(meshtorch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
target_link_libraries(meshtorch_pch PUBLIC meshtorch::meshtorch meshtorch::torch)
target_precompile_headers(meshtorch_pch PRIVATE
  <torch/torch.h>
  <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
  <torch/csrc/distributed/c10d/TCPStore.hpp>
  <nlohmann/json.hpp>
  <CLI/CLI.hpp>)

# meshtorch_executable(NAME SOURCES...): a LibTorch program in build/bin sharing the PCH.
function(meshtorch_executable name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE meshtorch_pch)
  target_precompile_headers(${name} REUSE_FROM meshtorch_pch)
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
# includes LibTorch, compiled with the include paths and definitions every program gets (those
# of meshtorch_pch, which links meshtorch and LibTorch), without the precompiled header.
function(meshtorch_torch_compile_fail_test name source expected)
  set(includes "$<TARGET_PROPERTY:meshtorch_pch,INCLUDE_DIRECTORIES>")
  set(definitions "$<TARGET_PROPERTY:meshtorch_pch,COMPILE_DEFINITIONS>")
  add_test(NAME ${name}
    COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only
            "$<$<BOOL:${includes}>:-I$<JOIN:${includes},;-I>>"
            "$<$<BOOL:${definitions}>:-D$<JOIN:${definitions},;-D>>"
            ${CMAKE_CURRENT_SOURCE_DIR}/${source}
    COMMAND_EXPAND_LISTS)
  set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${expected}" LABELS compile-fail)
endfunction()
