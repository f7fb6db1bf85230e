"""The core's op matrix, and what only the torch API adds (in-place, async, groups, sparse),
through ``spark_dl.torch`` on 2 and 3 ranks, every dtype (bfloat16 and float16 included);
process sets through the torch API on 3 ranks."""

import pytest

from harness import run_once, run_ranks
from torch_workers import torch_cases

pytestmark = pytest.mark.timeout(300)
_results = {}


def _matrix(np_):
    return run_once(_results, np_,
                    lambda: run_ranks("torch_workers:op_matrix", np_, timeout=240))


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", torch_cases())
def test_op(case, np_):
    errors = {rank: r[case] for rank, r in enumerate(_matrix(np_)) if r[case] is not None}
    assert not errors, f"{case} on {np_} ranks: {errors}"


def test_process_sets_through_torch_api():
    res = [r["__process_sets__"] for r in _matrix(3)]
    for rank in (0, 2):
        r = res[rank]
        assert r["sum"] == [2.0]
        assert r["gather"] == [0, 2]
        assert r["bcast"] == [2]  # root_rank is a global rank (Horovod's meaning)
        assert r["object"] == "from 2"
        assert "InvalidArgumentError" in r["outside_root"] and "[0, 2]" in r["outside_root"]
        assert r["objects"] == [0, 2]
        assert r["sparse"] == [1.0, 0.0, 1.0, 40.0]  # ranks 0 and 2 only, sparse all the way
        assert r["gather_grad"] == [1.0]  # average over the 2 members' losses of this rank's row
        # gradients averaged over ranks 0 and 2 only: (1 + 9) / 2
        assert r["weight_delta"][0] == pytest.approx([5.0, 5.0], rel=1e-6)
    assert set(res[1]) == {"weight_delta"}
    # rank 1 is outside the set: its own gradient
    assert res[1]["weight_delta"][0] == pytest.approx([4.0, 4.0], rel=1e-6)
