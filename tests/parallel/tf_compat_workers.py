"""Horovod-compatibility cases of spark_dl.tensorflow / spark_dl.keras, run on 2 spawned ranks
by tests/parallel/test_tf_horovod_compat.py (see harness.py).

Each case returns plain values (or "Type: message" when it raised) for the test to check;
every rank regenerates every rank's inputs, so it can compute the expected values itself.
"""

import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_dl.keras as hvd_keras  # noqa: E402
import spark_dl.tensorflow as hvd  # noqa: E402
from spark_dl.common import exceptions as sdl_errors  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def _graph(fn):
    return tf.function(fn)


def _err(e):
    return f"{type(e).__name__}: {e}"


def _raised(fn):
    """(class names along the MRO that matter, message) of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"type": type(e).__name__,
                "tf_failed_precondition": isinstance(e, tf.errors.FailedPreconditionError),
                "tf_invalid_argument": isinstance(e, tf.errors.InvalidArgumentError),
                "tf_op_error": isinstance(e, tf.errors.OpError),
                "sdl_mismatch": isinstance(e, sdl_errors.MismatchError),
                "sdl_invalid_argument": isinstance(e, sdl_errors.InvalidArgumentError),
                "hvd_mismatch": isinstance(e, hvd.MismatchError),
                "not_implemented": isinstance(e, NotImplementedError),
                "message": str(e)[:400]}
    return None


# ----------------------------------------------------------------------------- item 1: uint16

def _uint16(rank, size):
    out = {}
    mine = np.arange(3, dtype=np.uint16) + 1000 * (rank + 1)
    every = [np.arange(3, dtype=np.uint16) + 1000 * (r + 1) for r in range(size)]
    x = tf.constant(mine)
    rows = tf.constant(np.full(size, 1000 * (rank + 1), np.uint16))  # one row to each rank
    for mode, run in (("eager", lambda f, *a: f(*a)), ("graph", lambda f, *a: _graph(f)(*a))):
        got = run(hvd.allgather, x)
        out[f"allgather/{mode}"] = (got.dtype.name, got.numpy().tolist())
        got = run(lambda t: hvd.broadcast(t, 1), x)
        out[f"broadcast/{mode}"] = (got.dtype.name, got.numpy().tolist())
        got = run(hvd.alltoall, rows)
        out[f"alltoall/{mode}"] = (got.dtype.name, got.numpy().tolist())
        got = run(lambda t: hvd.allreduce(t, op=hvd.Sum), x)
        out[f"allreduce/{mode}"] = (got.dtype.name, got.numpy().tolist())
        got = run(lambda t: hvd.grouped_allgather([t, t[:1]]), x)
        out[f"grouped_allgather/{mode}"] = [(g.dtype.name, g.numpy().tolist()) for g in got]
    ps = hvd.add_process_set(list(range(size)))
    try:
        got = hvd.allgather(x, process_set=ps)
        out["allgather/process_set"] = (got.dtype.name, got.numpy().tolist())
        got = hvd.broadcast(x, 0, process_set=ps)
        out["broadcast/process_set"] = (got.dtype.name, got.numpy().tolist())
    finally:
        hvd.remove_process_set(ps)
    out["want_gather"] = np.concatenate(every).tolist()
    out["want_sum"] = np.sum(every, axis=0, dtype=np.uint16).tolist()

    import spark_dl.numpy as sdl_np
    got = sdl_np.allgather(mine)
    out["numpy_allgather"] = (got.dtype.name, got.tolist())

    import torch

    import spark_dl.torch as hvd_torch
    t = torch.from_numpy(mine.astype(np.int32)).to(torch.uint16)
    got = hvd_torch.allgather(t)
    out["torch_allgather"] = (str(got.dtype), got.to(torch.int32).tolist())
    got = hvd_torch.broadcast(t, 1)
    out["torch_broadcast"] = (str(got.dtype), got.to(torch.int32).tolist())
    return out


# ----------------------------------------------------------------------------- item 2: errors

def _errors(rank, size):
    out = {}
    out["shape/eager"] = _raised(lambda: hvd.allreduce(tf.ones([2 + rank]), name="c.shape"))
    out["dtype/eager"] = _raised(lambda: hvd.allreduce(
        tf.ones([2], tf.float32 if rank == 0 else tf.float64), name="c.dtype"))
    out["root/eager"] = _raised(lambda: hvd.broadcast(tf.ones([2]), rank, name="c.root"))
    out["op/eager"] = _raised(lambda: hvd.allreduce(
        tf.ones([2]), op=hvd.Sum if rank == 0 else hvd.Max, name="c.op"))
    out["shape/graph"] = _raised(lambda: _graph(lambda t: hvd.allreduce(t, name="g.shape"))(
        tf.ones([2 + rank])))
    out["splits/eager"] = _raised(lambda: hvd.alltoall(tf.ones([4]), splits=[1, 1]))
    out["splits/graph"] = _raised(lambda: _graph(lambda t: hvd.alltoall(t, splits=[1, 1]))(
        tf.ones([4])))
    out["process_set/eager"] = _raised(lambda: hvd.allreduce(
        tf.ones([2]), process_set=hvd.ProcessSet([0])))
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([rank]), dense_shape=[size, 2])
    for op in ("Min", "Max", "Product", "Adasum"):
        out[f"sparse_{op}"] = _raised(lambda op=op: hvd.allreduce(slices, op=getattr(hvd, op)))
    out["sparse_prescale"] = _raised(lambda: hvd.allreduce(slices, op=hvd.Sum,
                                                           prescale_factor=2.0))
    out["sparse_postscale"] = _raised(lambda: hvd.grouped_allreduce(
        [slices], op=hvd.Average, postscale_factor=2.0))
    # The runtime is usable after every error above.
    out["after"] = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy())
    return out


# ----------------------------------------------------------------------------- items 3, 4

def _size_op_and_alltoall(rank, size):
    out = {}
    ps = hvd.add_process_set([1])
    try:
        out["size_op"] = int(hvd.size_op(process_set_id=ps.process_set_id).numpy())
        out["size_op_graph"] = int(_graph(lambda: hvd.size_op(ps.process_set_id))().numpy())
        out["size_op_global"] = int(hvd.size_op().numpy())
        out["included"] = int(hvd.process_set_included_op(ps.process_set_id).numpy())
        out["included_global"] = int(hvd.process_set_included_op().numpy())
    finally:
        hvd.remove_process_set(ps)
    out["size_op_unknown"] = _raised(lambda: hvd.size_op(process_set_id=ps.process_set_id or 99))
    x = tf.constant([float(rank)] * size)
    plain = hvd.alltoall(x)
    out["alltoall_plain"] = (isinstance(plain, tf.Tensor), plain.numpy().tolist())
    plain_graph = _graph(lambda t: hvd.alltoall(t))(x)
    out["alltoall_plain_graph"] = (isinstance(plain_graph, tf.Tensor),
                                   plain_graph.numpy().tolist())
    with_splits = hvd.alltoall(x, splits=[1] * size)
    out["alltoall_splits"] = (isinstance(with_splits, tuple), len(with_splits),
                              with_splits[1].numpy().tolist())
    return out


# ----------------------------------------------------------------------------- item 5

def _broadcast_in_place(rank, size):
    out = {}
    v = tf.Variable([float(rank), 10.0 + rank])
    w = tf.Variable(rank, dtype=tf.int64)
    values = hvd.broadcast_([v, w], root_rank=1)
    out["eager"] = (v.numpy().tolist(), int(w.numpy()), [x.numpy().tolist() for x in values])
    v.assign([float(rank), 20.0 + rank])
    got = _graph(lambda: hvd.broadcast_([v], root_rank=0))()
    out["graph"] = (v.numpy().tolist(), got[0].numpy().tolist())
    out["global_eager"] = _raised(lambda: hvd.broadcast_global_variables(0))
    return out


def _model(seed, batch_norm=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,)), keras.layers.Dense(3, name="shared")]
    if batch_norm:
        layers.append(hvd.SyncBatchNormalization(name="bn"))
    layers.append(keras.layers.Dense(2, name="head"))
    return keras.Sequential(layers)


def _data(rows, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype("float32")
    return x, (x[:, :2] * 2.0 - x[:, 2:]).astype("float32")


def _tf_distributed_optimizer(rank, size):
    out = {}
    x, y = _data(16 * size)
    model = _model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    out["keras_is_distributed"] = hvd_keras.is_distributed(opt)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[rank::size], y[rank::size], batch_size=4, epochs=1, shuffle=False, verbose=0)
    out["keras_weights"] = [w.tolist() for w in model.get_weights()]

    # A tf.compat.v1 optimizer: compute_gradients returns the average over the ranks.
    v = tf.Variable([1.0, 1.0])
    legacy = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    pairs = legacy.compute_gradients(lambda: tf.reduce_sum(v * float(rank + 1)), var_list=[v])
    out["legacy_grad"] = pairs[0][0].numpy().tolist()
    legacy.apply_gradients(pairs)
    out["legacy_value"] = v.numpy().tolist()
    return out


def _sync_batch_norm(rank, size):
    """Ranks hold batches of 3 and 5 rows; the layer's output, moving statistics and the
    input gradient of the sum of every rank's loss must be those of one BatchNormalization
    over the union of the batches."""
    rows = [3 + 2 * r for r in range(size)]
    rng = np.random.default_rng(11)
    xs = [rng.normal(loc=r, size=(n, 4)).astype("float32") for r, n in enumerate(rows)]
    ws = [rng.normal(size=(n, 4)).astype("float32") for n in rows]  # per-row loss weights
    union_x, union_w = np.concatenate(xs), np.concatenate(ws)
    start = sum(rows[:rank])

    def run(layer, x, w):
        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * w)
        return y.numpy(), tape.gradient(loss, x).numpy()

    ref = keras.layers.BatchNormalization(momentum=0.5)
    ref_y, ref_dx = run(ref, union_x, union_w)
    out = {}
    for mode in ("eager", "graph"):
        layer = hvd.SyncBatchNormalization(momentum=0.5)
        fn = run if mode == "eager" else (lambda lyr, x, w: [
            t.numpy() for t in _graph(lambda a, b: _tape_step(lyr, a, b))(
                tf.constant(x), tf.constant(w))])
        y, dx = fn(layer, xs[rank], ws[rank])
        out[mode] = {
            "y": float(np.max(np.abs(y - ref_y[start:start + rows[rank]]))),
            "dx": float(np.max(np.abs(dx - ref_dx[start:start + rows[rank]]))),
            "moving_mean": float(np.max(np.abs(layer.moving_mean.numpy()
                                               - ref.moving_mean.numpy()))),
            "moving_variance": float(np.max(np.abs(layer.moving_variance.numpy()
                                                   - ref.moving_variance.numpy()))),
        }
    # What a local (unsynchronized) BatchNormalization would differ by: the test's scale.
    local = keras.layers.BatchNormalization(momentum=0.5)
    y_local, _ = run(local, xs[rank], ws[rank])
    out["local_y_differs_by"] = float(np.max(np.abs(y_local - ref_y[start:start + rows[rank]])))
    # Training a model with it through Keras fit.
    x, y = _data(8 * size)
    model = _model(0, batch_norm=True)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss="mse")
    model.fit(x[rank::size], y[rank::size], batch_size=4, epochs=1, shuffle=False, verbose=0)
    out["fit_weights"] = [w.tolist() for w in model.get_weights()]
    return out


def _tape_step(layer, x, w):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * w)
    return y, tape.gradient(loss, x)


def _local_variables(rank, size):
    out = {}
    # PartialDistributedGradientTape: the local layer's gradient stays this rank's / size.
    model = _model(0)
    x, _ = _data(4)
    xr = tf.constant(x * (rank + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(xr))
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=model.get_layer("head"))
    grads = ptape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(xr))
    own = tape.gradient(loss, model.trainable_variables)
    names = [v.path for v in model.trainable_variables]
    out["tape"] = {n: (np.asarray(g).tolist(), np.asarray(o).tolist())
                   for n, g, o in zip(names, grads, own)}
    # register_local_source on a plain DistributedGradientTape, scale_local_gradients=False.
    v, u = tf.Variable([1.0]), tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((v + u) * float(rank + 1))
    dtape = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
    dtape.register_local_source(u)
    gv, gu = dtape.gradient(loss, [v, u])
    out["register_local_source"] = (gv.numpy().tolist(), gu.numpy().tolist())

    # PartialDistributedOptimizer + BroadcastGlobalVariablesCallback(local_variables=) in fit:
    # every rank starts from its own weights; the shared layer ends equal, the head (local)
    # stays each rank's own and trains on its own data only.
    x, y = _data(16 * size)
    model = _model(100 + rank)
    head = model.get_layer("head")
    head_init = [w.copy() for w in head.get_weights()]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[rank::size], y[rank::size], batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
                  0, local_variables=head.trainable_weights)])
    out["fit_shared"] = [w.tolist() for w in model.get_layer("shared").get_weights()]
    out["fit_head"] = [w.tolist() for w in head.get_weights()]
    out["fit_head_init"] = [w.tolist() for w in head_init]
    out["optimizer_variables"] = [v.path for v in opt.variables]  # no model weights in there
    # register_local_var on a DistributedOptimizer: the same exclusion.
    model2 = _model(7)
    opt2 = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model2.compile(optimizer=opt2, loss="mse")
    model2.build((None, 4))
    for var in model2.get_layer("head").trainable_weights:
        opt2.register_local_var(var)
    model2.fit(x[rank::size] * (rank + 1), y[rank::size], batch_size=4, epochs=1,
               shuffle=False, verbose=0)
    out["register_local_var_shared"] = [w.tolist() for w in
                                        model2.get_layer("shared").get_weights()]
    out["register_local_var_head"] = [w.tolist() for w in model2.get_layer("head").get_weights()]
    return out


# ----------------------------------------------------------------------------- item 6

def _iterations(rank, size):
    x, y = _data(12 * 4 * size)
    model = _model(0)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=3)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[rank::size], y[rank::size], batch_size=4, epochs=1, shuffle=False, verbose=0)
    return {"iterations": int(keras.ops.convert_to_numpy(opt.iterations)), "batches": 12,
            "updates": int(keras.ops.convert_to_numpy(opt._iterations)) // 3}


CASES = {"uint16": _uint16, "errors": _errors, "size_op_alltoall": _size_op_and_alltoall,
         "broadcast_in_place": _broadcast_in_place,
         "tf_distributed_optimizer": _tf_distributed_optimizer,
         "sync_batch_norm": _sync_batch_norm, "local_variables": _local_variables,
         "iterations": _iterations}


def compat():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for name, fn in CASES.items():
        try:
            out[name] = fn(rank, size)
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = {"error": _err(e) + "\n" + traceback.format_exc()}
    return out
