"""conf/gpu_discovery.sh prints Spark's resource JSON from nvidia-smi (a fake one here)."""

import json
import os
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "conf", "gpu_discovery.sh")

pytestmark = pytest.mark.timeout(60)


def discover(where, smi_output=None):
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True)
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nprintf '%s'\n" % smi_output)
        smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run(["sh", SCRIPT], env=env, capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return json.loads(out)


def test_indices_from_nvidia_smi(tmp_path):
    assert discover(tmp_path, "0\\n1\\n3\\n") == {"name": "gpu", "addresses": ["0", "1", "3"]}


def test_no_gpu_means_no_addresses(tmp_path):
    assert discover(tmp_path / "no_smi") == {"name": "gpu", "addresses": []}
    assert discover(tmp_path / "smi_fails", "No devices were found\\n")["addresses"] == []
