"""spark_dl for TensorFlow 2: Horovod's ``horovod.tensorflow`` API over spark_dl's core.

Switching from Horovod is a change of import::

    import spark_dl.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Every collective is an ordinary TensorFlow op that runs eagerly and inside
``tf.function`` (not under XLA): the tensors reach the C++ core as NumPy arrays through
``tf.numpy_function``, so nothing is compiled against TensorFlow and any TF 2.x works as
installed. Keras users want :mod:`spark_dl.keras` (also ``spark_dl.tensorflow.keras``).
See docs/keras.md.
"""

from spark_dl.common.exceptions import (  # noqa: F401
    DuplicateNameError, HorovodInternalError, NotInitializedError, OpTimeoutError,
    PeerFailureError, SdlError, ShutdownError)
from spark_dl.tensorflow.errors import InvalidArgumentError, MismatchError  # noqa: F401
from spark_dl.tensorflow.compression import Compression  # noqa: F401
from spark_dl.tensorflow.functions import (  # noqa: F401
    allgather_object, broadcast_global_variables, broadcast_object, broadcast_variables)
from spark_dl.tensorflow.gradient_tape import (  # noqa: F401
    DistributedGradientTape, PartialDistributedGradientTape)
from spark_dl.tensorflow.mpi_ops import *  # noqa: F401,F403
from spark_dl.tensorflow.mpi_ops import __all__ as _ops_all
from spark_dl.tensorflow.optimizer import DistributedOptimizer  # noqa: F401
from spark_dl.tensorflow import elastic  # noqa: F401,E402 - hvd.elastic.run, hvd.elastic.*State

__all__ = list(_ops_all) + [
    "Compression", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "SyncBatchNormalization", "broadcast_variables",
    "broadcast_global_variables", "broadcast_object", "allgather_object", "SdlError",
    "HorovodInternalError", "PeerFailureError", "MismatchError", "DuplicateNameError",
    "InvalidArgumentError", "NotInitializedError", "OpTimeoutError", "ShutdownError",
    "elastic",
]


def __getattr__(name):
    # Keras-based, imported on first use: ``import spark_dl.tensorflow`` does not import
    # Keras (nor fix its backend) for programs that use plain TensorFlow only.
    if name == "SyncBatchNormalization":
        from spark_dl.keras.sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
