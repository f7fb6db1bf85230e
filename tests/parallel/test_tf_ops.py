"""spark_dl.tensorflow on 2 and 3 ranks: every collective x dtype x reduce op, eagerly and
inside tf.function; gradients of the differentiable ops; DistributedGradientTape;
broadcast_variables; process sets; the XLA refusal."""

import pytest

from harness import run_once, run_ranks
from tf_workers import selected

pytestmark = pytest.mark.timeout(400)
_results = {}


def _matrix(np_):
    return run_once(_results, np_, lambda: run_ranks("tf_workers:op_matrix", np_, timeout=360))


@pytest.mark.parametrize("np_,case,mode", [(n, c, m) for n in (2, 3) for c, m in selected(n)])
def test_op(case, mode, np_):
    key = f"{case}/{mode}"
    errors = {rank: r[key] for rank, r in enumerate(_matrix(np_)) if r[key] is not None}
    assert not errors, f"{key} on {np_} ranks: {errors}"


def test_process_sets():
    res = [r["__process_sets__"] for r in _matrix(3)]
    for rank in (0, 2):
        r = res[rank]
        assert r["sum"] == [2.0]
        assert r["gather"] == [0, 2]
        assert r["bcast"] == [2]  # root_rank is a global rank (2)
        assert r["object"] == "from 2"
        assert r["objects"] == [0, 2]
        assert r["grad"] == [2.0]  # the members' output gradients 1 and 3, averaged
        assert r["tape_grad"] == [3.0]  # gradients 1 and 5 averaged over ranks 0 and 2
    assert set(res[1]) == {"tape_grad"}
    assert res[1]["tape_grad"] == [2.0]  # outside the set: its own gradient


def test_xla_is_refused_with_a_clear_error():
    for res in run_ranks("tf_workers:xla_refused", 2, timeout=120):
        for where, message in res.items():
            assert message is not None, f"{where}: the op was traced under XLA without an error"
            assert "jit_compile=False" in message
