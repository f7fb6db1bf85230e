"""Gradients of the collectives (allreduce, allgather, broadcast, alltoall, reducescatter and
their grouped forms) in Horovod's conventions, globally and on a process set, SyncBatchNorm
against BatchNorm on the union of the batches, and join, on 2 and 3 ranks."""

import pytest

from harness import run_once, run_ranks

pytestmark = pytest.mark.timeout(300)
_results = {}

CASES = [
    "allreduce-Sum-1.0-1.0", "allreduce-Average-1.0-1.0", "allreduce-Sum-2.0-3.0",
    "allreduce-Average-0.5-4.0", "allreduce-Max", "grouped_allreduce-Sum", "allgather",
    "grouped_allgather", "broadcast-root0", "alltoall", "reducescatter-Sum",
    "reducescatter-Average", "reducescatter-Sum-2.0-0.5", "reducescatter-Average-3.0-2.0",
    "grouped_reducescatter", "sync_bn-3d-even", "sync_bn-4d-uneven", "sync_bn-2d-no_affine",
    # on a process set of non-contiguous global ranks ({0, 2} of 3), root its last member
    "set-allreduce-Average", "set-allgather", "set-grouped_allgather", "set-broadcast",
    "set-broadcast_", "set-reducescatter-Sum", "set-reducescatter-Average",
    "set-grouped_reducescatter", "set-alltoall", "set-sync_bn",
]


def _launch(np_):
    return run_once(_results, np_, lambda: run_ranks("torch_autograd_workers:autograd_and_sync_bn",
                                                     np_, timeout=240))


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", CASES + ["broadcast-rootlast"])
def test_gradient(case, np_):
    per_rank = _launch(np_)
    key = case if case != "broadcast-rootlast" else f"broadcast-root{np_ - 1}"
    errors = {rank: r[key] for rank, r in enumerate(per_rank) if r[key] is not None}
    assert not errors, f"{case} on {np_} ranks: {errors}"


def test_join_returns_last_rank_and_others_reduce_zeros():
    res = run_ranks("torch_workers:join_uneven", 3, timeout=60)
    assert [r["sums"] for r in res] == [[3.0, 3.0], [3.0, 3.0, 2.0], [3.0, 3.0, 2.0, 1.0]]
    assert all(r["last"] == 2 for r in res)
