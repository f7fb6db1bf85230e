"""Functions run on spawned ranks by tests/parallel/test_keras_*.py (see harness.py).

Every rank regenerates the whole data set from a seed, trains its share with
spark_dl.keras.DistributedOptimizer and, in the same process, a plain Keras model on the
union of every rank's batches (the 1-process reference), and returns the difference.
The Keras backend is whatever KERAS_BACKEND the test gave the ranks.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import spark_dl.keras as hvd  # noqa: E402

# name -> (backward_passes_per_step, average_aggregated_gradients, compression, run_eagerly)
TRAIN_CONFIGS = {
    "plain": (1, False, "none", False),
    "eager": (1, False, "none", True),
    "bpps2_averaged": (2, True, "none", False),
    "bpps2_summed": (2, False, "none", False),
    "fp16": (1, False, "fp16", False),
}
_B = 4          # rows per rank per backward pass
_UPDATES = 6    # optimizer updates per run


def _threads():
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif keras.backend.backend() == "torch":
        import torch
        torch.set_num_threads(1)


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def _data(rows):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 5)).astype("float32")
    w = rng.normal(size=(5, 3)).astype("float32")
    return x, np.tanh(x @ w).astype("float32")


def _train(config, rank, size):
    bpps, averaged, compression, eager = TRAIN_CONFIGS[config]
    group = bpps * _B                       # rows per rank per update
    x, y = _data(_UPDATES * group * size)
    # Rank r takes rows [r*group, (r+1)*group) of every block of size*group rows.
    idx = np.concatenate([np.arange(k * group * size + rank * group,
                                    k * group * size + (rank + 1) * group)
                          for k in range(_UPDATES)])
    init = [w.copy() for w in _model(0).get_weights()]

    model = _model(0)
    model.set_weights(init)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=bpps,
        average_aggregated_gradients=averaged,
        compression=getattr(hvd.Compression, compression))
    model.compile(optimizer=opt, loss="mse", run_eagerly=eager)
    model.fit(x[idx], y[idx], batch_size=_B, epochs=1, shuffle=False, verbose=0)

    # The reference: one process, one batch = the union of every rank's rows of an update.
    # A summed accumulation applies bpps times the averaged gradient: the same as bpps x lr.
    ref = _model(0)
    ref.set_weights(init)
    lr = 0.1 * (bpps if bpps > 1 and not averaged else 1)
    ref.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=group * size, epochs=1, shuffle=False, verbose=0)

    got, want = model.get_weights(), ref.get_weights()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(got, init))
    return {"diff": diff, "moved": moved, "tol": 2e-3 if compression == "fp16" else 1e-5,
            "weights": [w.tolist() for w in got],
            "iterations": int(keras.ops.convert_to_numpy(opt.iterations))}


def train_equivalence(*configs):
    hvd.init()
    _threads()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for config in configs or TRAIN_CONFIGS:
        try:
            out[config] = _train(config, rank, size)
        except Exception as e:  # noqa: BLE001 - reported per config
            import traceback
            out[config] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


def save_load_broadcast():
    """model.save -> spark_dl.keras.load_model keeps the optimizer state and re-wraps it;
    the broadcast callback and broadcast_global_variables make ranks agree."""
    hvd.init()
    _threads()
    rank = hvd.rank()
    out = {}
    x, y = _data(32)
    model = _model(100 + rank)  # different initial weights on every rank
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x[rank::2], y[rank::2], batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["after_callback"] = [w.tolist() for w in model.get_weights()]
    out["adam_slots"] = [np.asarray(keras.ops.convert_to_numpy(v)).tolist()
                         for v in model.optimizer.variables]

    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    plain = keras.saving.load_model(path)
    out["plain_load_class"] = type(plain.optimizer).__name__
    out["plain_load_distributed"] = hvd.is_distributed(plain.optimizer)
    loaded = hvd.load_model(path)
    out["loaded_distributed"] = hvd.is_distributed(loaded.optimizer)
    out["loaded_is_adam"] = isinstance(loaded.optimizer, keras.optimizers.Adam)
    out["loaded_iterations"] = int(keras.ops.convert_to_numpy(loaded.optimizer.iterations))
    out["saved_iterations"] = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    # Training the loaded model on different data per rank keeps the ranks equal.
    loaded.fit(x[rank::2] * (1 + rank), y[rank::2], batch_size=4, epochs=1, shuffle=False,
               verbose=0)
    out["after_loaded_fit"] = [w.tolist() for w in loaded.get_weights()]

    other = _model(200 + rank)
    other.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    hvd.broadcast_global_variables(1, other)
    out["global_root1"] = [w.tolist() for w in other.get_weights()]
    return out


def callbacks_behaviour():
    """MetricAverageCallback averages logs; the warmup callback's learning rates."""
    hvd.init()
    _threads()
    rank, size = hvd.rank(), hvd.size()
    out = {}

    class Constant(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["marker"] = float(rank + 1)

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen, self.lrs = [], []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(dict(logs))

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    x, y = _data(64)
    model = _model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rec = Record()
    steps = 4
    model.fit(x[rank::size][:steps * 4], y[rank::size][:steps * 4], batch_size=4, epochs=3,
              shuffle=False, verbose=0,
              callbacks=[Constant(), hvd.callbacks.LearningRateWarmupCallback(
                  0.4, warmup_epochs=2, momentum_correction=False),
                  hvd.callbacks.MetricAverageCallback(), rec])
    out["marker"] = [s["marker"] for s in rec.seen]
    out["loss"] = [s["loss"] for s in rec.seen]
    out["lrs"] = rec.lrs
    out["steps"] = steps
    return out


def keras_api():
    """save_load_broadcast and callbacks_behaviour in one launch (TensorFlow imports once)."""
    return {"save_load": save_load_broadcast(), "callbacks": callbacks_behaviour()}


def sync_batch_norm_torch():
    """SyncBatchNormalization on the torch backend: with batches of 3 and 5 rows, output,
    moving statistics and the input gradient of the sum of both ranks' losses are those of
    one BatchNormalization over the union (max abs differences returned)."""
    import torch

    hvd.init()
    _threads()
    rank, size = hvd.rank(), hvd.size()
    rows = [3 + 2 * r for r in range(size)]
    rng = np.random.default_rng(11)
    xs = [rng.normal(loc=r, size=(n, 4)).astype("float32") for r, n in enumerate(rows)]
    ws = [rng.normal(size=(n, 4)).astype("float32") for n in rows]
    start = sum(rows[:rank])

    def run(layer, x, w):
        x = torch.tensor(x, requires_grad=True)
        y = layer(x, training=True)
        (y * torch.tensor(w)).sum().backward()
        return y.detach().numpy(), x.grad.numpy()

    ref = keras.layers.BatchNormalization(momentum=0.5)
    ref_y, ref_dx = run(ref, np.concatenate(xs), np.concatenate(ws))
    layer = hvd.SyncBatchNormalization(momentum=0.5)
    y, dx = run(layer, xs[rank], ws[rank])
    part = slice(start, start + rows[rank])
    return {"backend": keras.backend.backend(),
            "y": float(np.max(np.abs(y - ref_y[part]))),
            "dx": float(np.max(np.abs(dx - ref_dx[part]))),
            "moving_mean": float(np.max(np.abs(keras.ops.convert_to_numpy(layer.moving_mean)
                                               - keras.ops.convert_to_numpy(ref.moving_mean)))),
            "moving_variance": float(np.max(np.abs(
                keras.ops.convert_to_numpy(layer.moving_variance)
                - keras.ops.convert_to_numpy(ref.moving_variance))))}
