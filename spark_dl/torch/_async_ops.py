"""The core's collectives on torch tensors: the asynchronous forms.

Every function here enqueues its work and returns a
:class:`~spark_dl.common.handles.Handle`; ``synchronize(handle)`` returns the
result as torch tensors. Tensors reach the core through DLPack: a contiguous
CPU tensor is read (and, for the in-place forms, written) in its own memory;
any other layout goes through a contiguous copy, copied back for in-place
forms when the operation finishes. Results whose size is known only after
negotiation (allgather, alltoall, reducescatter) are the core's own buffers,
wrapped without a copy.

The blocking and autograd-aware forms are in :mod:`spark_dl.torch.mpi_ops`.
"""

import functools

import torch

from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.handles import CompositeHandle
from spark_dl.common.ops import (Average, Sum, alltoall_splits, group_name, resolve_op,
                                 set_size)
from spark_dl.common.process_sets import global_process_set
from spark_dl.torch import _device

__all__ = [
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather_async", "grouped_allgather_async", "broadcast_async",
    "broadcast_async_", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "barrier", "join",
]

# What the core reduces; anything else is refused here, before any rank enqueues a part of a group.
_SUPPORTED_DTYPES = frozenset([
    torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.bool,
])


# ----------------------------------------------------------------------------- helpers

def _check(tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{what} has layout {tensor.layout}; only dense tensors can be reduced (for sparse "
            "gradients use sparse_allreduce_async or DistributedOptimizer(sparse_as_dense=True))")
    if tensor.device.type != "cpu":
        _device.check_device(tensor, what)  # CUDA once the core takes it; others never
    if tensor.dtype not in _SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{what} has dtype {tensor.dtype}; supported: uint8, int8, uint16, int16, int32, "
            "int64, float16, bfloat16, float32, float64, bool")


def _source(tensor, what="tensor"):
    """The tensor the core reads: its own memory when contiguous, else a contiguous copy.

    Always detached: DLPack refuses to export tensors that require grad, and
    the collectives' autograd is handled by :mod:`spark_dl.torch.mpi_ops`.
    """
    _check(tensor, what)
    t = tensor.detach()
    return t if t.is_contiguous() else t.contiguous()


def _target(tensor, what="tensor"):
    """(buffer the core reads and writes, function that makes ``tensor`` hold the result)."""
    _check(tensor, what)
    t = tensor.detach()
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


# torch dtype -> the core's dtype code, for the batched path (submit_many).
_CORE_DTYPES = {getattr(torch, name): code for name, code in _ops.DTYPES.items()}


def _per_tensor_allreduces(tensors, bufs, copy_backs, names, op, prescale_factor,
                           postscale_factor, process_set, group="", group_size=0, label=""):
    """The batched paths' form for tensors on several devices (CPU and CUDA, or several
    GPUs): one :func:`_ops.submit` each.

    The batch entry point takes tensors on one device; here each crosses through DLPack
    with its stream (:mod:`spark_dl.torch._device`), so the core learns its device and
    orders its reads after the framework's work. ``copy_backs`` None: out of place
    (the core allocates each host result); else in place, and the result is ``tensors``.
    """
    in_place = copy_backs is not None
    handles = []
    for i, buf in enumerate(bufs):
        if not in_place and buf.is_cuda:
            handles.append(_allreduce_into_new(buf, names[i], op, prescale_factor,
                                               postscale_factor, process_set, group, group_size))
            continue
        finish = (lambda o, ints: None) if in_place else (lambda o, ints: _wrap(o[0]))
        handles.append(_ops.submit(
            "allreduce", names[i], buf, buf if in_place else None, finish=finish,
            process_set=process_set, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, group=group, group_size=group_size,
            core_output=not in_place))

    def combine(results):
        if not in_place:
            return results
        for copy_back in copy_backs:
            copy_back()
        return list(tensors) if group else tensors  # as the batched forms return them

    return CompositeHandle(handles, combine, label)


def _host_code(t):
    """The core's dtype code of ``t`` when the core can take it as it is, by address: a
    dense, contiguous CPU tensor of a supported dtype; else None (it needs :func:`_target`:
    a check of its device, a copy, or an error naming the problem)."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.layout is torch.strided \
            and t.is_contiguous():
        return _CORE_DTYPES.get(t.dtype)
    return None


def _batch_targets(tensors):
    """:func:`_target` of each tensor, for the batched in-place path.

    Returns (buffers, copy-backs, specs); specs is (addresses, shapes, dtype codes,
    device) for :func:`_ops.submit_many` when every buffer is on one device (device None
    for host memory, else ``(DEVICE_CUDA, index)``), else None. A step's gradients are
    dense, contiguous tensors of a supported dtype: CPU ones are taken as they are with
    a few attribute reads in one pass (this runs once per tensor per step; for 200
    tensors the pass is part of a sub-millisecond step); anything else goes through
    :func:`_target`, which checks the device, copies or names the problem.
    """
    codes = _CORE_DTYPES
    bufs, copy_backs, addrs, shapes, dtypes = [], [], [], [], []
    host = True
    for i, t in enumerate(tensors):
        code = _host_code(t)
        if code is not None:
            bufs.append(t)
            addrs.append(t.data_ptr())
            shapes.append(t.shape)
            dtypes.append(code)
            continue
        buf, copy_back = _target(t, f"tensors[{i}]")
        bufs.append(buf)
        if copy_back is not None:
            copy_backs.append(copy_back)
        addrs.append(buf.data_ptr())
        shapes.append(buf.shape)
        dtypes.append(codes[buf.dtype])
        host = host and buf.is_cpu
    device = None if host else _one_cuda_device(bufs)
    if not host and device is None:
        return bufs, copy_backs, None
    return bufs, copy_backs, (addrs, shapes, dtypes, device)


def _one_cuda_device(bufs):
    """``(DEVICE_CUDA, index)`` when every buffer is on one CUDA device, else None."""
    first = bufs[0].device
    if first.type != "cuda" or any(b.device != first for b in bufs):
        return None
    return _ops.DEVICE_CUDA, first.index


def _batch_specs(bufs):
    """(addresses, shapes, dtype codes, device) of checked contiguous tensors for
    :func:`_ops.submit_many` (see :func:`_batch_targets`), or None when they are not
    on one device."""
    device = None
    if not all(t.is_cpu for t in bufs):
        device = _one_cuda_device(bufs)
        if device is None:
            return None
    codes = _CORE_DTYPES
    return ([t.data_ptr() for t in bufs], [t.shape for t in bufs],
            [codes[t.dtype] for t in bufs], device)


@functools.lru_cache(maxsize=256)
def _member_names(group, n):
    """``<group>.<i>`` for a group of n members (the same list every step)."""
    return tuple(f"{group}.{i}" for i in range(n))


def _wrap(capsule):
    """A torch tensor over one of the core's output buffers (no copy)."""
    return torch.from_dlpack(capsule)


def _as_list(tensors, kind):
    tensors = list(tensors)
    if not tensors:
        raise InvalidArgumentError(f"{kind} needs at least one tensor")
    return tensors


# ----------------------------------------------------------------------------- allreduce

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` over ``process_set``; the result is a new tensor.

    Args:
        tensor: a CPU or CUDA tensor; every member must pass the same shape and dtype
            under the same ``name``.
        average: deprecated: True means ``op=Average``, False ``op=Sum``.
        name: identifies the operation across ranks (unnamed operations are
            matched by the order in which each rank calls them).
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor / postscale_factor: multiply by these before / after
            the reduction (Average divides by the set size after both).
        process_set: the ranks taking part (default: all).

    Returns:
        A handle; ``synchronize(handle)`` returns the reduced tensor.
    """
    src = _source(tensor)
    if src.is_cuda:
        return _allreduce_into_new(src, name, resolve_op(average, op), prescale_factor,
                                   postscale_factor, process_set)
    # The core allocates the result (pooled, pre-faulted memory) and reduces
    # straight from src into it: no copy and no page faults on the way.
    return _ops.submit("allreduce", name, src, None, core_output=True,
                       finish=lambda o, i: _wrap(o[0]),
                       process_set=process_set, op=resolve_op(average, op),
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def _allreduce_into_new(src, name, op, prescale_factor, postscale_factor, process_set,
                        group="", group_size=0):
    """Out-of-place allreduce of a device tensor into a result PyTorch allocates: its
    caching allocator, ordered on the current stream, instead of a device allocation by
    the core per call (whose ``cudaFree``, when the result is dropped, synchronizes the
    whole device). The core reads ``src`` and writes the result in its stream order."""
    out = torch.empty_like(src)
    return _ops.submit("allreduce", name, src, out, finish=lambda o, i: out,
                       process_set=process_set, op=op, prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor, group=group, group_size=group_size)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`allreduce_async`: ``tensor`` receives the result and is returned."""
    code = _host_code(tensor)
    if code is not None:
        # A contiguous host tensor goes by address through the batch entry point, as a
        # batch of one: exporting it through DLPack (once as input, once as output) costs
        # more than the rest of the call, and per-tensor loops (a Horovod program's own
        # allreduce_async_ per gradient) make this call hundreds of times a step.
        return _ops.allreduce_host(name, tensor.data_ptr(), tensor.shape, code, tensor,
                                   lambda outputs: tensor, process_set, resolve_op(average, op),
                                   prescale_factor, postscale_factor)
    buf, copy_back = _target(tensor)

    def finish(outputs, ints):
        if copy_back is not None:
            copy_back()
        return tensor

    return _ops.submit("allreduce", name, buf, buf, finish=finish, process_set=process_set,
                       op=resolve_op(average, op), prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor)


def grouped_allreduce_named(tensors, average, name, op, prescale_factor, postscale_factor,
                            process_set, in_place, member_names=None):
    """The grouped allreduce behind the public forms; ``member_names`` (default
    ``<name>.<i>``) name the members, e.g. after the parameters whose gradients they are."""
    tensors = _as_list(tensors, "grouped_allreduce")
    op = resolve_op(average, op)
    # Every tensor is checked before any is enqueued (and submit_many enqueues all or none):
    # a half-enqueued group would never complete.
    if in_place:
        bufs, copy_backs, specs = _batch_targets(tensors)
    else:
        bufs = [_source(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        specs = _batch_specs(bufs)
    group = group_name("grouped_allreduce", name, process_set)
    if member_names is None:
        member_names = _member_names(group, len(tensors))
    if specs is None:
        return _per_tensor_allreduces(
            tensors, bufs, copy_backs if in_place else None, member_names, op, prescale_factor,
            postscale_factor, process_set, group=group, group_size=len(tensors), label=group)
    # One call enqueues every member, one handle waits for all (submit_many).
    addrs, shapes, dtypes, device = specs
    results = ()
    if in_place:
        def finish(outputs):
            for copy_back in copy_backs:
                copy_back()
            return list(tensors)

        outs = addrs
    elif device is not None:
        # Results PyTorch allocates (see _allreduce_into_new: no cudaFree per result).
        results = [torch.empty_like(b) for b in bufs]

        def finish(outputs):
            return list(results)

        outs = [r.data_ptr() for r in results]
    else:
        def finish(outputs):
            return [_wrap(o[0]) for o in outputs]

        outs = [0] * len(bufs)  # the core allocates each result
    return _ops.submit_many("allreduce", member_names, addrs, outs, shapes, dtypes,
                            keep=(tensors, bufs, results), finish=finish,
                            process_set=process_set, op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, group=group,
                            group_size=len(tensors), label=group, device=device,
                            source=bufs[0])


def batched_allreduce_async_(tensors, names, op, prescale_factor, postscale_factor, process_set):
    """In-place allreduces of many tensors with one call: independent operations (not a
    group: each runs as soon as every rank has it), one wake-up of the core's background
    thread and one :class:`~spark_dl.common.handles.BatchHandle` whose result is the
    list of tensors. What :class:`~spark_dl.torch.DistributedOptimizer` uses for the
    gradients of a step."""
    bufs, copy_backs, specs = _batch_targets(tensors)
    label = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})"
    if specs is None:
        return _per_tensor_allreduces(tensors, bufs, copy_backs, names, op, prescale_factor,
                                      postscale_factor, process_set, label=label)
    addrs, shapes, dtypes, device = specs

    def finish(outputs):
        for copy_back in copy_backs:
            copy_back()
        return tensors

    return _ops.submit_many("allreduce", names, addrs, addrs, shapes, dtypes,
                            keep=(tensors, bufs), finish=finish, process_set=process_set, op=op,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            label=label, device=device, source=bufs[0])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Reduces a list of tensors as one unit: negotiated together, reduced in one fused collective.

    The members are named ``<name>.<i>``. ``synchronize`` returns the list of results.
    """
    return grouped_allreduce_named(tensors, average, name, op, prescale_factor,
                                   postscale_factor, process_set, in_place=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`grouped_allreduce_async`: each tensor receives its result."""
    return grouped_allreduce_named(tensors, average, name, op, prescale_factor,
                                   postscale_factor, process_set, in_place=True)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Reduces a sparse COO tensor by gathering every rank's indices and values.

    Nothing is densified: two allgathers (``<name>.indices``, ``<name>.values``)
    carry each rank's nonzeros. The result is a coalesced sparse tensor
    (duplicate indices summed); with ``op=Average`` the values are divided by the
    set size. Only Sum and Average are defined for sparse tensors. Every rank's
    tensor must have the same shape, sparse and dense dimensions.

    Returns:
        A handle: ``handle()`` (Horovod's form), ``handle.wait()`` or
        ``synchronize(handle)`` return the result.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise InvalidArgumentError("sparse_allreduce_async needs a sparse COO tensor")
    if op not in (Average, Sum):
        raise InvalidArgumentError("sparse allreduce supports op=Average or op=Sum only")
    t = tensor.detach().coalesce()
    name = group_name("sparse_allreduce", name, process_set)
    # Rows of (nnz, sparse_dim) indices and (nnz, *dense) values concatenate along axis 0.
    h_idx = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices",
                            process_set=process_set)
    h_val = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)
    n = set_size(process_set)
    shape = t.shape

    def combine(results):
        indices, values = results
        if op == Average:
            values = values / n if values.is_floating_point() \
                else torch.div(values, n, rounding_mode="trunc")
        # Every rank sent valid coalesced indices: skip the invariant checks.
        return torch.sparse_coo_tensor(indices.t(), values, size=shape,
                                       check_invariants=False).coalesce()

    return CompositeHandle([h_idx, h_val], combine, name)


# ----------------------------------------------------------------------------- allgather, broadcast

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Concatenates every member's ``tensor`` along dimension 0 (first dimensions may differ)."""
    src = _source(tensor)
    return _ops.submit("allgather", name, src, finish=lambda o, i: _wrap(o[0]),
                       process_set=process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """:func:`allgather_async` of each tensor in a list; ``synchronize`` returns the list.

    The members are named ``<name>.<i>``.
    """
    tensors = _as_list(tensors, "grouped_allgather")
    sources = [_source(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    group = group_name("grouped_allgather", name, process_set)
    # Negotiated as one unit: every member is ready on every rank before any runs.
    handles = [_ops.submit("allgather", f"{group}.{i}", src, finish=lambda o, i: _wrap(o[0]),
                           process_set=process_set, group=group, group_size=len(sources))
               for i, src in enumerate(sources)]
    return CompositeHandle(handles, list, group)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying ``root_rank``'s ``tensor`` to every member; the result is a new tensor.

    ``root_rank`` is a global rank, a member of ``process_set`` (as in Horovod and
    ``torch.distributed``); another rank raises :class:`InvalidArgumentError` naming the
    set's ranks.
    """
    src = _source(tensor)
    out = torch.empty_like(src)
    return _ops.submit("broadcast", name, src, out, finish=lambda o, i: out,
                       process_set=process_set, root=root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast_async`: ``tensor`` receives the root's values."""
    buf, copy_back = _target(tensor)

    def finish(outputs, ints):
        if copy_back is not None:
            copy_back()
        return tensor

    return _ops.submit("broadcast", name, buf, buf, finish=finish, process_set=process_set,
                       root=root_rank)


# ----------------------------------------------------------------------------- alltoall, scatter

def _splits_list(splits, tensor, process_set):
    # The shared check sees a tensor's dtype through NumPy (floats stay floats), or its
    # values as Python numbers where NumPy has no such dtype (bfloat16).
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu()
        try:
            splits = splits.numpy()
        except TypeError:
            splits = splits.tolist()
    return alltoall_splits(splits, tensor.shape[0] if tensor.dim() else None,
                           set_size(process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[j]`` rows (dimension 0) of ``tensor`` to member j, receives theirs.

    Without ``splits`` the rows are divided evenly. ``synchronize`` returns
    ``(received tensor, received splits as an int32 tensor)``.

    Raises:
        InvalidArgumentError: bad splits (see :func:`~spark_dl.common.ops.alltoall_splits`),
            before anything is enqueued.
    """
    src = _source(tensor)
    split_list = _splits_list(splits, src, process_set)
    return _ops.submit("alltoall", name, src, splits=split_list, process_set=process_set,
                       finish=lambda o, i: (_wrap(o[0]), torch.tensor(list(i), dtype=torch.int32)))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over the set; this rank receives its slice of dimension 0.

    Rows are divided as evenly as possible, the first ``rows % size`` members
    getting one more.
    """
    src = _source(tensor)
    return _ops.submit("reducescatter", name, src, finish=lambda o, i: _wrap(o[0]),
                       process_set=process_set, op=resolve_op(None, op),
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """:func:`reducescatter_async` of each tensor in a list; ``synchronize`` returns the list."""
    tensors = _as_list(tensors, "grouped_reducescatter")
    sources = [_source(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    group = group_name("grouped_reducescatter", name, process_set)
    op = resolve_op(None, op)
    # Negotiated as one unit, as for grouped_allgather_async.
    handles = [_ops.submit("reducescatter", f"{group}.{i}", src, finish=lambda o, i: _wrap(o[0]),
                           process_set=process_set, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, group=group,
                           group_size=len(sources)) for i, src in enumerate(sources)]
    return CompositeHandle(handles, list, group)


# ----------------------------------------------------------------------------- control

def barrier(process_set=global_process_set, timeout=None):
    """Returns when every member of ``process_set`` has called barrier."""
    _ops.submit("barrier", None, None, process_set=process_set).wait(timeout)


def join(device=-1, process_set=global_process_set, timeout=None):
    """Marks this rank as out of data and waits for the others; returns the last rank to join.

    Until every rank has joined, the others' allreduces proceed with this rank
    contributing zeros. ``device`` is accepted for Horovod compatibility (CPU only).
    """
    h = _ops.submit("join", "join", None, process_set=process_set,
                    finish=lambda o, i: int(i[0]))
    return h.wait(timeout)
