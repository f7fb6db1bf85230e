// The GPU layer's part of spark_dl._core: the run-time availability query and
// test-only entry points (names starting with "_gpu_" or "_Gpu": not API; they
// take raw device pointers as integers and exist for tests/gpu and
// tests/unit/test_cuda_build.py). Compiled in every build; without CUDA the
// query reports why nothing is available and the test entry points are absent.
#pragma once

#include <nanobind/nanobind.h>

namespace sdl {
namespace gpu {

void RegisterPythonBindings(nanobind::module_& m);

}  // namespace gpu
}  // namespace sdl
