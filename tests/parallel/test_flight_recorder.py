"""The flight recorder (docs/observability.md): each rank's ring of its last
collectives, dumped on every rank when the job fails; rank 0 names where the ranks
parted ways."""

import json
import os
import tempfile

from harness import collect, run_ranks, spawn_ranks


def _load(folder, rank):
    with open(os.path.join(folder, f"flight_recorder.rank{rank}.json")) as f:
        return json.load(f)


def test_records_are_complete_and_ordered():
    for recs in run_ranks("stall_workers:healthy", 2, args=("20",), timeout=60):
        assert [r["name"] for r in recs] == [f"t.{i}" for i in range(20)]
        for r in recs:
            assert r["op"] == "allreduce" and r["shape"] == [4] and r["state"] == "ok", r
            assert 0 < r["enqueued"] <= r["negotiated"] <= r["started"] <= r["done"], r
            assert r["dtype"] == "float64" and r["process_set"] == 0


def test_ring_keeps_the_last_n():
    recs = run_ranks("stall_workers:healthy", 2, args=("20",), timeout=60,
                     env={"SDL_FLIGHT_RECORDER_SIZE": "8"})[0]
    assert [r["name"] for r in recs] == [f"t.{i}" for i in range(12, 20)]
    assert run_ranks("stall_workers:healthy", 2, args=("5",), timeout=60,
                     env={"SDL_FLIGHT_RECORDER_SIZE": "0"})[0] == []


def test_stall_shutdown_dumps_every_rank_and_names_the_diverging_collective():
    folder = tempfile.mkdtemp(prefix="sdl-fr-")
    procs, outdir, server = spawn_ranks(
        "stall_workers:silent_rank", 3,
        env={"SDL_STALL_SHUTDOWN_TIME": "2", "SDL_FLIGHT_RECORDER_DIR": folder}, args=("4", "5"))
    results = collect(procs, outdir, server, timeout=90)
    dumps = [_load(folder, r) for r in range(3)]
    for r, d in enumerate(dumps):
        assert d["rank"] == r and d["wall_time_base"] > 1.6e9 and "Stalled" in d["reason"], d
        names = [x["name"] for x in d["records"]]
        assert names[:4] == [f"step.{i}" for i in range(4)], names
        assert all(x["state"] == "ok" for x in d["records"][:4]), d
    # Ranks 0 and 1 were waiting on 'grad.w' (never negotiated: the dump is taken before
    # the pending operations fail); rank 2 never submitted it.
    for r in (0, 1):
        last = dumps[r]["records"][-1]
        assert last["name"] == "grad.w" and last["negotiated"] == 0, last
        assert last["state"] == "waiting", last
    assert "grad.w" not in [x["name"] for x in dumps[2]["records"]]
    err0 = results[0][1]["value"]["error"]
    assert "allreduce 'grad.w'" in err0 and "missing rank 2" in err0, err0
    assert "full dump in " + os.path.join(folder, "flight_recorder.rank0.json") in results[0][2]


def test_peer_loss_dumps_and_rank0_names_what_it_waited_on():
    folder = tempfile.mkdtemp(prefix="sdl-fr-")
    procs, outdir, server = spawn_ranks(
        "stall_workers:dying_rank", 3,
        env={"SDL_FLIGHT_RECORDER_DIR": folder, "SDL_TIMEOUT": "10"}, args=("3",))
    results = collect(procs, outdir, server, timeout=90, wait_for=[0, 1])
    for r in (0, 1):
        payload = results[r][1]
        assert payload and payload["ok"], results[r][2]
        err = payload["value"]["error"]
        assert err and err.startswith("PeerFailureError"), err
        d = _load(folder, r)
        assert [x["name"] for x in d["records"]] == ["step.0", "step.1", "step.2", "grad.w"], d
        assert d["records"][-1]["state"] != "ok"
    err0 = results[0][1]["value"]["error"]
    assert "parted ways at allreduce 'grad.w'" in err0, err0
