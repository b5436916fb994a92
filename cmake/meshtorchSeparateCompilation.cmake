# meshtorch_compiled_library(NAME TORCH_TARGET): a static library that compiles meshtorch's
# non-template functions once (<meshtorch/src.hpp>) and makes every target linking it see only
# their declarations (MESHTORCH_SEPARATE_COMPILATION, a PUBLIC definition): what a program links
# instead of meshtorch::meshtorch when its translation units should not each compile them (see
# include/meshtorch/separate_compilation.hpp). It links meshtorch::headers, not meshtorch::meshtorch:
# fmt is not header-only there (no FMT_HEADER_ONLY), its engine is compiled once in the library
# (src.hpp) from the fmt headers LibTorch ships. TORCH_TARGET is the program's LibTorch target
# (meshtorch::torch from meshtorch_find_libtorch(), or `torch` from find_package(Torch)).
function(meshtorch_compiled_library name torch_target)
  set(source ${CMAKE_CURRENT_BINARY_DIR}/${name}_src.cpp)
  file(CONFIGURE OUTPUT ${source} CONTENT "#include <meshtorch/src.hpp>\n" @ONLY)
  add_library(${name} STATIC ${source})
  target_compile_definitions(${name} PUBLIC MESHTORCH_SEPARATE_COMPILATION)
  target_link_libraries(${name} PUBLIC meshtorch::headers ${torch_target})
endfunction()
