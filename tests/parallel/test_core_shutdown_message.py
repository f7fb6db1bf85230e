"""A rank that calls collectives after its peers shut down gets a ShutdownError that
names the operation, the ranks that had shut down, and the rule that was broken."""

import numpy as np
import pytest

import spark_dl.numpy as sdl
from harness import run_ranks

RULE = "every rank must make the same collective calls in the same order"


def peers_shut_down_first():
    """Rank 0 stops after one step; the others run one more (a mismatched script)."""
    sdl.init()
    sdl.allreduce(np.ones(2), name="step0")
    if sdl.rank() == 0:
        sdl.shutdown()
        return {}
    out = {}
    # Pending when rank 0 stops: fails through its handle.
    handle = sdl.allreduce_async(np.ones(2), name="step1")
    try:
        handle.wait(timeout=60)
    except sdl.ShutdownError as e:
        out["pending"] = str(e)
    # Called after the stop: fails at the call.
    try:
        sdl.broadcast(np.ones(2), root_rank=0, name="late")
    except sdl.ShutdownError as e:
        out["late"] = str(e)
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_collective_after_peer_shutdown_names_the_peer(np_):
    res = run_ranks("test_core_shutdown_message:peers_shut_down_first", np_, timeout=120)
    assert res[0] == {}
    for rank in range(1, np_):
        r = res[rank]
        assert r["pending"] == (f"allreduce 'step1' on rank {rank} cannot run: rank 0 had "
                                f"already shut down; {RULE}"), r
        assert r["late"] == (f"broadcast 'late' on rank {rank} cannot run: rank 0 had already "
                             f"shut down; {RULE}"), r


def every_rank_shuts_down():
    """Both ranks shut down together: whoever asked, nobody is blamed."""
    sdl.init()
    sdl.allreduce(np.ones(2), name="x")
    sdl.shutdown()
    try:
        sdl.allreduce(np.ones(2), name="y")
    except sdl.NotInitializedError as e:
        return str(e)
    return None


def test_own_shutdown_keeps_the_plain_message():
    for msg in run_ranks("test_core_shutdown_message:every_rank_shuts_down", 2, timeout=120):
        assert msg is not None and "shut down" in msg and "had already" not in msg


def transport_after_peers_shut_down():
    """Rank 0 stops; the others see the stop, then ask for their transport."""
    sdl.init()
    before = sdl.transport()
    sdl.allreduce(np.ones(2), name="step0")
    if sdl.rank() == 0:
        sdl.shutdown()
        return before, before
    try:
        sdl.allreduce_async(np.ones(2), name="step1").wait(timeout=60)
    except sdl.ShutdownError:
        pass
    # The stop released the communicators before it failed step1.
    return before, sdl.transport()


def test_transport_is_still_reported_after_a_peer_shut_down():
    for before, after in run_ranks("test_core_shutdown_message:transport_after_peers_shut_down",
                                   2, timeout=120):
        assert before == after == "shm", (before, after)
