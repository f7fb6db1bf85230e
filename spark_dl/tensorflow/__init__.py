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
    DuplicateNameError, HorovodInternalError, InvalidArgumentError, MismatchError,
    NotInitializedError, OpTimeoutError, PeerFailureError, SdlError, ShutdownError)
from spark_dl.tensorflow.compression import Compression  # noqa: F401
from spark_dl.tensorflow.functions import (  # noqa: F401
    allgather_object, broadcast_object, broadcast_variables)
from spark_dl.tensorflow.gradient_tape import DistributedGradientTape  # noqa: F401
from spark_dl.tensorflow.mpi_ops import *  # noqa: F401,F403
from spark_dl.tensorflow.mpi_ops import __all__ as _ops_all

__all__ = list(_ops_all) + [
    "Compression", "DistributedGradientTape", "broadcast_variables", "broadcast_object",
    "allgather_object", "SdlError", "HorovodInternalError", "PeerFailureError", "MismatchError",
    "DuplicateNameError", "InvalidArgumentError", "NotInitializedError", "OpTimeoutError",
    "ShutdownError",
]
