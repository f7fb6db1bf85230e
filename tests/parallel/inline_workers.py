"""Rank functions for test_core_inline_cycles.py: waiting threads run their rank's cycles
(the inline_cycles knob), ranks that never wait, and shutdown while a thread waits."""

import threading
import time

import numpy as np

import spark_dl.numpy as sdl
from spark_dl.common import basics
from spark_dl.common.exceptions import SdlError


def threads_wait(threads=4, ops=25):
    """``threads`` Python threads per rank, each allreducing its own tensors and waiting.

    One waiting thread at a time runs the rank's cycles; the others sleep until their
    handles finish or the cycle lock frees. Every sum must be right.
    """
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    errors = []

    def body(t):
        try:
            for i in range(ops):
                x = np.full(16 + t, float(rank * 100 + t), dtype=np.float32)
                got = sdl.allreduce(x, name=f"inline.t{t}.{i}", op=sdl.Sum)
                want = sum(r * 100 + t for r in range(size))
                if not np.array_equal(got, np.full(16 + t, float(want), dtype=np.float32)):
                    errors.append(f"thread {t} op {i}: {got[:3]} != {want}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"thread {t}: {e!r}")

    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(120)
    alive = [th.name for th in ts if th.is_alive()]
    counters = basics.counters()
    sdl.shutdown()
    return {"errors": errors, "alive": alive, "counters": counters}


def never_waits(steps=20):
    """Rank 0 waits on every allreduce (inline cycles); the others only poll, so their
    background threads run their cycles."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    ok = 0
    for step in range(steps):
        x = np.full(256, float(rank + step), dtype=np.float32)
        h = sdl.allreduce_async_(x, name="inline.poll", op=sdl.Sum)
        if rank == 0:
            sdl.synchronize(h)
        else:
            deadline = time.monotonic() + 60
            while not sdl.poll(h):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step}: poll never saw the allreduce finish")
                time.sleep(0.0002)
            sdl.synchronize(h)
        if np.array_equal(x, np.full(256, float(sum(r + step for r in range(size))),
                                     dtype=np.float32)):
            ok += 1
    counters = basics.counters()
    sdl.shutdown()
    return {"ok": ok, "counters": counters}


def shutdown_while_waiting():
    """Rank 0: a thread waits on an allreduce rank 1 never submits (so it sits in a cycle
    it runs itself); the main thread shuts down meanwhile. The wait must end with the
    shutdown error, in bounded time."""
    sdl.init()
    rank = sdl.rank()
    if rank != 0:
        time.sleep(1.5)  # idle: its background thread matches rank 0's cycles
        sdl.shutdown()
        return {}
    x = np.ones(8, dtype=np.float32)
    h = sdl.allreduce_async_(x, name="inline.never", op=sdl.Sum)
    outcome = {}

    def waiter():
        start = time.monotonic()
        try:
            sdl.synchronize(h)
            outcome["error"] = None
        except SdlError as e:
            outcome["error"] = f"{type(e).__name__}: {e}"
        outcome["waited_s"] = time.monotonic() - start

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.5)
    inline = basics.counters()["inline_cycles"]
    start = time.monotonic()
    sdl.shutdown()
    th.join(60)
    outcome["alive"] = th.is_alive()
    outcome["shutdown_s"] = time.monotonic() - start
    outcome["inline_cycles"] = inline
    return outcome
