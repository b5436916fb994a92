# meshtorch_compiled_library(NAME TORCH_TARGET [PARTS part...]): a static library that compiles
# meshtorch's non-template functions once and makes every target linking it see only their
# declarations (MESHTORCH_SEPARATE_COMPILATION, a PUBLIC definition): what a program links instead
# of meshtorch::meshtorch when its translation units should not each compile them (see
# include/meshtorch/separate_compilation.hpp). One source file per part (<meshtorch/src/PART.hpp>),
# so that a parallel build compiles them side by side: core and programs always, tokenizers where
# meshtorch::tokenizers exists and tracking where meshtorch::tracking does (their libraries are
# linked PUBLIC); PARTS names fewer, for a program that includes no header of the others (it would
# fail to link, naming the functions it misses). It links meshtorch::headers, not
# meshtorch::meshtorch: fmt is not header-only there (no FMT_HEADER_ONLY), its engine is compiled
# once in the core part from the fmt headers LibTorch ships. TORCH_TARGET is the program's LibTorch
# target (meshtorch::torch from meshtorch_find_libtorch(), or `torch` from find_package(Torch)).
function(meshtorch_compiled_library name torch_target)
  cmake_parse_arguments(PARSE_ARGV 2 arg "" "" "PARTS")
  set(available core programs)
  foreach(optional tokenizers tracking)
    if(TARGET meshtorch::${optional})
      list(APPEND available ${optional})
    endif()
  endforeach()
  if(arg_PARTS)
    set(parts ${arg_PARTS})
    foreach(part IN LISTS parts)
      if(NOT part IN_LIST available)
        message(FATAL_ERROR "meshtorch_compiled_library(${name}): no part '${part}' here (available: ${available}; "
                            "tokenizers needs meshtorch::tokenizers, tracking meshtorch::tracking)")
      endif()
    endforeach()
  else()
    set(parts ${available})
  endif()
  set(sources)
  set(part_libraries)
  foreach(part IN LISTS parts)
    set(source ${CMAKE_CURRENT_BINARY_DIR}/${name}_${part}.cpp)
    file(CONFIGURE OUTPUT ${source} CONTENT "#include <meshtorch/src/${part}.hpp>\n" @ONLY)
    list(APPEND sources ${source})
    if(part MATCHES "^(tokenizers|tracking)$")
      list(APPEND part_libraries meshtorch::${part})
    endif()
  endforeach()
  add_library(${name} STATIC ${sources})
  target_compile_definitions(${name} PUBLIC MESHTORCH_SEPARATE_COMPILATION)
  target_link_libraries(${name} PUBLIC meshtorch::headers ${part_libraries} ${torch_target})
endfunction()
