"""spark_dl for NumPy arrays: the core's collectives with no framework at all.

Useful for scripts, tests and benchmarks, and as the model for framework front
ends. Every operation has a blocking form and an ``*_async`` form returning a
:class:`~spark_dl.common.handles.Handle`::

    import numpy as np
    import spark_dl.numpy as sdl

    sdl.init()
    total = sdl.allreduce(np.ones(4, np.float32), op=sdl.Sum)
"""

import numpy as np

from spark_dl.common import *  # noqa: F401,F403
from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.handles import CompositeHandle, synchronize
from spark_dl.common.objects import allgather_object, broadcast_object
from spark_dl.common.ops import alltoall_splits, group_name, resolve_op, set_size
from spark_dl.common.process_sets import global_process_set

__all__ = [
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "allgather", "allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "synchronize", "poll", "broadcast_object",
    "allgather_object",
]


def _as_array(tensor):
    # np.ascontiguousarray would turn 0-d arrays into 1-d ones.
    return np.asarray(tensor, order="C")


def _from(outputs):
    return np.from_dlpack(_ops.DLPackTensor(outputs[0]))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` over the process set; the result is a new array.

    Args:
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor / postscale_factor: multiply before / after the reduction.
    """
    arr = _as_array(tensor)
    # The core allocates the result (pooled, pre-faulted memory) and reduces
    # straight from arr into it: no copy and no page faults on the way.
    return _ops.submit("allreduce", name, arr, None, core_output=True,
                       finish=lambda o, i: _ops.numpy_output(o[0]),
                       process_set=process_set, op=resolve_op(average, op),
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Blocking :func:`allreduce_async`."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                       postscale_factor, process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`allreduce_async`: ``tensor`` (C-contiguous, writable) receives the result."""
    if not (isinstance(tensor, np.ndarray) and tensor.flags.c_contiguous and tensor.flags.writeable):
        raise InvalidArgumentError("in-place allreduce needs a writable C-contiguous numpy array")
    return _ops.submit("allreduce", name, tensor, tensor, finish=lambda o, i: tensor,
                       process_set=process_set, op=resolve_op(average, op),
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Blocking :func:`allreduce_async_`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Reduces a list of arrays as one unit: negotiated together and fused into one collective."""
    group = group_name("grouped_allreduce", name, process_set)
    handles = []
    for i, t in enumerate(tensors):
        arr = _as_array(t)
        out = np.empty_like(arr)
        handles.append(_ops.submit(
            "allreduce", f"{group}.{i}", arr, out, finish=lambda o, i, out=out: out,
            process_set=process_set, op=resolve_op(average, op), prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, group=group, group_size=len(tensors)))
    return CompositeHandle(handles, list, group)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Blocking :func:`grouped_allreduce_async`; returns the list of results."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's array along axis 0 (first dimensions may differ)."""
    arr = _as_array(tensor)
    return _ops.submit("allgather", name, arr, finish=lambda o, i: _from(o), process_set=process_set)


def allgather(tensor, name=None, process_set=global_process_set):
    """Blocking :func:`allgather_async`."""
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns a new array holding ``root_rank``'s ``tensor`` on every rank.

    ``root_rank`` is a global rank, a member of ``process_set`` (as in Horovod).
    """
    arr = _as_array(tensor)
    out = arr.copy()
    return _ops.submit("broadcast", name, arr, out, finish=lambda o, i: out,
                       process_set=process_set, root=root_rank)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Blocking :func:`broadcast_async`."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast_async` into ``tensor`` (writable, C-contiguous)."""
    if not (isinstance(tensor, np.ndarray) and tensor.flags.c_contiguous and tensor.flags.writeable):
        raise InvalidArgumentError("in-place broadcast needs a writable C-contiguous numpy array")
    return _ops.submit("broadcast", name, tensor, tensor, finish=lambda o, i: tensor,
                       process_set=process_set, root=root_rank)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Blocking :func:`broadcast_async_`."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[j]`` rows (axis 0) to rank j; returns (received array, received splits).

    Without ``splits`` the rows are divided evenly (axis 0 must divide by the set size).
    """
    arr = _as_array(tensor)
    splits = alltoall_splits(splits, arr.shape[0] if arr.ndim else None, set_size(process_set))
    return _ops.submit("alltoall", name, arr, splits=splits, process_set=process_set,
                       finish=lambda o, i: (_from(o), np.asarray(i, dtype=np.int32)))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Blocking :func:`alltoall_async`."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor, name=None, op=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over the set and returns this rank's slice of axis 0.

    Rows are divided as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    arr = _as_array(tensor)
    return _ops.submit("reducescatter", name, arr, finish=lambda o, i: _from(o),
                       process_set=process_set, op=resolve_op(None, op),
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def reducescatter(tensor, name=None, op=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Blocking :func:`reducescatter_async`."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                           postscale_factor))


def barrier(process_set=global_process_set, timeout=None):
    """Returns when every member of the process set has reached the barrier."""
    synchronize(_ops.submit("barrier", None, None, process_set=process_set), timeout)


def join(process_set=global_process_set, timeout=None):
    """Marks this rank as out of data; returns the last rank to join.

    Until every rank has joined, the others' allreduces run with this rank
    contributing zeros (Average still divides by the full set size).
    """
    h = _ops.submit("join", "join", None, process_set=process_set,
                    finish=lambda o, i: int(i[0]))
    return synchronize(h, timeout)
