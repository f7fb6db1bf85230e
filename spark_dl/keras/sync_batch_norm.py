"""SyncBatchNormalization: Keras 3 batch normalization whose batch statistics span every rank.

Horovod's ``horovod.tensorflow.SyncBatchNormalization`` for Keras 3: in training, each
rank sums its batch (count, sum, sum of squares) per channel, one allreduce adds them up
over the process set, and mean and variance are those of the union of every rank's batch
(exact also when the ranks' batches differ in size, or with a mask). The gradient flows
through the allreduce, so the backward pass is that of batch normalization over the union
too. In inference it is plain ``BatchNormalization`` (the moving statistics, which are the
same on every rank since every rank updated them with the same values).

Every member of the process set must run the layer in training on each step (the
allreduce is a collective). TensorFlow and torch Keras backends.
"""

import keras
from keras import ops

from spark_dl.common.ops import Sum, set_size
from spark_dl.common.process_sets import global_process_set
from spark_dl.keras import _backend

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="spark_dl")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with batch statistics over every rank's batch.

    Args:
        fused: Horovod's argument; only ``False``/``None`` (Keras 3 has no fused kernel
            to refuse).
        process_set: the ranks whose batches are normalized together (default: all; not
            saved with the model: a loaded layer uses every rank).
        **kwargs: as ``keras.layers.BatchNormalization`` (``axis``, ``momentum``,
            ``epsilon``, ``center``, ``scale``, ...; not ``synchronized``, which is
            tf.distribute's version of the same idea, nor ``renorm``).
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):  # noqa: D107
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes through spark_dl; "
                             "leave synchronized (tf.distribute's) unset")
        if kwargs.get("renorm"):
            raise ValueError("SyncBatchNormalization does not support renorm=True")
        _backend.require_supported("SyncBatchNormalization")
        super().__init__(**kwargs)
        self.process_set = process_set

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        config.pop("renorm", None)
        config.pop("renorm_clipping", None)
        config.pop("renorm_momentum", None)
        return config

    def _moments(self, inputs, mask):
        if set_size(self.process_set) == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            weights = ops.ones_like(inputs)
        else:
            weights = ops.cast(ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(inputs)),
                               inputs.dtype)
        counts = ops.sum(weights, axes)
        total = ops.sum(inputs * weights, axes)
        squares = ops.sum(ops.square(inputs) * weights, axes)
        # One allreduce for the three statistics (summed: exact with unequal batches).
        stats = _backend.allreduce(ops.stack([counts, total, squares]), op=Sum,
                                   process_set=self.process_set)
        n = ops.maximum(stats[0], keras.backend.epsilon())
        mean = stats[1] / n
        variance = ops.maximum(stats[2] / n - ops.square(mean), 0.0)
        return mean, variance
