# meshtorch_find_libtorch(): defines the target meshtorch::torch.
#
# CPU build (default): links only torch_cpu and c10 from the LibTorch prefix MESHTORCH_LIBTORCH
# (scripts/setup unpacks one from the pinned torch wheel; an official CPU LibTorch works too).
# The wheel's CUDA libraries are not needed, and its TorchConfig would go looking for them.
# CUDA build (MESHTORCH_CUDA=ON): uses the prefix's full TorchConfig (find_package(Torch)).
# A CPU build against a CUDA LibTorch (one with lib/libtorch_cuda.so) is refused: it would build a
# program that silently never uses the GPU. MESHTORCH_ALLOW_CPU_BUILD_OF_CUDA_LIBTORCH=ON allows it.
function(meshtorch_find_libtorch)
  if(TARGET meshtorch::torch)
    return()
  endif()
  set(default_prefix "$ENV{MESHTORCH_LIBTORCH}")
  if(NOT default_prefix AND EXISTS "${PROJECT_SOURCE_DIR}/.deps/libtorch")
    set(default_prefix "${PROJECT_SOURCE_DIR}/.deps/libtorch")
  endif()
  set(MESHTORCH_LIBTORCH "${default_prefix}" CACHE PATH "LibTorch prefix (include/, lib/, share/cmake)")

  if(MESHTORCH_CUDA)
    # Caffe2's CMake files otherwise compile and run a CUDA program to detect the GPUs' archs,
    # which fails without a GPU and under CMAKE_CXX_STANDARD 20 (no CUDA20 dialect); meshtorch
    # compiles no CUDA code, so the list only has to be valid. Ampere and Hopper by default.
    if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      set(TORCH_CUDA_ARCH_LIST "8.0;9.0" CACHE STRING "CUDA archs for Caffe2's CMake files")
    endif()
    find_package(Torch REQUIRED HINTS "${MESHTORCH_LIBTORCH}/share/cmake/Torch")
    add_library(meshtorch::torch INTERFACE IMPORTED GLOBAL)
    target_link_libraries(meshtorch::torch INTERFACE ${TORCH_LIBRARIES})
    target_compile_definitions(meshtorch::torch INTERFACE MESHTORCH_WITH_CUDA=1)
    meshtorch_link_openmp_of_libtorch("${MESHTORCH_LIBTORCH}")
    return()
  endif()

  if(NOT EXISTS "${MESHTORCH_LIBTORCH}/include/torch/csrc/api/include/torch/torch.h")
    message(FATAL_ERROR
      "meshtorch: no LibTorch at MESHTORCH_LIBTORCH='${MESHTORCH_LIBTORCH}' "
      "(include/torch/csrc/api/include/torch/torch.h is missing). Run scripts/setup, or pass "
      "-DMESHTORCH_LIBTORCH=/path/to/libtorch.")
  endif()
  if(EXISTS "${MESHTORCH_LIBTORCH}/lib/libtorch_cuda.so" AND NOT MESHTORCH_ALLOW_CPU_BUILD_OF_CUDA_LIBTORCH)
    message(FATAL_ERROR
      "meshtorch: MESHTORCH_LIBTORCH='${MESHTORCH_LIBTORCH}' is a CUDA LibTorch (it has "
      "lib/libtorch_cuda.so), but this is a CPU-only build, whose programs would never use the GPU. "
      "Configure with -DMESHTORCH_CUDA=ON (scripts/setup does so when it finds a GPU and a CUDA "
      "LibTorch), or point MESHTORCH_LIBTORCH at a CPU LibTorch; to build CPU-only against it "
      "anyway, pass -DMESHTORCH_ALLOW_CPU_BUILD_OF_CUDA_LIBTORCH=ON.")
  endif()
  foreach(lib torch_cpu c10)
    find_library(MESHTORCH_${lib}_LIBRARY ${lib} PATHS "${MESHTORCH_LIBTORCH}/lib" NO_DEFAULT_PATH REQUIRED)
  endforeach()
  find_package(Threads REQUIRED)
  add_library(meshtorch::torch INTERFACE IMPORTED GLOBAL)
  target_include_directories(meshtorch::torch SYSTEM INTERFACE
    "${MESHTORCH_LIBTORCH}/include" "${MESHTORCH_LIBTORCH}/include/torch/csrc/api/include")
  # The c10d headers guard Gloo and the distributed API with these macros; the wheel is built with both.
  target_compile_definitions(meshtorch::torch INTERFACE USE_DISTRIBUTED USE_C10D_GLOO)
  target_link_libraries(meshtorch::torch INTERFACE
    "${MESHTORCH_torch_cpu_LIBRARY}" "${MESHTORCH_c10_LIBRARY}" Threads::Threads)
  target_link_options(meshtorch::torch INTERFACE "-Wl,-rpath,${MESHTORCH_LIBTORCH}/lib")
  meshtorch_link_openmp_of_libtorch("${MESHTORCH_LIBTORCH}")
endfunction()

# at::parallel_for is a template whose OpenMP backend (ATen/ParallelOpenMP.h) is a `#pragma omp
# parallel` compiled into the caller: without -fopenmp a program's own parallel loops (the fused
# kernels of kernels/) run on one thread whatever at::set_num_threads says. LibTorch's CMake files
# do not say so, as PyTorch's C++ extensions add -fopenmp themselves. With GCC and the pinned
# wheel (its lib/ holds libgomp.so.1, found first on the rpath) one runtime is loaded and one
# set_num_threads governs both; a LibTorch whose lib/ holds a renamed libgomp, or Clang's libomp,
# loads a second runtime, whose thread count then follows OMP_NUM_THREADS.
function(meshtorch_link_openmp_of_libtorch prefix)
  file(STRINGS "${prefix}/include/ATen/Config.h" openmp_line REGEX "#define AT_PARALLEL_OPENMP 1")
  if(NOT openmp_line)
    return()
  endif()
  find_package(OpenMP COMPONENTS CXX)
  if(NOT OpenMP_CXX_FOUND)
    message(FATAL_ERROR "meshtorch: this LibTorch parallelises with OpenMP (AT_PARALLEL_OPENMP), and the compiler's "
                        "OpenMP was not found: at::parallel_for in meshtorch's kernels would run on one thread "
                        "(Debian: GCC's libgomp comes with g++; for Clang install libomp-dev)")
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND EXISTS "${prefix}/lib/libgomp.so.1")
    # LibTorch's own libgomp by its path, not the compiler's: the one loaded anyway, and CMake then
    # finds no second libgomp.so.1 to warn about on the rpath.
    target_compile_options(meshtorch::torch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${OpenMP_CXX_FLAGS}>)
    target_link_libraries(meshtorch::torch INTERFACE "${prefix}/lib/libgomp.so.1")
  else()
    target_link_libraries(meshtorch::torch INTERFACE OpenMP::OpenMP_CXX)
  endif()
endfunction()
