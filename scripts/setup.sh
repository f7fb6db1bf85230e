#!/usr/bin/env bash
# Sets up a machine for spark_dl from nothing: Debian packages (Gloo, Open MPI,
# a JRE for Spark, the C++ toolchain), a virtualenv in .venv, the Python
# dependencies with torch pinned to its CPU build (constraints.txt), and the
# native extension (an editable install: scikit-build-core runs CMake).
# Safe to run again: it installs only what is missing and rebuilds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(build-essential cmake pkg-config libgloo-dev libopenmpi-dev openmpi-bin
              openjdk-17-jre-headless procps)
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import ensurepip" >/dev/null 2>&1 || APT_PACKAGES+=(python3-venv)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
echo "setup: installing Python dependencies (torch pinned by constraints.txt)"
.venv/bin/python -m pip install -q -c constraints.txt torch numpy
echo "setup: building spark_dl (native core) in editable mode"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[torch,spark,test,mpi,keras,lightning]"
.venv/bin/python -c "import spark_dl._core as c; print('setup: spark_dl core built:', c.build_info())"
