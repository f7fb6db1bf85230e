"""benchmarks/elastic_spark.py without Spark: its help, and the report of a saved run (both
kinds of death, the stages, the target line). The measurement itself needs a local-cluster
session and minutes: its numbers come from running the script (docs/benchmarks.md)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "elastic_spark.py")
pytestmark = pytest.mark.timeout(120)


def _run(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)


def test_help_names_both_deaths():
    p = _run("--help")
    assert p.returncode == 0, p.stderr
    assert "--deaths" in p.stdout and "executor" in p.stdout and "heartbeat" in p.stdout


def _fake(recovery, lost):
    return {"recovery": recovery, "resumed_at_step": 16, "step_time": 0.03, "sizes": [2, 3],
            "parts": {"caller saw death": lost, "error caught": 0.1,
                      "first step (rank 0)": recovery}}


def test_report_of_a_saved_run(tmp_path):
    saved = {"args": {"die_at": 15, "steps": 30, "machine": "m", "load_before": "1 1 1",
                      "load_after": "1 1 1", "revision": "git x", "pyspark_version": "4",
                      "gloo": False, "features": 64, "width": 256, "classes": 10,
                      "batch": 32},
             "results": {"worker": [_fake(0.3, 0.2), _fake(0.5, 0.3)],
                         "executor": [_fake(3.0, 2.8), _fake(20.0, 2.9)]}}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    p = _run("--report", str(path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0.40 s (0.30-0.50)" in p.stdout and "11.50 s (3.00-20.00)" in p.stdout
    assert "worker: target (under 15 s on Spark): met" in p.stdout
    assert "executor: target (under 15 s on Spark): met" in p.stdout
    assert "| caller saw death" in p.stdout and "| error caught" in p.stdout
