"""Rank functions of test_timeline.py (spark_dl.numpy; the test sets SDL_TIMELINE & co)."""

import json
import os
import time

import numpy as np

import spark_dl.numpy as sdl

NAMES = [f"w{i}" for i in range(6)]


def _step(prefix, names=NAMES, n=64):
    """Allreduces one array per name at once (fused where they fit) and checks the sums."""
    arrays = [np.full(n, float(i + 1), np.float32) for i in range(len(names))]
    handles = [sdl.allreduce_async(a, name=f"{prefix}{name}", op=sdl.Sum)
               for name, a in zip(names, arrays)]
    for h, a in zip(handles, arrays):
        assert np.allclose(h.wait(timeout=30), a * sdl.size())


def read_trace(path, tries=20):
    """The parsed file; a read racing the writer's one pwrite may see a torn tail
    (timeline.h), so a failed parse is retried a few times before it counts."""
    for i in range(tries):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError:
            if i == tries - 1:
                raise
            time.sleep(0.01)


def steps(steps="4"):
    """Training-like steps on the same names, one tensor the last rank submits 0.6 s after
    the others, and rank 0 reading the trace while the job runs."""
    sdl.init()
    mid = None
    for s in range(int(steps)):
        _step("", NAMES)
        if s == 1 and sdl.rank() == 0:
            time.sleep(0.05)  # a few writer periods: the first steps are in the file
            mid = len(read_trace(os.environ.get("SDL_TIMELINE") or os.environ["HOROVOD_TIMELINE"]))
    if sdl.rank() == sdl.size() - 1:
        time.sleep(0.6)
    sdl.allreduce(np.ones(4, np.float32), name="late", op=sdl.Sum)
    sdl.barrier()
    return {"mid_events": mid, "counters": sdl.counters()}


def forever():
    """Steps until killed (the SIGKILL test)."""
    sdl.init()
    while True:
        _step("", NAMES)


def window():
    """Steps before, inside and after a start_timeline/stop_timeline window."""
    sdl.init()
    path = os.environ["TIMELINE_TEST_PATH"]
    _step("before.")
    writes = sdl.start_timeline(path, mark_cycles=False)
    for _ in range(3):
        _step("in.")
    sdl.stop_timeline()
    for _ in range(3):
        _step("after.")
    sdl.barrier()
    return {"writes": writes}


def many(steps="5"):
    """Many tensors per step into a tiny queue: records must be dropped, never waited for."""
    sdl.init()
    names = [f"m{i}" for i in range(200)]
    t0 = time.monotonic()
    for _ in range(int(steps)):
        _step("", names, n=4)
    took = time.monotonic() - t0
    counters = sdl.counters()
    sdl.stop_timeline()
    return {"took": took, "counters": counters}


def sdlrun_main():
    """The program sdlrun starts (test_sdlrun_flags): a few steps."""
    sdl.init()
    for _ in range(3):
        _step("")
    sdl.shutdown()


if __name__ == "__main__":
    sdlrun_main()
