"""SparkDLStrategy on 2 ranks: same weights as one process on the union of both ranks'
batches, validation metrics (self.log sync_dist and torchmetrics) equal to the
single-process ones, checkpoints written by rank 0 only, and the collectives Lightning uses."""

import pytest
import torch

from harness import run_once, run_ranks

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(300)
_results = {}


def _launch(target):
    return run_once(_results, target,
                    lambda: run_ranks(f"lightning_workers:{target}", 2, timeout=240))


def _close(a, b, tol=1e-5):
    return all(float((x - y).abs().max()) <= tol for x, y in zip(a, b))


@pytest.mark.parametrize("target", ["fit_two_ranks", "fit_accumulate"])
def test_weights_match_one_process_on_union_of_batches(target):
    r0, r1 = _launch(target)
    assert r0["world_size"] == 2
    assert _close(r0["weights"], r0["ref_weights"]), (r0["weights"], r0["ref_weights"])
    assert _close(r0["weights"], r1["weights"], tol=0.0), "ranks ended with different weights"
    moved = float((r0["weights"][0] - r0["init_weights"][0]).abs().max())
    assert moved > 1e-2, "the weights did not change: nothing was trained"


def test_validation_metrics_synced():
    r0, r1 = _launch("fit_two_ranks")
    for r in (r0, r1):
        # val_loss: mean of per-batch means over both ranks (equal batches) = full-set MSE.
        assert r["val_loss"] == pytest.approx(r["ref_val"], rel=1e-5)
        # torchmetrics' states gathered through spark_dl: the full-set MSE as well.
        assert r["val_mse"] == pytest.approx(r["ref_val"], rel=1e-5)


def test_checkpoints_written_by_rank_zero_only():
    r0, r1 = _launch("fit_two_ranks")
    assert r0["saved"] >= 1 and r1["saved"] == 0, (r0["saved"], r1["saved"])
    assert "last.ckpt" in r0["files"]


def test_collectives():
    r0, r1 = _launch("collectives")
    for r in (r0, r1):
        assert r["mean"] == [1.5, 5.0]
        assert r["sum"] == [3.0, 10.0]
        assert r["max"] == [2.0, 10.0]
        assert r["int_mean"] == 1.5
        assert r["not_tensor"] == 3.5
        assert r["gather"] == [[1.0, 0.0], [2.0, 10.0]]
        assert r["bcast"] == {"from": 1}
        assert r["any"] is True and r["all"] is False
        assert r["ragged"] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
        assert r["ragged2d"] == [[1, 2], [2, 3]]


def test_pytorch_lightning_package():
    r0, r1 = _launch("fit_pytorch_lightning")
    assert r0["base"] == ["pytorch_lightning", "pytorch_lightning"]
    assert r0["steps"] == 8
    assert _close(r0["weights"], r1["weights"], tol=0.0), "ranks ended with different weights"


def test_sync_batchnorm():
    r0, r1 = _launch("fit_sync_batchnorm")
    assert r0["type"] == "spark_dl.torch.sync_batch_norm"
    # Statistics over both ranks' (differently scaled) batches: the same on both ranks.
    assert torch.allclose(r0["running_var"], r1["running_var"])
    assert _close(r0["weights"], r1["weights"], tol=1e-6)


def test_manual_optimization_with_accumulation():
    r0, r1 = _launch("fit_manual_accumulate")
    assert _close(r0["weights"], r0["ref_weights"]), (r0["weights"], r0["ref_weights"])
    assert _close(r0["weights"], r1["weights"], tol=0.0)
