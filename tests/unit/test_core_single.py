"""The core in one process: lifecycle errors, knobs, argument checks, size-1 results."""

import os
import subprocess
import sys

import numpy as np
import pytest

from spark_dl.common import ops
import spark_dl.numpy as sdl
from spark_dl.common import knobs


@pytest.fixture
def initialized():
    sdl.init()
    yield
    sdl.shutdown()


def test_calls_before_init_and_after_shutdown_raise_clearly():
    sdl.shutdown()
    with pytest.raises(sdl.NotInitializedError, match="init"):
        sdl.rank()
    sdl.init()
    assert sdl.is_initialized() and sdl.size() == 1
    h = sdl.allreduce_async(np.ones(3), name="x")
    assert h.wait(timeout=10).tolist() == [1.0, 1.0, 1.0]
    sdl.shutdown()
    assert not sdl.is_initialized()
    with pytest.raises(sdl.NotInitializedError, match="shut down"):
        sdl.allreduce(np.ones(3))


def test_a_handle_outliving_its_runtime_says_it_was_shut_down():
    """Taking a result after shutdown() (here or in another thread) is the shutdown
    error, not "not initialized"; after a new init() the old handle still fails so
    rather than reaching the new runtime's operation with the same id."""
    torch = pytest.importorskip("torch")
    import spark_dl.torch as sdl_torch

    sdl.init()
    h = sdl.allreduce_async(np.ones(3), name="x")
    batch = sdl_torch.grouped_allreduce_async_([torch.ones(2), torch.ones(3)], name="b")
    sdl.shutdown()
    with pytest.raises(sdl.ShutdownError, match="'x' did not finish: spark_dl was shut down"):
        h.wait(timeout=10)
    with pytest.raises(sdl.ShutdownError, match="did not finish: spark_dl was shut down"):
        batch.wait(timeout=10)
    sdl.init()
    try:
        fresh = sdl.allreduce_async(np.full(3, 2.0), name="y")
        with pytest.raises(sdl.ShutdownError, match="'x'"):
            h.poll()
        with pytest.raises(sdl.ShutdownError, match="'x'"):
            h.wait(timeout=10)
        assert fresh.wait(timeout=10).tolist() == [2.0, 2.0, 2.0]
    finally:
        sdl.shutdown()


def test_size_one_results(initialized):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = sdl.counters().get("backend.host", 0)
    assert np.array_equal(sdl.allreduce(x, op=sdl.Sum), x)
    assert sdl.counters()["backend.host"] == before + 1  # which backend ran it
    assert np.array_equal(sdl.allgather(x), x)
    assert np.array_equal(sdl.broadcast(x, 0), x)
    out, splits = sdl.alltoall(x)
    assert np.array_equal(out, x) and splits.tolist() == [2]
    assert np.array_equal(sdl.reducescatter(x, op=sdl.Sum), x)
    assert sdl.join() == 0
    sdl.barrier()
    assert sdl.transport() == "self"


@pytest.mark.parametrize("call,match", [
    (lambda: sdl.allreduce(np.ones(2, bool), op=sdl.Sum), "not defined for bool"),
    (lambda: sdl.allgather(np.float32(1.0)), "at least one dimension"),
    (lambda: sdl.broadcast(np.ones(2), root_rank=3), "root_rank 3 is outside the global process set"),
    (lambda: sdl.alltoall(np.ones(4), splits=[3]), "sum to 3 but the first dimension is 4"),
    (lambda: sdl.alltoall(np.ones(4), splits=[2, 2]), "one split per rank"),
    (lambda: sdl.allreduce(np.ones(2, np.complex64)), "unsupported tensor dtype"),
    (lambda: sdl.allreduce(np.ones(2), op=sdl.Adasum), "Adasum"),
    (lambda: ops.submit("allreduce", "no_out", np.ones(3)), "needs an output tensor"),
    (lambda: ops.submit("broadcast", "b", np.ones(3), core_output=True),
     "only an allreduce without an output tensor"),
    (lambda: ops.submit("allreduce", "both", np.ones(3), np.ones(3), core_output=True),
     "only an allreduce without an output tensor"),
])
def test_invalid_arguments_raise_before_enqueue(initialized, call, match):
    with pytest.raises(sdl.InvalidArgumentError, match=match):
        call()
    # the runtime is still usable
    assert sdl.allreduce(np.ones(1), op=sdl.Sum).tolist() == [1.0]


@pytest.mark.parametrize("shape", [(), (0, 4), (5, 3), (1 << 19,)])
def test_out_of_place_allreduce_single_rank(initialized, shape):
    # The core allocates the result (heap below 1 MiB, its pool above): a new, writable
    # array equal to the input, which stays untouched.
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    keep = x.copy()
    y = sdl.allreduce(x, op=sdl.Sum)
    assert y.shape == x.shape and y.dtype == x.dtype and np.array_equal(y, x)
    assert y.size == 0 or not np.shares_memory(x, y)
    y += 1
    assert np.array_equal(x, keep)
    z = sdl.allreduce(x, op=sdl.Average, prescale_factor=2.0, postscale_factor=0.5)
    assert np.array_equal(z, x)


def test_duplicate_name_in_flight_single_rank(initialized):
    sdl.set_knob("cycle_time_ms", 50)
    first = sdl.allreduce_async(np.ones(2), name="same")
    try:
        sdl.allreduce_async(np.ones(2), name="same")
    except sdl.DuplicateNameError as e:
        assert "'same' is already in flight" in str(e)
    first.wait(timeout=10)


def test_knob_table_is_the_core_table():
    table = knobs.table()
    assert table["fusion_threshold"].env == "SDL_FUSION_THRESHOLD"
    assert table["fusion_threshold"].default == 128 * 1024 * 1024
    assert table["cycle_time_ms"].default == 1.0 and table["cycle_time_ms"].tunable
    assert table["cache_capacity"].default == 1024
    assert table["timeout_s"].default <= 30
    assert knobs.value("fusion_threshold", {"SDL_FUSION_THRESHOLD": "42"}) == 42
    assert "SDL_CYCLE_TIME" in knobs.describe()


def test_docs_knob_table_is_the_code_table():
    # docs/core.md carries knobs.describe() verbatim; regenerate it when knobs.json changes.
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "core.md")
    with open(docs) as f:
        assert knobs.describe().strip() in f.read(), (
            "docs/core.md's knob table is stale: paste the output of "
            "python -c 'from spark_dl.common import knobs; print(knobs.describe())'")


def test_init_knob_overrides_and_fixed_knobs(initialized):
    sdl.shutdown()
    sdl.init(fusion_threshold=0, cache_capacity=0)
    from spark_dl import _core

    config = dict(_core.config())
    assert config["fusion_threshold"] == "0" and config["cache_capacity"] == "0"
    with pytest.raises(sdl.InvalidArgumentError, match="fixed at init"):
        sdl.set_knob("cache_capacity", 5)
    with pytest.raises(sdl.InvalidArgumentError, match="unknown knob"):
        sdl.set_knob("no_such_knob", 1)


@pytest.mark.parametrize("var, text, expected", [
    ("SDL_CYCLE_TIME", "fast", "a number"),
    ("SDL_START_TIMEOUT", "soon", "a duration"),   # read by the core and the launchers
    ("SDL_SHM", "maybe", "a boolean"),
    ("SDL_CONTROLLER", "nccl", "one of auto, gloo, mpi"),
])
def test_bad_knob_value_in_environment_names_the_variable(var, text, expected):
    code = "import spark_dl.numpy as s; s.init()"
    env = dict(os.environ, **{var: text})
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert f"InvalidArgumentError: {var}={text}: expected {expected}" in p.stderr, p.stderr


def test_init_warns_about_a_misspelled_or_renamed_variable():
    code = "import spark_dl.numpy as s; s.init(); s.shutdown()"
    env = dict(os.environ, SDL_FUSION_TRESHOLD="0", SDL_STALL_WARNING="5", SDL_BUILD_TESTS="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert ("SDL_FUSION_TRESHOLD is no spark_dl setting and is ignored: set "
            "SDL_FUSION_THRESHOLD instead") in p.stderr
    assert ("SDL_STALL_WARNING was renamed and is ignored: set SDL_STALL_CHECK_TIME "
            "instead") in p.stderr
    assert "SDL_BUILD_TESTS" not in p.stderr  # a build's own variable, no near miss


def test_size_without_launcher_is_a_clear_error():
    code = "import spark_dl.numpy as s; s.init()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDL_", "OMPI_", "PMI_"))}
    env.update(SDL_RANK="0", SDL_SIZE="2")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "start the job with sdlrun" in p.stderr
