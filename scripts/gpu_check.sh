#!/usr/bin/env bash
# GPU check of spark_dl in one command, on the GPU machine itself (docs/gpu.md):
#
#     bash scripts/gpu_check.sh                # build, tests/gpu, C++ tests, benchmarks/gpu.py
#                                              # and benchmarks/gpu_train.py
#     bash scripts/gpu_check.sh --skip build   # again on the same machine: reuse that build
#     bash scripts/gpu_check.sh --fetch-deps   # on a networked machine: put what the GPU
#                                              # machine may lack into .gpudeps/ (git-ignored;
#                                              # copy it along with the checkout)
#
# Nothing built on a CPU machine runs on the GPU machine (its Python and torch differ), so
# this builds the extension there: a virtualenv with --system-site-packages (torch, CUDA's
# wheels and CMake come from the system), the Python packages the system lacks installed
# from .gpudeps/wheels without network, then an editable install (--no-index
# --no-build-isolation --no-deps) with CUDA required and compiled for this GPU's
# architecture only. Gloo (Debian's libgloo-dev) is needed by the build; where the system
# lacks it, the .deb files in .gpudeps/ are unpacked into a private prefix.
#
# The check fails rather than passing vacuously: CUDA must be usable, the build must have
# CUDA and NCCL and NCCL must load (else every CUDA collective would quietly take the host
# staging path), and a test of tests/gpu may skip only for want of a second GPU or of the
# Spark/Keras/Lightning stack (Java, pyspark, ...); the test log lists every skip.
#
# Options: --skip STAGE[,STAGE...] with stages build, tests, cpp, bench (build: reuse the
# virtualenv and build of an earlier run on this machine; bench: both benchmarks). Each
# stage has a time limit; with a build of a few minutes they add up to under 10 minutes.
# Settings (environment): PYTHON (default python3), SDL_GPU_CHECK_OUT (logs; default
# build/gpu-check), SDL_CMAKE_ARGS (extra CMake arguments), SDL_GPU_CHECK_TESTS (pytest
# selection; default tests/gpu tests/unit/test_gpu_*.py test_cxx_runtime.py), SDL_GPU_CHECK_TESTS_TIMEOUT (the
# tests stage's limit in seconds, default 300; at the limit pytest is interrupted and its
# report lists what ran), SDL_GPU_CHECK_ALLOW_NO_NCCL=1 (a
# build or machine without NCCL passes: host staging only), SDL_GPU_PYTHON (--fetch-deps:
# the GPU machine's Python version, default 3.12), SDL_CUDA_ARCH (e.g. 90; default: this
# GPU's compute capability), SDL_GPU_CHECK_BUDGET (seconds the whole check aims at, default
# 480: benchmarks/gpu_train.py gets what is left of it, at least 60 s and at most 150 s).
# The C++ unit tests (native/tests: hierarchical allreduce, pinned staging pool, backend
# choice with fakes) run when the build found googletest.
# Exit status: 0 when every stage run passed; 1 otherwise; 2 when something the check
# needs is missing (it says what).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEPS_DIR="$ROOT/.gpudeps"
# Debian packages the build needs (Gloo; googletest for the C++ unit tests).
DEBS="libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200 libgtest-dev"
# Python packages the build and the tests need beyond torch (the GPU machine's Python may
# lack them, and it may have no network): import names, then pip names.
NEED_PY="scikit_build_core nanobind numpy cloudpickle psutil pytest pytest_timeout"
NEED_PIP="scikit-build-core nanobind numpy cloudpickle psutil pytest pytest-timeout"

say() { printf '\n=== %s\n' "$*"; }
die() { printf '\ngpu_check: %s\n' "$1" >&2; exit "${2:-1}"; }

if [[ "${1:-}" == "--fetch-deps" ]]; then
    mkdir -p "$DEPS_DIR/wheels"
    if command -v apt-get >/dev/null; then
        (cd "$DEPS_DIR" && apt-get download $DEBS) || die "apt-get download failed" 2
    else
        echo "no apt-get here: Gloo's .deb files not fetched (the GPU machine then needs libgloo-dev)"
    fi
    # shellcheck disable=SC2086
    "${PYTHON:-python3}" -m pip download -q --only-binary=:all: -c "$ROOT/constraints.txt" \
        --python-version "${SDL_GPU_PYTHON:-3.12}" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$DEPS_DIR/wheels" $NEED_PIP \
        || die "pip download failed" 2
    ls -l "$DEPS_DIR" "$DEPS_DIR/wheels"
    echo "copy .gpudeps/ to the GPU machine along with the checkout (git ignores it)"
    exit 0
fi

SKIP=","
if [[ "${1:-}" == "--skip" ]]; then
    SKIP=",${2:?--skip needs stages, e.g. --skip build,bench},"
    shift 2
fi
[[ $# -eq 0 ]] || die "unknown arguments: $* (the options are at the top of $0)" 2
skipped() { [[ "$SKIP" == *",$1,"* ]]; }
STARTED=$SECONDS
STAGE_START=$SECONDS
stage_time() { echo "($1: $((SECONDS - STAGE_START)) s; $((SECONDS - STARTED)) s so far)"; }

PY="${PYTHON:-python3}"
OUTDIR="${SDL_GPU_CHECK_OUT:-$ROOT/build/gpu-check}"
VENV="${SDL_GPU_CHECK_VENV:-/tmp/sdl-gpu-venv}"
VPY="$VENV/bin/python"
mkdir -p "$OUTDIR"
declare -A RESULT

# ----------------------------------------------------------------------------- the machine
say "machine"
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"  # the build finds nvcc on PATH
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version \
    --format=csv || echo "nvidia-smi: not found"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc: not found"
command -v cmake >/dev/null && cmake --version | head -n 1 || echo "cmake: not on PATH"
echo "CPUs: $(nproc)"
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

# ----------------------------------------------------------------------------- Gloo
gloo_found() {
    for d in /usr/include /usr/local/include ${CPATH:+${CPATH//:/ }}; do
        [[ -f "$d/gloo/allreduce.h" ]] && return 0
    done
    return 1
}
gtest_found() {
    for d in /usr/lib/x86_64-linux-gnu /usr/lib /usr/local/lib ${CMAKE_PREFIX_PATH:+${CMAKE_PREFIX_PATH//:/ }}; do
        [[ -f "$d/cmake/GTest/GTestConfig.cmake" ]] && return 0
    done
    return 1
}
if ! gloo_found || ! gtest_found; then
    shopt -s nullglob
    debs=("$DEPS_DIR"/*.deb)
    [[ ${#debs[@]} -gt 0 ]] || die "Gloo is not installed here and .gpudeps/ holds no .deb: \
run 'bash scripts/gpu_check.sh --fetch-deps' on a networked Debian/Ubuntu machine and copy \
.gpudeps/ here (packages: $DEBS)" 2
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
    # At run time only the libraries the system lacks (Gloo, hiredis): a Debian copy must
    # not shadow one the system has (libibverbs, libnl), which torch or MPI may also load.
    RUNTIME_LIBS="$PREFIX/runtime-libs"
    mkdir -p "$RUNTIME_LIBS"
    for f in "$PREFIX"/usr/lib/*.so.* "$PREFIX"/usr/lib/x86_64-linux-gnu/*.so.*; do
        soname=$(basename "$f")
        ldconfig -p | grep -q "^[[:space:]]*$soname " || ln -sf "$f" "$RUNTIME_LIBS/$soname"
    done
    echo "run-time libraries from .gpudeps/: $(ls "$RUNTIME_LIBS" | tr '\n' ' ')"
    export LD_LIBRARY_PATH="$RUNTIME_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "Gloo, googletest: unpacked ${#debs[@]} packages from .gpudeps/ into $PREFIX"
fi

# ----------------------------------------------------------------------------- build
missing_py() {
    "$VPY" - "$NEED_PY" <<'EOF'
import importlib.util, sys
print(" ".join(n for n in sys.argv[1].split() if importlib.util.find_spec(n) is None))
EOF
}

if skipped build; then
    say "build: skipped (reusing $VENV)"
    "$VPY" -c 'import spark_dl._core' 2>/dev/null \
        || die "--skip build, but $VENV holds no earlier build of spark_dl" 2
    RESULT[build]=reused
else
    say "build (log: $OUTDIR/build.log)"
    STAGE_START=$SECONDS
    rm -rf "$VENV"
    PIP=()
    if "$PY" -m venv --system-site-packages "$VENV" 2>"$OUTDIR/venv.log"; then
        PIP=("$VPY" -m pip)
    elif "$PY" -m venv --system-site-packages --without-pip "$VENV" 2>>"$OUTDIR/venv.log"; then
        PIP=("$PY" -m pip --python "$VPY")  # no ensurepip here: $PY's pip drives it
    else
        cat "$OUTDIR/venv.log"
        die "cannot create the virtualenv $VENV" 2
    fi
    # --system-site-packages gives the *base* interpreter's packages; when $PY is itself a
    # virtualenv (its torch lives there), its site-packages are added too (after the new
    # environment's own, so that the spark_dl built here wins).
    PARENT_SITE=$("$PY" -c 'import site; print("\n".join(site.getsitepackages()))')
    VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    while IFS= read -r dir; do
        [[ -n "$dir" ]] && echo "import site; site.addsitedir('$dir')"
    done <<<"$PARENT_SITE" >"$VSITE/_sdl_parent_site.pth"
    missing=$(missing_py)
    if [[ -n "$missing" && -d "$DEPS_DIR/wheels" ]]; then
        wanted=$(echo "$missing" | sed 's/scikit_build_core/scikit-build-core/; s/pytest_timeout/pytest-timeout/')
        echo "installing from .gpudeps/wheels: $wanted"
        # shellcheck disable=SC2086
        "${PIP[@]}" install -q --no-index --find-links "$DEPS_DIR/wheels" $wanted \
            >>"$OUTDIR/venv.log" 2>&1 \
            || { tail -n 20 "$OUTDIR/venv.log"; die "installing $wanted from .gpudeps/wheels failed" 2; }
        missing=$(missing_py)
    fi
    [[ -z "$missing" ]] || die "missing Python packages: $missing. Run 'bash scripts/gpu_check.sh \
--fetch-deps' on a networked machine and copy .gpudeps/ here (docs/gpu.md)" 2
    "$VPY" -c 'import torch, nanobind, scikit_build_core' \
        || die "the virtualenv $VENV does not see torch, nanobind or scikit-build-core of $PY" 2
    # CUDA required, and compiled for this GPU only (every architecture nvcc knows takes
    # minutes); scikit-build-core reads ;-separated KEY=VALUE pairs here.
    ARCH=${SDL_CUDA_ARCH:-$("$VPY" -c \
        'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")' 2>/dev/null)}
    export SKBUILD_CMAKE_DEFINE="SDL_WITH_CUDA=ON${ARCH:+;SDL_CUDA_ARCHITECTURES=$ARCH}"
    export SKBUILD_CMAKE_ARGS="${SDL_CMAKE_ARGS:-}"
    echo "CMake: $SKBUILD_CMAKE_DEFINE ${SDL_CMAKE_ARGS:-}"
    # A build folder of its own: a CPU build of the same checkout keeps its CMake cache.
    export SKBUILD_BUILD_DIR="$ROOT/build/gpu-check-build"
    export SKBUILD_BUILD_VERBOSE=true
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    if timeout 420 "${PIP[@]}" install --no-index --no-build-isolation --no-deps -v -e . \
            >"$OUTDIR/build.log" 2>&1; then
        RESULT[build]=ok
    else
        RESULT[build]=FAILED
        tail -n 60 "$OUTDIR/build.log"
        die "the build failed or passed 420 s (whole log: $OUTDIR/build.log)"
    fi
    grep -A 20 "spark_dl build: enabled" "$OUTDIR/build.log" | grep "spark_dl build\|  [+-] " || true
    stage_time build
fi

say "build_info"
"$VPY" - <<'EOF' || die "spark_dl does not import after the build"
import spark_dl, spark_dl.torch as hvd
from spark_dl import _core
from spark_dl.torch import _device
print("spark_dl from", spark_dl.__file__)
print("build_info:", _core.build_info())
print("gpu_runtime_info:", _core.gpu_runtime_info())
print("cuda_built:", hvd.cuda_built(), " nccl_built:", hvd.nccl_built())
print("core takes CUDA tensors:", _device.core_cuda_support())
EOF
# NCCL built and loadable: without it every CUDA collective takes the host staging path and
# the tests still pass, which would verify the wrong thing.
RESULT[nccl]=$("$VPY" - <<'EOF'
from spark_dl import _core
b, g = _core.build_info(), _core.gpu_runtime_info()
wrong = [what for what, ok in (("built with CUDA", b.get("cuda")), ("built with NCCL", b.get("nccl")),
                               ("CUDA usable", g.get("cuda_usable")),
                               ("NCCL usable", g.get("nccl_usable"))) if not ok]
why = "; ".join(str(g[k]) for k in ("cuda_reason", "nccl_reason") if g.get(k))
print("ok" if not wrong else "FAILED (not " + ", not ".join(wrong) + (f": {why}" if why else "") + ")")
EOF
)
RESULT[nccl]=${RESULT[nccl]:-"FAILED (could not ask the build)"}
if [[ "${RESULT[nccl]}" != ok && "${SDL_GPU_CHECK_ALLOW_NO_NCCL:-0}" == 1 ]]; then
    RESULT[nccl]="allowed: ${RESULT[nccl]}"
fi
echo "NCCL: ${RESULT[nccl]}"

# ----------------------------------------------------------------------------- tests
if skipped tests; then
    RESULT[tests]="skipped (--skip)"
else
    say "tests (log: $OUTDIR/tests.log)"
    STAGE_START=$SECONDS
    rm -f "$OUTDIR/tests.xml"
    # SIGINT at the limit: pytest stops like on Ctrl-C and still writes its report, so the
    # tests that ran are listed (then SIGKILL if it does not end within 20 s).
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=20 "${SDL_GPU_CHECK_TESTS_TIMEOUT:-300}" \
        "$VPY" -m pytest ${SDL_GPU_CHECK_TESTS:-tests/gpu tests/unit/test_gpu_devices.py \
        tests/unit/test_gpu_torch.py tests/unit/test_gpu_discovery.py \
        tests/unit/test_gpu_ops_choice.py tests/unit/test_gpu_keras_lightning.py \
        tests/unit/test_cxx_runtime.py} -v -rs \
        -p no:cacheprovider --junitxml="$OUTDIR/tests.xml" 2>&1 | tee "$OUTDIR/tests.log"
    rc=${PIPESTATUS[0]}
    RESULT[tests]=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (pytest exit $rc)")
    # A test of tests/gpu may skip only for a second GPU or the Spark/Keras/Lightning stack.
    RESULT[skips]=$("$VPY" - "$OUTDIR/tests.xml" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
allowed = re.compile(r"two GPUs|2 GPUs|second GPU|pyspark|Java|lightning|keras", re.I)
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError) as e:
    print(f"FAILED (no test report: {e})")
    sys.exit()
bad = [f"{c.get('classname')}::{c.get('name')}: {s.get('message', '')[:100]}"
       for c in cases for s in c.findall("skipped")
       if c.get("classname", "").startswith("tests.gpu.")
       and not allowed.search(s.get("message", ""))]
gpu = sum(1 for c in cases if c.get("classname", "").startswith("tests.gpu."))
print(f"ok ({gpu} tests/gpu tests)" if gpu and not bad else
      "FAILED (no tests/gpu test ran)" if not gpu else
      f"FAILED ({len(bad)} tests/gpu test(s) skipped for no good reason: " + " | ".join(bad[:4]) + ")")
EOF
)
    RESULT[skips]=${RESULT[skips]:-"FAILED (could not read the test report)"}
    stage_time tests
fi

# ----------------------------------------------------------------------------- C++ tests
CPP_TESTS="$ROOT/build/gpu-check-build/tests/sdl_core_tests"
if skipped cpp; then
    RESULT[cpp_tests]="skipped (--skip)"
elif [[ -x "$CPP_TESTS" ]]; then
    say "C++ unit tests (log: $OUTDIR/cpp_tests.log)"
    timeout 120 "$CPP_TESTS" 2>&1 | tee "$OUTDIR/cpp_tests.log" | tail -n 5
    rc=${PIPESTATUS[0]}
    RESULT[cpp_tests]=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")
else
    RESULT[cpp_tests]="not built (googletest missing: not counted)"
fi

# ----------------------------------------------------------------------------- benchmark
if skipped bench; then
    RESULT[benchmark]="skipped (--skip)"
else
    say "benchmarks/gpu.py (log: $OUTDIR/bench.log)"
    STAGE_START=$SECONDS
    timeout 100 "$VPY" benchmarks/gpu.py --iters 30 --timeout 90 --json "$OUTDIR/bench.json" \
        2>&1 | tee "$OUTDIR/bench.log"
    rc=${PIPESTATUS[0]}
    # The same with hierarchical allreduce (spark_dl's columns change; torch's are the control).
    timeout 100 "$VPY" benchmarks/gpu.py --hierarchical --iters 30 --timeout 90 \
        --json "$OUTDIR/bench_hierarchical.json" 2>&1 | tee -a "$OUTDIR/bench.log"
    rc2=${PIPESTATUS[0]}
    RESULT[benchmark]=$([[ $rc -eq 0 && $rc2 -eq 0 ]] && echo ok || \
        echo "FAILED (exit $rc, hierarchical exit $rc2)")
    stage_time benchmark

    # Training on the GPU: the estimators' worker loop on CUDA against the CPU (torch,
    # Lightning), a DistributedOptimizer step against DDP on NCCL, two ranks sharing the GPU
    # against gloo. Its limit is what is left of the check's budget (60 to 150 s); its own
    # --timeout ends it 15 s earlier, so it still reports the parts it finished.
    STAGE_START=$SECONDS
    limit=$(( ${SDL_GPU_CHECK_BUDGET:-480} - (SECONDS - STARTED) ))
    limit=$(( limit < 60 ? 60 : limit > 150 ? 150 : limit ))
    say "benchmarks/gpu_train.py, ${limit} s at most (log: $OUTDIR/bench_train.log)"
    timeout --kill-after=10 "$limit" "$VPY" benchmarks/gpu_train.py --rounds 2 --iters 30 \
        --timeout $((limit - 15)) --json "$OUTDIR/bench_train.json" 2>&1 \
        | tee "$OUTDIR/bench_train.log"
    rc=${PIPESTATUS[0]}
    if [[ $rc -eq 0 ]]; then RESULT[gpu_train]=ok
    elif [[ $rc -eq 3 ]]; then RESULT[gpu_train]="FAILED (a peer NOT MEASURED)"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then RESULT[gpu_train]="FAILED (passed ${limit} s)"
    else RESULT[gpu_train]="FAILED (exit $rc)"
    fi
    stage_time gpu_train
fi

# ----------------------------------------------------------------------------- summary
say "summary"
status=0
for step in cuda build nccl tests skips cpp_tests benchmark gpu_train; do
    [[ -n "${RESULT[$step]:-}" ]] || continue
    printf '  %-10s %s\n' "$step" "${RESULT[$step]}"
    case "${RESULT[$step]}" in
        ok|ok\ *|reused|"not built"*|"skipped (--skip)"|allowed:*) ;;
        *) status=1 ;;
    esac
done
echo "  time       $((SECONDS - STARTED)) s"
# gpu_train's ratios and checks (its tables are in bench_train.log).
TRAIN_LINES="faster than cpu|loss cuda|x (ddp|gloo)|by backend|staged allreduce|pyspark imp|^NOT MEAS|^FAILED"
[[ -n "${RESULT[gpu_train]:-}" ]] && { grep -E "$TRAIN_LINES" "$OUTDIR/bench_train.log" \
    | sed 's/^/  gpu_train: /' || true; }
[[ -f "$OUTDIR/tests.log" ]] && { grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/tests.log" | tail -n 40 || true; }
echo "logs: $OUTDIR"
exit $status
