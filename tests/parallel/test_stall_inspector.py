"""The stall inspector (docs/observability.md): rank 0 warns about tensors some ranks
have not submitted, naming them, the missing ranks and their hosts; with a shutdown
time the stall becomes a PeerFailureError on every rank."""

import socket

from harness import collect, spawn_ranks


def test_warning_names_tensor_missing_rank_and_host_within_check_time():
    procs, outdir, server = spawn_ranks("stall_workers:late_rank", 3,
                                        env={"SDL_STALL_CHECK_TIME": "1"}, args=("3",))
    results = collect(procs, outdir, server, timeout=60)
    assert all(p and p["ok"] and p["value"] == 3.0 for _, p, _ in results), results
    out0 = results[0][2]
    lines = [ln for ln in out0.splitlines() if "stall inspector" in ln]
    assert lines, out0
    first = lines[0]
    assert "allreduce 'slow'" in first and "missing rank 2" in first, first
    assert f"(host {socket.gethostname()})" in first, first
    assert "submitted by ranks [0, 1]" in first and "SDL_STALL_CHECK_TIME" in first, first
    # One warning per check period (1 s) while the stall lasts (3 s): not one per cycle.
    assert 1 <= len(lines) <= 4, lines
    # Only the coordinator warns.
    assert "stall inspector" not in results[1][2] + results[2][2]


def test_horovod_variable_and_disable():
    procs, outdir, server = spawn_ranks(
        "stall_workers:late_rank", 2,
        env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_CHECK_DISABLE": "1"},
        args=("2",))
    results = collect(procs, outdir, server, timeout=60)
    assert all(p and p["ok"] for _, p, _ in results), results
    assert "stall inspector" not in results[0][2], results[0][2]
    procs, outdir, server = spawn_ranks("stall_workers:late_rank", 2,
                                        env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"},
                                        args=("2",))
    results = collect(procs, outdir, server, timeout=60)
    assert "stall inspector" in results[0][2] and "missing rank 1" in results[0][2], results[0][2]


def test_shutdown_time_raises_on_every_rank_within_bound():
    shutdown_s = 2.0
    procs, outdir, server = spawn_ranks(
        "stall_workers:silent_rank", 3,
        env={"SDL_STALL_CHECK_TIME": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(shutdown_s)},
        args=("3", "6"))
    results = collect(procs, outdir, server, timeout=90)
    for rank, (code, payload, output) in enumerate(results):
        assert payload and payload["ok"], output
        r = payload["value"]
        assert r["error"] and r["error"].startswith("PeerFailureError"), (rank, r["error"], output)
        assert "Stalled for more than" in r["error"], r["error"]
        assert "allreduce 'grad.w'" in r["error"] and "missing rank 2" in r["error"], r["error"]
        assert f"(host {socket.gethostname()})" in r["error"], r["error"]
        # Every rank dumped its flight recorder to its log.
        assert f"flight recorder of rank {rank}" in output, output
    # The waiting ranks fail once the shutdown time passed (plus check pacing and a
    # loaded machine's slack); the silent rank fails at its next call, after its sleep.
    for rank in (0, 1):
        took = results[rank][1]["value"]["took"]
        assert shutdown_s - 0.5 < took < shutdown_s + 8, (rank, took)
    assert results[2][1]["value"]["took"] < 1.0, results[2][1]["value"]


def test_sdlrun_job_warns_stops_and_dumps(tmp_path):
    """Under sdlrun: the warning, the error on every rank and the dumps, end to end."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    code = ("import sys; sys.path.insert(0, %r); import stall_workers as w; "
            "r = w.silent_rank('2', '4'); print('RESULT', r['error'])" % here)
    env = dict(os.environ, PYTHONPATH=repo, SDL_STALL_CHECK_TIME="1",
               SDL_STALL_SHUTDOWN_TIME="2", SDL_FLIGHT_RECORDER_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "spark_dl.runner", "-np", "2", sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=90, env=env)
    out = p.stdout + p.stderr
    assert "stall inspector: 1 tensor of process set 0" in out and "missing rank 1" in out, out
    results = [ln for ln in out.splitlines() if "RESULT PeerFailureError: Stalled" in ln]
    assert len(results) == 2 and all("allreduce 'grad.w'" in ln for ln in results), out
    for rank in (0, 1):
        with open(tmp_path / f"flight_recorder.rank{rank}.json") as f:
            names = [x["name"] for x in json.load(f)["records"]]
        assert names[:2] == ["step.0", "step.1"], names
    assert "flight recorder of rank 0" in out and "flight recorder of rank 1" in out, out
