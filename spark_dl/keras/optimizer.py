"""DistributedOptimizer for Keras 3: any Keras optimizer, gradients averaged across ranks.

How it plugs in: the wrapper is an instance of a subclass of the wrapped optimizer's own
class (same name and module, so ``model.save()`` writes the plain optimizer and any Keras
can load it). The subclass overrides one step of Keras's ``apply``: the clipping that
runs right before the update (``_clip_gradients``). Keras calls it only when the
variables are about to change, which gives the right place for both cases:

- every step (``backward_passes_per_step=1``): the gradients are allreduced, then
  clipped, then applied, so clipping sees the global gradient;
- with ``backward_passes_per_step=k``: Keras's own gradient accumulation
  (``gradient_accumulation_steps=k``) sums k steps locally in its accumulators and only
  the k-th step reaches the clipping, so one allreduce per k steps travels.

All gradients of a step travel as one grouped allreduce: on TensorFlow one op in the
compiled train function, on torch one grouped call. Variables registered as local
(:func:`PartialDistributedOptimizer`, ``register_local_var``) keep their own gradient.

``optimizer.iterations`` counts backward passes, as Horovod's does: with
``backward_passes_per_step=k`` it grows by k per update (Keras alone counts updates there).
Inside the update itself (Adam's bias correction, for instance) Keras's update count is
what the optimizer sees, so the arithmetic of an update is Keras's.
"""

import keras

from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.ops import Average, resolve_op, set_size
from spark_dl.common.process_sets import global_process_set
from spark_dl.keras import _backend
from spark_dl.keras.compression import Compression

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "is_distributed",
           "wrap_in_place"]

_classes = {}  # wrapped optimizer class -> its distributed subclass


class _Untracked:
    """Holds variables and layers out of sight of Keras's and TensorFlow's attribute
    tracking: a list of them set on the optimizer would become optimizer state (saved
    with it, counted in ``optimizer.variables``)."""

    def __init__(self, items=()):
        self.items = list(items)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    _sdl_distributed = True

    def _sdl_setup(self, name, compression, sparse_as_dense, backward_passes_per_step,
                   average_aggregated_gradients, gradient_predivide_factor, op, process_set,
                   scale_local_gradients=True):
        op = resolve_op(None, op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average")
        self._sdl_name = name or "DistributedOptimizer"
        self._sdl_compression = compression
        self._sdl_sparse_as_dense = bool(sparse_as_dense)
        self._sdl_bpps = int(backward_passes_per_step)
        self._sdl_average_aggregated = bool(average_aggregated_gradients)
        self._sdl_predivide = float(gradient_predivide_factor)
        self._sdl_op = op
        self._sdl_process_set = process_set
        self._sdl_active = None  # decided on first use (init() may come after wrapping)
        self._sdl_scale_local = bool(scale_local_gradients)
        self._sdl_local_vars = _Untracked()    # registered with register_local_var
        self._sdl_local_layers = _Untracked()  # their trainable weights are local
        self._sdl_vars = _Untracked()          # the variables of the update being applied
        self._sdl_in_apply = False

    @property
    def iterations(self):
        # Horovod counts backward passes; Keras, with gradient accumulation, updates. Inside
        # an update Keras's own count is kept (its optimizers' arithmetic depends on it).
        if getattr(self, "_sdl_bpps", 1) > 1 and not getattr(self, "_sdl_in_apply", False):
            return self._iterations
        return super().iterations

    def register_local_var(self, var):
        """Keeps ``var``'s gradient on this rank: not allreduced, only divided by the process
        set's size when ``scale_local_gradients`` (Horovod's ``register_local_var``)."""
        self._sdl_local_vars.items.append(var)

    def _sdl_local_ids(self):
        local = list(self._sdl_local_vars.items)
        for layer in self._sdl_local_layers.items:
            local += list(layer.trainable_weights)
        return {id(v) for v in local}

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Every backend's apply passes through here with the variables in the gradients'
        # order; _clip_gradients below needs them to tell local variables apart.
        self._sdl_vars.items, self._sdl_in_apply = list(trainable_variables), True
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            self._sdl_vars.items, self._sdl_in_apply = [], False

    def _sdl_reset_step(self):
        """Forgets what was decided for the job's old membership (an elastic reset: the
        size may differ now); the next trace or step decides again."""
        self._sdl_active = None

    def _sdl_is_active(self):
        if self._sdl_active is None:
            ps = self._sdl_process_set
            in_set = ps is global_process_set or ps is None or ps.included()
            self._sdl_active = in_set and set_size(ps) > 1
        return self._sdl_active

    def _sdl_scale_factors(self):
        pre, post = 1.0, 1.0
        if self._sdl_op == Average:
            # Average divides by the set size in the core after the postscale; splitting
            # the division around the reduction keeps fp16 sums from overflowing.
            pre, post = 1.0 / self._sdl_predivide, self._sdl_predivide
        if self._sdl_bpps > 1 and not self._sdl_average_aggregated:
            # Keras's accumulation averages the k local steps; Horovod's default sums them.
            post *= self._sdl_bpps
        return pre, post

    def _sdl_allreduce(self, grads):
        """Returns ``grads`` reduced over the process set (None entries stay None)."""
        if not self._sdl_is_active():
            return grads
        grads = list(grads)
        out = list(grads)
        pre, post = self._sdl_scale_factors()
        dense_at, sparse_at = [], []
        current = self._sdl_vars.items
        local_ids = self._sdl_local_ids() if len(current) == len(grads) else set()
        for i, g in enumerate(grads):
            if g is None:
                continue
            if local_ids and id(current[i]) in local_ids:
                out[i] = self._sdl_local_gradient(g)
                continue
            if _backend.is_sparse(g):
                if self._sdl_sparse_as_dense:
                    grads[i] = keras.ops.convert_to_tensor(g)
                    dense_at.append(i)
                else:
                    sparse_at.append(i)
            else:
                dense_at.append(i)
        if dense_at:
            pairs = [self._sdl_compression.compress(grads[i]) for i in dense_at]
            reduced = _backend.grouped_allreduce([p[0] for p in pairs], self._sdl_op, pre, post,
                                                 f"{self._sdl_name}.gradients",
                                                 self._sdl_process_set)
            for i, r, p in zip(dense_at, reduced, pairs):
                out[i] = self._sdl_compression.decompress(r, p[1])
        for i in sparse_at:
            reduced = _backend.allreduce(grads[i], name=f"{self._sdl_name}.sparse.{i}",
                                         op=self._sdl_op, process_set=self._sdl_process_set)
            out[i] = reduced * post * pre if (pre, post) != (1.0, 1.0) else reduced
        return out

    def _sdl_local_gradient(self, g):
        """A local variable's gradient: its own, scaled as the reduced ones are around the
        reduction, divided by the set size when ``scale_local_gradients`` (as Horovod)."""
        factor = 1.0
        if self._sdl_scale_local:
            factor /= set_size(self._sdl_process_set)
        if self._sdl_bpps > 1 and not self._sdl_average_aggregated:
            factor *= self._sdl_bpps
        if factor == 1.0:
            return g
        if _backend.is_sparse(g):
            import tensorflow as tf
            return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
        return g * factor

    def _clip_gradients(self, grads):
        # Keras calls this once per update, right before applying (see the module doc).
        return super()._clip_gradients(self._sdl_allreduce(grads))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise InvalidArgumentError(
            "spark_dl.keras.DistributedOptimizer cannot run in a stateless (jax) train step; "
            "use KERAS_BACKEND=tensorflow or torch")


def _distributed_class(base):
    cls = _classes.get(base)
    if cls is None:
        # The same name and module as the wrapped class: saving writes the plain optimizer.
        cls = type(base.__name__, (_DistributedOptimizer, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        # Saved under the wrapped class's names: its public ``keras.optimizers.*`` name for
        # Keras's own optimizers, its registered name for a registered custom one. (Keras
        # internals, pinned by constraints.txt; without them saving still works, under the
        # wrapped class's module path.)
        try:
            from keras.src import api_export
            from keras.src.saving import object_registration as reg
        except ImportError:  # pragma: no cover
            pass
        else:
            public = api_export.REGISTERED_OBJS_TO_NAMES.get(base)
            if public is not None:
                api_export.REGISTERED_OBJS_TO_NAMES[cls] = public
            if base in reg.GLOBAL_CUSTOM_NAMES:
                reg.GLOBAL_CUSTOM_NAMES[cls] = reg.GLOBAL_CUSTOM_NAMES[base]
        _classes[base] = cls
    return cls


def is_distributed(optimizer):
    """True when ``optimizer`` was wrapped by :func:`DistributedOptimizer`."""
    return getattr(optimizer, "_sdl_distributed", False)


def _check_args(optimizer, backward_passes_per_step, compression):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps a Keras 3 optimizer instance (keras.optimizers.*), got "
            f"{type(optimizer).__name__}; for tf.GradientTape loops use "
            f"spark_dl.tensorflow.DistributedGradientTape")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise InvalidArgumentError(
            "wrap the inner optimizer, not the LossScaleOptimizer: "
            "LossScaleOptimizer(DistributedOptimizer(opt))")
    if is_distributed(optimizer):
        raise InvalidArgumentError("this optimizer is already a DistributedOptimizer")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise InvalidArgumentError(
            f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise InvalidArgumentError(
            f"compression must be a compressor such as spark_dl.keras.Compression.fp16, got "
            f"{compression!r}")
    _backend.require_supported("DistributedOptimizer")


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Returns a copy of ``optimizer`` that averages gradients across ranks before applying.

    The result is still an instance of the optimizer's class (a ``keras.optimizers.Optimizer``),
    so it goes into ``model.compile(optimizer=...)`` and ``model.save()`` as usual.

    Args:
        optimizer: any Keras 3 optimizer instance (state it already has is copied).
        name: prefix of the allreduce names (equal on every rank).
        compression: ``Compression.fp16`` sends float gradients as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors instead of
            gathering their rows.
        gradient_predivide_factor: with op=Average, divide by this before the sum and by
            ``size / factor`` after it.
        op: Average (default) or Sum.
        backward_passes_per_step: k > 1 accumulates k steps of gradients locally (Keras's
            ``gradient_accumulation_steps``) and allreduces and applies on every k-th step.
        average_aggregated_gradients: with k > 1, apply the mean of the k local steps
            instead of their sum (Horovod's default is the sum).
        process_set: average over this process set only.
        scale_local_gradients: divide the gradients of local variables
            (``register_local_var``, :func:`PartialDistributedOptimizer`) by the process set's
            size, as Horovod does.
        device_dense, device_sparse, num_groups, groups: accepted for Horovod
            compatibility; all gradients travel as one group.

    Raises:
        InvalidArgumentError: not a Keras optimizer, a bad argument, or a jax backend.
    """
    _check_args(optimizer, backward_passes_per_step, compression)
    config = optimizer.get_config()
    own = config.get("gradient_accumulation_steps")
    if backward_passes_per_step > 1:
        if own and own != backward_passes_per_step:
            raise InvalidArgumentError(
                f"the optimizer has gradient_accumulation_steps={own} but "
                f"backward_passes_per_step={backward_passes_per_step}; give only one")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped._sdl_setup(name, compression, sparse_as_dense, backward_passes_per_step,
                       average_aggregated_gradients, gradient_predivide_factor, op, process_set,
                       scale_local_gradients)
    if optimizer.built:
        # Carry the state over: same variables, same slot values and iteration count.
        wrapped.build(optimizer._trainable_variables)
        for mine, theirs in zip(wrapped.variables, optimizer.variables):
            mine.assign(theirs)
    return wrapped


def wrap_in_place(optimizer, **kwargs):
    """Turns a Keras optimizer *instance* into a DistributedOptimizer, keeping its state
    (used by :func:`spark_dl.keras.load_model` on the optimizer Keras restored)."""
    _check_args(optimizer, kwargs.get("backward_passes_per_step", 1),
                kwargs.get("compression", Compression.none))
    optimizer.__class__ = _distributed_class(type(optimizer))
    defaults = dict(name=None, compression=Compression.none, sparse_as_dense=False,
                    backward_passes_per_step=optimizer.gradient_accumulation_steps or 1,
                    average_aggregated_gradients=True, gradient_predivide_factor=1.0,
                    op=Average, process_set=global_process_set)
    defaults.update(kwargs)
    optimizer._sdl_setup(**defaults)
    return optimizer


def PartialDistributedOptimizer(optimizer, name=None, device_dense="",  # noqa: N802
                                device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """:func:`DistributedOptimizer` whose ``local_layers`` keep their own gradients.

    The trainable weights of every layer in ``local_layers`` are updated with this rank's
    gradient (divided by the process set's size when ``scale_local_gradients``, as in
    Horovod); all other gradients are averaged across ranks. The layers are read when an
    update runs, so they may still be unbuilt here.

    Raises:
        InvalidArgumentError: a ``local_layers`` entry is not a Keras layer, or as
            :func:`DistributedOptimizer`.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(layer).__name__ for layer in local_layers
           if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise InvalidArgumentError(f"local_layers must be Keras layers, got {bad}")
    opt = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    opt._sdl_local_layers = _Untracked(local_layers)
    return opt
