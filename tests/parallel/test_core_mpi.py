"""The core on MPI: plain mpirun, process sets, mpi4py sub-communicators, a killed rank."""

import os
import subprocess
import sys
import time

import pytest

from harness import HERE, MPI_TEST_ENV, REPO, run_ranks
from spark_dl import _core

pytestmark = pytest.mark.skipif(not _core.build_info()["mpi"], reason="spark_dl built without MPI")
MPI_ENV = {"SDL_CONTROLLER": "mpi", "SDL_SHM": "0"}


def test_process_sets_on_mpi():
    res = run_ranks("core_workers:process_sets", 3, env=MPI_ENV, timeout=90, launcher="mpi")
    for rank, r in enumerate(res):
        assert r["global"] == 3.0 and r["global_after"] == 6.0
        if rank in (0, 2):
            assert r["evens"] == 2.0
        if rank in (0, 1):
            assert r["init_set"] == 3.0


def test_mismatch_on_mpi():
    for r in run_ranks("core_workers:mismatch", 2, env=MPI_ENV, timeout=60, args=("shape",),
                       launcher="mpi"):
        assert r["error"].startswith("MismatchError") and "rank 1 has [2]" in r["error"]
        assert r["after"] == 2.0


def test_mpi4py_split_runs_two_independent_jobs():
    res = run_ranks("core_workers:mpi4py_split", 4, timeout=90, launcher="mpi")
    for world_rank, r in enumerate(res):
        assert r["size"] == 2 and r["rank"] == world_rank // 2
        # evens: world ranks 0, 2 -> 1 + 3; odds: 1, 3 -> 2 + 4
        assert r["sum"] == (4.0 if r["color"] == 0 else 6.0)
        assert r["user_sum"] == 4
        assert r["threads"] is True and r["mpi_enabled"] is True


def test_killed_rank_ends_mpirun_in_bounded_time():
    env = dict(os.environ, **MPI_TEST_ENV, **MPI_ENV)
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")])
    outdir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sdl-mpi-kill-{os.getpid()}")
    os.makedirs(outdir, exist_ok=True)
    start = time.monotonic()
    p = subprocess.run(["mpirun", "-np", "3", sys.executable, os.path.join(HERE, "rank_main.py"),
                        "core_workers:die_mid_collective", outdir, "kill"],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90)
    elapsed = time.monotonic() - start
    out = p.stdout.decode(errors="replace")
    assert p.returncode != 0, out
    assert elapsed < 45, out
    assert "signal 9" in out or "Killed" in out or "PeerFailureError" in out, out
