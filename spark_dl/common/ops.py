"""Framework-neutral submission of collectives to the core.

Front ends (:mod:`spark_dl.numpy`, ``spark_dl.torch``, ...) pass any object
that speaks DLPack (``__dlpack__``) and a ``finish`` function that turns the
core's DLPack outputs into their own tensor type. Nothing is copied for
contiguous CPU tensors. The argument handling every front end shares lives here
too: the reduce op (:func:`resolve_op`), operation and group names, the size and
rank within a process set, and alltoall's splits (default and checked).
"""

import collections
import itertools
import operator

import numpy as np

from spark_dl.common import basics as _basics
from spark_dl.common.native import core as _core
from spark_dl.common.basics import rank as _global_rank
from spark_dl.common.basics import size as _global_size
from spark_dl.common.exceptions import InvalidArgumentError, raise_from_core
from spark_dl.common.handles import BatchHandle, Handle
from spark_dl.common.process_sets import global_process_set

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "resolve_op", "auto_name",
           "group_name", "set_size", "set_rank", "set_ranks", "root_index", "even_splits",
           "alltoall_splits", "submit", "submit_many", "DLPackTensor", "DTYPES"]

Average = _core.REDUCE_OPS["Average"]
Sum = _core.REDUCE_OPS["Sum"]
Min = _core.REDUCE_OPS["Min"]
Max = _core.REDUCE_OPS["Max"]
Product = _core.REDUCE_OPS["Product"]
# Horovod's Adasum reduction is not implemented; passing it raises instead of falling back.
Adasum = -1
_REDUCE_OPS = frozenset([Average, Sum, Min, Max, Product])

OP = _core.OP_TYPES
_ALLREDUCE = OP["allreduce"]
# The core's dtype codes by name ('float32': ...), for submit_many's dtypes.
DTYPES = _core.DTYPES
_counters = collections.defaultdict(itertools.count)
_counted_in = 0  # the runtime (init_serial) the counters belong to


def resolve_op(average, op, default=Average):
    """Horovod's deprecated ``average=`` flag and ``op=``, reconciled into one reduce op.

    Raises:
        InvalidArgumentError: both given, Adasum, or an unknown op.
    """
    if average is not None and op is not None:
        raise InvalidArgumentError("the op parameter supersedes average; pass only one of them")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if op is Adasum or op == Adasum:
        raise InvalidArgumentError("Adasum is not supported by spark_dl; use op=Average or op=Sum")
    if op not in _REDUCE_OPS:
        raise InvalidArgumentError(
            f"unknown reduce op {op!r}; use Average, Sum, Min, Max or Product")
    return op


def set_size(process_set):
    """Number of ranks in ``process_set`` (the global set when None)."""
    if process_set is None or process_set is global_process_set:
        return _global_size()
    return process_set.size()


def set_rank(process_set):
    """This process's rank within ``process_set`` (-1 when not a member)."""
    if process_set is None or process_set is global_process_set:
        return _global_rank()
    return process_set.rank()


def set_ranks(process_set):
    """The global ranks of ``process_set``'s members, ascending."""
    if process_set is None or process_set is global_process_set:
        return list(range(_global_size()))
    process_set._require_registered()
    return list(process_set.ranks)


def root_index(root_rank, process_set):
    """The core's root for ``root_rank``: its index among ``process_set``'s members.

    ``root_rank`` is a *global* rank, as in Horovod and ``torch.distributed``
    (``broadcast(t, root_rank=2, process_set=ProcessSet([0, 2]))`` sends rank 2's
    tensor). Every API with a root goes through :func:`submit`, which calls this.

    Raises:
        InvalidArgumentError: ``root_rank`` is not an integer, or not a member of the set.
    """
    try:
        r = operator.index(root_rank)
    except TypeError:
        raise InvalidArgumentError(f"root_rank must be an integer (a global rank), got "
                                   f"{type(root_rank).__name__} {root_rank!r}") from None
    ranks = set_ranks(process_set)
    global_set = process_set is None or process_set is global_process_set
    if global_set and 0 <= r < len(ranks):
        return r
    if not global_set and r in ranks:
        return ranks.index(r)
    what = "the global process set" if global_set else \
        f"process set {process_set.process_set_id}"
    raise InvalidArgumentError(
        f"root_rank {r} is outside {what}, whose global ranks are {ranks}; root_rank is a "
        "global rank (as in Horovod), and the root must be a member of the process set")


def even_splits(rows, n):
    """alltoall's splits without ``splits=``: ``rows`` (None for a scalar) divided evenly
    over ``n`` ranks.

    Raises:
        InvalidArgumentError: ``rows`` does not divide by ``n``.
    """
    if rows is None or rows % n:
        have = "a scalar" if rows is None else rows
        raise InvalidArgumentError(f"alltoall without splits needs dimension 0 ({have}) "
                                   f"divisible by the number of ranks ({n})")
    return [rows // n] * n


def alltoall_splits(splits, rows, n):
    """alltoall's splits as a list of ints, checked on the calling rank before anything is
    enqueued, so that bad splits raise the same error on every rank that passes them and
    no rank waits for a send that never comes. Every front end calls this one function.

    Args:
        splits: None (``rows`` divided evenly, see :func:`even_splits`), or one row count
            per member of the set: a sequence or a one-dimensional array of integers
            (a framework tensor as ``tolist()`` or NumPy gives it, so its dtype counts).
        rows: the tensor's first dimension (None for a scalar).
        n: the size of the process set.

    Raises:
        InvalidArgumentError: a scalar tensor; splits that are not integers (floats,
            booleans, strings), not one-dimensional, not one per member, negative, or
            that do not add up to ``rows``.
    """
    if splits is None:
        return even_splits(rows, n)
    if rows is None:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    try:
        arr = np.asarray(splits)
    except Exception:  # noqa: BLE001 - ragged nesting, objects NumPy cannot take
        arr = None
    if arr is None or arr.ndim != 1:
        raise InvalidArgumentError(f"alltoall splits must be a one-dimensional sequence of "
                                   f"integers, one per rank of the process set ({n}), got "
                                   f"{splits!r}")
    if len(arr) != n:
        raise InvalidArgumentError(f"alltoall needs one split per rank of the process set "
                                   f"({n}), got {len(arr)}: {arr.tolist()}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"alltoall splits must be integers, got {arr.dtype} values "
                                   f"{arr.tolist()}")
    values = [int(s) for s in arr]
    if any(s < 0 for s in values):
        raise InvalidArgumentError(f"alltoall splits must be >= 0, got {values}")
    if sum(values) != rows:
        raise InvalidArgumentError(f"alltoall splits of {values} rows sum to {sum(values)} but "
                                   f"the first dimension is {rows}")
    return values


def auto_name(kind, process_set_id=0):
    """A name for an unnamed operation.

    Counted per operation kind and process set, so the name is equal on every
    member that calls the same unnamed operations on that set in the same order
    (ranks outside a set do not fall out of step with its members).
    """
    global _counted_in
    if _counted_in != _basics.init_serial():
        # Numbered from 0 in every runtime: the ranks of a later init() (an elastic job's
        # next generation, newcomers included) must number them alike.
        _counters.clear()
        _counted_in = _basics.init_serial()
    n = next(_counters[(kind, process_set_id)])
    return f"{kind}.noname.{n}" if process_set_id == 0 else f"{kind}.ps{process_set_id}.noname.{n}"


class DLPackTensor:
    """Presents a DLPack capsule from the core through the ``__dlpack__`` protocol.

    ``numpy.from_dlpack(DLPackTensor(c))`` and ``torch.from_dlpack(...)`` take
    the memory without copying; the capsule can be consumed once.
    """

    __slots__ = ("_capsule",)

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack tensor was already consumed")
        return capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU, device 0


def numpy_output(capsule):
    """A writable NumPy array over a core output capsule, without a copy (``numpy.from_dlpack``
    would mark it read-only)."""
    return _core.to_numpy(capsule)


def _ps_id(process_set):
    if process_set is None or process_set is global_process_set:
        return 0
    process_set._require_registered()
    return process_set.process_set_id


def group_name(kind, name, process_set):
    """``name``, or an :func:`auto_name` for an unnamed grouped operation on ``process_set``."""
    return name or auto_name(kind, _ps_id(process_set))


# The core's device type codes (DeviceType), for submit_many.
DEVICE_CPU, DEVICE_CUDA = 0, 1

# The framework's stream of a device tensor (DLPack's numbering), set by the framework
# binding that can pass device tensors (spark_dl.torch for CUDA); None: host tensors only.
_stream_of = None


# A context manager that makes a device tensor's device current while the core takes it
# (PyTorch exports a CUDA tensor through DLPack only on its current device), or None.
_device_scope = None


# ``order(tensor, stream)`` when a device tensor's handle completes, or None.
_order_after = None


def set_stream_provider(fn, scope=None, order=None):
    """``fn(tensor) -> int``: the DLPack stream number the core must order its reads after
    for ``tensor`` (0 for host tensors). The core records an event there at enqueue,
    waits for it before reading, and makes that stream wait for the result (no
    device-wide synchronize). ``scope(tensor)``: a context manager to enter around the
    enqueue (e.g. that makes the tensor's device current), or None when none is needed.
    ``order(tensor, stream)``: called on the thread that takes the result, before it is
    built, to order the stream current there after ``stream`` when they differ."""
    global _stream_of, _device_scope, _order_after
    _stream_of = fn
    _device_scope = scope
    _order_after = order


def submit(kind, name, tensor, output=None, *, keep=(), finish=None, process_set=None,
           op=Sum, prescale_factor=1.0, postscale_factor=1.0, root=0, splits=(),
           group="", group_size=0, core_output=False):
    """Enqueues one operation and returns its :class:`Handle`.

    Args:
        kind: 'allreduce', 'allgather', 'broadcast', 'alltoall', 'reducescatter',
            'barrier' or 'join'.
        tensor / output: DLPack-capable CPU arrays (output written in place).
        op: a reduce op checked by :func:`resolve_op` (allreduce, reducescatter).
        root: broadcast's root, a *global* rank (see :func:`root_index`).
        keep: more objects to keep alive until the handle completes.
        finish: ``finish(outputs, ints)`` builds the result from the core's
            DLPack outputs and integer results.
        core_output: allreduce without ``output``: the core allocates the result
            (from its pool of pre-faulted buffers, reused once the caller drops
            them) and hands it back as ``outputs[0]``; its transport reads
            ``tensor`` directly, without copying it first.
    """
    # Per-tensor loops call this once per gradient: the common case (host tensor, no device
    # scope) runs no more Python than it needs.
    ps_id = _ps_id(process_set)
    if kind == "broadcast":
        root = root_index(root, process_set)
    name = name or auto_name(kind, ps_id)
    source = tensor if tensor is not None else output
    stream = _stream_of(source) if _stream_of is not None and source is not None else 0
    scope = _device_scope(source) if stream and _device_scope is not None else None
    args = (OP[kind], name, tensor, output, ps_id, int(op), float(prescale_factor),
            float(postscale_factor), int(root), [int(s) for s in splits] if splits else [],
            group, int(group_size), bool(core_output), int(stream))
    try:
        if scope is None:
            hid = _core.enqueue(*args)
        else:
            with scope:
                hid = _core.enqueue(*args)
    except _core.CoreError as e:
        raise_from_core(e)
    if stream and _order_after is not None:
        finish = _ordered(finish or _no_result, source, stream)
    return Handle(hid, (tensor, output, keep), finish or _no_result, name=name)


def _no_result(outputs, ints):
    return None


def _ordered(finish, source, stream):
    """``finish`` after the current stream of ``source``'s device is ordered after the
    stream the core signalled (a gradient hook enqueues on autograd's stream, the
    optimizer step reads the gradient on the caller's)."""
    def run(outputs, ints):
        _order_after(source, stream)
        return finish(outputs, ints)
    return run


def allreduce_host(name, addr, shape, code, keep, finish, process_set, op, prescale_factor,
                   postscale_factor):
    """:func:`submit_many`'s enqueue for one C-contiguous host tensor reduced in place
    (``op``: a resolved reduce op; ``code``: the tensor's :data:`DTYPES` code; ``name``
    None: an :func:`auto_name`). A Horovod program's own loop of ``allreduce_async_`` per
    gradient makes this call hundreds of times a step, so it does only what that case
    needs."""
    ps_id = _ps_id(process_set)
    name = name or auto_name("allreduce", ps_id)
    try:
        first = _core.enqueue_many(_ALLREDUCE, [name], [addr], [addr], [shape], [code], ps_id,
                                   int(op), float(prescale_factor), float(postscale_factor), 0,
                                   "", 0, DEVICE_CPU, 0, 0)
    except _core.CoreError as e:
        raise_from_core(e)
    return BatchHandle(first, keep, finish, name, 1)


def submit_many(kind, names, in_addrs, out_addrs, shapes, dtypes, *, keep, finish,
                process_set=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                group="", group_size=0, label="", device=None, source=None):
    """Enqueues a batch of operations of one kind with one call; returns one
    :class:`~spark_dl.common.handles.BatchHandle` for all of them.

    The fast path for many small tensors (a step's gradients): one call into the
    core, one wake-up of its background thread, one handle object and one wait,
    instead of one of each per tensor. Tensors are given by address, shape and
    core dtype code (:data:`DTYPES`); the caller has checked that each is a
    C-contiguous CPU tensor of a supported dtype, and ``keep`` holds them (the
    handle keeps it alive until it is synchronized). ``out_addrs[i]`` 0 asks the
    core to allocate that allreduce's result. The operations are enqueued all or
    none. ``finish(outputs)``: see :class:`~spark_dl.common.handles.BatchHandle`.
    ``device``: ``(device type code, index)`` of every tensor when they are on one
    device (:data:`DEVICE_CUDA`), None for host memory; ``source``, one of them, whose
    framework stream (see :func:`set_stream_provider`) the core orders the batch after.

    Only allreduce is batched so far (its tensors are caller memory of known size).
    """
    if kind != "allreduce":
        raise InvalidArgumentError(f"submit_many runs allreduce only, not {kind}")
    ps_id = _ps_id(process_set)
    device_type, device_index = device or (DEVICE_CPU, 0)
    stream = 0
    if device_type != DEVICE_CPU and _stream_of is not None and source is not None:
        stream = _stream_of(source)
    try:
        first = _core.enqueue_many(OP[kind], names, in_addrs, out_addrs, shapes, dtypes, ps_id,
                                   int(op), float(prescale_factor), float(postscale_factor), 0,
                                   group, int(group_size), device_type, int(device_index),
                                   int(stream))
    except _core.CoreError as e:
        raise_from_core(e)
    if stream and _order_after is not None:
        plain = finish

        def finish(outputs):
            _order_after(source, stream)  # as _ordered does for single operations
            return plain(outputs)
    return BatchHandle(first, keep, finish, label or group or names[0], len(names))
