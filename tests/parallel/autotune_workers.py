"""Rank functions of test_autotune.py (spark_dl.numpy; the test sets SDL_AUTOTUNE & co)."""

import numpy as np

import spark_dl.numpy as sdl


def tune(steps="80", tensors="24", elements="4096"):
    """Fusion-benchmark-like steps (many small allreduces, same names every step), then the
    autotune state this rank saw. Every rank runs the same steps: the tuner's progress is
    never used to decide how many (ranks may be a few idle cycles apart when they look)."""
    sdl.init()
    n, k = int(tensors), int(elements)
    arrays = [np.full(k, float(i + 1), np.float32) for i in range(n)]
    seen = []  # the params after each step (checks that results stay right as they change)
    for _ in range(int(steps)):
        handles = [sdl.allreduce_async(a, name=f"grad.{i}", op=sdl.Sum)
                   for i, a in enumerate(arrays)]
        for h, a in zip(handles, arrays):
            assert np.allclose(h.wait(timeout=30), a * sdl.size())
        seen.append(sdl.autotune_state()["applied"]["serial"])
    sdl.barrier()
    state = sdl.autotune_state()
    return {"state": state, "seen": seen, "counters": sdl.counters(),
            "transport": sdl.transport()}


if __name__ == "__main__":  # under sdlrun (test_sdlrun_flags_reach_the_workers)
    tune(steps="40")
