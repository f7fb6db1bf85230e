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
    if config.startswith("sparse"):  # sparse gradients stay sparse, sparse_as_dense too (Horovod)
        assert all(r["emb_grad_layout"] == "torch.sparse_coo" for r in per_rank), per_rank


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
        # The root's state was empty: created by a zero-gradient step, as in Horovod.
        assert len(summary["state"]) == 6  # every parameter, the unused branch's too
        if optimizer == "adam":
            assert {s["step"] for s in summary["state"].values()} == {1.0}
        else:
            assert all(not any(_flat(s["momentum_buffer"])) for s in summary["state"].values())
    else:
        assert summary["state"], "the root's state did not arrive"
        if optimizer == "adam":
            steps = {s["step"] for s in summary["state"].values()}
            assert steps == ({2.0} if scenario == "root_ahead" else {1.0})


def _flat(v):
    return [x for row in v for x in _flat(row)] if isinstance(v, list) else [v]


def test_broadcast_through_distributed_optimizer():
    res = _same_on_both_ranks("distributed_adam")
    # one zero-gradient step creating the state (as Horovod), then two real ones
    assert {s["step"] for s in res["summary"]["state"].values()} == {3.0}


def test_broadcasts_take_global_roots_on_process_sets():
    res = run_ranks("torch_workers:broadcast_on_sets", 3, timeout=120)
    assert res[1]["none_grad_is_none"]
    assert res[0]["global"] == res[1]["global"] == res[2]["global"]
    state = res[0]["global"]
    assert state["groups"][0]["lr"] == 0.02  # rank 1's
    assert len(state["state"]) == 4  # fc1 and fc2; the extra branch never had a gradient
    a, c = res[0], res[2]
    assert set(res[1]) == {"none_grad_is_none", "global", "sparse_adam_steps"}
    assert all(r["sparse_adam_steps"] == [1.0] for r in res)
    for r in (a, c):
        assert r["params_kept"] and r["grads_kept"], r
        assert "InvalidArgumentError" in r["set_bad_root"] and "[0, 2]" in r["set_bad_root"]
        assert "InvalidArgumentError" in r["set_bad_root_object"]
        assert r["set_object"] == "from 2"
        assert r["set_async"] == [2.0]
    assert a["set_state"] == c["set_state"]
    assert {s["step"] for s in a["set_state"]["state"].values()} == {1.0}
    assert len(a["set_state"]["state"]) == 6
    assert a["set_params"] == c["set_params"]


def test_broadcast_and_allgather_object():
    assert _same_on_both_ranks("object") == {"rank": 1, "t": [0, 1, 2]}
    objs = _same_on_both_ranks("objects")
    assert [o["rank"] for o in objs] == [0, 1]
    assert [len(o["payload"]) for o in objs] == [0, 1000]
