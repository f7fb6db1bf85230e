"""The example notebooks (examples/notebooks): the Jupyter one runs headless and shows what it
should, the Databricks one compiles.

``torch_estimator.ipynb`` runs under nbclient in a kernel on this interpreter (a kernel spec
written into a temporary directory, so a fresh clone needs no registered kernel), from the
notebook's folder, as Jupyter runs it. Its outputs must show a fit (epoch lines), a sane
evaluator number, the plots, and nothing else: no traceback, no quoted strings or ``''``
left by the progress bar, no Spark WARN lines or console bars, nothing on stderr but the
JDK's one start-up notice.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "examples" / "notebooks"
JUPYTER = NOTEBOOKS / "torch_estimator.ipynb"
DATABRICKS = NOTEBOOKS / "databricks_torch_estimator.py"
KERNEL = "spark_dl_tests"
CELL_TIMEOUT_S = 300
# The JVM's notice for the incubator module Spark 4 loads: printed by the JDK itself
# before any logging is configured, on every Spark start.
STDERR_ALLOWED = re.compile(r"^WARNING: Using incubator modules: ")


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    return output.get("data", {}).get("text/plain", "")


def test_jupyter_notebook_is_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(JUPYTER), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert "widgets" not in nb.metadata


def test_databricks_notebook_is_valid_python_in_databricks_source_format():
    text = DATABRICKS.read_text()
    compile(text, str(DATABRICKS), "exec")
    assert text.startswith("# Databricks notebook source\n")
    cells = text.split("\n# COMMAND ----------\n")
    assert len(cells) > 5
    assert any("# MAGIC %md" in c for c in cells) and any("# MAGIC %pip install" in c
                                                          for c in cells)
    assert "TorchEstimator(" in text and "Store.create(" in text
    assert "spark.stop()" not in text  # the session belongs to Databricks


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel spec on this interpreter, found first through JUPYTER_PATH; the kernel's
    Spark workers run this interpreter with the source tree importable (as in conftest)."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "spark_dl tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep)
                           if p]))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT)] + paths))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return KERNEL


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(CELL_TIMEOUT_S * 3)
def test_jupyter_notebook_runs_headless_with_quiet_useful_outputs(kernel):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(str(JUPYTER), as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    seconds = time.monotonic() - start
    cells = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in cells for o in c.outputs]
    streams = [o for o in outputs if o.output_type == "stream"]
    everything = "\n".join(_text(o) for o in outputs)
    summary = f"ran in {seconds:.0f}s; outputs:\n{everything[-6000:]}"

    assert not [o for o in outputs if o.output_type == "error"], summary
    assert "Traceback" not in everything, summary
    # The fit: its header, one line per epoch, its end; the bar left nothing behind.
    fit = next(c for c in cells if "estimator.fit(" in c.source)
    fit_text = "\n".join(_text(o) for o in fit.outputs)
    assert "TorchEstimator: run " in fit_text and " done in " in fit_text, summary
    epochs = re.findall(r"^Epoch (\d+)/(\d+): loss ", fit_text, re.M)
    assert epochs and len(epochs) == int(epochs[-1][1]), summary
    for o in outputs:
        if o.output_type in ("display_data", "execute_result"):
            plain = o.get("data", {}).get("text/plain", "")
            assert not re.fullmatch(r"\s*(''|\"\"|'[^\n]*')\s*", plain), (plain, summary)
    # The history and predictions plots.
    images = [c for c in cells if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert any("plot_history()" in c.source for c in images), summary
    assert len(images) >= 2, summary
    # The evaluation: a number, and a model that learned something.
    found = re.search(r"test RMSE ([0-9.]+), R2 (-?[0-9.]+)", everything)
    assert found, summary
    rmse, r2 = float(found.group(1)), float(found.group(2))
    assert 0 < rmse < 0.8 and r2 > 0.7, summary
    # Quiet: no Spark log lines or console bars, nothing on stderr but the JDK's notice.
    assert not re.search(r"\b(WARN|ERROR)\b", everything), summary
    assert "[Stage " not in everything and "GpuFallbackWarning" not in everything, summary
    stderr = [line for o in streams if o.name == "stderr"
              for line in o.text.splitlines() if line.strip()]
    assert all(STDERR_ALLOWED.match(line) for line in stderr), summary
    print(f"torch_estimator.ipynb ran in {seconds:.1f}s")
