"""The wheel, built once per test session, and what the install tests run it in.

- ``wheel``: ``scripts/build_wheel.sh`` into a temporary folder (incremental: the editable
  install's build folder is reused).
- ``wheel_venv``: a new virtualenv with the wheel installed and no access to this checkout.
  Its third-party packages (torch, pyspark, ...) are the main ``.venv``'s, reached through a
  path in a ``.pth`` file: a plain path line adds the folder, but not the ``.pth`` files in
  it, so the editable spark_dl of ``.venv`` stays invisible. ``pip check`` proves the wheel's
  requirements are met. (A complete ``pip install spark_dl-*.whl[torch,spark]`` downloads and
  unpacks ~1.8 GB: measured in docs/install.md, not repeated by every CI run.)
- ``hidden_system``: a command prefix that runs a command in a private mount namespace where
  the project's system libraries and Open MPI's programs are replaced by empty files, as on
  a machine that never installed them (root only).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What scripts/setup.sh's apt packages provide that a wheel user does not have: Gloo and the
# libraries it links, Open MPI's libraries and its launchers.
SYSTEM_LIBRARIES = ("libgloo.so*", "libhiredis.so*", "libibverbs.so*", "libnl-3.so*",
                    "libnl-route-3.so*", "libmpi.so*", "libopen-pal.so*", "libopen-rte.so*")
SYSTEM_PROGRAMS = ("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted")
LIBRARY_DIRS = ("/usr/lib", "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/local/lib")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """Path of the repaired wheel (its folder also holds the sdist)."""
    if sys.platform != "linux" or sysconfig.get_platform() != "linux-x86_64":
        pytest.skip("the wheel is built for Linux x86_64")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_wheel.sh"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = glob.glob(str(out / "spark_dl-*.whl"))
    assert len(wheels) == 1, (wheels, proc.stdout[-2000:])
    return wheels[0]


@pytest.fixture(scope="session")
def wheel_venv(wheel, tmp_path_factory):
    """The bin folder of a new venv with the wheel installed (see the module docstring)."""
    venv = tmp_path_factory.mktemp("wheel_venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "main_venv_packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["install", "--no-deps", wheel], check=True, timeout=600,
                   stdin=subprocess.DEVNULL)
    check = subprocess.run(pip + ["check"], capture_output=True, text=True, timeout=300)
    mine = [ln for ln in check.stdout.splitlines() if ln.lower().startswith("spark-dl")
            or ln.lower().startswith("spark_dl")]
    assert not mine, check.stdout
    return venv / "bin"


def _system_files():
    files = set()
    for folder in LIBRARY_DIRS:
        for pattern in SYSTEM_LIBRARIES:
            for path in glob.glob(os.path.join(folder, pattern)):
                files.add(os.path.realpath(path))
    for program in SYSTEM_PROGRAMS:
        path = shutil.which(program)
        if path:
            files.add(os.path.realpath(path))
    return sorted(files)


@pytest.fixture(scope="session")
def hidden_system():
    """A command prefix (list) running its command where the system's Gloo and Open MPI are
    empty files; skips where mount namespaces are not available (not root)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the system libraries needs root (unshare --mount)")
    files = _system_files()
    assert any("libgloo" in f for f in files), "the system Gloo this test hides was not found"
    script = ('for f in "$@"; do [ "$f" = -- ] && break; mount --bind /dev/null "$f" || exit 97; '
              'shift; done; shift; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "hide",
            *files, "--"]
