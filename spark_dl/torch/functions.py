"""Making ranks agree: broadcast of parameters, optimizer state and Python objects.

``broadcast_object`` and ``allgather_object`` are the framework-neutral ones of
:mod:`spark_dl.common.objects`. Every function here is collective: every member of
``process_set`` must call it, in the same order as its other collectives.
"""

import collections
import warnings

import torch

from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.handles import synchronize
from spark_dl.common.objects import allgather_object, broadcast_object
from spark_dl.common.basics import rank as _global_rank
from spark_dl.common.ops import root_index
from spark_dl.common.process_sets import ProcessSet, global_process_set
from spark_dl.torch._async_ops import broadcast_async_

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites every rank's parameters with ``root_rank``'s, in place.

    Typically called once after building the model (and after loading a
    checkpoint on the root only)::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    Args:
        params: a dict of name -> tensor (``model.state_dict()``), or a list
            (or other iterable) of tensors or of ``(name, tensor)`` pairs
            (``model.named_parameters()``).
        root_rank: the global rank whose values win (a member of ``process_set``).
        process_set: the ranks taking part.

    Raises:
        ValueError: ``params`` is of another type, or holds something that is not a tensor.
    """
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise InvalidArgumentError(f"invalid params of type {type(params).__name__}: pass a "
                                   "state_dict, named_parameters() or a list of tensors")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(f"broadcast_parameters: '{name}' is a "
                                       f"{type(p).__name__}, not a tensor")
    # Start every broadcast before waiting for any, so they are negotiated together.
    handles = [broadcast_async_(p, root_rank, None if name is None else f"broadcast.{name}",
                                process_set) for name, p in items]
    for h in handles:
        synchronize(h)


def _split_tensors(obj, tensors):
    """``obj`` with every tensor replaced by its index in ``tensors`` (appended to it)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    return _map_children(obj, lambda v: _split_tensors(v, tensors))


def _join_tensors(obj, tensors):
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    return _map_children(obj, lambda v: _join_tensors(v, tensors))


def _map_children(obj, fn):
    """A dict, list or tuple with ``fn`` applied to each value; other objects unchanged."""
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = fn(v)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    return obj


class _TensorSlot:
    """Where a tensor sat in a broadcast structure: its index, shape, dtype and kind of
    device ("cpu", "cuda": each rank receives on its own device of that kind)."""

    __slots__ = ("index", "shape", "dtype", "device")

    def __init__(self, index, shape, dtype, device="cpu"):
        self.index, self.shape, self.dtype, self.device = index, shape, dtype, device

    def __getstate__(self):
        return (self.index, self.shape, self.dtype, self.device)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype, self.device = state


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Works for any ``torch.optim.Optimizer`` (including a
    :class:`~spark_dl.torch.optimizer.DistributedOptimizer`), whatever its state
    holds: the structure of the root's ``state_dict()`` travels as one pickled
    object and its tensors by in-place broadcast. Ranks whose state is still
    empty receive the root's.

    As in Horovod, a root whose state is still empty (a new optimizer) first
    creates it with one step on zero gradients (for parameters whose ``.grad`` is
    None too), so every rank starts from the same materialized state (Adam's
    ``step`` is then 1, as in Horovod). Unlike Horovod, that step leaves the
    parameters and gradients as they were (a weight decay would otherwise move
    them). An optimizer whose ``step`` needs a closure (LBFGS) keeps its empty state.

    The model's parameters are not touched: call :func:`broadcast_parameters` for them.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        root_rank: the global rank whose state wins (a member of ``process_set``).
        model: optional, as in Horovod: its ``nn.Embedding(sparse=True)`` parameters get
            sparse zero gradients in the step that creates the state (SparseAdam's
            parameters always do).
        process_set: the ranks taking part (a :class:`ProcessSet` passed third, in
            place of ``model``, is taken as the process set).
    """
    if isinstance(model, ProcessSet):  # the earlier signature (optimizer, root_rank, process_set)
        model, process_set = None, model
    root_index(root_rank, process_set)  # checked on every rank before anything is sent
    is_root = _global_rank() == root_rank
    if is_root and not optimizer.state and not isinstance(optimizer, torch.optim.LBFGS):
        _materialize_state(optimizer, model)
    state = optimizer.state_dict()
    tensors = []
    skeleton = _split_tensors(state, tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.structure",
                                process_set=process_set)
    if not is_root:
        tensors = []
        _collect_slots(skeleton, tensors)
        # On the root's kind of device (Adam's moments sit with CUDA parameters, a
        # non-capturable step on the CPU): CUDA on this rank's parameters' GPU.
        cuda = _cuda_device_of(optimizer)
        tensors = [torch.empty(slot.shape, dtype=slot.dtype,
                               device=cuda if slot.device == "cuda" else "cpu")
                   for slot in tensors]
    handles = [broadcast_async_(t, root_rank, f"broadcast_optimizer_state.{i}", process_set)
               for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if not is_root:
        optimizer.load_state_dict(_join_tensors(skeleton, tensors))


def _cuda_device_of(optimizer):
    """The GPU of the optimizer's first CUDA parameter, else the current CUDA device, else
    None (a rank without CUDA: a CUDA slot of the root then fails in the core, naming the
    devices)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_cuda:
                return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _collect_slots(obj, out):
    """Appends every _TensorSlot of a structure to ``out``, ordered by index."""
    found = []

    def walk(o):
        if isinstance(o, _TensorSlot):
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    out.extend(sorted(found, key=lambda s: s.index))


def _materialize_state(optimizer, model):
    """One step of ``optimizer``'s own update on zero gradients, creating its state;
    parameters and gradients are restored afterwards."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if isinstance(p, torch.Tensor) and p.requires_grad]
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
            p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's step() would allreduce, which only this rank runs:
    # take the wrapped optimizer's step.
    from spark_dl.torch.optimizer import _DistributedOptimizer

    step = super(_DistributedOptimizer, optimizer).step \
        if isinstance(optimizer, _DistributedOptimizer) else optimizer.step
    try:
        with torch.no_grad():
            step()
    except Exception as e:  # noqa: BLE001 - e.g. LBFGS needs a closure: keep the empty state
        optimizer.state.clear()
        warnings.warn(f"broadcast_optimizer_state: could not create the state of "
                      f"{type(optimizer).__name__} with a zero-gradient step ({e}); broadcasting "
                      "its empty state", stacklevel=3)
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                p.grad = grad
