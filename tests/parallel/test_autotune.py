"""Autotune (docs/observability.md, section Autotune): rank 0 tunes, every rank applies the
same parameters from the same negotiation cycle on, the CSV records every sample.

Ranks are spawned under plain pytest (harness.py); every wait is bounded.
"""

import csv
import os
import subprocess
import sys

import pytest

from harness import HERE, REPO, run_once, run_ranks
from spark_dl.common.native import core as _core

pytestmark = pytest.mark.timeout(150)

WARMUP, STEPS, MAX = 1, 3, 4
_RUNS = {}


def tuned_job(tmp_path_factory, hosts=None):
    """One 3-rank job with tiny autotune settings (shared by the tests that read it)."""
    def launch():
        log = str(tmp_path_factory.mktemp("autotune") / "autotune.csv")
        env = {"SDL_AUTOTUNE": "1", "SDL_AUTOTUNE_LOG": log,
               "SDL_AUTOTUNE_WARMUP_SAMPLES": str(WARMUP),
               "SDL_AUTOTUNE_STEPS_PER_SAMPLE": str(STEPS),
               "SDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(MAX)}
        if hosts:
            env["SDL_TEST_HOSTS"] = hosts
        return run_ranks("autotune_workers:tune", 3, env=env, timeout=120), log
    return run_once(_RUNS, hosts, launch)


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_every_rank_switches_parameters_in_the_same_cycle(tmp_path_factory):
    res, _ = tuned_job(tmp_path_factory)
    changes = [r["state"]["changes"] for r in res]
    # One change per sample (warm-up included) plus the chosen values, each with the
    # world cycle it took effect in: a rank that switched one cycle late (or early, or to
    # other values) differs here.
    assert len(changes[0]) == 1 + WARMUP + MAX, changes[0]
    for r in (1, 2):
        assert changes[r] == changes[0], (r, changes[r], changes[0])
    cycles = [c for c, _ in changes[0]]
    assert cycles == sorted(set(cycles)) and cycles[0] >= 1
    serials = [p["serial"] for _, p in changes[0]]
    assert serials == list(range(1, 2 + WARMUP + MAX))
    # Tuning stopped: the last change is the choice, in force everywhere at the end.
    final = changes[0][-1][1]
    assert final["done"] and not any(p["done"] for _, p in changes[0][:-1])
    for r in res:
        assert r["state"]["applied"] == final
        assert r["state"]["world_cycles"] > cycles[-1]
    # One host: hierarchical allreduce is never tuned.
    assert not any(p["hierarchical_tuned"] for _, p in changes[0])


def test_csv_has_every_sample_and_the_best_is_chosen(tmp_path_factory):
    res, log = tuned_job(tmp_path_factory)
    rows = read_csv(log)
    assert [r["sample"] for r in rows] == [str(i) for i in range(WARMUP + MAX)] + ["chosen"]
    assert [r["warmup"] for r in rows] == ["1"] * WARMUP + ["0"] * (MAX + 1)
    for r in rows:
        assert float(r["score_bytes_per_s"]) > 0, r
        int(r["fusion_threshold_bytes"]), float(r["cycle_time_ms"])
        assert r["response_cache"] in ("0", "1") and r["hierarchical_allreduce"] == ""
    scored = rows[WARMUP:-1]
    best = max(scored, key=lambda r: float(r["score_bytes_per_s"]))
    chosen = rows[-1]
    keys = ("fusion_threshold_bytes", "cycle_time_ms", "response_cache", "score_bytes_per_s")
    assert all(chosen[k] == best[k] for k in keys), (chosen, best)
    # best_so_far marks running maxima; the first scored sample (the knobs' own values) is
    # one, so the chosen score is at least the defaults' score measured in this run.
    running = 0.0
    for r in scored:
        s = float(r["score_bytes_per_s"])
        assert r["best_so_far"] == ("1" if s > running else "0"), scored
        running = max(running, s)
    assert float(chosen["score_bytes_per_s"]) >= float(scored[0]["score_bytes_per_s"])
    # The first scored sample ran with the knobs' defaults (128 MiB, 1 ms, cache on).
    assert (scored[0]["fusion_threshold_bytes"], scored[0]["cycle_time_ms"],
            scored[0]["response_cache"]) == (str(128 << 20), "1", "1")
    # The applied values on every rank are the chosen row's.
    final = res[0]["state"]["applied"]
    assert (str(final["fusion_threshold"]), final["response_cache"]) == (
        chosen["fusion_threshold_bytes"], chosen["response_cache"] == "1")
    assert abs(final["cycle_time_ms"] - float(chosen["cycle_time_ms"])) < 1e-9


def test_hierarchical_allreduce_is_tuned_across_hosts(tmp_path_factory):
    # Ranks 0 and 1 share a host, rank 2 is alone: the world transport is hierarchical.
    res, log = tuned_job(tmp_path_factory, hosts="hostA,hostA,hostB")
    assert {r["transport"] for r in res} == {"hierarchical"}
    changes = [r["state"]["changes"] for r in res]
    assert changes[1] == changes[0] and changes[2] == changes[0]
    assert all(p["hierarchical_tuned"] for _, p in changes[0])
    rows = read_csv(log)
    assert len(rows) == WARMUP + MAX + 1
    assert {r["hierarchical_allreduce"] for r in rows} <= {"0", "1"}


@pytest.mark.parametrize("launcher", ["store", pytest.param("mpi", marks=pytest.mark.skipif(
    not _core.build_info()["mpi"], reason="spark_dl built without MPI"))])
def test_same_cycle_over_the_network_transports(launcher):
    # SDL_SHM=0: the AND runs over Gloo (store) or MPI instead of shared memory.
    env = {"SDL_AUTOTUNE": "1", "SDL_SHM": "0", "SDL_AUTOTUNE_WARMUP_SAMPLES": str(WARMUP),
           "SDL_AUTOTUNE_STEPS_PER_SAMPLE": str(STEPS),
           "SDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(MAX)}
    res = run_ranks("autotune_workers:tune", 3, env=env, timeout=120, launcher=launcher,
                    args=("40",))
    assert {r["transport"] for r in res} == {"gloo" if launcher == "store" else "mpi"}
    changes = [r["state"]["changes"] for r in res]
    assert len(changes[0]) == 1 + WARMUP + MAX and changes[0][-1][1]["done"]
    assert changes[1] == changes[0] and changes[2] == changes[0]


def test_without_autotune_nothing_is_tuned():
    res = run_ranks("autotune_workers:tune", 2, args=("5",), timeout=90)
    for r in res:
        assert r["state"]["changes"] == [] and r["state"]["applied"]["serial"] == 0
        assert set(r["seen"]) == {0}


def test_sdlrun_flags_reach_the_workers(tmp_path):
    log = str(tmp_path / "sdlrun.csv")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    for k in [k for k in env if "AUTOTUNE" in k]:
        del env[k]
    p = subprocess.run(
        [sys.executable, "-m", "spark_dl.runner", "-np", "2", "--autotune", "--autotune-log-file",
         log, "--autotune-warmup-samples", "0", "--autotune-steps-per-sample", "2",
         "--autotune-bayes-opt-max-samples", "3", sys.executable,
         os.path.join(HERE, "autotune_workers.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90)
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0, out
    assert [r["sample"] for r in read_csv(log)] == ["0", "1", "2", "chosen"]
    # Rank 0 says what it tunes, and that one host leaves hierarchical allreduce alone.
    assert "hierarchical allreduce not tuned" in out and "autotune: chose" in out, out
