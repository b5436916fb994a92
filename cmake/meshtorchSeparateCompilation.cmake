# meshtorch_compiled_library(NAME TORCH_TARGET): a static library that compiles meshtorch's
# non-template functions once and makes every target linking it see only their declarations
# (MESHTORCH_SEPARATE_COMPILATION, a PUBLIC definition): what a program links instead of
# meshtorch::meshtorch when its translation units should not each compile them (see
# include/meshtorch/separate_compilation.hpp). One source file per part (<meshtorch/src/PART.hpp>),
# so that a parallel build compiles them side by side: core and programs always, tokenizers where
# meshtorch::tokenizers exists and tracking where meshtorch::tracking does (their libraries are
# linked PUBLIC). It links meshtorch::headers, not meshtorch::meshtorch: fmt is not header-only
# there (no FMT_HEADER_ONLY), its engine is compiled once in the core part from the fmt headers
# LibTorch ships. TORCH_TARGET is the program's LibTorch target (meshtorch::torch from
# meshtorch_find_libtorch(), or `torch` from find_package(Torch)).
function(meshtorch_compiled_library name torch_target)
  set(parts core programs)
  set(part_libraries)
  foreach(optional tokenizers tracking)
    if(TARGET meshtorch::${optional})
      list(APPEND parts ${optional})
      list(APPEND part_libraries meshtorch::${optional})
    endif()
  endforeach()
  set(sources)
  foreach(part IN LISTS parts)
    set(source ${CMAKE_CURRENT_BINARY_DIR}/${name}_${part}.cpp)
    file(CONFIGURE OUTPUT ${source} CONTENT "#include <meshtorch/src/${part}.hpp>\n" @ONLY)
    list(APPEND sources ${source})
  endforeach()
  add_library(${name} STATIC ${sources})
  target_compile_definitions(${name} PUBLIC MESHTORCH_SEPARATE_COMPILATION)
  target_link_libraries(${name} PUBLIC meshtorch::headers ${part_libraries} ${torch_target})
endfunction()
