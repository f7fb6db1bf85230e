"""Functions run on spawned ranks by tests/parallel/test_tf_*.py (see harness.py).

Every rank regenerates every rank's inputs from seeds, computes the expected result of
each collective by itself and returns only its errors. Each case runs twice: eagerly and
inside ``tf.function`` (modes "eager" and "graph").
"""

import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_dl.tensorflow as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "bool"]
OPS = ["Average", "Sum", "Min", "Max", "Product"]
MODES = ["eager", "graph"]


def tf_cases():
    """Case ids: 'kind-dtype[-extra]'."""
    out = []
    for dt in DTYPES:
        for op in OPS:
            if dt != "bool" or op in ("Min", "Max", "Product"):
                out.append(f"allreduce-{dt}-{op}")
        out.append(f"allgather-{dt}")
        out.append(f"broadcast-{dt}-root0")
        out.append(f"broadcast-{dt}-rootlast")
    for dt in ("float32", "int32", "bfloat16", "uint16"):
        out.append(f"alltoall-{dt}-uneven")
        out.append(f"alltoall-{dt}-even")
        for op in ("Sum", "Average", "Max"):
            out.append(f"reducescatter-{dt}-{op}")
    out += ["allreduce_scaled-float32-Sum", "allreduce_scaled-float64-Average",
            "allreduce_fp16-float32-Average", "allreduce-float32-Sum-scalar",
            "allreduce-float32-Sum-empty", "grouped_allreduce-mixed-Sum",
            "grouped_allgather-float32", "grouped_reducescatter-float32-Sum",
            "allreduce_sparse-float32-Sum", "allreduce_sparse-float32-Average",
            "grad-allreduce-Sum", "grad-allreduce-Average", "grad-allreduce-Max",
            "grad-allreduce-Product", "grad-grouped_allreduce-Average", "grad-allgather",
            "grad-broadcast", "grad-alltoall", "grad-reducescatter-Sum",
            "grad-reducescatter-Average", "tape-Average", "tape-fp16", "broadcast_variables"]
    return out


GRAPH_DTYPES = ("int32", "float16", "bfloat16", "float32", "bool")
THREE_RANK_KINDS = ("allreduce-float32", "allreduce-int64", "allgather-float32",
                    "broadcast-float32", "alltoall-float32", "reducescatter-float32", "grad-",
                    "grouped_", "tape-", "broadcast_variables")


def selected(np_):
    """(case, mode) pairs run on np_ ranks: every dtype eagerly, a dtype per kind of storage
    in tf.function (the op is the same; tracing is what graph mode adds), and on 3 ranks
    the float cases, gradients and groups (uneven splits and row counts)."""
    out = []
    for case in tf_cases():
        parts = case.split("-")
        plain = not case.startswith(("grad-", "tape-", "grouped_", "broadcast_variables",
                                     "allreduce_"))
        if np_ == 3 and not case.startswith(THREE_RANK_KINDS):
            continue
        for mode in MODES:
            if mode == "graph" and plain and parts[1] not in GRAPH_DTYPES:
                continue
            out.append((case, mode))
    return out


def _rng(case, rank):
    return np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode()))


def _np_dtype(dt):
    return np.float32 if dt == "bfloat16" else np.dtype(dt)


def _data(case, rank, shape, dt):
    rng = _rng(case, rank)
    if dt == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return rng.integers(1, 4, size=shape).astype(_np_dtype(dt))


def _reduce(arrs, op, dt):
    if dt == "bool":
        return np.logical_or.reduce(arrs) if op == "Max" else np.logical_and.reduce(arrs)
    stack = np.stack(arrs)
    if op in ("Sum", "Average"):
        total = stack.sum(axis=0, dtype=stack.dtype)
        if op == "Average":
            return total / len(arrs) if np.issubdtype(stack.dtype, np.floating) \
                else total // len(arrs)
        return total
    if op == "Min":
        return stack.min(axis=0)
    if op == "Max":
        return stack.max(axis=0)
    return stack.prod(axis=0, dtype=stack.dtype)


def _tensor(a, dt):
    return tf.constant(a, dtype=tf.as_dtype(dt))


def _check(got, want, dt):
    if isinstance(got, tf.Tensor):
        if got.dtype != tf.as_dtype(dt):
            return f"dtype {got.dtype.name} != {dt}"
        got = tf.cast(got, tf.float32).numpy() if dt == "bfloat16" else got.numpy()
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5}.get(dt, 1e-12)
    if np.issubdtype(want.dtype, np.floating) or dt in ("float16", "bfloat16"):
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, want)
    return None if ok else f"values differ: got {got.ravel()[:6]}, expected {want.ravel()[:6]}"


def _in_mode(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def _collective_case(case, mode, rank, size):
    kind, dt = case.split("-")[:2]
    extra = case.split("-")[2] if case.count("-") >= 2 else ""
    variant = case.split("-")[3] if case.count("-") >= 3 else ""
    if kind in ("allreduce", "allreduce_scaled", "allreduce_fp16"):
        shape = {"scalar": (), "empty": (0, 4)}.get(variant, (5, 3))
        inputs = [_data(case, r, shape, dt) for r in range(size)]
        pre, post = (0.5, 3.0) if kind == "allreduce_scaled" else (1.0, 1.0)
        comp = hvd.Compression.fp16 if kind == "allreduce_fp16" else hvd.Compression.none
        got = _in_mode(mode, lambda x: hvd.allreduce(
            x, op=getattr(hvd, extra), prescale_factor=pre, postscale_factor=post,
            compression=comp), _tensor(inputs[rank], dt))
        want = _reduce([a * pre for a in inputs] if pre != 1.0 else inputs, extra, dt)
        want = want * post if post != 1.0 else want
        return _check(got, want, dt)
    if kind == "allgather":
        inputs = [_data(case, r, (r + 1, 2), dt) for r in range(size)]
        got = _in_mode(mode, hvd.allgather, _tensor(inputs[rank], dt))
        return _check(got, np.concatenate(inputs), dt)
    if kind == "broadcast":
        root = 0 if extra == "root0" else size - 1
        inputs = [_data(case, r, (4, 2), dt) for r in range(size)]
        got = _in_mode(mode, lambda x: hvd.broadcast(x, root), _tensor(inputs[rank], dt))
        return _check(got, inputs[root], dt)
    if kind == "alltoall":
        # Rank r sends (r + j) % 3 rows to rank j (uneven), or 2 rows to each (even).
        splits = [[(r + j) % 3 if extra == "uneven" else 2 for j in range(size)]
                  for r in range(size)]
        inputs = [_data(case, r, (sum(splits[r]), 2), dt) for r in range(size)]
        pieces = []
        for r in range(size):
            start = sum(splits[r][:rank])
            pieces.append(inputs[r][start:start + splits[r][rank]])
        if extra == "uneven":
            got, received = _in_mode(mode, lambda x: hvd.alltoall(x, splits=splits[rank]),
                                     _tensor(inputs[rank], dt))
        else:  # without splits: the tensor alone (Horovod's return value)
            got, received = _in_mode(mode, hvd.alltoall, _tensor(inputs[rank], dt)), None
        err = _check(got, np.concatenate(pieces), dt)
        want_splits = [splits[r][rank] for r in range(size)]
        return err or (None if received is None or received.numpy().tolist() == want_splits
                       else f"received splits {received.numpy().tolist()} != {want_splits}")
    if kind == "reducescatter":
        rows = 2 * size + 1
        inputs = [_data(case, r, (rows, 2), dt) for r in range(size)]
        reduced = _reduce(inputs, extra, dt)
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:rank])
        got = _in_mode(mode, lambda x: hvd.reducescatter(x, op=getattr(hvd, extra)),
                       _tensor(inputs[rank], dt))
        return _check(got, reduced[start:start + counts[rank]], dt)
    raise ValueError(case)


def _grouped_case(case, mode, rank, size):
    if case == "grouped_allreduce-mixed-Sum":
        dts = ["float32", "int64", "float16"]
        inputs = [[_data(f"{case}{i}", r, (3, i + 1), dt) for r in range(size)]
                  for i, dt in enumerate(dts)]
        got = _in_mode(mode, lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum),
                       *[_tensor(inp[rank], dt) for inp, dt in zip(inputs, dts)])
        errs = [_check(g, _reduce(inp, "Sum", dt), dt) for g, inp, dt in zip(got, inputs, dts)]
        return next((e for e in errs if e), None)
    if case == "grouped_allgather-float32":
        inputs = [[_data(f"{case}{i}", r, (r + i + 1, 2), "float32") for r in range(size)]
                  for i in range(3)]
        got = _in_mode(mode, lambda *xs: hvd.grouped_allgather(list(xs)),
                       *[_tensor(inp[rank], "float32") for inp in inputs])
        errs = [_check(g, np.concatenate(inp), "float32") for g, inp in zip(got, inputs)]
        return next((e for e in errs if e), None)
    if case == "grouped_reducescatter-float32-Sum":
        inputs = [[_data(f"{case}{i}", r, (size * 2, i + 1), "float32") for r in range(size)]
                  for i in range(2)]
        got = _in_mode(mode, lambda *xs: hvd.grouped_reducescatter(list(xs), op=hvd.Sum),
                       *[_tensor(inp[rank], "float32") for inp in inputs])
        errs = [_check(g, _reduce(inp, "Sum", "float32")[2 * rank:2 * rank + 2], "float32")
                for g, inp in zip(got, inputs)]
        return next((e for e in errs if e), None)
    if case.startswith("allreduce_sparse"):
        op = case.split("-")[2]
        values = [_data(case, r, (r + 1, 3), "float32") for r in range(size)]
        indices = [np.arange(r + 1, dtype=np.int64) + r for r in range(size)]

        def fn(v, i):
            out = hvd.allreduce(tf.IndexedSlices(v, i, dense_shape=[10, 3]), op=getattr(hvd, op))
            return tf.convert_to_tensor(out)
        got = _in_mode(mode, fn, tf.constant(values[rank]), tf.constant(indices[rank]))
        dense = np.zeros((10, 3), np.float32)
        for v, i in zip(values, indices):
            np.add.at(dense, i, v)
        return _check(got, dense / size if op == "Average" else dense, "float32")
    raise ValueError(case)


def _grad_case(case, mode, rank, size):
    """Gradients of sum(w_r * out) where every rank r weighs the output with its own w_r."""
    parts = case.split("-")
    kind, op = parts[1], (parts[2] if len(parts) > 2 else "")
    x = [np.arange(1, 7, dtype=np.float32).reshape(3, 2) + r for r in range(size)]
    w = [np.full((1, 1), r + 1.0, np.float32) for r in range(size)]
    w_avg = sum(wi for wi in w) / size
    xt, wt = tf.constant(x[rank]), tf.constant(w[rank])

    def run(fn):
        def step(xv, wv):
            with tf.GradientTape() as tape:
                tape.watch(xv)
                loss = fn(xv, wv)
            return tape.gradient(loss, xv)
        return _in_mode(mode, step, xt, wt).numpy()

    if kind == "allreduce":
        got = run(lambda xv, wv: tf.reduce_sum(wv * hvd.allreduce(xv, op=getattr(hvd, op))))
        stack = np.stack(x)
        if op == "Sum":
            want = np.full_like(x[rank], w_avg.item() * size)  # Sum of the w's
        elif op == "Average":
            want = np.full_like(x[rank], w_avg.item())  # the average of the w's
        elif op == "Max":
            want = np.where(x[rank] == stack.max(axis=0), w_avg.item() * size, 0.0)
        else:  # Product
            want = w_avg.item() * size * stack.prod(axis=0) / x[rank]
        return _check(got, want.astype(np.float32), "float32")
    if kind == "grouped_allreduce":
        def fn(xv, wv):
            a, b = hvd.grouped_allreduce([xv, 2 * xv], op=hvd.Average)
            return tf.reduce_sum(wv * a) + tf.reduce_sum(wv * b)
        return _check(run(fn), np.full_like(x[rank], 3 * w_avg.item()), "float32")
    if kind == "allgather":
        got = run(lambda xv, wv: tf.reduce_sum(wv * hvd.allgather(xv)))
        return _check(got, np.full_like(x[rank], w_avg.item()), "float32")  # set-average
    if kind == "broadcast":
        got = run(lambda xv, wv: tf.reduce_sum(wv * hvd.broadcast(xv, 1)))
        want = np.full_like(x[rank], w_avg.item() if rank == 1 else 0.0)
        return _check(got, want, "float32")
    if kind == "alltoall":
        # rank r scales what it received from rank j by (j+1)*(r+1): the gradient of the rows
        # rank r sent to rank j is (r+1)*(j+1).
        def fn(xv, wv):
            y = hvd.alltoall(tf.tile(xv[:1], [size, 1]))
            scale = tf.constant([[float(j + 1)] for j in range(size)])
            return tf.reduce_sum(wv * scale * y)
        got = run(fn)
        want = np.zeros_like(x[rank])
        want[0] = sum((rank + 1) * (j + 1) for j in range(size))
        return _check(got, want, "float32")
    if kind == "reducescatter":
        xs = [np.tile(xi[:1], [size, 1]) for xi in x]
        xt2 = tf.constant(xs[rank])

        def step(xv, wv):
            with tf.GradientTape() as tape:
                tape.watch(xv)
                loss = tf.reduce_sum(wv * hvd.reducescatter(xv, op=getattr(hvd, op)))
            return tape.gradient(loss, xv)
        got = _in_mode(mode, step, xt2, wt).numpy()
        rows = np.concatenate([np.full((1, 2), w[r].item()) for r in range(size)])
        want = rows * size if op == "Sum" else rows  # Horovod: Sum's scaled by the set size
        return _check(got, want.astype(np.float32), "float32")
    raise ValueError(case)


def _tape_case(case, mode, rank, size):
    comp = hvd.Compression.fp16 if case == "tape-fp16" else hvd.Compression.none
    v = tf.Variable(np.ones((2, 2), np.float32))
    unused = tf.Variable(1.0)
    xs = [np.full((2, 2), r + 1.0, np.float32) for r in range(size)]

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        g, none = tape.gradient(loss, [v, unused])
        return g, tf.constant(none is None)
    g, none = _in_mode(mode, step, tf.constant(xs[rank]))
    err = _check(g, sum(xs) / size, "float32")
    return err or (None if bool(none.numpy()) else "an unconnected gradient was not None")


def _broadcast_variables_case(case, mode, rank, size):
    vs = [tf.Variable(np.full((2,), rank, np.float32)), tf.Variable(rank, dtype=tf.int64)]
    if mode == "eager":
        hvd.broadcast_variables(vs, root_rank=size - 1)
    else:
        @tf.function
        def bcast():
            hvd.broadcast_variables(vs, root_rank=size - 1)
        bcast()
    return _check(vs[0].read_value(), np.full((2,), size - 1, np.float32), "float32") or \
        _check(vs[1].read_value(), np.int64(size - 1), "int64")


def _one_case(case, mode, rank, size):
    if case.startswith("grad-"):
        return _grad_case(case, mode, rank, size)
    if case.startswith("tape-"):
        return _tape_case(case, mode, rank, size)
    if case == "broadcast_variables":
        return _broadcast_variables_case(case, mode, rank, size)
    if case.startswith(("grouped_", "allreduce_sparse")):
        return _grouped_case(case, mode, rank, size)
    return _collective_case(case, mode, rank, size)


def op_matrix():
    """{'case/mode': error or None} for the selected cases, then process sets on 3 ranks."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for case, mode in selected(size):
        try:
            out[f"{case}/{mode}"] = _one_case(case, mode, rank, size)
        except Exception as e:  # noqa: BLE001 - reported per case
            out[f"{case}/{mode}"] = f"{type(e).__name__}: {e}"
    if size == 3:
        out["__process_sets__"] = _process_sets(rank)
    return out


def _process_sets(rank):
    """A set of global ranks {0, 2}: ops and gradients reach its members only."""
    ps = hvd.add_process_set([0, 2])
    res = {}
    try:
        if rank in (0, 2):
            x = tf.constant([float(rank)])
            res["sum"] = hvd.allreduce(x, op=hvd.Sum, process_set=ps).numpy().tolist()
            res["gather"] = tf.function(lambda t: hvd.allgather(t, process_set=ps))(
                tf.constant([rank])).numpy().tolist()
            res["bcast"] = hvd.broadcast(tf.constant([rank]), 2, process_set=ps).numpy().tolist()
            res["object"] = hvd.broadcast_object(f"from {rank}", 2, process_set=ps)
            res["objects"] = hvd.allgather_object(rank, process_set=ps)

            @tf.function
            def grad(t):
                with tf.GradientTape() as tape:
                    tape.watch(t)
                    loss = tf.reduce_sum(hvd.allreduce(t, op=hvd.Average, process_set=ps)
                                         * (rank + 1.0))
                return tape.gradient(loss, t)
            res["grad"] = grad(tf.constant([1.0])).numpy().tolist()
        v = tf.Variable([0.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * float(rank * rank + 1))
        tape = hvd.DistributedGradientTape(tape, process_set=ps)
        res["tape_grad"] = tape.gradient(loss, [v])[0].numpy().tolist()
    finally:
        hvd.remove_process_set(ps)
    return res


def xla_refused():
    """An op traced under jit_compile=True fails at trace time with the XLA message, also
    from a Keras model compiled with jit_compile=True."""
    hvd.init()
    out = {}
    try:
        tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(tf.constant([1.0]))
        out["tf_function"] = None
    except hvd.InvalidArgumentError as e:
        out["tf_function"] = str(e)
    import keras

    import spark_dl.keras as hvd_keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD()), loss="mse",
                  jit_compile=True)
    try:
        model.fit(np.ones((4, 2), np.float32), np.ones((4, 1), np.float32), verbose=0)
        out["keras"] = None
    except hvd.InvalidArgumentError as e:
        out["keras"] = str(e)
    return out
