#!/usr/bin/env bash
# Sets up a machine for spark_dl from nothing: Debian packages (Gloo, Open MPI,
# a JRE for Spark, the C++ toolchain, googletest for the core's C++ tests, iproute2 and
# OpenSSH for the multi-host tests' network namespaces and sdlrun over ssh), a
# virtualenv in .venv, the Python dependencies with torch pinned to its CPU build
# (constraints.txt), and the native extension (an editable install: scikit-build-core runs CMake).
# Safe to run again: it installs only what is missing and rebuilds incrementally. When
# nothing it installs from has changed since its last success (this script, pyproject.toml,
# setup.cfg, constraints.txt, the knob table the core is built from, every file under
# native/: a hash kept in .venv) and the installed package still imports, it checks that
# and stops within seconds.
# SETUP_FORCE=1 runs every step anyway; `setup.sh --check` only says whether there is
# anything to do (exit 0: nothing, 3: something), changing nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
[ "${1:-}" = "--check" ] && CHECK=1

APT_PACKAGES=(build-essential cmake pkg-config libgloo-dev libopenmpi-dev openmpi-bin libgtest-dev
              openjdk-17-jre-headless procps iproute2 openssh-server openssh-client)
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import ensurepip" >/dev/null 2>&1 || APT_PACKAGES+=(python3-venv)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ] && [ "$CHECK" = 1 ]; then
  echo "setup: would install ${missing[*]}"
  exit 3
fi
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

STAMP=.venv/.spark_dl_setup_stamp
inputs_hash() {
  { sha256sum scripts/setup.sh pyproject.toml setup.cfg constraints.txt spark_dl/config/knobs.json
    find native -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } 2>/dev/null | sha256sum | cut -d' ' -f1
}
# The installed package must be this checkout's (editable), with its extension and the
# main dependencies present (find_spec: without importing torch).
installed_ok() {
  .venv/bin/python - "$PWD" <<'PY' >/dev/null 2>&1
import importlib.util, os, sys
import spark_dl, spark_dl._core
assert os.path.realpath(spark_dl.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
assert all(importlib.util.find_spec(m) for m in ("torch", "numpy", "pyspark", "pyarrow"))
PY
}
if [ "${SETUP_FORCE:-0}" != 1 ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] \
   && [ "$(cat "$STAMP")" = "$(inputs_hash)" ] && installed_ok; then
  echo "setup: nothing changed since the last setup (delete $STAMP or set SETUP_FORCE=1 to redo it)"
  exit 0
fi
if [ "$CHECK" = 1 ]; then
  echo "setup: would install and build (.venv missing, inputs changed since the last setup, or the package does not import)"
  exit 3
fi
rm -f "$STAMP"

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# torch: PyPI's Linux wheel is the CUDA build, which brings ~17 NVIDIA packages (several GB).
# On a machine without an NVIDIA GPU, PyTorch's CPU-only index is added where it can be reached
# (its torch==X+cpu then wins over PyPI's X); where not (machines that reach only a package
# mirror), pip takes what it finds. TORCH_INDEX_URL overrides the index ("" for none).
torch_index=()
if [ -n "${TORCH_INDEX_URL+set}" ]; then
  [ -n "$TORCH_INDEX_URL" ] && torch_index=(--extra-index-url "$TORCH_INDEX_URL")
elif ! { [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; }; then
  cpu_index=https://download.pytorch.org/whl/cpu
  if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
       "$cpu_index" >/dev/null 2>&1; then
    torch_index=(--extra-index-url "$cpu_index")
    echo "setup: no NVIDIA GPU here: torch's CPU build from $cpu_index"
  else
    echo "setup: no NVIDIA GPU here, but $cpu_index cannot be reached: torch from the configured index"
  fi
fi
echo "setup: installing Python dependencies (torch pinned by constraints.txt)"
# pip byte-compiles what it installs one file at a time (about 24,000 files here, over two
# minutes of one core); --no-compile, and compileall on every core at the end instead.
# Compiled they must be: with PYTHONDONTWRITEBYTECODE set, as on some machines, no import
# ever writes a .pyc, and every process would compile TensorFlow, torch and pyspark again.
.venv/bin/python -m pip install -q --no-compile -c constraints.txt "${torch_index[@]}" torch numpy
# Where nvcc is present (CI's machines, GPU hosts) the default build compiles the CUDA code;
# NCCL's header comes from the nvidia-nccl-cu13 wheel in site-packages (cmake/cuda.cmake finds
# it there), so install that first and the NCCL code is compiled too. --no-deps: the wheel's
# only dependency is the CUDA runtime wheel, which a GPU host's driver stack or torch brings.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: nvcc found: installing NCCL's headers and library (nvidia-nccl-cu13)"
  .venv/bin/python -m pip install -q --no-compile --no-deps -c constraints.txt nvidia-nccl-cu13
fi
echo "setup: building spark_dl (native core) in editable mode (${SECONDS}s so far)"
# The build tools live in .venv and the build does not isolate itself: CMake's cache in
# build/ then points at this nanobind, so the C++ tests and CMake checks in the test suite
# can reconfigure and rebuild there (an isolated build's tools are deleted after it).
.venv/bin/python -m pip install -q --no-compile -c constraints.txt "scikit-build-core>=0.10" \
  "nanobind>=2.0"
# Keras: tensorflow-cpu (the same TensorFlow without its GPU parts) instead of the keras
# extra's `tensorflow`, with the keras extra's other requirement.
.venv/bin/python -m pip install -q --no-compile -c constraints.txt --no-build-isolation \
  -e ".[torch,spark,test,mpi,lightning,notebook,mlflow]" tensorflow-cpu keras
echo "setup: byte-compiling the environment's packages (${SECONDS}s so far)"
# Files some packages ship that are not Python 3 (templates, test data) fail to compile,
# as they do under pip: -qq and the exit status ignored.
.venv/bin/python -m compileall -qq -j 0 \
  "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
.venv/bin/python -c "import spark_dl._core as c; print('setup: spark_dl core built:', c.build_info())"
inputs_hash > "$STAMP"
echo "setup: done in ${SECONDS}s"
