"""DistributedOptimizer: averages gradients across ranks while the backward pass runs.

A hook on every parameter fires as soon as autograd has accumulated that
parameter's gradient and queues its in-place allreduce (``p.grad``). Queued
gradients are handed to the core together, in one call with one handle
(:func:`~spark_dl.torch._async_ops.batched_allreduce_async_`), when the last
expected gradient of the step arrives or when the queue holds
``_FLUSH_BYTES`` (25 MiB, DDP's bucket size: large models still overlap
communication with the rest of the backward pass, as DDP's buckets do);
``step()`` flushes what is left, waits, then runs the wrapped optimizer's
update. Per-tensor calls would each wake
the core's background thread, which then negotiates and runs the first few
gradients while the rest are still arriving (issue 18 measured that path
slower than not fusing at all). The core fuses each batch into one collective
and serves repeated steps from its response cache. Every rank names the
same gradients, so which rank flushes when does not matter for correctness:
the core negotiates by name.

Lifecycle of one parameter ``p`` between two steps (``backward_passes_per_step`` = k):

1. each backward pass accumulates into ``p.grad`` and decrements ``p``'s
   countdown; the k-th queues the allreduce (or, for a parameter in a group,
   counts towards its group, whose grouped allreduce starts with its last member);
   the queue is flushed as described above;
2. ``synchronize()`` starts what the hooks did not (parameters unused in this
   step get zero gradients, incomplete groups), waits for every allreduce,
   writes the results back into the gradients and resets the countdowns;
3. the wrapped optimizer's ``step()`` updates the parameters.
"""

import contextlib
import warnings
import weakref

import torch

from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.handles import synchronize as _wait
from spark_dl.common.ops import Average, resolve_op, set_size
from spark_dl.common.process_sets import global_process_set
from spark_dl.torch._async_ops import (batched_allreduce_async_, grouped_allreduce_named,
                                       sparse_allreduce_async)
from spark_dl.torch.compression import Compression

__all__ = ["DistributedOptimizer"]

# Queued gradient bytes that start a batch before the step's last gradient arrives: DDP's
# default bucket size (bucket_cap_mb=25). Smaller batches start communicating earlier in the
# backward pass, but every batch is one more negotiation cycle and one more collective whose
# waits compete with the backward pass for the cores (on a 2-core machine a 1 MiB threshold
# measured no faster: docs/benchmarks.md).
_FLUSH_BYTES = 25 << 20

_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def _sdl_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set):
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._sparse_layout = {}    # p -> (sparse_dim, dense_dim) once p had a sparse gradient
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step

        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _name_parameters(named_parameters, params)
        # Ordered (a list, not a set) so that every rank submits in the same order.
        self._requires_update = []
        seen = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._requires_update.append(p)
        self._groups = _form_groups(groups, self._requires_update)
        self._group_of = {}
        for k, members in enumerate(self._groups):
            for p in members:
                self._group_of[p] = k

        self._ungrouped = sum(1 for p in self._requires_update if p not in self._group_of)
        self._should_synchronize = True
        self._hook_handles = []
        self._active = False
        self._sdl_reset_step()

    def _sdl_reset_step(self):
        """Forgets the step in flight and decides, for the job's current membership,
        whether gradients are averaged at all. Called at construction and by an elastic
        reset (the handles of a step in flight died with the old runtime)."""
        self._delay = {p: self.backward_passes_per_step for p in self._requires_update}
        self._started = set()       # ungrouped parameters queued or reduced in this step
        self._queue = []            # (p, compression ctx, wire tensor) not yet handed over
        self._queue_bytes = 0
        self._batches = []          # (batch handle, [(p, ctx, wire)])
        self._handles = {}          # p -> (handle, compression ctx, wire tensor): sparse
        self._group_handles = {}    # group index -> (handle, [ctx], [wire tensor])
        self._group_ready = [0] * len(self._groups)
        self._touched = set()       # parameters whose hook ran since the last synchronize
        self._synchronized = False
        # One process (or a set this rank is not in) has nothing to average: step() is
        # the wrapped optimizer's step, as in Horovod (the hooks, once registered, stay
        # silent while inactive).
        ps = self.process_set
        in_set = ps is global_process_set or ps is None or ps.included()
        self._active = in_set and set_size(ps) > 1
        if self._active and not self._hook_handles:
            self._register_hooks()

    # ------------------------------------------------------------------ hooks

    def _register_hooks(self):
        ref = weakref.ref(self)
        for p in self._requires_update:
            # The newest DistributedOptimizer over a parameter owns its hook; an older
            # one that is not yet garbage-collected stays silent instead of reducing
            # the gradient a second time under the same name.
            p._sdl_hook_owner = ref
            hook = _make_hook(ref, p)
            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
            else:  # torch 2.0: a hook on the parameter's gradient accumulator node
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hook_handles.append(
                    acc.register_hook(lambda *unused, hook=hook, p=p: hook(p)))
                self._hook_handles.append(acc)  # keeps the node (and its hook) alive
        # The hooks must not outlive the optimizer: a later optimizer over the same
        # parameters would otherwise see every gradient reduced twice.
        weakref.finalize(self, _remove_hooks, self._hook_handles)

    def _grad_ready(self, p):
        if self._delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        if p.grad is not None and p.grad.requires_grad:
            raise AssertionError("DistributedOptimizer does not support gradients that require "
                                 "grad (backward(create_graph=True))")
        self._touched.add(p)
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        k = self._group_of.get(p)
        if k is None:
            self._queue_grad(p)
            if len(self._started) == self._ungrouped or self._queue_bytes >= _FLUSH_BYTES:
                self._flush()
            return
        self._group_ready[k] += 1
        if self._group_ready[k] == len(self._groups[k]):
            self._group_handles[k] = self._allreduce_group_async(k)

    # ------------------------------------------------------------------ allreduce

    def _scale_factors(self):
        # Average divides by the set size in the core after the postscale; splitting
        # the division around the reduction keeps fp16 sums from overflowing.
        if self._op == Average:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _dense_grad(self, p):
        """``p.grad`` ready for its allreduce: zeros when unused on this rank in this step
        (other ranks may have a gradient for it; an empty sparse tensor for a parameter
        known to have sparse gradients), densified with ``sparse_as_dense``."""
        if p.grad is None:
            layout = self._sparse_layout.get(p)
            if layout is None or self._sparse_as_dense:
                p.grad = torch.zeros_like(p)
            else:
                sparse_dim, dense_dim = layout
                p.grad = torch.sparse_coo_tensor(
                    torch.empty((sparse_dim, 0), dtype=torch.int64, device=p.device),
                    torch.empty((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype,
                                device=p.device), p.shape)
        elif p.grad.layout == torch.sparse_coo:
            self._sparse_layout[p] = (p.grad.sparse_dim(), p.grad.dense_dim())
            if self._sparse_as_dense:
                p.grad = p.grad.to_dense()
        return p.grad

    def _queue_grad(self, p):
        """Queues ``p``'s dense gradient for the next batch (a sparse one starts now)."""
        self._started.add(p)
        grad = self._dense_grad(p)
        if grad.layout != torch.strided:
            self._handles[p] = (sparse_allreduce_async(grad, name=self._parameter_names[p],
                                                       op=self._op, process_set=self.process_set),
                                None, None)
            return
        wire, ctx = self._compression.compress(grad)
        self._queue.append((p, ctx, wire))
        self._queue_bytes += wire.numel() * wire.element_size()

    def _flush(self):
        """Hands the queued gradients to the core: one call, one handle."""
        if not self._queue:
            return
        items, self._queue, self._queue_bytes = self._queue, [], 0
        pre, post = self._scale_factors()
        handle = batched_allreduce_async_(
            [wire for _, _, wire in items], [self._parameter_names[p] for p, _, _ in items],
            self._op, pre, post, self.process_set)
        self._batches.append((handle, items))

    def _allreduce_group_async(self, k):
        members = self._groups[k]
        wires, ctxs = [], []
        for p in members:
            grad = self._dense_grad(p)
            if grad.layout != torch.strided:
                raise InvalidArgumentError(
                    f"parameter '{self._parameter_names[p]}' has a sparse gradient; grouped "
                    "allreduce needs dense ones (pass sparse_as_dense=True)")
            wire, ctx = self._compression.compress(grad)
            wires.append(wire)
            ctxs.append(ctx)
        pre, post = self._scale_factors()
        # Members keep their parameters' names, so that errors name the parameter.
        handle = grouped_allreduce_named(
            wires, None, f"allreduce.group{k}.{self._parameter_names[members[0]]}", self._op,
            pre, post, self.process_set, in_place=True,
            member_names=[self._parameter_names[p] for p in members])
        self._group_ready[k] = 0
        return handle, ctxs, wires

    def synchronize(self):
        """Waits for every gradient allreduce of this step (starting the missing ones).

        After it, ``p.grad`` holds the averaged gradient. Call it explicitly to
        modify gradients (e.g. clip them) before ``step()``, and then call
        ``step()`` inside :meth:`skip_synchronize`.
        """
        if not self._active:
            self._synchronized = True
            return
        for p in self._requires_update:
            if p not in self._group_of and p not in self._started:
                self._queue_grad(p)
        self._flush()
        for k in range(len(self._groups)):
            if k not in self._group_handles:
                self._group_handles[k] = self._allreduce_group_async(k)
        # Wait for every handle even after a failure, so that nothing stays in flight,
        # then raise the first error (a mismatch names the parameter).
        error = None
        for handle, items in self._batches:
            try:
                _wait(handle)
                for p, ctx, wire in items:
                    self._store(p, wire, ctx, wire)
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        for p, (handle, ctx, wire) in self._handles.items():
            try:
                self._store(p, _wait(handle), ctx, wire)
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        for k, (handle, ctxs, wires) in self._group_handles.items():
            try:
                for p, result, ctx, wire in zip(self._groups[k], _wait(handle), ctxs, wires):
                    self._store(p, result, ctx, wire)
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        self._handles.clear()
        self._batches.clear()
        self._started.clear()
        self._group_handles.clear()
        self._touched.clear()
        self._group_ready = [0] * len(self._groups)
        for p in self._requires_update:
            self._delay[p] = self.backward_passes_per_step
        if error is not None:
            raise error
        self._synchronized = True

    def _store(self, p, result, ctx, wire):
        if wire is None:  # sparse allreduce returns a new sparse tensor
            p.grad = result
            return
        if wire is not p.grad:  # compressed (a copy): bring the result back
            p.grad.copy_(self._compression.decompress(result, ctx))
        layout = self._sparse_layout.get(p)
        if layout is not None:
            # sparse_as_dense reduced a sparse gradient as a dense one: hand it back in the
            # layout autograd gave it (as Horovod does), since the wrapped optimizer may need
            # it (SparseAdam). Rows that average to exactly zero are left out.
            p.grad = p.grad.to_sparse(layout[0])

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this context, ``step()`` does not synchronize (call :meth:`synchronize` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronizes the gradients (unless inside :meth:`skip_synchronize`), then steps."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    # The wrapped class's step already runs the step hooks (torch wraps each optimizer
    # class's step once). Marked as wrapped, so that load_state_dict, whose
    # _patch_step_function wraps the step of the instance's class, does not wrap this one
    # too: hooks would then fire twice, the outer pre-hook before synchronize().
    step.hooked = True

    def zero_grad(self, *args, **kwargs):
        """The wrapped optimizer's ``zero_grad``; refused while gradients are being reduced."""
        if self._handles or self._batches or self._queue or self._group_handles or self._touched:
            raise AssertionError(_ZERO_GRAD_RACE)
        return super().zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        """Changes how many backward passes accumulate locally before gradients are reduced."""
        if int(passes) < 1:
            raise InvalidArgumentError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = int(passes)
        for p in self._requires_update:
            self._delay[p] = self.backward_passes_per_step


def _make_hook(ref, p):
    def hook(*unused):
        opt = ref()
        if opt is not None and opt._active and getattr(p, "_sdl_hook_owner", None) is ref:
            opt._grad_ready(p)
    return hook


def _remove_hooks(handles):
    for h in handles:
        if hasattr(h, "remove"):
            h.remove()


def _name_parameters(named_parameters, params):
    """{parameter: allreduce name}, checking the names as Horovod does."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise InvalidArgumentError("named_parameters should be a sequence of tuples (name, "
                                   "parameter), usually produced by model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise InvalidArgumentError("Parameter names in named_parameters must be unique. "
                                   f"Found duplicates: {', '.join(dups)}")
    by_id = {id(p): f"allreduce.{n}" for n, p in named}
    unnamed = [id(p) for p in params if id(p) not in by_id]
    if unnamed:
        raise InvalidArgumentError("named_parameters was specified, but one or more model "
                                   f"parameters were not named. Python object ids: {unnamed}")
    return {p: by_id[id(p)] for p in params}


def _form_groups(groups, params):
    """The parameter groups reduced together: [] (every parameter alone) or lists of parameters."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, int):
        if groups < 0:
            raise InvalidArgumentError("groups should be a non-negative integer or a list of "
                                       "lists of torch.Tensor")
        # Contiguous runs of the parameter order: neighbours get their gradients close in time.
        n = min(groups, len(params))
        out, start = [], 0
        for k in range(n):
            stop = start + len(params) // n + (1 if k < len(params) % n else 0)
            out.append(params[start:stop])
            start = stop
        return [g for g in out if g]
    if not isinstance(groups, (list, tuple)):
        raise InvalidArgumentError("groups should be a non-negative integer or a list of lists "
                                   "of torch.Tensor")
    wanted = {id(p) for p in params}
    placed = set()
    out = []
    for group in groups:
        members = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise InvalidArgumentError("groups must contain only torch.Tensor objects")
            if id(p) not in wanted:
                continue  # not optimized here (or frozen): nothing to reduce
            if id(p) in placed:
                raise InvalidArgumentError("a parameter appears in more than one group")
            placed.add(id(p))
            members.append(p)
        if members:
            out.append(members)
    return out


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    The result is an instance of the wrapped optimizer's class (``isinstance``
    checks, ``state_dict()``, LR schedulers keep working) that shares its
    parameter groups and state with ``optimizer``.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``: names the allreduces
            (and the errors that mention them); every optimized parameter must be named.
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients
            travel as float16 and are restored after the reduction).
        backward_passes_per_step: backward passes accumulated locally before
            the gradients are reduced (gradient accumulation); ``step()`` after that many.
        op: ``Average`` (default) or ``Sum`` of the ranks' gradients.
        gradient_predivide_factor: with Average, divide by this before the
            reduction and by ``size / factor`` after it.
        num_groups: deprecated spelling of an integer ``groups``.
        groups: an integer n (split the parameters into n groups, each reduced
            as one grouped allreduce) or a list of lists of parameters.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as
            dense tensors (one allreduce instead of an allgather of indices and values),
            then turn the result back into a sparse gradient of the parameter's layout,
            as Horovod does, so ``torch.optim.SparseAdam`` works either way. Default
            False: reduced by allgather of their indices and values. A parameter unused
            on some rank in the very first step cannot be known to be sparse there (its
            zero gradient stays dense on that rank): use it on every rank in that step.
        process_set: the ranks whose gradients are averaged.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"optimizer must be a torch.optim.Optimizer, got "
                                   f"{type(optimizer).__name__}")
    op = resolve_op(None, op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidArgumentError("gradient_predivide_factor not supported with op != Average")
    if int(backward_passes_per_step) < 1:
        raise InvalidArgumentError("backward_passes_per_step must be >= 1")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=<int> instead", DeprecationWarning,
                      stacklevel=2)
        if groups is None:
            groups = num_groups
    base = type(optimizer)
    if isinstance(optimizer, _DistributedOptimizer):
        raise InvalidArgumentError("optimizer is already a DistributedOptimizer")
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    # A new instance over the same attributes: param_groups and state are shared, not
    # rebuilt, so hyperparameters, loaded state and custom constructors all carry over.
    # Attributes that bind methods to the old instance (an LR scheduler's step counter
    # wrapper) are left behind.
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in ("step", "zero_grad")})
    wrapped._sdl_setup(named_parameters, compression, int(backward_passes_per_step), op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped
