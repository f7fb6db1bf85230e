"""Process sets, fusion and cache counters, join, and every error case of the core."""

import time

import pytest

from harness import collect, run_ranks, spawn_ranks


@pytest.mark.parametrize("np_", [3, 4])
def test_process_sets(np_):
    res = run_ranks("core_workers:process_sets", np_, timeout=90)
    evens = list(range(0, np_, 2))
    for rank, r in enumerate(res):
        if rank in (0, 1):
            assert r["init_set"] == 3.0
            assert r["init_set_rank"] == rank
        assert r["ids"] == (2, 3)
        assert r["global"] == float(np_)
        if rank in evens:
            assert r["evens"] == float(sum(evens))
            assert r["evens_gather"] == evens
            assert r["evens_bcast"] == [evens[-1]]
        else:
            assert "not a member" in r["nonmember"]
        assert r["removed"] is True
        assert "not registered" in r["after_remove"]
        assert r["global_after"] == 2.0 * np_


def test_numpy_object_broadcast_and_allgather():
    res = run_ranks("core_workers:objects", 3, timeout=90)
    for rank, r in enumerate(res):
        assert r["bcast"] == {"from": 1, "blob": b"x" * 5000}
        assert r["gather"] == [("rank", i, [0] * i) for i in range(3)]
        if rank == 1:
            assert r["odd_gather"] == [1] and r["odd_bcast"] == "root 1"


def test_fusion_and_cache_counters():
    for r in run_ranks("core_workers:fusion_and_cache", 2, timeout=90):
        assert r["ok"]
        c0, c1, c2, c3 = r["c0"], r["c1"], r["c2"], r["c3"]
        # 40 tensors submitted at once: fused into fewer collectives than tensors.
        first_tensors = c1["tensors"] - c0["tensors"]
        first_collectives = c1["collectives"] - c0["collectives"]
        assert first_tensors == 40
        assert first_collectives < 40 / 2, (c0, c1)
        assert c1["fused_tensors"] > 0
        # The next 20 steps reuse the names: served from the response cache.
        assert c2["cache_hits"] - c1["cache_hits"] >= 20 * 40 * 0.9, (c1, c2)
        assert c2["full_negotiations"] - c1["full_negotiations"] <= 20, (c1, c2)
        # fusion_threshold=0 disables fusion: one collective per tensor.
        assert c3["collectives"] - c2["collectives"] == 10
        assert c3["fused_tensors"] == c2["fused_tensors"]


def test_join_contributes_zeros_and_returns_last_rank():
    res = run_ranks("core_workers:join_uneven", 3, timeout=60)
    # steps: rank0 2, rank1 3, rank2 4 -> sums 3,3,2,1 as ranks join
    assert res[2]["sums"] == [3.0, 3.0, 2.0, 1.0]
    assert res[1]["sums"] == [3.0, 3.0, 2.0]
    assert res[0]["sums"] == [3.0, 3.0]
    assert all(r["last"] == 2 for r in res)


@pytest.mark.parametrize("kind,needle", [
    ("shape", "Mismatched allreduce shapes for tensor 'w': rank 0 has [1]; rank 1 has [2]"),
    ("dtype", "Mismatched allreduce data types for tensor 'w': rank 0 has float32; rank 1 has float64"),
    ("op", "Mismatched allgather operations for tensor 'w'"),
    ("root", "Mismatched broadcast root ranks for tensor 'w': rank 0 has root 0; rank 1 has root 1"),
    ("reduce", "Mismatched allreduce reduce ops for tensor 'w'"),
])
def test_mismatch_raises_on_every_rank(kind, needle):
    res = run_ranks("core_workers:mismatch", 2, timeout=60, args=(kind,))
    for r in res:
        assert r["error"] is not None and r["error"].startswith("MismatchError"), r
        if kind != "op":
            assert needle in r["error"]
        else:
            assert "operations for tensor 'w'" in r["error"] and "rank 0 has allreduce" in r["error"]
        assert r["after"] == 2.0


def test_duplicate_inflight_name():
    res = run_ranks("core_workers:duplicate_name", 2, timeout=60)
    assert "already in flight" in res[0] and "'dup'" in res[0]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_killed_rank_fails_peers_in_bounded_time(transport):
    env = {"SDL_SHM": "1" if transport == "shm" else "0"}
    procs, outdir, server = spawn_ranks("core_workers:die_mid_collective", 3, env=env,
                                        args=("kill",))
    start = time.monotonic()
    results = collect(procs, outdir, server, timeout=60, wait_for=[0, 1])
    assert time.monotonic() - start < 40
    for rank in (0, 1):
        code, payload, output = results[rank]
        assert payload and payload["ok"], output
        r = payload["value"]
        assert r["error"] and r["error"].startswith("PeerFailureError"), r
        assert "rank 2" in r["error"] or transport == "gloo", r
        assert r["elapsed"] < 30, r
        assert r["later"] == "PeerFailureError"
    assert results[2][0] == -9


def test_hung_rank_fails_peers_after_timeout_knob():
    procs, outdir, server = spawn_ranks("core_workers:die_mid_collective", 2,
                                        env={"SDL_TIMEOUT": "3"}, args=("stop",))
    results = collect(procs, outdir, server, timeout=60, wait_for=[0])
    code, payload, output = results[0]
    assert payload and payload["ok"], output
    r = payload["value"]
    assert r["error"].startswith("PeerFailureError") and "SDL_TIMEOUT" in r["error"], r
    assert 2.5 < r["elapsed"] < 15, r


def test_grouped_allgather_runs_every_member():
    for r in run_ranks("core_workers:grouped_allgather", 2, timeout=60):
        assert r == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_idle_and_waiting_ranks_leave_the_cpu_alone(transport):
    # Idle ranks that belong to every set run heartbeat cycles only
    # (SDL_IDLE_CYCLE_TIME, 100 ms), not one per SDL_CYCLE_TIME (1 ms); a rank
    # waiting in a collective for a late peer sleeps instead of spinning.
    env = {"SDL_SHM": "1" if transport == "shm" else "0"}
    res = run_ranks("core_workers:idle_costs", 2, env=env, timeout=60)
    for r in res:
        assert r["idle_cycles"] <= 25, r
    waiter = res[0]
    assert waiter["wait_wall"] > 1.2, waiter
    assert waiter["wait_cpu"] < 0.06 * waiter["wait_wall"], waiter


def test_subset_ops_stay_fast_while_an_outsider_idles():
    # A rank outside a set keeps short idle cycles: the set's members need
    # its world cycles, so it must not sleep for SDL_IDLE_CYCLE_TIME.
    res = run_ranks("core_workers:subset_while_outsider_idles", 3, timeout=60)
    for r in res[:2]:
        assert r["elapsed"] < 1.5, r


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatched_submissions_fail_after_the_timeout(np_):
    res = run_ranks("core_workers:mismatched_submissions", np_, env={"SDL_TIMEOUT": "2"},
                    timeout=90)
    for rank, r in enumerate(res):
        mine, theirs = ("a", "b") if rank == 0 else ("b", "a")
        assert r["cached"].startswith("MismatchError"), r
        assert f"allreduce of tensor '{mine}'" in r["cached"], r
        assert f"waits on '{theirs}'" in r["cached"], r
        assert "SDL_TIMEOUT" in r["cached"], r
        assert 1.5 < r["cached_s"] < 20, r
        assert r["after"] == float(np_)
        assert r["fresh"].startswith("MismatchError") and f"'fresh.{rank}'" in r["fresh"], r
        others = [f"'fresh.{q}'" for q in range(np_) if q != rank]
        assert all(o in r["fresh"] for o in others), r
        if np_ == 3 and rank != 1:
            other = 2 - rank
            assert r["subset"].startswith("MismatchError"), r
            assert f"'sub.{rank}'" in r["subset"] and f"rank {other} waits on 'sub.{other}'" \
                in r["subset"], r
            assert r["subset_after"] == 2.0
            # roots are named as the global ranks the callers passed
            assert "rank 0 has root 0; rank 2 has root 2" in r["subset_root"], r


def test_blocked_wait_is_interruptible():
    res = run_ranks("core_workers:interrupted_wait", 2, timeout=60)
    assert res[0]["interrupted"] and res[0]["after_s"] < 3, res
    assert res[0]["ctrl_c"], res
    assert res[0]["value"] == res[1]["value"] == [2.0, 2.0]
    assert res[0]["value2"] == res[1]["value2"] == [2.0, 2.0]
