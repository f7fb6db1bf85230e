"""executor_probe.same_interpreter: a venv's python is not its base interpreter.

Both are the same binary (the venv's ``bin/python`` links to the base), but they run with
different packages; taking one for the other skipped the executor check for a bare venv and
let the barrier job fail with a page of traces (issue 32's packed-env test found it).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

from spark_dl.spark.launch.executor_probe import same_interpreter  # noqa: E402


def test_this_interpreter_under_its_own_names(tmp_path):
    assert same_interpreter(sys.executable)
    link = tmp_path / "bin"
    os.symlink(os.path.dirname(sys.executable), link)  # the venv folder reached by a link
    assert same_interpreter(str(link / os.path.basename(sys.executable)))


def test_another_venv_on_the_same_binary_is_another_interpreter(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")],
                   check=True, timeout=120)
    other = str(tmp_path / "v" / "bin" / "python")
    assert os.path.realpath(other) == os.path.realpath(sys.executable) or sys.prefix == sys.base_prefix
    assert not same_interpreter(other)
    assert not same_interpreter("python3") and not same_interpreter(None)
