"""Functions run on spawned ranks by test_stall_inspector.py and test_flight_recorder.py."""

import os
import time

import numpy as np

import spark_dl.numpy as sdl
from spark_dl.common.basics import flight_recorder


def late_rank(delay="2.5"):
    """The last rank submits 'slow' late: rank 0's stall inspector warns meanwhile."""
    sdl.init()
    if sdl.rank() == sdl.size() - 1:
        time.sleep(float(delay))
    return float(sdl.allreduce(np.array([1.0]), name="slow", op=sdl.Sum)[0])


def _attempt(fn):
    """Runs fn; returns (error text or None, seconds it took)."""
    t0 = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the test inspects which error it was
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


def silent_rank(steps="3", sleep="6"):
    """Every rank runs `steps` allreduces; then all but the last submit 'grad.w' while
    the last one sleeps `sleep` seconds (alive, submitting nothing) and then calls an
    allreduce of its own. With SDL_STALL_SHUTDOWN_TIME set every rank must raise."""
    sdl.init()
    for i in range(int(steps)):
        sdl.allreduce(np.array([1.0]), name=f"step.{i}", op=sdl.Sum)
    if sdl.rank() == sdl.size() - 1:
        time.sleep(float(sleep))
        err, took = _attempt(lambda: sdl.allreduce(np.array([1.0]), name="late", op=sdl.Sum))
    else:
        err, took = _attempt(lambda: sdl.allreduce(np.ones(3), name="grad.w", op=sdl.Sum))
    records = flight_recorder()
    return {"error": err, "took": took, "records": records}


def dying_rank(steps="3"):
    """Every rank runs `steps` allreduces, then the last rank exits while the others
    submit 'grad.w': a peer loss."""
    sdl.init()
    for i in range(int(steps)):
        sdl.allreduce(np.array([1.0]), name=f"step.{i}", op=sdl.Sum)
    if sdl.rank() == sdl.size() - 1:
        time.sleep(0.5)
        os._exit(3)
    err, took = _attempt(lambda: sdl.allreduce(np.ones(3), name="grad.w", op=sdl.Sum))
    return {"error": err, "took": took, "records": flight_recorder()}


def healthy(steps="20"):
    """Plain allreduces: the accessor shows them done, in order, with ordered times."""
    sdl.init()
    for i in range(int(steps)):
        sdl.allreduce(np.full(4, float(i)), name=f"t.{i}", op=sdl.Sum)
    recs = flight_recorder()
    sdl.shutdown()
    return recs
