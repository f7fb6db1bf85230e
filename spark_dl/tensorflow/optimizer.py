"""``spark_dl.tensorflow.DistributedOptimizer``: Horovod's optimizer wrapper of
``horovod.tensorflow`` for both kinds of TensorFlow optimizer.

- A Keras 3 optimizer (``keras.optimizers.*``, what TensorFlow 2 programs use) becomes
  :func:`spark_dl.keras.DistributedOptimizer`, as Horovod hands Keras optimizers to its
  Keras wrapper.
- A ``tf.compat.v1.train.Optimizer`` is wrapped so that ``compute_gradients`` (and so
  ``minimize``) returns gradients averaged across ranks, as Horovod's TensorFlow 1 wrapper.
"""

import tensorflow as tf

from spark_dl.common.ops import Average
from spark_dl.common.process_sets import global_process_set
from spark_dl.tensorflow.compression import Compression
from spark_dl.tensorflow.errors import InvalidArgumentError
from spark_dl.tensorflow.gradient_tape import allreduce_gradients

__all__ = ["DistributedOptimizer"]


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: gradients are allreduced in
    ``compute_gradients``; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, name, use_locking, reduce_args):  # noqa: D107
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce_args = reduce_args

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        reduced = allreduce_gradients(list(grads), **self._reduce_args)
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",  # noqa: N802
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Returns ``optimizer`` wrapped so that gradients are averaged across ranks.

    Args:
        optimizer: a Keras 3 optimizer (see :func:`spark_dl.keras.DistributedOptimizer`,
            which gets every argument) or a ``tf.compat.v1.train.Optimizer``.
        backward_passes_per_step, average_aggregated_gradients, scale_local_gradients:
            Keras optimizers only (a v1 optimizer takes ``backward_passes_per_step=1``).
        Other arguments as :class:`spark_dl.tensorflow.DistributedGradientTape`.

    Raises:
        InvalidArgumentError: another kind of optimizer, or an argument the kind does
            not take.
    """
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        import spark_dl.keras as sdl_keras
        return sdl_keras.DistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise InvalidArgumentError(
                "backward_passes_per_step > 1 needs a Keras optimizer; a "
                "tf.compat.v1.train.Optimizer takes 1")
        reduce_args = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                           gradient_predivide_factor=gradient_predivide_factor,
                           process_set=process_set,
                           name=f"{name or 'DistributedOptimizer'}.gradients")
        return _LegacyDistributedOptimizer(
            optimizer, name or f"Distributed{type(optimizer).__name__}", use_locking,
            reduce_args)
    raise InvalidArgumentError(
        f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*) or a "
        f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}; for custom training "
        f"loops use spark_dl.tensorflow.DistributedGradientTape")
