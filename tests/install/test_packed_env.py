"""Executors without spark_dl get it from a packed virtualenv shipped with the job (issue 32).

The way docs/install.md gives for clusters whose nodes lack spark_dl: a venv with the wheel,
packed by ``venv-pack``, shipped through ``spark.archives`` (``--archives env.tar.gz#env``)
and run by the executors as ``./env/bin/python``. Checked on ``local-cluster`` (executor JVMs
of their own, each unpacking the archive in its working folder): the driver runs the wheel's
venv, the Python workers first a bare venv (on ``local[2]``: the probe's error must point at
the packed env), then the executors the packed env (``spark.run`` with two Gloo ranks works).
"""

import os
import shutil
import subprocess
import sys

import pytest

from installed import run_in

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]

JOB = '''
import sys
from pyspark.sql import SparkSession
import spark_dl.spark
from spark_dl.spark.launch.errors import ExecutorPythonError

builder = (SparkSession.builder.master(sys.argv[3])
           .config("spark.ui.enabled", "false").config("spark.pyspark.python", sys.argv[1]))
if sys.argv[2] != "-":
    builder = builder.config("spark.archives", sys.argv[2])
spark = builder.getOrCreate()

def fn():
    import sys, numpy as np, spark_dl.numpy as sdl
    sdl.init()
    return sys.executable, float(sdl.allreduce(np.ones(1, np.float32), op=sdl.Sum)[0])

try:
    print("result", spark_dl.spark.run(fn, num_proc=2, start_timeout=120))
except ExecutorPythonError as exc:
    print("ExecutorPythonError", exc)
spark.stop()
'''


@pytest.fixture(scope="module")
def packed_env(wheel, tmp_path_factory):
    """env.tar.gz: a venv with the wheel and its own requirements only, packed."""
    pack = shutil.which("venv-pack") or os.path.join(os.path.dirname(sys.executable), "venv-pack")
    if not os.path.exists(pack):
        pytest.skip("venv-pack is not installed (the test extra has it)")
    folder = tmp_path_factory.mktemp("packed")
    env = folder / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check",
                    "install", wheel], check=True, timeout=600, stdin=subprocess.DEVNULL)
    out = folder / "env.tar.gz"
    subprocess.run([pack, "-p", str(env), "-o", str(out), "-q"], check=True, timeout=600)
    return out


def test_executors_run_spark_dl_from_the_packed_env(wheel_venv, packed_env, tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)

    # The bare venv's refusal needs no executor JVMs: local[2]'s Python workers run it too.
    proc = run_in(wheel_venv, ["python", str(job), str(bare / "bin" / "python"), "-",
                               "local[2]"], timeout=300)
    assert "ExecutorPythonError" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "venv-pack" in proc.stdout and "docs/install.md" in proc.stdout, proc.stdout

    proc = run_in(wheel_venv, ["python", str(job), "./env/bin/python", f"{packed_env}#env",
                               "local-cluster[2,1,1024]"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("result"))
    assert line.count("2.0") == 2, line
    # each rank ran the unpacked archive's interpreter, in its executor's working folder
    assert line.count("/env/bin/python") == 2 and str(wheel_venv) not in line, line
