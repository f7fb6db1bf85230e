"""The synthetic benchmark example and the DDP comparison run end to end (tiny sizes)."""

import os
import subprocess
import sys

import pytest

from harness import REPO

pytestmark = pytest.mark.timeout(180)


def _run(args, timeout=150):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_synthetic_benchmark_example_under_sdlrun():
    p = _run(["-m", "spark_dl.runner", "-np", "2", sys.executable,
              "examples/pytorch_synthetic_benchmark.py", "--batch-size", "4", "--width", "4",
              "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2",
              "--fp16-allreduce", "--threads", "1"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Iter #1:" in p.stdout and "img/sec per CPU" in p.stdout
    assert "Total img/sec on 2 CPU(s):" in p.stdout


def test_ddp_benchmark_runs_and_keeps_replicas_identical():
    p = _run(["benchmarks/torch_ddp.py", "--rounds", "1", "--iters", "2", "--warmup", "1",
              "--width", "4", "--batch-size", "4", "--transports", "shm"])
    assert p.returncode == 0, p.stdout + p.stderr
    for label in ("spark_dl DistributedOptimizer", "torch DDP (gloo)",
                  "no communication (ceiling)"):
        assert f"| shm | {label}" in p.stdout
