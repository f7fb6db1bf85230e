"""Errors through the torch API on 2 ranks: mismatches raise on every rank naming the tensor,
a name reused in flight raises, DistributedOptimizer's misuse checks; the runtime stays
usable after each."""

import pytest

from harness import run_ranks

pytestmark = pytest.mark.timeout(120)
_results = []


def _errors():
    if not _results:
        _results.append(run_ranks("torch_workers:errors", 2, timeout=90))
    return _results[0]


@pytest.mark.parametrize("case,needle", [
    ("dtype", "Mismatched allreduce data types for tensor 'w_dtype': rank 0 has float32; "
              "rank 1 has float64"),
    ("shape", "Mismatched allreduce shapes for tensor 'w_shape': rank 0 has [2]; rank 1 has [3]"),
    ("gather_dims", "Mismatched allgather shapes for tensor 'w_gather'"),
    ("optimizer_shapes", "Mismatched allreduce shapes for tensor 'allreduce.1.weight'"),
    ("optimizer_group_shapes", "Mismatched allreduce shapes for tensor 'allreduce.0.weight'"),
])
def test_mismatch_raises_on_every_rank_with_the_name(case, needle):
    for rank, r in enumerate(_errors()):
        assert r[case] is not None and r[case].startswith("MismatchError"), (rank, r[case])
        assert needle in r[case]


def test_runtime_usable_after_errors():
    for r in _errors():
        assert r["after_mismatch"] == 2.0
        assert r["final"] == 2.0


def test_duplicate_name_in_flight():
    res = _errors()
    assert res[0]["duplicate"].startswith("DuplicateNameError")
    assert "'dup'" in res[0]["duplicate"] and "already in flight" in res[0]["duplicate"]
    assert res[1]["duplicate"] is None


@pytest.mark.parametrize("case,needle", [
    ("zero_grad_race", "AssertionError: optimizer.zero_grad() was called after loss.backward()"),
    ("too_many_passes", "AssertionError: Gradients were computed more than "
                        "backward_passes_per_step times"),
    ("adasum", "InvalidArgumentError: Adasum is not supported"),
    ("bad_splits", "InvalidArgumentError: alltoall splits of"),
    ("uneven_default_splits", "InvalidArgumentError: alltoall without splits needs dimension 0"),
])
def test_misuse_raises(case, needle):
    for r in _errors():
        assert r[case] is not None and r[case].startswith(needle), r[case]


def test_step_after_synchronize_warns():
    for r in _errors():
        assert r["step_after_synchronize_warns"] == [
            "optimizer.step() called without optimizer.skip_synchronize()"]


def test_hooks_start_allreduces_in_backward_and_die_with_the_optimizer():
    for r in _errors():
        assert r["started_in_backward"] == 2  # weight and bias, before step()
        assert r["rewrapped_grad"] == [4.0, 4.0]  # 2 rows x 2 ranks: reduced exactly once
