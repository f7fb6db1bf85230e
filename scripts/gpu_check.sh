#!/usr/bin/env bash
# GPU check of spark_dl in one command, on the GPU machine itself (docs/gpu.md):
#
#     bash scripts/gpu_check.sh                # build, tests/gpu, benchmarks/gpu.py, summary
#     bash scripts/gpu_check.sh --fetch-deps   # on a networked Debian/Ubuntu machine: put
#                                              # the Gloo packages into .gpudeps/ to carry
#
# Nothing built on a CPU machine runs on the GPU machine (its Python and torch differ), so
# this builds the extension there: a virtualenv with --system-site-packages (torch, CUDA's
# wheels, nanobind, scikit-build-core, CMake come from the system), then an editable
# install without network (--no-index --no-build-isolation --no-deps). Gloo (Debian's
# libgloo-dev) is needed by the build; where the system lacks it, the .deb files in
# .gpudeps/ (from --fetch-deps) are unpacked into a private prefix.
#
# Settings (environment): PYTHON (default python3), SDL_GPU_CHECK_OUT (logs; default
# build/gpu-check), SDL_CMAKE_ARGS (extra CMake arguments, e.g. -DSDL_CUDA_ARCHITECTURES=90),
# SDL_GPU_CHECK_TESTS (pytest selection; default tests/gpu tests/unit/test_gpu_*.py).
# The C++ unit tests (native/tests: hierarchical allreduce, pinned staging pool, backend
# choice with fakes) run too when the build found googletest; CUDA being usable there does
# not change them, except that the refusal of CUDA tensors without a backend is skipped.
# Exit status: 0 when the build, every test and the benchmark passed; 1 otherwise; 2 when
# something the check needs is missing (it says what).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEPS_DIR="$ROOT/.gpudeps"
GLOO_DEBS="libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200"

say() { printf '\n=== %s\n' "$*"; }
die() { printf '\ngpu_check: %s\n' "$1" >&2; exit "${2:-1}"; }

if [[ "${1:-}" == "--fetch-deps" ]]; then
    command -v apt-get >/dev/null || die "--fetch-deps needs apt-get (Debian/Ubuntu)" 2
    mkdir -p "$DEPS_DIR"
    (cd "$DEPS_DIR" && apt-get download $GLOO_DEBS) || die "apt-get download failed" 2
    ls -l "$DEPS_DIR"
    echo "carry .gpudeps/ to the GPU machine (it is not committed: add it to .git/info/exclude)"
    exit 0
fi

PY="${PYTHON:-python3}"
OUTDIR="${SDL_GPU_CHECK_OUT:-$ROOT/build/gpu-check}"
VENV="${SDL_GPU_CHECK_VENV:-/tmp/sdl-gpu-venv}"
mkdir -p "$OUTDIR"
declare -A RESULT

# ----------------------------------------------------------------------------- the machine
say "machine"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version \
    --format=csv || echo "nvidia-smi: not found"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc: not found"
command -v cmake >/dev/null && cmake --version | head -n 1 || echo "cmake: not on PATH"
"$PY" - <<'EOF' || die "$PY cannot import torch: this check runs spark_dl.torch on CUDA" 2
import sys, torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
EOF

# Without a usable GPU every test of tests/gpu skips: the check must not pass then.
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    RESULT[cuda]=ok
else
    RESULT[cuda]="NOT AVAILABLE (torch.cuda.is_available() is False: tests/gpu skip)"
fi

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["scikit_build_core", "nanobind", "numpy", "cloudpickle", "psutil", "pytest",
        "pytest_timeout"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [[ -n "$missing" ]]; then
    die "missing Python packages: $missing. The build needs scikit-build-core and nanobind, \
the tests pytest and pytest-timeout; carry them as wheels (docs/gpu.md)" 2
fi

# ----------------------------------------------------------------------------- Gloo
gloo_found() {
    for d in /usr/include /usr/local/include ${CPATH:+${CPATH//:/ }}; do
        [[ -f "$d/gloo/allreduce.h" ]] && return 0
    done
    return 1
}
if ! gloo_found; then
    shopt -s nullglob
    debs=("$DEPS_DIR"/*.deb)
    [[ ${#debs[@]} -gt 0 ]] || die "Gloo is not installed here and .gpudeps/ holds no .deb: \
run 'bash scripts/gpu_check.sh --fetch-deps' on a networked Debian/Ubuntu machine and carry \
.gpudeps/ (packages: $GLOO_DEBS)" 2
    PREFIX=/tmp/sdl-gpudeps
    rm -rf "$PREFIX" && mkdir -p "$PREFIX"
    for f in "${debs[@]}"; do dpkg -x "$f" "$PREFIX" || die "cannot unpack $f" 2; done
    # Debian's Gloo config names its library by absolute path: point it into the prefix.
    for f in "$PREFIX"/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
        sed -i "s#\"/usr/lib/#\"$PREFIX/usr/lib/#g" "$f"
    done
    export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
    LIBS="$PREFIX/usr/lib:$PREFIX/usr/lib/x86_64-linux-gnu"
    export LIBRARY_PATH="$LIBS${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "Gloo: unpacked ${#debs[@]} packages from .gpudeps/ into $PREFIX"
fi

# ----------------------------------------------------------------------------- build
say "build (log: $OUTDIR/build.log)"
rm -rf "$VENV"
PIP=()
if "$PY" -m venv --system-site-packages "$VENV" 2>"$OUTDIR/venv.log"; then
    PIP=("$VENV/bin/python" -m pip)
elif "$PY" -m venv --system-site-packages --without-pip "$VENV" 2>>"$OUTDIR/venv.log"; then
    PIP=("$PY" -m pip --python "$VENV/bin/python")  # no ensurepip here: $PY's pip drives it
else
    cat "$OUTDIR/venv.log"
    die "cannot create the virtualenv $VENV" 2
fi
VPY="$VENV/bin/python"
# --system-site-packages gives the *base* interpreter's packages; when $PY is itself a
# virtualenv (its torch lives there), its site-packages are added too (after the new
# environment's own, so that the spark_dl built here wins).
PARENT_SITE=$("$PY" -c 'import site; print("\n".join(site.getsitepackages()))')
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
while IFS= read -r dir; do
    [[ -n "$dir" ]] && echo "import site; site.addsitedir('$dir')"
done <<<"$PARENT_SITE" >"$VSITE/_sdl_parent_site.pth"
"$VPY" -c 'import torch, nanobind, scikit_build_core' \
    || die "the virtualenv $VENV does not see torch, nanobind or scikit-build-core of $PY" 2
export SKBUILD_CMAKE_ARGS="${SDL_CMAKE_ARGS:-}"
# A build folder of its own: a CPU build of the same checkout keeps its CMake cache.
export SKBUILD_BUILD_DIR="$ROOT/build/gpu-check-build"
export SKBUILD_BUILD_VERBOSE=true
if "${PIP[@]}" install --no-index --no-build-isolation --no-deps -v -e . \
        >"$OUTDIR/build.log" 2>&1; then
    RESULT[build]=ok
else
    RESULT[build]=FAILED
    tail -n 60 "$OUTDIR/build.log"
    die "the build failed (whole log: $OUTDIR/build.log)"
fi
grep -A 20 "spark_dl build: enabled" "$OUTDIR/build.log" | grep "spark_dl build\|  [+-] " || true

say "build_info"
"$VPY" - <<'EOF' || die "spark_dl does not import after the build"
import spark_dl, spark_dl.torch as hvd
from spark_dl import _core
from spark_dl.torch import _device
print("spark_dl from", spark_dl.__file__)
print("build_info:", _core.build_info())
print("cuda_built:", hvd.cuda_built(), " nccl_built:", hvd.nccl_built())
print("core takes CUDA tensors:", _device.core_cuda_support())
EOF

# ----------------------------------------------------------------------------- tests
say "tests (log: $OUTDIR/tests.log)"
# shellcheck disable=SC2086
"$VPY" -m pytest ${SDL_GPU_CHECK_TESTS:-tests/gpu tests/unit/test_gpu_devices.py \
    tests/unit/test_gpu_torch.py tests/unit/test_gpu_discovery.py \
    tests/unit/test_gpu_ops_choice.py tests/unit/test_gpu_keras_lightning.py} -v -rs \
    -p no:cacheprovider \
    --junitxml="$OUTDIR/tests.xml" 2>&1 | tee "$OUTDIR/tests.log"
rc=${PIPESTATUS[0]}
RESULT[tests]=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (pytest exit $rc)")

# ----------------------------------------------------------------------------- C++ tests
CPP_TESTS="$ROOT/build/gpu-check-build/tests/sdl_core_tests"
if [[ -x "$CPP_TESTS" ]]; then
    say "C++ unit tests (log: $OUTDIR/cpp_tests.log)"
    timeout 600 "$CPP_TESTS" 2>&1 | tee "$OUTDIR/cpp_tests.log" | tail -n 5
    rc=${PIPESTATUS[0]}
    RESULT[cpp_tests]=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")
else
    RESULT[cpp_tests]="not built (googletest missing: not counted)"
fi

# ----------------------------------------------------------------------------- benchmark
say "benchmarks/gpu.py (log: $OUTDIR/bench.log)"
timeout 900 "$VPY" benchmarks/gpu.py --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
rc=${PIPESTATUS[0]}
# The same with hierarchical allreduce (spark_dl's columns change; torch's are the control).
timeout 900 "$VPY" benchmarks/gpu.py --hierarchical --json "$OUTDIR/bench_hierarchical.json" \
    2>&1 | tee -a "$OUTDIR/bench.log"
rc2=${PIPESTATUS[0]}
RESULT[benchmark]=$([[ $rc -eq 0 && $rc2 -eq 0 ]] && echo ok || \
    echo "FAILED (exit $rc, hierarchical exit $rc2)")

# ----------------------------------------------------------------------------- summary
say "summary"
status=0
for step in cuda build tests cpp_tests benchmark; do
    printf '  %-10s %s\n' "$step" "${RESULT[$step]}"
    [[ "${RESULT[$step]}" == ok || "${RESULT[$step]}" == "not built"* ]] || status=1
done
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/tests.log" | tail -n 40 || true
echo "logs: $OUTDIR"
exit $status
