"""The extension uses the process's shared C++ runtime, never a static copy of its own.

On the H100 machine (issue 29) the image's g++ was a wrapper with ``-B`` into a folder
holding ``libstdc++.a`` but no ``libstdc++.so``, so ``_core`` carried a static libstdc++
beside the shared one that torch and Gloo use: importing torch after ``spark_dl._core``
aborted ("free(): invalid pointer" in ``std::locale::~locale``) and the core's own
``ostream << double`` crashed in ``std::codecvt``. native/cmake/cxx_runtime.cmake detects
such a compiler and links the shared runtime explicitly; these tests hold that, on this
machine's build and on a compiler made to behave like that wrapper.
"""

import os
import shutil
import subprocess
import sys

import pytest

from spark_dl import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = os.path.join(ROOT, "native", "cmake", "cxx_runtime.cmake")


def _dynamic(path, flag):
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) is needed; it comes with the compiler that built _core"
    return subprocess.run([readelf, "-W", flag, path], capture_output=True, text=True,
                          check=True).stdout


def test_extension_needs_the_shared_cxx_runtime_and_carries_none():
    needed = [line.split("[", 1)[1].rstrip("]") for line in
              _dynamic(_core.__file__, "-d").splitlines() if "(NEEDED)" in line]
    assert "libstdc++.so.6" in needed, needed
    # A static copy would define (and export) the locale machinery itself.
    defined = [line.split()[-1] for line in _dynamic(_core.__file__, "--dyn-syms").splitlines()
               if " UND " not in line and "_ZNSt6locale" in line]
    assert not defined, defined[:5]


def test_torch_imports_after_the_core_and_the_core_formats_numbers():
    pytest.importorskip("torch")
    code = ("import spark_dl._core\n"
            "import torch\n"
            "import spark_dl.torch as hvd\n"
            "hvd.init()\n"
            "out = hvd.allreduce(torch.full((5,), 3.0), op=hvd.Average, prescale_factor=0.5)\n"
            "assert out.tolist() == [1.5] * 5, out\n"
            "hvd.shutdown()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDL_", "HOROVOD_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def _configure(tmp_path, name, cxx):
    """SDL_CXX_RUNTIME as cxx_runtime.cmake sets it for compiler ``cxx``."""
    src = tmp_path / name
    src.mkdir()
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.19)\nproject(probe LANGUAGES CXX)\n"
        f'include("{MODULE}")\n'
        'file(WRITE "${CMAKE_BINARY_DIR}/runtime.txt" "${SDL_CXX_RUNTIME}")\n')
    build = tmp_path / (name + "-build")
    proc = subprocess.run(["cmake", "-S", str(src), "-B", str(build),
                           f"-DCMAKE_CXX_COMPILER={cxx}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (build / "runtime.txt").read_text(), proc.stdout


def _gxx():
    gxx = shutil.which("g++")
    if not gxx or not shutil.which("cmake"):
        pytest.skip("needs g++ and cmake (the native build's own tools)")
    return gxx


def test_a_normal_gcc_keeps_its_default(tmp_path):
    runtime, _ = _configure(tmp_path, "plain", _gxx())
    assert runtime == ""


def test_a_gcc_that_would_link_libstdcxx_statically_gets_the_shared_one(tmp_path):
    gxx = _gxx()
    archive = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert os.path.isabs(archive), f"{gxx} has no libstdc++.a: {archive}"
    # The wrapper seen on the GPU image: -B into a copy of GCC's library folder without
    # libstdc++.so, so -lstdc++ finds the archive first.
    libdir = tmp_path / "gcc-lib"
    libdir.mkdir()
    for entry in os.listdir(os.path.dirname(archive)):
        if not entry.startswith("libstdc++.so"):
            os.symlink(os.path.join(os.path.dirname(archive), entry), libdir / entry)
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec "{gxx}" -B{libdir}/ "$@"\n')
    wrapper.chmod(0o755)
    runtime, log = _configure(tmp_path, "wrapped", str(wrapper))
    assert os.path.basename(runtime) == "libstdc++.so.6" and os.path.exists(runtime), log
    assert "would link libstdc++ statically" in log
