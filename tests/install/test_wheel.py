"""The wheel from scripts/build_wheel.sh works where spark_dl was never built (issue 32).

Installed into a new venv that cannot see this checkout, and run where the system's Gloo and
Open MPI are hidden (conftest.hidden_system): the core loads from the wheel alone, ``sdlrun
-np 2`` runs Gloo collectives, a TorchEstimator fits (two ranks launched as ``spark.run``
launches them) and transforms on ``local[2]``, and the MPI features say what to install. Where Open MPI is installed, the
same wheel uses it.
"""

import os
import re
import shutil
import subprocess
import zipfile

import pytest

from installed import ROOT, run_in

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# Libraries a manylinux wheel may take from the system (the policy's list, x86_64).
POLICY = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libpthread.so.0",
          "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2", "linux-vdso.so.1"}


def _needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_wheel_bundles_what_it_needs(wheel, tmp_path):
    name = os.path.basename(wheel)
    assert re.match(r"spark_dl-[\d.]+-cp\d+-cp\d+-manylinux_2_\d+_x86_64\.whl$", name), name
    assert any(n.endswith(".tar.gz") for n in os.listdir(os.path.dirname(wheel))), "no sdist"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
        names = z.namelist()
    assert "spark_dl/config/knobs.json" in names
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]
    bundled = set(os.listdir(tmp_path / "spark_dl.libs"))
    assert any(b.startswith("libgloo") for b in bundled), bundled
    cores = {n.split(".")[0]: str(tmp_path / "spark_dl" / n)
             for n in os.listdir(tmp_path / "spark_dl") if n.endswith(".so")}
    assert set(cores) == {"_core", "_core_nompi"}, cores
    for lib in [*cores.values(), *(str(tmp_path / "spark_dl.libs" / b) for b in bundled)]:
        outside = [n for n in _needed(lib) if n not in POLICY and n not in bundled]
        allowed = ["libmpi.so.40"] if lib == cores["_core"] else []
        assert outside == allowed, f"{os.path.basename(lib)} needs {outside} from the system"


def test_core_loads_without_system_libraries(wheel_venv, hidden_system):
    proc = run_in(wheel_venv, ["python", "-c", """
import os, spark_dl, spark_dl.torch as hvd
from spark_dl.common import native
print(os.path.dirname(spark_dl.__file__))
print(native.core.__name__)
print(native.mpi_missing_reason())
hvd.init(); import torch; print(hvd.allreduce(torch.ones(3)).tolist())
"""], prefix=hidden_system)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder, core, reason, result = proc.stdout.strip().splitlines()[-4:]
    assert "/work/main" not in folder and "wheel_venv" in folder, folder
    assert core == "spark_dl._core_nompi"
    assert "libmpi.so.40" in reason and "install Open MPI" in reason, reason
    assert result == "[1.0, 1.0, 1.0]"


def test_sdlrun_two_ranks_without_system_libraries(wheel_venv, hidden_system):
    proc = run_in(wheel_venv, ["sdlrun", "-np", "2", str(wheel_venv / "python"), "-c", """
import numpy as np, spark_dl.numpy as sdl
sdl.init()
print("rank", sdl.rank(), sdl.allreduce(np.full(4, sdl.rank() + 1.0, np.float32), op=sdl.Sum).tolist())
"""], prefix=hidden_system, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} [3.0, 3.0, 3.0, 3.0]" in proc.stdout, proc.stdout


def test_mpi_without_open_mpi_says_what_to_install(wheel_venv, hidden_system):
    proc = run_in(wheel_venv, ["sdlrun", "--mpi", "-np", "2", str(wheel_venv / "python"), "-c",
                               "print('ran')"], prefix=hidden_system, timeout=120)
    assert proc.returncode != 0 and "ran" not in proc.stdout
    assert "install Open MPI" in proc.stderr, proc.stderr[-2000:]
    proc = run_in(wheel_venv, ["python", "-c", """
import spark_dl.numpy as sdl
try:
    sdl.init(comm=[0])
except Exception as exc:
    print(type(exc).__name__, exc)
"""], prefix=hidden_system, timeout=120)
    assert "InvalidArgumentError" in proc.stdout and "libmpi.so.40" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]


def test_the_demo_fit_without_system_libraries(wheel_venv, hidden_system, tmp_path):
    # The fit launches its two ranks through the same barrier job as spark.run.
    env = {"PYSPARK_PYTHON": str(wheel_venv / "python")}
    demo = tmp_path / "torch_estimator_demo.py"
    shutil.copy(os.path.join(ROOT, "examples", "spark", "torch_estimator_demo.py"), demo)
    proc = run_in(wheel_venv, ["python", str(demo), "--rows", "1000", "--epochs", "2"],
                  prefix=hidden_system, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "torch_estimator_demo: OK" in proc.stdout, proc.stdout


def test_wheel_uses_the_machines_open_mpi(wheel_venv):
    if not any(os.path.exists(os.path.join(d, "libmpi.so.40"))
               for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/local/lib")):
        pytest.skip("Open MPI (libmpi.so.40) is not installed here")
    proc = run_in(wheel_venv, ["sdlrun", "--mpi", "-np", "2", str(wheel_venv / "python"), "-c", """
import numpy as np, spark_dl.numpy as sdl
from spark_dl.common import native
sdl.init()
print("rank", sdl.rank(), native.core.__name__, sdl.mpi_enabled(),
      sdl.allreduce(np.ones(2, np.float32), op=sdl.Sum).tolist())
"""], timeout=180, env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} spark_dl._core True [2.0, 2.0]" in proc.stdout, proc.stdout
