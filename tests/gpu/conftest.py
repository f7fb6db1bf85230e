"""tests/gpu: spark_dl on CUDA tensors. Run on a GPU machine with ``bash scripts/gpu_check.sh``
(it builds the extension there first; nothing built on a CPU machine runs there).

Every test here is skipped, with the reason, where ``torch.cuda.is_available()`` is False;
the CPU-verifiable parts of GPU support are in tests/unit/test_gpu_*.py and
tests/spark/test_gpu_*.py. Multi-rank tests use tests/parallel/harness.py.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PARALLEL = os.path.join(os.path.dirname(HERE), "parallel")
for path in (HERE, PARALLEL):
    if path not in sys.path:
        sys.path.insert(0, path)


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"tests/gpu: {reason}")
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(skip)
