"""DistributedOptimizer on 2 ranks against 1 process trained on the union of both ranks'
batches; broadcast_parameters / broadcast_optimizer_state / object broadcasts."""

import pytest

from harness import run_once, run_ranks
from torch_workers import TRAIN_CONFIGS

pytestmark = pytest.mark.timeout(300)
_results = {}


def _launch(target):
    return run_once(_results, target,
                    lambda: run_ranks(f"torch_workers:{target}", 2, timeout=240))


@pytest.mark.parametrize("config", list(TRAIN_CONFIGS))
def test_training_matches_one_process_on_union_of_batches(config):
    per_rank = [r[config] for r in _launch("train_equivalence")]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["moved"] > 1e-3, "the weights did not change: nothing was trained"
        assert r["diff"] <= r["tol"], f"rank {rank} differs from the reference by {r['diff']}"
    # Every rank applied the same averaged gradients: the same weights everywhere.
    assert per_rank[0]["params"] == per_rank[1]["params"]


def _same_on_both_ranks(key):
    a, b = (r[key] for r in _launch("broadcast_state"))
    assert a == b, f"{key} differs between ranks"
    return a


@pytest.mark.parametrize("key", ["state_dict_root0", "named_root1", "list_root0"])
def test_broadcast_parameters(key):
    _same_on_both_ranks(key)


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
@pytest.mark.parametrize("scenario", ["root_ahead", "other_ahead", "both_empty", "both_stepped"])
def test_broadcast_optimizer_state(optimizer, scenario):
    res = _same_on_both_ranks(f"{optimizer}/{scenario}")
    summary = res["summary"]
    assert summary["groups"][0]["lr"] == 0.01  # the root's (rank 1 had 0.02)
    if scenario in ("other_ahead", "both_empty"):
        assert summary["state"] == {}  # the root's state was empty: so is everyone's
    else:
        assert summary["state"], "the root's state did not arrive"
        if optimizer == "adam":
            steps = {s["step"] for s in summary["state"].values()}
            assert steps == ({2.0} if scenario == "root_ahead" else {1.0})


def test_broadcast_through_distributed_optimizer():
    res = _same_on_both_ranks("distributed_adam")
    assert {s["step"] for s in res["summary"]["state"].values()} == {2.0}


def test_broadcast_and_allgather_object():
    assert _same_on_both_ranks("object") == {"rank": 1, "t": [0, 1, 2]}
    objs = _same_on_both_ranks("objects")
    assert [o["rank"] for o in objs] == [0, 1]
    assert [len(o["payload"]) for o in objs] == [0, 1000]
