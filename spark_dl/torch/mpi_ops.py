"""Horovod's ``horovod.torch.mpi_ops`` surface: topology, collectives and their autograd.

The blocking collectives that return a new tensor (``allreduce``,
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``,
``alltoall``, ``reducescatter``, ``grouped_reducescatter``) are autograd
functions: when their input requires grad, ``backward`` runs the adjoint
collective on every member of the process set, so every member must run the
backward pass. The gradients follow Horovod's conventions (the loss is taken
as averaged over the set's ranks; docs/torch.md has the table):

* ``allreduce`` (Sum, Average): the same reduction, scale factors included, of
  the output gradients;
* ``broadcast``: the set-average of the output gradients on the root, zeros elsewhere;
* ``allgather`` / ``grouped_allgather``: this rank's rows of the set-average
  of the output gradients;
* ``reducescatter`` / ``grouped_reducescatter``: the allgather of the output
  gradients, times the set size for Sum, times the pre- and post-scale factors;
* ``alltoall``: the output gradients sent back where their rows came from.

The in-place forms (``allreduce_``, ``broadcast_``, ...) and the ``*_async``
forms do not record autograd history, as in Horovod.
"""


import torch

from spark_dl.common.basics import (  # noqa: F401 - re-exported
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline)
from spark_dl.common.handles import poll, synchronize  # noqa: F401 - re-exported
from spark_dl.common.ops import (  # noqa: F401 - re-exported
    Adasum, Average, Max, Min, Product, Sum, resolve_op, set_rank, set_size)
from spark_dl.common.process_sets import (  # noqa: F401 - re-exported
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from spark_dl.torch._async_ops import (  # noqa: F401 - re-exported
    allgather_async, allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_async,
    broadcast_async_, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter_async, join, reducescatter_async, sparse_allreduce_async)
from spark_dl.torch.compression import Compression

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
]

def _grad_name(name, suffix="grad"):
    """The name of a backward collective: derived from the forward's name when it has one."""
    return None if name is None else f"{name}.{suffix}"


# ----------------------------------------------------------------------------- allreduce

def _reduce_grads(grads, inputs, outputs, op, prescale, postscale, name, process_set):
    """Gradients of (grouped) allreduce, for the sum of every rank's loss.

    Sum/Average: the same reduction applied to the incoming gradients. Min/Max:
    the summed gradient flows to the rank(s) whose value was selected.
    Product: the summed gradient times ``result / input``.
    """
    grads = [g.contiguous() for g in grads]
    if op in (Sum, Average):
        return synchronize(grouped_allreduce_async(
            grads, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=process_set))
    summed = synchronize(grouped_allreduce_async(grads, name=name, op=Sum,
                                                 process_set=process_set))
    out = []
    for g, x, y in zip(summed, inputs, outputs):
        if op == Product:
            out.append(g * y / x)
        else:
            picked = (x == y) if prescale == 1.0 and postscale == 1.0 \
                else torch.isclose(x * prescale * postscale, y)
            out.append(g * prescale * postscale * picked)
    return out


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        result = synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                             process_set))
        ctx.args = (op, prescale, postscale, name, process_set)
        if op not in (Sum, Average):
            ctx.save_for_backward(tensor, result)
        return result

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, name, process_set = ctx.args
        x, y = ctx.saved_tensors if op not in (Sum, Average) else (None, None)
        g, = _reduce_grads([grad], [x], [y], op, prescale, postscale, _grad_name(name),
                           process_set)
        return g, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        results = synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale,
                                                      postscale, process_set))
        ctx.args = (op, prescale, postscale, name, process_set, len(tensors))
        if op not in (Sum, Average):
            ctx.save_for_backward(*tensors, *results)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, name, process_set, n = ctx.args
        saved = ctx.saved_tensors if op not in (Sum, Average) else (None,) * (2 * n)
        out = _reduce_grads(grads, saved[:n], saved[n:], op, prescale, postscale,
                            _grad_name(name), process_set)
        return (None,) * 5 + tuple(out)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` over ``process_set`` and returns the result (a new tensor).

    Differentiable: the gradient is the same reduction of the incoming gradients
    (Sum, Average), or routed to the selected rank (Min, Max). See
    :func:`~spark_dl.torch.mpi_ops.allreduce_async` for the arguments;
    ``compression`` (e.g. ``Compression.fp16``) applies on the wire.
    """
    op = resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor,
                               process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` in place and returns it (no autograd)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces a list of tensors as one fused unit; returns the list of results (differentiable)."""
    op = resolve_op(average, op)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set,
                                      *[p[0] for p in pairs])
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Reduces every tensor of the list in place, as one fused unit; returns the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ----------------------------------------------------------------------------- allgather

def _offsets(first_dims, name, process_set):
    """Offsets of this rank's rows in each gathered tensor (one allgather of all first dims)."""
    mine = torch.tensor([first_dims], dtype=torch.int64)
    every = synchronize(allgather_async(mine, name=name, process_set=process_set))
    return every[:set_rank(process_set)].sum(dim=0).tolist()


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.args = (tensor.shape[0] if tensor.dim() else 0, name, process_set)
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        rows, name, process_set = ctx.args
        averaged = synchronize(allreduce_async(grad.contiguous(), name=_grad_name(name),
                                               op=Average, process_set=process_set))
        offset, = _offsets([rows], _grad_name(name, "grad.rows"), process_set)
        return averaged.narrow(0, offset, rows), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = ([t.shape[0] if t.dim() else 0 for t in tensors], name, process_set)
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        rows, name, process_set = ctx.args
        averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads],
                                                       name=_grad_name(name), op=Average,
                                                       process_set=process_set))
        offsets = _offsets(rows, _grad_name(name, "grad.rows"), process_set)
        return (None, None) + tuple(a.narrow(0, o, r) for a, o, r in zip(averaged, offsets, rows))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every member's ``tensor`` along dimension 0 (differentiable: the
    gradient is this rank's rows of the set-average of the output gradients).

    First dimensions may differ between ranks; the other dimensions and the
    dtype must match.
    """
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of each tensor of a list; returns the list (differentiable)."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ----------------------------------------------------------------------------- broadcast

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, name, process_set = ctx.args
        averaged = synchronize(allreduce_async(grad.contiguous(), name=_grad_name(name),
                                               op=Average, process_set=process_set))
        if rank() != root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every member (a new tensor; differentiable:
    the root receives the set-average of the output gradients, the others zeros).

    ``root_rank`` is a global rank, a member of ``process_set`` (as in Horovod).
    """
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites ``tensor`` with ``root_rank``'s values and returns it (no autograd)."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------------- alltoall

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.args = (received, name, process_set)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        received, name, process_set = ctx.args
        back, _ = synchronize(alltoall_async(grad.contiguous(), received, _grad_name(name),
                                             process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[j]`` rows of ``tensor`` to member j and returns what arrived (differentiable).

    Returns:
        The received rows, concatenated in rank order, when ``splits`` is None;
        otherwise ``(received tensor, received splits)``, as Horovod.
    """
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# ----------------------------------------------------------------------------- reducescatter

def _scatter_grads(grads, op, prescale, postscale, name, process_set):
    if op not in (Sum, Average):
        raise NotImplementedError("reducescatter has gradients for op=Sum and op=Average only")
    gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], name=name,
                                                   process_set=process_set))
    # Horovod's convention: Sum's gradient is scaled by the set size, Average's is not.
    factor = prescale * postscale * (set_size(process_set) if op == Sum else 1)
    return [g * factor if factor != 1.0 else g for g in gathered]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, process_set, prescale, postscale):
        ctx.args = (op, prescale, postscale, name, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, name, process_set = ctx.args
        g, = _scatter_grads([grad], op, prescale, postscale, _grad_name(name), process_set)
        return g, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, process_set, prescale, postscale, *tensors):
        ctx.args = (op, prescale, postscale, name, process_set)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, name, process_set = ctx.args
        return (None,) * 5 + tuple(_scatter_grads(grads, op, prescale, postscale,
                                                  _grad_name(name), process_set))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over the set; returns this rank's slice of dimension 0.

    Rows are divided as evenly as possible, the first ``rows % size`` ranks getting one more.
    Differentiable (op Sum or Average): the gradient is the allgather of the output
    gradients, times the set size for Sum, times ``prescale_factor * postscale_factor``.
    """
    op = resolve_op(None, op)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, op, name, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """:func:`reducescatter` of each tensor of a list; returns the list (differentiable)."""
    op = resolve_op(None, op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(op, name, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
