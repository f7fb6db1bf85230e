"""Builds (or finds) and runs the core's C++ unit tests (native/tests, googletest).

The extension's own build directory (``build/<wheel tag>``, from ``pip install``)
builds them when googletest is installed; this test brings that target up to date
and runs it. Without such a directory it configures ``build/cpp-tests`` itself.
It skips only when googletest (Debian ``libgtest-dev``) is absent; a failing
build or a failing C++ test fails it.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(REPO, "native")
TARGET = "sdl_core_tests"


def _gtest_installed():
    configs = glob.glob("/usr/lib/*/cmake/GTest/GTestConfig.cmake") + glob.glob(
        "/usr/lib/cmake/GTest/GTestConfig.cmake") + glob.glob(
        "/usr/local/lib*/cmake/GTest/GTestConfig.cmake")
    return bool(configs) or os.path.exists("/usr/include/gtest/gtest.h")


def _run(cmd, timeout):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, text=True)
    return proc.returncode, proc.stdout


def _configured_with_tests(build_dir):
    cache = os.path.join(build_dir, "CMakeCache.txt")
    if not os.path.exists(cache):
        return False
    with open(cache) as f:
        text = f.read()
    return (re.search(r"^SDL_BUILD_TESTS:BOOL=ON$", text, re.M) is not None
            and os.path.realpath(NATIVE) in text)


def _build_dir():
    """A configured build directory that has the test target, configuring one if needed."""
    for d in sorted(glob.glob(os.path.join(REPO, "build", "cp*"))):
        if _configured_with_tests(d):
            return d
    d = os.path.join(REPO, "build", "cpp-tests")
    if not _configured_with_tests(d):
        rc, out = _run(["cmake", "-S", NATIVE, "-B", d, "-DSDL_BUILD_TESTS=ON",
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       timeout=300)
        assert rc == 0, f"configuring the C++ tests failed:\n{out[-6000:]}"
    return d


@pytest.mark.timeout(1500)
def test_cpp_unit_tests_pass():
    if not _gtest_installed():
        pytest.skip("googletest is not installed (Debian: apt-get install libgtest-dev; "
                    "scripts/setup.sh installs it)")
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH, but the C++ unit tests need it to build")
    d = _build_dir()
    rc, out = _run(["cmake", "--build", d, "--target", TARGET, "--parallel", "2"], timeout=1200)
    assert rc == 0, f"building {TARGET} in {d} failed:\n{out[-6000:]}"
    binary = os.path.join(d, "tests", TARGET)
    assert os.access(binary, os.X_OK), f"{binary} was not built"
    rc, out = _run([binary, "--gtest_brief=1"], timeout=240)
    assert rc == 0, f"C++ unit tests failed (exit {rc}):\n{out[-8000:]}"
    ran = re.search(r"\[==========\] (\d+) tests? from", out)
    assert ran and int(ran.group(1)) > 0, f"no C++ tests ran:\n{out[-2000:]}"
