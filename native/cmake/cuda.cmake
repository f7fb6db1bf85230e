# CUDA kernels and NCCL operations for spark_dl (issue 12).
#
# What gets built:
#   - CUDA (SDL_HAVE_CUDA): the batched pack/unpack/scale kernels, compiled by nvcc
#     into a fatbin embedded in the extension, and the run-time loader of the CUDA
#     runtime. Needs nvcc and the toolkit's headers (12.0 or later) at build time.
#   - NCCL (SDL_HAVE_NCCL): the NCCL communicators and collectives. Needs CUDA
#     above and nccl.h (2.14 or later) at build time: from Python's nvidia-nccl-cu13
#     / -cu12 wheel (site-packages/nvidia/nccl/include), SDL_NCCL_ROOT, the CUDA
#     toolkit or the system.
# Neither is linked: libcudart and libnccl are opened at run time (dlopen), so one
# build runs on CPU-only hosts and on GPU hosts, and the extension has no
# DT_NEEDED entry on either (tests/unit/test_cuda_build.py checks).
#
# Options (pass with pip: -C cmake.define.SDL_WITH_CUDA=OFF):
#   SDL_WITH_CUDA           AUTO (default: build when nvcc is found), ON (fail without), OFF
#   SDL_CUDA_ARCHITECTURES  e.g. "80;90"; empty: every architecture this nvcc supports
#                           from Turing on, plus PTX of the oldest for newer GPUs
#   SDL_NCCL_ROOT           a directory holding include/nccl.h (or nccl.h)
#
# Include after find_package(Python); call sdl_add_gpu_sources(<target>) on the
# extension. Appends to SDL_ENABLED / SDL_MISSING (the build summary).

set(SDL_WITH_CUDA "AUTO" CACHE STRING
    "Build the CUDA kernels and NCCL operations: AUTO (when nvcc is found), ON, OFF")
set_property(CACHE SDL_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(SDL_CUDA_ARCHITECTURES "" CACHE STRING
    "GPU architectures of the kernels (e.g. 80;90); empty: a default list for this nvcc")
set(SDL_NCCL_ROOT "" CACHE PATH "A directory holding include/nccl.h (or nccl.h)")

set(SDL_CUDA_BUILT FALSE)
set(SDL_NCCL_BUILT FALSE)
set(SDL_CUDA_NOTE "")  # why CUDA was left out
set(SDL_NCCL_NOTE "")  # why NCCL was left out
string(TOUPPER "${SDL_WITH_CUDA}" _sdl_with_cuda)

# --- CUDA: nvcc and the toolkit's headers ---------------------------------------------
if(_sdl_with_cuda STREQUAL "OFF")
  set(SDL_CUDA_NOTE "SDL_WITH_CUDA=OFF")
else()
  include(CheckLanguage)
  check_language(CUDA)  # honours CMAKE_CUDA_COMPILER and CUDACXX; otherwise nvcc on PATH
  if(NOT CMAKE_CUDA_COMPILER)
    set(SDL_CUDA_NOTE "nvcc not found: put it on PATH or set CMAKE_CUDA_COMPILER")
  else()
    if(NOT CUDAToolkit_ROOT)
      get_filename_component(_sdl_nvcc "${CMAKE_CUDA_COMPILER}" REALPATH)
      get_filename_component(_sdl_nvcc_bin "${_sdl_nvcc}" DIRECTORY)
      get_filename_component(CUDAToolkit_ROOT "${_sdl_nvcc_bin}" DIRECTORY)
    endif()
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      set(SDL_CUDA_NOTE "nvcc at ${CMAKE_CUDA_COMPILER}, but no CUDA toolkit headers next to it")
    elseif(CUDAToolkit_VERSION VERSION_LESS 12.0)
      set(SDL_CUDA_NOTE "CUDA ${CUDAToolkit_VERSION} is too old: the kernels need 12.0 or later")
    else()
      set(SDL_CUDA_BUILT TRUE)
    endif()
  endif()
endif()
if(NOT SDL_CUDA_BUILT AND _sdl_with_cuda STREQUAL "ON")
  message(FATAL_ERROR "SDL_WITH_CUDA=ON, but CUDA cannot be built: ${SDL_CUDA_NOTE}")
endif()

if(SDL_CUDA_BUILT)
  set(_sdl_archs "${SDL_CUDA_ARCHITECTURES}")
  if(NOT _sdl_archs)
    # Turing (75) is the oldest CUDA 13 supports; 100/120 need 12.8.
    if(CUDAToolkit_VERSION VERSION_GREATER_EQUAL 12.8)
      set(_sdl_archs 75 80 86 89 90 100 120)
    else()
      set(_sdl_archs 75 80 86 89 90)
    endif()
  endif()
  list(SORT _sdl_archs COMPARE NATURAL)
  list(GET _sdl_archs 0 _sdl_ptx_arch)
  set(_sdl_gencode "")
  set(SDL_CUDA_ARCH_STRING "")
  foreach(_a IN LISTS _sdl_archs)
    list(APPEND _sdl_gencode "-gencode=arch=compute_${_a},code=sm_${_a}")
    string(APPEND SDL_CUDA_ARCH_STRING "sm_${_a} ")
  endforeach()
  # PTX of the oldest architecture: the driver compiles it for GPUs newer than the list.
  list(APPEND _sdl_gencode "-gencode=arch=compute_${_sdl_ptx_arch},code=compute_${_sdl_ptx_arch}")
  string(APPEND SDL_CUDA_ARCH_STRING "compute_${_sdl_ptx_arch}")
  list(APPEND SDL_ENABLED
       "CUDA kernels (nvcc ${CUDAToolkit_VERSION}: ${SDL_CUDA_ARCH_STRING}), libcudart loaded at run time")
else()
  list(APPEND SDL_MISSING "CUDA (GPU tensors): ${SDL_CUDA_NOTE}")
endif()

# --- NCCL: nccl.h ----------------------------------------------------------------------
if(NOT SDL_CUDA_BUILT)
  set(SDL_NCCL_NOTE "needs CUDA, which is left out")
else()
  set(_sdl_nccl_hints "")
  if(SDL_NCCL_ROOT)
    list(APPEND _sdl_nccl_hints "${SDL_NCCL_ROOT}/include" "${SDL_NCCL_ROOT}")
  endif()
  # Every site-packages of the interpreter that builds the extension: the
  # nvidia-nccl-cu13/-cu12 wheels install nvidia/nccl/include/nccl.h.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import site, sys; print(';'.join([*site.getsitepackages(), site.getusersitepackages(), *sys.path]))"
    OUTPUT_VARIABLE _sdl_py_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(_d IN LISTS _sdl_py_dirs)
    if(_d AND IS_DIRECTORY "${_d}/nvidia")
      file(GLOB _sdl_nv_includes LIST_DIRECTORIES true "${_d}/nvidia/*/include")
      list(APPEND _sdl_nccl_hints "${_d}/nvidia/nccl/include" ${_sdl_nv_includes})
    endif()
  endforeach()
  list(APPEND _sdl_nccl_hints ${CUDAToolkit_INCLUDE_DIRS})
  list(REMOVE_DUPLICATES _sdl_nccl_hints)
  # A cached hit whose header went away (the wheel was uninstalled) is searched again.
  if(SDL_NCCL_INCLUDE_DIR AND NOT EXISTS "${SDL_NCCL_INCLUDE_DIR}/nccl.h")
    unset(SDL_NCCL_INCLUDE_DIR CACHE)
  endif()
  find_path(SDL_NCCL_INCLUDE_DIR nccl.h HINTS ${_sdl_nccl_hints})
  if(NOT SDL_NCCL_INCLUDE_DIR)
    set(SDL_NCCL_NOTE "nccl.h not found: pip install --no-deps nvidia-nccl-cu13 (or -cu12) into the build's Python, or set SDL_NCCL_ROOT")
  else()
    file(STRINGS "${SDL_NCCL_INCLUDE_DIR}/nccl.h" _sdl_nccl_defs
         REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
    set(SDL_NCCL_HEADER_VERSION "")
    foreach(_part MAJOR MINOR PATCH)
      string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_sdl_nccl_defs}")
      list(APPEND SDL_NCCL_HEADER_VERSION "${CMAKE_MATCH_1}")
    endforeach()
    string(REPLACE ";" "." SDL_NCCL_HEADER_VERSION "${SDL_NCCL_HEADER_VERSION}")
    if(SDL_NCCL_HEADER_VERSION VERSION_LESS 2.14)
      set(SDL_NCCL_NOTE "nccl.h ${SDL_NCCL_HEADER_VERSION} at ${SDL_NCCL_INCLUDE_DIR} is older than 2.14")
    else()
      set(SDL_NCCL_BUILT TRUE)
    endif()
  endif()
endif()
if(SDL_NCCL_BUILT)
  list(APPEND SDL_ENABLED
       "NCCL operations (nccl.h ${SDL_NCCL_HEADER_VERSION} from ${SDL_NCCL_INCLUDE_DIR}), libnccl loaded at run time")
else()
  list(APPEND SDL_MISSING "NCCL (fused GPU collectives): ${SDL_NCCL_NOTE}")
endif()

# --- the sources ------------------------------------------------------------------------
function(_sdl_c_string out text)
  string(REPLACE "\\" "\\\\" text "${text}")
  string(REPLACE "\"" "\\\"" text "${text}")
  set(${out} "\"${text}\"" PARENT_SCOPE)
endfunction()

# Adds the GPU layer to `target`: always its Python bindings (which report what
# was left out and why); the kernels and loaders with CUDA; the NCCL code with NCCL.
function(sdl_add_gpu_sources target)
  set(src "${CMAKE_CURRENT_SOURCE_DIR}/src")
  set(gen "${CMAKE_CURRENT_BINARY_DIR}/generated/gpu")
  _sdl_c_string(cuda_note "${SDL_CUDA_NOTE}")
  _sdl_c_string(nccl_note "${SDL_NCCL_NOTE}")
  _sdl_c_string(arch_string "${SDL_CUDA_ARCH_STRING}")
  file(CONFIGURE OUTPUT "${gen}/build_config.h" CONTENT
"// Generated by native/cmake/cuda.cmake: what the build left out of the GPU layer and why.
#pragma once
#define SDL_CUDA_BUILD_NOTE ${cuda_note}
#define SDL_NCCL_BUILD_NOTE ${nccl_note}
#define SDL_CUDA_ARCH_STRING ${arch_string}
")
  # gpu/python_bindings.cc (nanobind) is the module's: CMakeLists.txt adds it there.
  if(NOT SDL_CUDA_BUILT)
    return()
  endif()

  # The kernels: nvcc -> fatbin -> .incbin into the extension's read-only data.
  set(fatbin "${gen}/kernels.fatbin")
  set(host_compiler "${CMAKE_CXX_COMPILER}")
  if(CMAKE_CUDA_HOST_COMPILER)
    set(host_compiler "${CMAKE_CUDA_HOST_COMPILER}")
  endif()
  add_custom_command(
    OUTPUT "${fatbin}"
    COMMAND "${CMAKE_CUDA_COMPILER}" -fatbin -std=c++17 -O3 -ccbin "${host_compiler}"
            -Wno-deprecated-gpu-targets ${_sdl_gencode} "-I${src}"
            -o "${fatbin}" "${src}/gpu/kernels.cu"
    DEPENDS "${src}/gpu/kernels.cu" "${src}/gpu/kernel_params.h"
    COMMENT "nvcc: spark_dl CUDA kernels (${SDL_CUDA_ARCH_STRING})"
    VERBATIM)
  file(CONFIGURE OUTPUT "${gen}/kernels_fatbin.cc" CONTENT
"// Generated by native/cmake/cuda.cmake: the fatbin nvcc built from
// src/gpu/kernels.cu, loaded by kernels.cc. Its own read-only section (a name
// the linker keeps, unlike .rodata.*), so tests and tools can find it in the .so.
__asm__(\".section sdl_kernels_fatbin,\\\"a\\\"\\n\"
        \".balign 64\\n\"
        \".globl sdl_kernels_fatbin_start\\n\"
        \".hidden sdl_kernels_fatbin_start\\n\"
        \"sdl_kernels_fatbin_start:\\n\"
        \".incbin \\\"${fatbin}\\\"\\n\"
        \".byte 0\\n\"
        \".previous\\n\");
")
  set_source_files_properties("${gen}/kernels_fatbin.cc" PROPERTIES OBJECT_DEPENDS "${fatbin}")
  target_sources(${target} PRIVATE
    "${src}/gpu/dynlib.cc"
    "${src}/gpu/cuda_api.cc"
    "${src}/gpu/cuda_util.cc"
    "${src}/gpu/kernels.cc"
    "${gen}/kernels_fatbin.cc"
    "${src}/ops/cuda_memory.cc")
  target_compile_definitions(${target} PUBLIC SDL_HAVE_CUDA=1)
  # Headers only: the types and declarations; no CUDA library is linked.
  target_include_directories(${target} PUBLIC ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(${target} PUBLIC ${CMAKE_DL_LIBS})

  if(SDL_NCCL_BUILT)
    target_sources(${target} PRIVATE "${src}/gpu/nccl_api.cc" "${src}/gpu/nccl_comm.cc"
                                     "${src}/ops/nccl_backend.cc")
    target_compile_definitions(${target} PUBLIC SDL_HAVE_NCCL=1)
    target_include_directories(${target} PUBLIC "${SDL_NCCL_INCLUDE_DIR}")
  endif()
endfunction()
