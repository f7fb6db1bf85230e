// Opening the CUDA runtime and NCCL at run time (dlopen), so one build of
// spark_dl runs on CPU-only hosts and on GPU hosts: the extension has no
// DT_NEEDED entry on libcudart or libnccl (tests/unit/test_cuda_build.py checks).
#pragma once

#include <string>
#include <vector>

namespace sdl {
namespace gpu {

// A shared library opened with dlopen. Never closed: CUDA and NCCL register
// atexit work and threads, and unloading them under a live process is unsafe.
struct DynLib {
  void* handle = nullptr;
  std::string path;  // the file the dynamic loader resolved (for messages and build_info)

  bool loaded() const { return handle != nullptr; }
  // The address of `name`, or nullptr.
  void* Symbol(const char* name) const;
};

// Where to look for a library besides the dynamic loader's own search path.
//   subdir_globs: directories relative to each search root, where one "*" path
//                 element matches any subdirectory ("nvidia/*/lib").
//   fixed_dirs:   absolute directories tried after the loader's search path
//                 (the CUDA toolkit's usual place).
struct LibrarySearch {
  std::vector<std::string> sonames;  // in order of preference: "libcudart.so.13", ...
  std::vector<std::string> subdir_globs;
  std::vector<std::string> fixed_dirs;
};

// Opens the first library found, in this order:
//   1. a soname the process already has loaded (RTLD_NOLOAD): the copy PyTorch
//      loaded, so both share one CUDA runtime / NCCL;
//   2. <root>/<subdir_glob>/<soname> for every search root (the site-packages
//      that holds this extension, then those added with AddSearchRoots): the
//      nvidia-* wheels' layout;
//   3. the bare soname through the dynamic loader (LD_LIBRARY_PATH, ldconfig);
//   4. <fixed_dir>/<soname>.
// On failure returns an unloaded DynLib and sets *error to what was tried and
// what dlopen said, naming `what` ("the CUDA runtime").
DynLib OpenLibrary(const char* what, const LibrarySearch& search, std::string* error);

// Adds directories (typically Python's sys.path) searched in step 2. Thread-safe;
// takes effect for libraries not loaded yet.
void AddSearchRoots(const std::vector<std::string>& roots);

// The search roots in use: the directory above the one holding this extension
// (site-packages for an installed spark_dl), then the added ones, deduplicated.
std::vector<std::string> SearchRoots();

}  // namespace gpu
}  // namespace sdl
