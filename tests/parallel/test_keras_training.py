"""spark_dl.keras on 2 ranks: DistributedOptimizer against 1 process trained on the union of
both ranks' batches (TensorFlow and torch backends), save/load, broadcasts, callbacks."""

import pytest

from harness import run_once, run_ranks
from keras_workers import TRAIN_CONFIGS

pytestmark = pytest.mark.timeout(400)
_results = {}
TORCH_CONFIGS = ["plain", "bpps2_summed", "fp16"]


def _launch(target, backend, *args):
    return run_once(_results, (target, backend), lambda: run_ranks(
        f"keras_workers:{target}", 2, env={"KERAS_BACKEND": backend}, timeout=360, args=args))


def _check_training(per_rank, config):
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["moved"] > 1e-3, "the weights did not change: nothing was trained"
        assert r["diff"] <= r["tol"], f"rank {rank} differs from the reference by {r['diff']}"
    # Every rank applied the same reduced gradients: the same weights everywhere.
    assert per_rank[0]["weights"] == per_rank[1]["weights"]


@pytest.mark.parametrize("config", list(TRAIN_CONFIGS))
def test_tensorflow_training_matches_one_process(config):
    per_rank = [r[config] for r in _launch("train_equivalence", "tensorflow")]
    _check_training(per_rank, config)
    # Horovod counts backward passes: 6 updates of backward_passes_per_step passes each.
    bpps = TRAIN_CONFIGS[config][0]
    assert per_rank[0]["iterations"] == 6 * bpps


@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_torch_backend_training_matches_one_process(config):
    per_rank = [r[config] for r in _launch("train_equivalence", "torch", *TORCH_CONFIGS)]
    _check_training(per_rank, config)


def _api(key, backend="tensorflow"):
    return [r[key] for r in _launch("keras_api", backend)]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_broadcast_callback_and_save_load_round_trip(backend):
    a, b = _api("save_load", backend)
    assert a["after_callback"] == b["after_callback"], "ranks differ after the broadcast"
    assert a["adam_slots"] == b["adam_slots"]
    # A plain Keras load sees the plain optimizer; spark_dl.keras.load_model re-wraps it.
    assert a["plain_load_class"] == "Adam" and not a["plain_load_distributed"]
    assert a["loaded_distributed"] and a["loaded_is_adam"]
    assert a["loaded_iterations"] == a["saved_iterations"] > 0
    assert a["after_loaded_fit"] == b["after_loaded_fit"], \
        "the re-wrapped optimizer did not average"
    assert a["global_root1"] == b["global_root1"]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_metric_average_callback(backend):
    for r in _api("callbacks", backend):
        assert r["marker"] == [1.5, 1.5, 1.5]  # ranks logged 1.0 and 2.0
    a, b = _api("callbacks", backend)
    assert a["loss"] == b["loss"]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_learning_rate_warmup_values(backend):
    r = _api("callbacks", backend)[0]
    steps, size, lr0 = r["steps"], 2, 0.4
    want = []
    for epoch in range(2):
        for batch in range(steps):
            e = epoch + batch / steps
            want.append(lr0 / size * (e * (size - 1) / 2 + 1))
    assert r["lrs"][:2 * steps] == pytest.approx(want, rel=1e-6)
    # After warm-up the rate stays where the ramp left it.
    assert r["lrs"][2 * steps:] == pytest.approx([want[-1]] * steps, rel=1e-6)
