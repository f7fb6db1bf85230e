#include "gpu/dynlib.h"

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <algorithm>
#include <mutex>

namespace sdl {
namespace gpu {
namespace {

std::mutex g_roots_mu;
std::vector<std::string> g_extra_roots;

bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string Dirname(const std::string& p) {
  size_t slash = p.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

// The directory holding the shared object that contains this function.
std::string ThisLibraryDir() {
  Dl_info info;
  if (::dladdr(reinterpret_cast<void*>(&ThisLibraryDir), &info) == 0 || !info.dli_fname)
    return "";
  char resolved[4096];
  if (::realpath(info.dli_fname, resolved) == nullptr) return Dirname(info.dli_fname);
  return Dirname(resolved);
}

// Expands "a/*/b" under root into existing directories (one "*" element at most
// per path element; enough for the nvidia wheels' nvidia/<component>/lib).
void ExpandGlob(const std::string& root, const std::string& glob, std::vector<std::string>* out) {
  std::vector<std::string> current{root};
  size_t start = 0;
  while (start <= glob.size()) {
    size_t slash = glob.find('/', start);
    std::string part = glob.substr(start, slash == std::string::npos ? std::string::npos
                                                                      : slash - start);
    std::vector<std::string> next;
    for (const auto& dir : current) {
      if (part == "*") {
        DIR* d = ::opendir(dir.c_str());
        if (!d) continue;
        std::vector<std::string> names;
        while (dirent* e = ::readdir(d)) {
          std::string n = e->d_name;
          if (n != "." && n != ".." && IsDir(dir + "/" + n)) names.push_back(n);
        }
        ::closedir(d);
        std::sort(names.begin(), names.end());  // deterministic order
        for (const auto& n : names) next.push_back(dir + "/" + n);
      } else if (!part.empty()) {
        if (IsDir(dir + "/" + part)) next.push_back(dir + "/" + part);
      } else {
        next.push_back(dir);
      }
    }
    current.swap(next);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  out->insert(out->end(), current.begin(), current.end());
}

DynLib Loaded(void* handle, const std::string& fallback_path) {
  DynLib lib;
  lib.handle = handle;
  lib.path = fallback_path;
  struct link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && map->l_name[0])
    lib.path = map->l_name;
  return lib;
}

}  // namespace

void* DynLib::Symbol(const char* name) const {
  return handle ? ::dlsym(handle, name) : nullptr;
}

void AddSearchRoots(const std::vector<std::string>& roots) {
  std::lock_guard<std::mutex> lk(g_roots_mu);
  for (const auto& r : roots) {
    if (r.empty()) continue;
    if (std::find(g_extra_roots.begin(), g_extra_roots.end(), r) == g_extra_roots.end())
      g_extra_roots.push_back(r);
  }
}

std::vector<std::string> SearchRoots() {
  std::vector<std::string> roots;
  std::string here = ThisLibraryDir();
  if (!here.empty()) roots.push_back(Dirname(here));  // .../site-packages/spark_dl -> site-packages
  std::lock_guard<std::mutex> lk(g_roots_mu);
  for (const auto& r : g_extra_roots)
    if (std::find(roots.begin(), roots.end(), r) == roots.end()) roots.push_back(r);
  return roots;
}

DynLib OpenLibrary(const char* what, const LibrarySearch& search, std::string* error) {
  // 1. Already in the process (e.g. loaded by torch): share it.
  for (const auto& so : search.sonames) {
    if (void* h = ::dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return Loaded(h, so);
  }
  std::vector<std::string> tried;
  std::string last_dlerror;
  auto try_path = [&](const std::string& path) -> void* {
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      // A file that exists but does not load (wrong architecture, missing
      // dependency) is worth reporting; "not found" for every candidate is not.
      if (e && (IsFile(path) || std::string(e).find("No such file") == std::string::npos))
        last_dlerror = e;
    }
    return h;
  };
  // 2. The wheels' directories under every search root.
  const std::vector<std::string> roots = SearchRoots();
  std::vector<std::string> dirs;
  for (const auto& root : roots)
    for (const auto& glob : search.subdir_globs) ExpandGlob(root, glob, &dirs);
  for (const auto& dir : dirs) {
    for (const auto& so : search.sonames) {
      std::string path = dir + "/" + so;
      if (!IsFile(path)) continue;
      if (void* h = try_path(path)) return Loaded(h, path);
    }
  }
  if (!search.subdir_globs.empty()) {
    std::string globs, under;
    for (const auto& g : search.subdir_globs) globs += (globs.empty() ? "" : ", ") + g;
    for (const auto& r : roots) under += (under.empty() ? "" : ", ") + r;
    tried.push_back(globs + " under " + (under.empty() ? "no search root" : under));
  }
  // 3. The dynamic loader's own search path.
  for (const auto& so : search.sonames)
    if (void* h = try_path(so)) return Loaded(h, so);
  tried.push_back("the dynamic loader's path (LD_LIBRARY_PATH, ldconfig)");
  // 4. Fixed places.
  for (const auto& dir : search.fixed_dirs) {
    for (const auto& so : search.sonames) {
      std::string path = dir + "/" + so;
      if (!IsFile(path)) continue;
      if (void* h = try_path(path)) return Loaded(h, path);
    }
    tried.push_back(dir);
  }
  if (error) {
    std::string names;
    for (const auto& so : search.sonames) names += (names.empty() ? "" : " or ") + so;
    std::string where;
    for (const auto& t : tried) where += (where.empty() ? "" : "; ") + t;
    *error = std::string(what) + " (" + names + ") was not found; searched: " + where;
    if (!last_dlerror.empty()) *error += "; last dlopen error: " + last_dlerror;
  }
  return DynLib();
}

}  // namespace gpu
}  // namespace sdl
