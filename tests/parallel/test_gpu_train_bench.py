"""benchmarks/gpu_train.py on the CPU (``--device cpu --quick``): every part runs end to end
without pyspark, and the report has every peer's numbers. The GPU numbers themselves need a
GPU machine (scripts/gpu_check.sh runs the script there)."""

import json
import os
import re
import subprocess
import sys

import pytest

from harness import REPO

# 25-60 s on the shared 2-core development machine (two ranks; mostly imports); the script bounds
# itself (--timeout) with room for a loaded machine, and the test's limit leaves it time to
# report.
pytestmark = pytest.mark.timeout(150)
SCRIPT_TIMEOUT_S = 100


def _run(tmp_path, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "benchmarks/gpu_train.py", *args, "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=SCRIPT_TIMEOUT_S + 30)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_cpu_quick_run_reports_every_peer(tmp_path):
    p, result = _run(tmp_path, "--device", "cpu", "--quick", "--timeout", str(SCRIPT_TIMEOUT_S))
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    out = p.stdout
    number = re.compile(r"^\d+\.\d+ \[\d+\.\d+, \d+\.\d+\]$")  # median [p10, p90]
    # (a) the estimators' worker loop, one row per framework, on the CPU.
    for fw in ("torch", "lightning"):
        row = next(ln for ln in out.splitlines() if ln.startswith(f"| {fw} | cpu |"))
        cells = _cells(row)
        assert number.match(cells[3]), row
        assert float(cells[4]) > 0 and float(cells[5]) > 0 and float(cells[6]) > 0, row
    # (b) one step: spark_dl, DDP (gloo here) and the no-communication ceiling.
    for peer in ("spark_dl", "ddp", "local"):
        row = next(ln for ln in out.splitlines() if ln.startswith(f"| {peer} |"))
        assert number.match(_cells(row)[1]), row
    assert "torch.distributed gloo" in out and "x ddp (time ratio" in out
    # (c) both workloads, all five forms, ratios between them.
    header = next(ln for ln in out.splitlines() if ln.startswith("| workload |"))
    assert _cells(header)[1:] == ["spark_dl", "spark_dl_batch", "spark_dl_group", "gloo_each",
                                  "gloo_flat"]
    for workload in ("small", "large"):
        row = next(ln for ln in out.splitlines() if ln.startswith(f"| {workload} |"))
        assert all(number.match(c) for c in _cells(row)[1:]), row
        assert f"{workload}: spark_dl" in out
    # Nothing in the worker path imported pyspark (the GPU machine has none).
    assert "pyspark imports refused (the GPU machine has none): none" in out
    assert not result["failures"] and not result["not_measured"]
    assert set(result["results"]) == {"estimator.torch", "estimator.lightning", "step",
                                      "shared_gpu"}
    assert not any(r["pyspark_loaded"] for r in result["results"].values())


def test_cuda_without_a_gpu_fails_instead_of_measuring_the_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p, result = _run(tmp_path, "--quick", "--parts", "step")
    assert p.returncode != 0 and result is None
    assert "no CUDA device here" in p.stderr
