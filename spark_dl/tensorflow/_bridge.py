"""The one place where TensorFlow tensors meet the core.

Every collective of :mod:`spark_dl.tensorflow` is a single ``tf.numpy_function`` op:
TensorFlow hands the op's inputs over as NumPy arrays (no copy for CPU tensors), the
Python body submits every tensor of the op to the core, waits for all of them and
returns NumPy arrays, which TensorFlow takes as the op's outputs. The same op runs
eagerly and inside ``tf.function``; nothing is compiled against TensorFlow.

Why ``numpy_function`` and not ``py_function`` + DLPack: both cross the same Python
boundary once per op, but ``py_function`` runs its body eagerly on EagerTensors, and each
tensor then needs a DLPack export in and a TensorFlow-allocated output; for 50 gradients
packed into one tensor it measured slightly slower (1 rank: +2.1 ms per step against
+1.5 ms; unpacked, 50 tensors: +12 ms against +5 ms; benchmarks/keras_train.py, docs/keras.md).
bfloat16 has no NumPy dtype the core accepts, so it travels as float32 (cast in
TensorFlow on both sides of the op).

Ordering: the ops are stateful, so ``tf.function`` keeps them in program order (its
automatic control dependencies), and every rank submits its collectives in the same
order, as the core requires. Unnamed operations get their names when they run, from
counters per operation kind, so retracing on one rank only cannot make names diverge.
"""

import numpy as np
import tensorflow as tf

from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import SdlError
from spark_dl.common.handles import CompositeHandle
from spark_dl.tensorflow.errors import XlaNotSupportedError, as_tf_error

__all__ = ["call", "run_collective", "XLA_MESSAGE", "XlaNotSupportedError"]

XLA_MESSAGE = (
    "spark_dl's TensorFlow collectives cannot run inside an XLA-compiled function "
    "(jit_compile=True): XLA cannot call back into Python. Compile without XLA: "
    "model.compile(..., jit_compile=False) for Keras, tf.function(jit_compile=False) otherwise.")

try:  # TensorFlow-internal, stable since TF 1.x; without it the check is skipped.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except ImportError:  # pragma: no cover
    _in_xla = None


def _check_not_xla():
    if _in_xla is not None and not tf.executing_eagerly() and _in_xla(
            tf.compat.v1.get_default_graph()):
        raise XlaNotSupportedError(XLA_MESSAGE)


def _wait(handles, name):
    return CompositeHandle(handles, list, name).wait()


def _np(a):
    # numpy_function gives 0-d inputs as NumPy scalars on some paths.
    return np.asarray(a, order="C")


def _from(outputs):
    return np.from_dlpack(_ops.DLPackTensor(outputs[0]))


def run_collective(kind, arrays, names, group, process_set, **kw):
    """Submits one operation of ``kind`` per array (NumPy side) and returns the results.

    With ``group`` set (a grouped operation) the members are negotiated and fused as one unit.
    """
    handles = []
    arrays = [_np(a) for a in arrays]
    # One group per dtype: the core fuses a group into one buffer and (as of this
    # writing) corrupts memory when a group mixes dtypes.
    subgroup, gsize = {}, {}
    if group:
        for a in arrays:
            gsize[a.dtype] = gsize.get(a.dtype, 0) + 1
        multi = len(gsize) > 1
        for a in arrays:
            subgroup[a.dtype] = f"{group}.{a.dtype.name}" if multi else group
    for a, name in zip(arrays, names):
        kw_group = dict(group=subgroup[a.dtype], group_size=gsize[a.dtype]) if group \
            else dict(group="", group_size=0)
        if kind == "allreduce":
            # The core allocates the result (pooled, pre-faulted memory) and reduces
            # straight from the input into it.
            h = _ops.submit(kind, name, a, None, core_output=True,
                            finish=lambda o, i: _ops.numpy_output(o[0]),
                            process_set=process_set, **kw_group, **kw)
        elif kind == "broadcast":
            out = a.copy()
            h = _ops.submit(kind, name, a, out, finish=lambda o, i, out=out: out,
                            process_set=process_set, **kw_group, **kw)
        elif kind == "alltoall":
            splits = kw.pop("splits")
            h = _ops.submit(kind, name, a, splits=splits, process_set=process_set,
                            finish=lambda o, i: (_from(o), np.asarray(i, dtype=np.int32)), **kw)
        else:  # allgather, reducescatter: the core allocates the output
            h = _ops.submit(kind, name, a, finish=lambda o, i: _from(o),
                            process_set=process_set, **kw_group, **kw)
        handles.append(h)
    return _wait(handles, group or (names[0] if names else kind))


def _wire(t):
    t = tf.convert_to_tensor(t)
    return (tf.cast(t, tf.float32), t.dtype) if t.dtype == tf.bfloat16 else (t, None)


def call(body, tensors, out_dtypes=None, out_shapes=None, op_name="SdlCollective"):
    """Runs ``body(*numpy arrays) -> list of arrays`` as one TensorFlow op over ``tensors``.

    Args:
        body: the NumPy-side function (it talks to the core).
        tensors: the op's inputs (converted with ``tf.convert_to_tensor``).
        out_dtypes: dtypes of the outputs (default: the inputs' dtypes).
        out_shapes: static shapes to set on the outputs (default: the inputs'; use
            ``None`` entries for outputs whose first dimension is data-dependent).

    Returns:
        The list of output tensors.
    """
    _check_not_xla()
    wired = [_wire(t) for t in tensors]
    inputs = [w[0] for w in wired]
    if out_dtypes is None:
        out_dtypes = [t.dtype for t in inputs]
        restore = [w[1] for w in wired]
    else:
        restore = [None] * len(out_dtypes)
        out_dtypes = list(out_dtypes)
        for i, dt in enumerate(out_dtypes):
            if dt == tf.bfloat16:
                out_dtypes[i], restore[i] = tf.float32, tf.bfloat16

    def _body(*arrays):
        try:
            outs = body(*arrays)
        except SdlError as e:
            # Eagerly this very exception reaches the caller; inside tf.function TensorFlow
            # turns it into a status (an argument error, a ValueError, becomes
            # tf.errors.InvalidArgumentError; spark_dl.tensorflow.errors explains the rest).
            twin = as_tf_error(e)
            if twin is e:
                raise
            raise twin.with_traceback(e.__traceback__) from None
        # numpy_function checks the dtypes exactly: scalars come back as 0-d arrays.
        return [np.asarray(o, dtype=dt.as_numpy_dtype) for o, dt in zip(outs, out_dtypes)]

    outs = tf.numpy_function(_body, inputs, out_dtypes, stateful=True, name=op_name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    outs = list(outs)
    shapes = out_shapes if out_shapes is not None else [t.shape for t in inputs]
    for o, s in zip(outs, shapes):
        if s is not None:
            o.set_shape(s)
    return [o if r is None else tf.cast(o, r) for o, r in zip(outs, restore)]
