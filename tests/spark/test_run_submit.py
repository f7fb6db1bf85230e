"""``examples/spark/run_demo.py`` through a real ``spark-submit`` (pyspark's bin/)."""

import os
import subprocess
import sys

import pytest

pyspark = pytest.importorskip("pyspark")

pytestmark = [pytest.mark.spark, pytest.mark.timeout(200)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_demo_through_spark_submit():
    spark_submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(paths))
    cmd = [spark_submit, "--master", "local[2]", "--driver-memory", "1g",
           "--conf", "spark.ui.enabled=false", "--conf", "spark.ui.showConsoleProgress=false",
           os.path.join(ROOT, "examples", "spark", "run_demo.py"), "--num-proc", "2"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "run_demo: OK, 2 workers returned [(0, 3.0), (1, 3.0)]" in proc.stdout
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank}/2" in proc.stdout
