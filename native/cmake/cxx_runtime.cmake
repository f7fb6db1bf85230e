# The C++ runtime the extension links: always the shared libstdc++.so.6.
#
# Gloo, torch, TensorFlow and MPI use the shared C++ runtime. An extension that carries a
# static copy of libstdc++ puts a second runtime into the same process, with its own
# locale state; streams built by one and destroyed or formatted by the other then crash
# ("free(): invalid pointer" in std::locale::~locale when torch is imported after
# spark_dl._core; a segfault in std::codecvt under `ostream << double` in the core's
# coordinator). Seen on a GPU image whose g++ is a wrapper passing
# -B/opt/gcc/lib/gcc/x86_64-linux-gnu/13/, a folder holding libstdc++.a but no
# libstdc++.so: the linker's -lstdc++ then takes the archive.
#
# The probe links a small shared library the way the extension is linked and reads the
# linker's trace (-Wl,-t). Where it took libstdc++.a and no libstdc++.so, the shared
# runtime the compiler can find (-print-file-name=libstdc++.so.6, else the usual library
# folders) is linked explicitly, ahead of the compiler's own -lstdc++, so the archive
# contributes nothing. Without a shared runtime the build stops with what to install.
#
# Sets SDL_CXX_RUNTIME: the library to link (empty: the compiler's default is fine).
set(SDL_CXX_RUNTIME "")
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(_sdl_probe_dir "${CMAKE_CURRENT_BINARY_DIR}/cxx_runtime_probe")
  file(MAKE_DIRECTORY "${_sdl_probe_dir}")
  file(WRITE "${_sdl_probe_dir}/probe.cc"
       "#include <sstream>\n#include <string>\n"
       "std::string sdl_probe(double x) { std::ostringstream s; s << x; return s.str(); }\n")
  execute_process(
    COMMAND "${CMAKE_CXX_COMPILER}" -shared -fPIC probe.cc -o probe.so -Wl,-t
    WORKING_DIRECTORY "${_sdl_probe_dir}"
    RESULT_VARIABLE _sdl_probe_rc OUTPUT_VARIABLE _sdl_probe_out ERROR_VARIABLE _sdl_probe_out)
  if(NOT _sdl_probe_rc EQUAL 0)
    message(STATUS "C++ runtime probe did not link (${_sdl_probe_rc}); keeping the compiler's default")
  elseif(_sdl_probe_out MATCHES "libstdc\\+\\+\\.a" AND NOT _sdl_probe_out MATCHES "libstdc\\+\\+\\.so")
    execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libstdc++.so.6
                    OUTPUT_VARIABLE _sdl_stdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT IS_ABSOLUTE "${_sdl_stdcxx}" OR NOT EXISTS "${_sdl_stdcxx}")
      unset(SDL_LIBSTDCXX_SO CACHE)
      find_file(SDL_LIBSTDCXX_SO libstdc++.so.6
                PATHS ${CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES} /usr/lib/x86_64-linux-gnu
                      /lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib
                NO_DEFAULT_PATH)
      set(_sdl_stdcxx "${SDL_LIBSTDCXX_SO}")
    endif()
    if(NOT _sdl_stdcxx OR NOT EXISTS "${_sdl_stdcxx}")
      message(FATAL_ERROR
        "${CMAKE_CXX_COMPILER} links libstdc++ statically (its library folders hold "
        "libstdc++.a but no libstdc++.so), and no shared libstdc++.so.6 was found: a static "
        "copy in spark_dl's extension would crash beside torch or Gloo. Install the C++ "
        "runtime (Debian/Ubuntu: libstdc++6) or build with a compiler that links it shared "
        "(CXX=/usr/bin/g++).")
    endif()
    set(SDL_CXX_RUNTIME "${_sdl_stdcxx}")
    message(STATUS "${CMAKE_CXX_COMPILER} would link libstdc++ statically: "
                   "linking the shared ${SDL_CXX_RUNTIME} instead")
  endif()
endif()
