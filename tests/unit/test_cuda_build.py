"""The CUDA/NCCL build on a machine with nvcc but maybe no GPU (CI's and ours).

What this checks without a GPU: the default build compiled the CUDA (and, with
nccl.h present, the NCCL) code; the extension does not link libcudart or libnccl
(they are opened at run time, so one build serves CPU-only and GPU hosts); the
run-time query says clearly why CUDA is not usable; the library loader's errors
name what was searched; the host-side work division of the batched copy kernels
covers every element once; the kernels' own code, run on the CPU block by
block and thread by thread, gives the CPU transports' results; and the CPU-only
configurations still configure.
The kernels and NCCL themselves run in tests/gpu (skipped without a GPU).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from spark_dl import _core
from spark_dl.common import basics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nvcc():
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def _wheel_nccl_header():
    """nccl.h from an nvidia-nccl-cu* wheel in this interpreter's site-packages, if any."""
    for d in [sysconfig.get_paths()["purelib"], *sys.path]:
        hits = glob.glob(os.path.join(d, "nvidia", "*", "include", "nccl.h"))
        if hits:
            return hits[0]
    return None


def _has_gpu():
    return bool(glob.glob("/dev/nvidia[0-9]*"))


needs_cuda_build = pytest.mark.skipif(
    not _core.build_info()["cuda"], reason="extension built without CUDA (no nvcc at build time)")


def test_build_info_tells_what_was_compiled():
    info = _core.build_info()
    if _nvcc():
        assert info["cuda"] is True, "nvcc is on this machine, so the default build compiles CUDA"
    if info["cuda"] and _wheel_nccl_header():
        assert info["nccl"] is True, "nccl.h is in site-packages, so the build compiles NCCL"
    assert basics.cuda_built() == info["cuda"] and basics.nccl_built() == info["nccl"]
    if not info["nccl"]:
        assert _core.gpu_runtime_info()["nccl_reason"]  # why it was left out


def test_nvcc_machines_build_nccl_too():
    """scripts/setup.sh installs the pinned nvidia-nccl-cu13 wheel where nvcc is present,
    before the editable build, so a CI machine (nvcc, no GPU) compiles the NCCL code."""
    if not _nvcc():
        pytest.skip("no nvcc here: the default build is CPU-only")
    assert _wheel_nccl_header(), (
        "nvcc is present but no nvidia-nccl-cu* wheel is in site-packages: run scripts/setup.sh "
        "(it installs nvidia-nccl-cu13 when nvcc is found)")
    info = _core.build_info()
    assert info["cuda"] is True and info["nccl"] is True, info


def test_setup_installs_the_pinned_nccl_wheel_before_the_build():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "scripts", "setup.sh")) as f:
        script = f.read()
    with open(os.path.join(root, "constraints.txt")) as f:
        pins = [ln.strip() for ln in f if ln.strip().startswith("nvidia-nccl-cu13==")]
    assert pins, "constraints.txt pins nvidia-nccl-cu13"
    wheel = script.index("--no-deps -c constraints.txt nvidia-nccl-cu13")
    assert wheel < script.index('-e ".[')  # before the editable build that looks for nccl.h
    assert "command -v nvcc" in script[:wheel]


def test_extension_links_neither_cudart_nor_nccl():
    readelf = shutil.which("readelf")
    if not readelf:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run([readelf, "-d", _core.__file__], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
              if "(NEEDED)" in line]
    assert needed, out  # the parse found the dynamic section
    linked = [n for n in needed if any(k in n for k in ("cudart", "nccl", "libcuda"))]
    assert not linked, f"{_core.__file__} must load these at run time, not link them: {linked}"


@needs_cuda_build
def test_kernel_fatbin_is_embedded():
    objcopy = shutil.which("objcopy")
    if not objcopy:
        pytest.skip("objcopy (binutils) is not installed")
    info = _core.gpu_runtime_info()
    assert "sm_90" in info["cuda_architectures"], info["cuda_architectures"]  # H100
    assert "compute_" in info["cuda_architectures"]  # PTX for newer GPUs
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sdl_fatbin_{os.getpid()}.bin")
    try:
        subprocess.run([objcopy, "-O", "binary", "--only-section=sdl_kernels_fatbin",
                        _core.__file__, out], check=True, capture_output=True, timeout=60)
        data = open(out, "rb").read()
    finally:
        if os.path.exists(out):
            os.unlink(out)
    assert data[:4] == bytes.fromhex("50ed55ba"), "not a CUDA fatbin (magic 0xBA55ED50)"
    for kernel in (b"sdl_batched_copy", b"sdl_scaled_copy_f16", b"sdl_scaled_copy_bf16",
                   b"sdl_scaled_copy_f64", b"sdl_scaled_copy_i64"):
        assert kernel in data, kernel


@needs_cuda_build
def test_runtime_usability_is_a_separate_question_with_a_reason():
    info = _core.gpu_runtime_info()
    assert info["cuda_built"] is True
    assert info["cuda_usable"] == (info["device_count"] > 0)
    if info["nccl_built"]:
        assert info["nccl_usable"] == info["cuda_usable"] or not info["nccl_library"]
    if _has_gpu():
        pytest.skip("a GPU is present: tests/gpu checks the usable case")
    assert info["cuda_usable"] is False and info["nccl_usable"] is False
    reason = info["cuda_reason"]
    # Either no runtime library at all, or the runtime without a driver/device.
    assert ("CUDA runtime" in reason and "not found" in reason) or \
        "cudaGetDeviceCount" in reason or "no device" in reason, reason
    assert info["nccl_reason"], info
    if info["nccl_library"]:  # the wheel's libnccl loaded fine; only the GPU is missing
        assert "CUDA is not usable" in info["nccl_reason"]
        assert info["nccl_version"] >= 21400


@needs_cuda_build
def test_loader_names_what_it_searched_when_a_library_is_missing():
    path, error = _core._gpu_test_open_library(
        "a test library", ["libsdl_no_such_lib.so.7"], ["nvidia/*/lib"], ["/nonexistent/lib"])
    assert path is None
    assert error.startswith("a test library (libsdl_no_such_lib.so.7) was not found")
    assert "nvidia/*/lib under" in error and "/nonexistent/lib" in error
    assert "LD_LIBRARY_PATH" in error


@needs_cuda_build
def test_loader_finds_a_library_in_a_wheel_layout_and_reports_a_broken_one(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to make a test library")
    lib_dir = tmp_path / "nvidia" / "fake_component" / "lib"
    lib_dir.mkdir(parents=True)
    src = tmp_path / "fake.c"
    src.write_text("int sdl_fake_symbol(void) { return 42; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libsdl_fake.so.1", "-o",
                    str(lib_dir / "libsdl_fake.so.1"), str(src)], check=True, timeout=120)
    (lib_dir / "libsdl_broken.so.1").write_bytes(b"this is not an ELF file")
    sys.path.insert(0, str(tmp_path))
    try:
        _core.gpu_runtime_info()  # adds sys.path to the loader's search roots
        path, error = _core._gpu_test_open_library("fake", ["libsdl_fake.so.1"],
                                                   ["nvidia/*/lib"], [])
        assert path == str(lib_dir / "libsdl_fake.so.1"), error
        path, error = _core._gpu_test_open_library("broken", ["libsdl_broken.so.1"],
                                                   ["nvidia/*/lib"], [])
        assert path is None
        assert "last dlopen error" in error and "libsdl_broken.so.1" in error, error
    finally:
        sys.path.remove(str(tmp_path))


@needs_cuda_build
@pytest.mark.parametrize("elem_size", [1, 2, 4, 8])
def test_batch_plan_covers_every_element_once(elem_size):
    chunk_elems = 16384 // elem_size
    counts = [0, 1, 7, chunk_elems - 1, chunk_elems, chunk_elems + 1, 3 * chunk_elems + 5]
    counts += [(i * 37) % 1000 + 1 for i in range(300)]  # more spans than one launch holds
    launches = _core._gpu_test_plan_batches(counts, elem_size)
    nonzero = [i for i, c in enumerate(counts) if c]
    assert len(launches) == -(-len(nonzero) // 128)  # 128 spans per launch at most
    seen = {}
    for entries, launch_chunk_elems, grid, chunks in launches:
        assert 1 <= entries <= 128 and launch_chunk_elems == chunk_elems
        assert 1 <= grid <= len(chunks)
        for span, begin, end in chunks:
            assert begin < end <= counts[span]
            assert begin % chunk_elems == 0  # aligned chunks keep 16-byte vectors aligned
            seen.setdefault(span, []).append((begin, end))
    assert sorted(seen) == nonzero
    for span, ranges in seen.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == counts[span]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (span, ranges)


def _cuda_include_dir():
    """A directory with the CUDA headers (cuda_fp16.h), or None."""
    candidates = []
    nvcc = _nvcc()
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                       "include"))
    candidates.append("/usr/local/cuda/include")
    for d in [sysconfig.get_paths()["purelib"], *sys.path]:
        candidates += glob.glob(os.path.join(d, "nvidia", "*", "include"))
    return next((c for c in candidates if os.path.exists(os.path.join(c, "cuda_fp16.h"))), None)


@pytest.mark.slow
def test_kernel_code_run_on_the_host_matches_the_cpu_scale(tmp_path):
    """kernels.cu's copy body, every block and thread in turn on the CPU, for every dtype,
    odd sizes, misaligned, in-place and multi-launch batches (kernels_host_check.cc)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    include = _cuda_include_dir()
    if not cxx or not include:
        pytest.skip("needs a C++ compiler and the CUDA headers")
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "build_config.h").write_text(
        '#pragma once\n#define SDL_CUDA_BUILD_NOTE ""\n#define SDL_NCCL_BUILD_NOTE ""\n'
        '#define SDL_CUDA_ARCH_STRING "host check"\n')
    src = os.path.join(ROOT, "native", "src")
    exe = str(tmp_path / "kernels_host_check")
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{src}",
         f"-I{tmp_path}", f"-I{include}", "-o", exe,
         *(os.path.join(src, f) for f in ("gpu/kernels_host_check.cc", "gpu/kernels.cc",
                                          "gpu/cuda_api.cc", "gpu/dynlib.cc",
                                          "common/types.cc", "common/reduce.cc")), "-ldl"],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-5000:]
    assert "warning" not in build.stderr, build.stderr[-5000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-5000:]
    assert "kernel emulation: " in run.stdout and ", 0 failed" in run.stdout, run.stdout[-2000:]


def _configure(tmp_path, name, *args, env=None):
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("cmake is not installed")
    build = tmp_path / name
    proc = subprocess.run(
        [cmake, "-S", os.path.join(ROOT, "native"), "-B", str(build),
         f"-DPython_EXECUTABLE={sys.executable}", *args],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_cpu_only_configure_with_cuda_off(tmp_path):
    out = _configure(tmp_path, "off", "-DSDL_WITH_CUDA=OFF")
    assert "- CUDA (GPU tensors): SDL_WITH_CUDA=OFF" in out, out
    assert "- NCCL (fused GPU collectives): needs CUDA" in out, out
    assert "+ CUDA kernels" not in out


def _path_without_nvcc():
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "nvcc")))


@pytest.mark.slow
def test_cpu_only_configure_without_nvcc_on_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDA_HOME")}
    env["PATH"] = _path_without_nvcc()
    out = _configure(tmp_path, "nonvcc", env=env)
    assert "- CUDA (GPU tensors): nvcc not found" in out, out
    assert "+ CUDA kernels" not in out


@pytest.mark.slow
def test_cuda_on_without_nvcc_fails_clearly(tmp_path):
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("cmake is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDA_HOME")}
    env["PATH"] = _path_without_nvcc()
    proc = subprocess.run(
        [cmake, "-S", os.path.join(ROOT, "native"), "-B", str(tmp_path / "on"),
         f"-DPython_EXECUTABLE={sys.executable}", "-DSDL_WITH_CUDA=ON"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "SDL_WITH_CUDA=ON, but CUDA cannot be built: nvcc not found" in proc.stderr, \
        proc.stderr[-3000:]


class _FakeTensor:
    """Just enough of a torch tensor for cuda_pack_for_tests' argument checks (no GPU)."""

    def __init__(self, ptr, nbytes, contiguous=True, dtype="torch.float32"):
        self._ptr, self.nbytes, self._contiguous, self.dtype = ptr, nbytes, contiguous, dtype

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contiguous


@needs_cuda_build
def test_pack_binding_checks_its_arguments_before_touching_the_gpu():
    buf = _FakeTensor(4096, 64)
    with pytest.raises(_core.CoreError, match="not contiguous"):
        _core.cuda_pack_for_tests([_FakeTensor(0, 16, contiguous=False)], buf, False, 1.0)
    with pytest.raises(_core.CoreError, match="the tensors hold 80 bytes, the buffer 64"):
        _core.cuda_pack_for_tests([_FakeTensor(0, 40), _FakeTensor(64, 40)], buf, False, 1.0)
    with pytest.raises(_core.CoreError, match="tensors of float32 and int64"):
        _core.cuda_pack_for_tests([_FakeTensor(0, 8), _FakeTensor(8, 8, dtype="torch.int64")],
                                  buf, False, 1.0)
    with pytest.raises(_core.CoreError, match="expected CUDA tensors"):
        _core.cuda_pack_for_tests([object()], buf, False, 1.0)
