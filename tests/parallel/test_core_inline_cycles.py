"""Inline cycles (issue 18): a thread that waits runs its rank's negotiation cycles itself;
the background thread runs them when nobody waits. Over shared memory and Gloo TCP."""

import pytest

from harness import run_ranks

pytestmark = pytest.mark.timeout(300)
TRANSPORTS = {"shm": {"SDL_SHM": "1"}, "gloo": {"SDL_SHM": "0", "SDL_CONTROLLER": "gloo"}}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_many_threads_waiting_at_once(transport):
    for rank, r in enumerate(run_ranks("inline_workers:threads_wait", 2,
                                       env=TRANSPORTS[transport], timeout=240)):
        assert r["errors"] == [] and r["alive"] == [], (rank, r)
        assert r["counters"]["inline_cycles"] > 0, (rank, r["counters"])


def test_knob_off_leaves_the_cycles_to_the_background_thread():
    env = dict(TRANSPORTS["shm"], SDL_INLINE_CYCLES="0")
    for rank, r in enumerate(run_ranks("inline_workers:threads_wait", 2, env=env, timeout=240)):
        assert r["errors"] == [] and r["alive"] == [], (rank, r)
        assert r["counters"]["inline_cycles"] == 0, (rank, r["counters"])


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_that_never_wait(np_):
    res = run_ranks("inline_workers:never_waits", np_, env=TRANSPORTS["shm"], timeout=240)
    for rank, r in enumerate(res):
        assert r["ok"] == 20, (rank, r)
    assert res[0]["counters"]["inline_cycles"] > 0
    for r in res[1:]:
        # Polls never run cycles; the synchronize after a successful poll has nothing to wait for.
        assert r["counters"]["inline_cycles"] == 0, r["counters"]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_shutdown_while_a_thread_runs_a_cycle(transport):
    r0 = run_ranks("inline_workers:shutdown_while_waiting", 2, env=TRANSPORTS[transport],
                   timeout=120)[0]
    assert r0["alive"] is False, r0
    assert r0["inline_cycles"] > 0, r0
    # The handle fails with the shutdown error, also when shutdown() dropped the
    # runtime before the thread took the result.
    assert r0["error"] is not None, r0
    assert r0["error"].startswith("ShutdownError"), r0
    assert "shut down" in r0["error"], r0
    assert r0["shutdown_s"] < 20, r0
