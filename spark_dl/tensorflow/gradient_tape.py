"""DistributedGradientTape: a ``tf.GradientTape`` whose ``gradient()`` averages across ranks."""

import tensorflow as tf

from spark_dl.common.ops import Average, resolve_op, set_size
from spark_dl.common.process_sets import global_process_set
from spark_dl.tensorflow.compression import Compression
from spark_dl.tensorflow.errors import InvalidArgumentError
from spark_dl.tensorflow.mpi_ops import allreduce, grouped_allreduce

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "allreduce_gradients"]


def _scale_factors(op, predivide):
    # Average divides by the set size in the core after the postscale; splitting the
    # division around the reduction keeps fp16 sums from overflowing.
    if op == Average:
        return 1.0 / predivide, predivide
    return 1.0, 1.0


def allreduce_gradients(grads, compression=Compression.none, sparse_as_dense=False, op=Average,
                        gradient_predivide_factor=1.0, process_set=global_process_set,
                        name="gradients"):
    """Reduces a list of gradients (None entries stay None) in one grouped op.

    Dense gradients travel together as one grouped allreduce; ``tf.IndexedSlices`` are
    gathered (or made dense first with ``sparse_as_dense``).
    """
    op = resolve_op(None, op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidArgumentError("gradient_predivide_factor needs op=Average")
    pre, post = _scale_factors(op, float(gradient_predivide_factor))
    grads = list(grads)
    dense_at, sparse_at = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                grads[i] = tf.convert_to_tensor(g)
                dense_at.append(i)
            else:
                sparse_at.append(i)
        else:
            dense_at.append(i)
    out = list(grads)
    if dense_at:
        reduced = grouped_allreduce([grads[i] for i in dense_at], op=op, compression=compression,
                                    prescale_factor=pre, postscale_factor=post,
                                    process_set=process_set, name=name)
        for i, r in zip(dense_at, reduced):
            out[i] = r
    for i in sparse_at:
        out[i] = allreduce(grads[i], op=op, name=f"{name}.sparse.{i}", process_set=process_set)
    return out


class DistributedGradientTape(tf.GradientTape):
    """Wraps a finished ``tf.GradientTape``: ``gradient()`` returns rank-averaged gradients.

    ::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = sdl.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    All gradients of one ``gradient()`` call travel as one grouped allreduce (one op).
    Horovod's ``device_dense``, ``device_sparse``, ``num_groups`` and ``groups`` are
    accepted and ignored: the core fuses the whole group anyway.

    Sources registered with :meth:`register_local_source` keep this rank's gradient
    (divided by the process set's size when ``scale_local_gradients``, as in Horovod).
    """

    def __init__(self, gradtape, device_dense="", device_sparse="",  # noqa: D107
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, name="DistributedGradientTape",
                 scale_local_gradients=True):
        if not isinstance(gradtape, tf.GradientTape):
            raise InvalidArgumentError(
                f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        # Take over the wrapped tape's state (its recorded operations) rather than
        # starting a new one; the wrapped tape must not be used afterwards.
        self.__dict__.update(gradtape.__dict__)
        self._sdl_args = dict(compression=compression, sparse_as_dense=sparse_as_dense,
                              op=resolve_op(None, op),
                              gradient_predivide_factor=gradient_predivide_factor,
                              process_set=process_set, name=name)
        ps = process_set
        self._sdl_active = (ps is global_process_set or ps.included()) and set_size(ps) > 1
        self._sdl_process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._sdl_local = {}  # id -> source: kept alive so that the ids stay theirs

    def register_local_source(self, source):
        """Keeps the gradient of ``source`` (a variable or watched tensor) on this rank:
        not allreduced, only divided by the process set's size when
        ``scale_local_gradients`` (Horovod's ``register_local_source``)."""
        self._sdl_local[id(source)] = source

    def _is_local(self, source):
        return id(source) in self._sdl_local

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        if not self._sdl_active:
            return grads
        flat = tf.nest.flatten(grads, expand_composites=False)
        if not self._sdl_local:
            return tf.nest.pack_sequence_as(grads, allreduce_gradients(flat, **self._sdl_args))
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        local = [self._is_local(s) for s in flat_sources]
        reduced = iter(allreduce_gradients([g for g, is_local in zip(flat, local)
                                            if not is_local], **self._sdl_args))
        out = []
        for g, is_local in zip(flat, local):
            if not is_local:
                out.append(next(reduced))
            elif g is None or not self.scale_local_gradients:
                out.append(g)
            else:
                out.append(_scaled(g, 1.0 / set_size(self._sdl_process_set)))
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """Horovod's split of :meth:`gradient`: ``(local pairs, global pairs)``, each a
        list of ``(source, gradient)`` in the order of ``sources``."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        local = [(s, g) for s, g in zip(sources, grads) if self._is_local(s)]
        shared = [(s, g) for s, g in zip(sources, grads) if not self._is_local(s)]
        return local, shared


def _scaled(g, factor):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """:class:`DistributedGradientTape` whose ``local_layers`` keep their own gradients.

    The trainable weights of each Keras layer in ``local_layers`` (built by now: the tape
    has recorded them) are registered with :meth:`DistributedGradientTape.register_local_source`.
    """
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(layer).__name__ for layer in local_layers
           if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise InvalidArgumentError(f"local_layers must be Keras layers, got {bad}")
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set,
        scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
