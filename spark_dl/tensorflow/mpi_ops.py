"""Horovod's ``horovod.tensorflow`` collectives on TensorFlow 2, eager and in ``tf.function``.

Each call is one TensorFlow op (see :mod:`spark_dl.tensorflow._bridge`): a grouped
operation over 50 tensors is one op and one trip into Python, not 50. The float
collectives that return a new tensor are differentiable (``tf.custom_gradient``), with
Horovod's conventions:

- ``allreduce`` / ``grouped_allreduce``: the same reduction (op and scale factors) of the
  incoming gradients for Sum and Average; for Min/Max the summed gradient goes to the
  rank(s) whose value was selected, for Product the summed gradient times ``out / in``;
- ``allgather``: this rank's rows of the set-average of the incoming gradients;
- ``broadcast``: the set-average of the incoming gradients on the root, zeros elsewhere;
- ``alltoall``: the incoming gradients sent back where they came from;
- ``reducescatter``: the incoming gradients gathered (times the set size for Sum).

Every member of the process set must run the backward pass too, as the forward pass.
XLA (``jit_compile=True``) cannot call these ops; they raise a clear error when traced there.
"""

import numpy as np
import tensorflow as tf

from spark_dl.common.basics import (  # noqa: F401 - re-exported
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline)
from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import raise_from_core
from spark_dl.common.handles import synchronize
from spark_dl.common.native import core as _core
from spark_dl.common.ops import (  # noqa: F401 - re-exported
    Adasum, Average, Max, Min, Product, Sum, alltoall_splits, even_splits, group_name,
    resolve_op, set_rank, set_size)
from spark_dl.common.process_sets import (  # noqa: F401 - re-exported
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from spark_dl.tensorflow._bridge import call, run_collective
from spark_dl.tensorflow.compression import Compression
from spark_dl.tensorflow.errors import InvalidArgumentError, translate_errors

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "broadcast_",
    "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
]


def _grad_name(name, suffix="grad"):
    return None if name is None else f"{name}.{suffix}"


def _member_names(kind, name, process_set, n):
    """(group, member names) of a grouped operation, resolved when the op runs."""
    group = group_name(kind, name, process_set)
    return group, [f"{group}.{i}" for i in range(n)]


def _differentiable(tensors):
    return all(t.dtype.is_floating for t in tensors)


def _tensors(values):
    return [tf.convert_to_tensor(v) for v in values]


# ----------------------------------------------------------------------------- allreduce

def _allreduce_raw(tensors, op, prescale, postscale, name, process_set, grouped=True):
    """One op reducing every tensor of the list (fused as a group when ``grouped``)."""
    if grouped and len(tensors) > 1:
        return _flat_allreduce(tensors, op, prescale, postscale, name, process_set)
    n = len(tensors)

    def body(*arrays):
        if grouped:
            group, names = _member_names("grouped_allreduce", name, process_set, n)
        else:
            group, names = "", [name]
        return run_collective("allreduce", arrays, names, group, process_set, op=op,
                              prescale_factor=prescale, postscale_factor=postscale)

    return call(body, tensors, op_name="SdlAllreduce")


def _flat_allreduce(tensors, op, prescale, postscale, name, process_set):
    """A grouped allreduce packed in TensorFlow: one flat tensor per dtype crosses into
    Python and the core, and is split back into the original shapes afterwards.

    Each tensor crossing ``numpy_function`` costs tens of microseconds on its own, and the
    core handles each submitted tensor separately until it fuses them; packing first
    (one memcpy per tensor inside the TensorFlow graph) measured about twice as fast for
    50 gradients (docs/keras.md, "Overhead"). Every reduce op is elementwise, so packing
    changes no result.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    dtypes = list(by_dtype)
    flats = [tf.concat([tf.reshape(tensors[i], [-1]) for i in by_dtype[dt]], 0)
             for dt in dtypes]

    def body(*arrays):
        group = group_name("grouped_allreduce", name, process_set)
        names = [f"{group}.{dt.name}" for dt in dtypes]
        return run_collective("allreduce", arrays, names, "", process_set, op=op,
                              prescale_factor=prescale, postscale_factor=postscale)

    reduced = call(body, flats, op_name="SdlGroupedAllreduce")
    out = [None] * len(tensors)
    for dt, flat in zip(dtypes, reduced):
        members = by_dtype[dt]
        sizes = [tf.size(tensors[i]) for i in members]
        for i, piece in zip(members, tf.split(flat, tf.stack(sizes), num=len(members))):
            out[i] = tf.reshape(piece, tf.shape(tensors[i]))
            out[i].set_shape(tensors[i].shape)
    return out


def _reduce_grads(grads, xs, ys, op, prescale, postscale, name, process_set):
    if op in (Sum, Average):
        return _allreduce_raw(grads, op, prescale, postscale, name, process_set)
    summed = _allreduce_raw(grads, Sum, 1.0, 1.0, name, process_set)
    out = []
    for g, x, y in zip(summed, xs, ys):
        if op == Product:
            out.append(g * y / x)
        else:  # Min / Max: the gradient flows to the rank(s) holding the selected value
            picked = tf.cast(tf.equal(x * (prescale * postscale), y), g.dtype)
            out.append(g * (prescale * postscale) * picked)
    return out


def _allreduce_diff(tensors, op, prescale, postscale, name, process_set, grouped):
    if not _differentiable(tensors):
        return _allreduce_raw(tensors, op, prescale, postscale, name, process_set, grouped)

    @tf.custom_gradient
    def fn(*xs):
        ys = _allreduce_raw(list(xs), op, prescale, postscale, name, process_set, grouped)

        def grad(*dys):
            return _reduce_grads(list(dys), xs, ys, op, prescale, postscale, _grad_name(name),
                                 process_set)
        return ys, grad

    return list(fn(*tensors))


def _check_sparse(op, prescale, postscale):
    """What Horovod refuses for ``tf.IndexedSlices`` (gathered, not reduced), refused alike."""
    if op == Adasum:
        raise NotImplementedError(
            "the Adasum reduction does not support tf.IndexedSlices; pass sparse_as_dense=True "
            "to DistributedOptimizer / DistributedGradientTape, or convert the slices with "
            "tf.convert_to_tensor")
    if op not in (Sum, Average):
        raise NotImplementedError("only op=Sum and Average are supported with tf.IndexedSlices; "
                                  "convert the slices with tf.convert_to_tensor for other ops")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("prescale_factor / postscale_factor are not supported with "
                                  "tf.IndexedSlices; scale the slices' values yourself")


def _sparse_allreduce(slices, op, name, process_set):
    """IndexedSlices: every rank's rows and indices gathered (Horovod's sparse allreduce)."""
    values, indices = grouped_allgather([slices.values, slices.indices], name=name,
                                        process_set=process_set)
    if op == Average:
        values = values / tf.cast(set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Reduces ``tensor`` over ``process_set`` (every member calls it) and returns the result.

    Args:
        tensor: a tensor (or anything ``tf.convert_to_tensor`` takes) or ``tf.IndexedSlices``
            (gathered instead of reduced, as in Horovod).
        op: Average (default), Sum, Min, Max or Product; ``average=`` is Horovod's older flag.
        compression: ``Compression.fp16`` sends floating tensors as float16.
        prescale_factor / postscale_factor: multiply before / after the reduction.
        name: the operation's name, equal on every rank (default: counted per call order).
        device_dense, device_sparse, ignore_name_scope: accepted for Horovod
            compatibility; spark_dl places tensors where they are.
    """
    if isinstance(tensor, tf.IndexedSlices) and op == Adasum:
        _check_sparse(op, prescale_factor, postscale_factor)  # Horovod's error, not ours
    op = resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _sparse_allreduce(tensor, op, name, process_set)
    wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out, = _allreduce_diff([wire], op, prescale_factor, postscale_factor, name, process_set,
                           grouped=False)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduces a list of tensors as one unit (one op, one fused collective); returns the list."""
    tensors = list(tensors)
    sparse = any(isinstance(t, tf.IndexedSlices) for t in tensors)
    if sparse and op == Adasum:
        _check_sparse(op, prescale_factor, postscale_factor)  # Horovod's error, not ours
    op = resolve_op(average, op)
    if not tensors:
        return []
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor,
                          name=None if name is None else f"{name}.{i}",
                          process_set=process_set) for i, t in enumerate(tensors)]
    pairs = [compression.compress(t) for t in _tensors(tensors)]
    outs = _allreduce_diff([p[0] for p in pairs], op, prescale_factor, postscale_factor, name,
                           process_set, grouped=True)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# ----------------------------------------------------------------------------- allgather

def _gathered_shape(t):
    return tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else None


def _allgather_raw(tensors, name, process_set, grouped=True):
    n = len(tensors)

    def body(*arrays):
        if grouped:
            group, names = _member_names("grouped_allgather", name, process_set, n)
        else:
            group, names = "", [name]
        return run_collective("allgather", arrays, names, group, process_set)

    return call(body, tensors, out_shapes=[_gathered_shape(t) for t in tensors],
                op_name="SdlAllgather")


def _allgather_diff(tensors, name, process_set, grouped):
    for t in tensors:
        if t.shape.rank == 0:
            raise InvalidArgumentError(
                "allgather needs tensors with at least one dimension (got a scalar); "
                "reshape it to [1] first")
    if not _differentiable(tensors):
        return _allgather_raw(tensors, name, process_set, grouped)

    @tf.custom_gradient
    def fn(*xs):
        ys = _allgather_raw(list(xs), name, process_set, grouped)

        def grad(*dys):
            averaged = _allreduce_raw(list(dys), Average, 1.0, 1.0, _grad_name(name),
                                      process_set)
            rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])
            every, = _allgather_raw([tf.reshape(rows, [1, -1])], _grad_name(name, "grad.rows"),
                                    process_set, grouped=False)
            offsets = tf.reduce_sum(every[:set_rank(process_set)], axis=0)
            return [g[offsets[i]:offsets[i] + rows[i]] for i, g in enumerate(averaged)]
        return ys, grad

    return list(fn(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every member's ``tensor`` along dimension 0 (first dimensions may differ)."""
    out, = _allgather_diff(_tensors([tensor]), name, process_set, grouped=False)
    return out


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """:func:`allgather` of each tensor of a list, as one unit; returns the list."""
    tensors = _tensors(tensors)
    return _allgather_diff(tensors, name, process_set, grouped=True) if tensors else []


# ----------------------------------------------------------------------------- broadcast

def _check_root(root_rank, process_set):
    """Raises before anything is traced when ``root_rank`` (a global rank) is not a member."""
    _ops.root_index(root_rank, process_set)


def _broadcast_raw(tensors, root_rank, name, process_set, names=None):
    def body(*arrays):
        members = names or ([name] if len(arrays) == 1 else
                            _member_names("broadcast", name, process_set, len(arrays))[1])
        return run_collective("broadcast", arrays, members, "", process_set,
                              root=int(root_rank))

    return call(body, tensors, op_name="SdlBroadcast")


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every member of ``process_set``.

    ``root_rank`` is a global rank, a member of the set (as in Horovod). Differentiable
    for floating tensors.
    """
    _check_root(root_rank, process_set)
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return _broadcast_raw([tensor], root_rank, name, process_set)[0]

    @tf.custom_gradient
    def fn(x):
        y, = _broadcast_raw([x], root_rank, name, process_set)

        def grad(dy):
            g, = _allreduce_raw([dy], Average, 1.0, 1.0, _grad_name(name), process_set,
                                grouped=False)
            return g if rank() == root_rank else tf.zeros_like(g)
        return y, grad

    return fn(tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrites each of ``variables`` with ``root_rank``'s value, in place (Horovod's
    ``broadcast_``), as one op for all of them.

    Args:
        variables: ``tf.Variable`` (or Keras 3 variables), the same list on every member.
        root_rank: the global rank (a member of ``process_set``) whose values everyone takes.

    Returns:
        The variables' new values (a list of tensors), eagerly and inside ``tf.function``.
    """
    _check_root(root_rank, process_set)
    variables = list(variables)
    if not variables:
        return []
    values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], root_rank,
                            name or "broadcast_", process_set)
    for v, x in zip(variables, values):
        v.assign(x)
    # Inside tf.function the reads follow the assignments (automatic control dependencies).
    return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


# ----------------------------------------------------------------------------- alltoall

def _alltoall_raw(tensor, splits, name, process_set):
    def body(array, splits_array):
        # The check every front end shares, on the values (eagerly and in tf.function),
        # before anything is enqueued.
        checked = alltoall_splits(splits_array, array.shape[0] if array.ndim else None,
                                  set_size(process_set))
        return list(run_collective("alltoall", [array], [name], "", process_set,
                                   splits=checked)[0])

    out, received = call(body, [tensor, splits], out_dtypes=[tensor.dtype, tf.int32],
                         out_shapes=[_gathered_shape(tensor), [set_size(process_set)]],
                         op_name="SdlAlltoall")
    return out, received


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends ``splits[j]`` rows (dimension 0) of ``tensor`` to member j.

    Returns:
        As Horovod: without ``splits`` (the rows divided evenly) the received tensor alone;
        with ``splits``, ``(received tensor, received splits)``: rows in rank order, and how
        many came from each member.
    """
    tensor = tf.convert_to_tensor(tensor)
    n = set_size(process_set)
    given = splits is not None
    if not given:
        if tensor.shape.rank == 0:
            raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
        rows = tensor.shape[0]
        if rows is not None:
            splits = tf.constant(even_splits(rows, n), tf.int32)
        else:
            splits = tf.fill([n], tf.shape(tensor)[0] // n)
    # Not cast: float splits must reach the check in _alltoall_raw as floats.
    splits = tf.convert_to_tensor(splits)
    if not _differentiable([tensor]):
        out, received = _alltoall_raw(tensor, splits, name, process_set)
        return (out, received) if given else out

    @tf.custom_gradient
    def fn(x):
        y, received = _alltoall_raw(x, splits, name, process_set)

        def grad(dy, _unused):
            back, _ = _alltoall_raw(dy, received, _grad_name(name), process_set)
            return back
        return (y, received), grad

    out, received = fn(tensor)
    return (out, received) if given else out


# ----------------------------------------------------------------------------- reducescatter

def _reducescatter_raw(tensors, op, prescale, postscale, name, process_set, grouped=True):
    n = len(tensors)

    def body(*arrays):
        if grouped:
            group, names = _member_names("grouped_reducescatter", name, process_set, n)
        else:
            group, names = "", [name]
        return run_collective("reducescatter", arrays, names, group, process_set, op=op,
                              prescale_factor=prescale, postscale_factor=postscale)

    return call(body, tensors, out_shapes=[_gathered_shape(t) for t in tensors],
                op_name="SdlReducescatter")


def _reducescatter_diff(tensors, op, prescale, postscale, name, process_set, grouped):
    for t in tensors:
        if t.shape.rank == 0:
            raise InvalidArgumentError("reducescatter needs tensors with at least one dimension")
    if not _differentiable(tensors) or op not in (Sum, Average):
        return _reducescatter_raw(tensors, op, prescale, postscale, name, process_set, grouped)

    @tf.custom_gradient
    def fn(*xs):
        ys = _reducescatter_raw(list(xs), op, prescale, postscale, name, process_set, grouped)

        def grad(*dys):
            gathered = _allgather_raw(list(dys), _grad_name(name), process_set)
            # Horovod's convention: Sum's gradient is scaled by the set size, Average's is not.
            factor = prescale * postscale * (set_size(process_set) if op == Sum else 1)
            return [g * factor if factor != 1.0 else g for g in gathered]
        return ys, grad

    return list(fn(*tensors))


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduces ``tensor`` over the set and returns this rank's slice of dimension 0.

    Rows are divided as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    op = resolve_op(None, op)
    wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out, = _reducescatter_diff([wire], op, prescale_factor, postscale_factor, name,
                               process_set, grouped=False)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, ignore_name_scope=False,
                          prescale_factor=1.0, postscale_factor=1.0, name=None):
    """:func:`reducescatter` of each tensor of a list, as one unit; returns the list."""
    op = resolve_op(None, op)
    pairs = [compression.compress(t) for t in _tensors(tensors)]
    if not pairs:
        return []
    outs = _reducescatter_diff([p[0] for p in pairs], op, prescale_factor, postscale_factor,
                               name, process_set, grouped=True)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# ----------------------------------------------------------------------------- join, barrier

def join(process_set=global_process_set):
    """Marks this rank as out of data; returns the last rank to join (an int32 tensor).

    Until every rank has joined, the others' allreduces run with this rank contributing
    zeros (Average still divides by the full set size).
    """
    def body(_unused):
        h = _ops.submit("join", "join", None, process_set=process_set,
                        finish=lambda o, i: int(i[0]))
        return [np.int32(synchronize(h))]

    out, = call(body, [tf.constant(0, tf.int32)], out_shapes=[[]], op_name="SdlJoin")
    return out


def barrier(process_set=global_process_set):
    """Returns when every member of the process set has reached the barrier (eager)."""
    def body(_unused):
        synchronize(_ops.submit("barrier", None, None, process_set=process_set))
        return [np.int32(0)]

    call(body, [tf.constant(0, tf.int32)], out_shapes=[[]], op_name="SdlBarrier")


# ----------------------------------------------------------------------------- topology as ops

def _set_ranks(process_set_id):
    """The members of the registered set ``process_set_id`` (0: every rank)."""
    if int(process_set_id) == 0:
        return list(range(size()))
    try:
        return list(_core.process_set_ranks(int(process_set_id)))
    except _core.CoreError as e:
        if e.args[0] != _core.ERROR_CODES["invalid_argument"]:
            raise_from_core(e)  # not initialized, shut down
        raise InvalidArgumentError(
            f"process_set_id={process_set_id}: {e.args[-1]}"
        ) from None


def _topology_op(value_fn, process_set_id, name, op_name):
    """An int32 scalar op that reads ``value_fn(process_set_id)`` when it runs (sets are
    added and removed at run time), checked once when built. For the global set (fixed
    from init() on) a constant, which XLA can compile too."""
    value = value_fn(process_set_id)  # unknown ids fail here, eagerly or while tracing
    if int(process_set_id) == 0:
        return tf.constant(value, tf.int32, name=name)
    out, = call(lambda _unused: [np.int32(value_fn(process_set_id))], [tf.constant(0, tf.int32)],
                out_dtypes=[tf.int32], out_shapes=[[]], op_name=op_name)
    return tf.identity(out, name=name) if name else out


def size_op(process_set_id=0, name=None):
    """The number of ranks (of process set ``process_set_id``; 0 is every rank) as an int32
    tensor, read when the op runs, as Horovod's ``size_op``.

    Raises:
        InvalidArgumentError: no process set with that id is registered.
    """
    return _topology_op(lambda i: len(_set_ranks(i)), process_set_id, name, "SdlSize")


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank is a member of process set ``process_set_id`` (0 is every rank),
    else 0, as an int32 tensor read when the op runs.

    Horovod returns a negative error code for an unknown id; spark_dl raises instead.

    Raises:
        InvalidArgumentError: no process set with that id is registered.
    """
    return _topology_op(lambda i: int(rank() in _set_ranks(i)), process_set_id, name,
                        "SdlProcessSetIncluded")


def rank_op(name=None):
    """This process's rank as an int32 tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_size_op(name=None):
    """The number of ranks on this host as an int32 tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def local_rank_op(name=None):
    """This process's rank on its host as an int32 tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


# Errors of the core leave every collective as spark_dl.tensorflow.errors types (both
# TensorFlow's and spark_dl's), whether raised while building the op or while it runs.
for _name in ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
              "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join",
              "barrier", "size_op", "process_set_included_op"):
    globals()[_name] = translate_errors(globals()[_name])
del _name
