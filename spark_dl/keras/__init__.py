"""spark_dl for Keras 3: Horovod's ``horovod.keras`` / ``horovod.tensorflow.keras`` API.

Switching from Horovod is a change of import::

    import spark_dl.keras as hvd          # or: import spark_dl.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="mse")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Runs on ``KERAS_BACKEND=tensorflow`` (the default) and ``KERAS_BACKEND=torch``; not on
jax. See docs/keras.md for what differs from Horovod.
"""

import keras

from spark_dl.common.basics import (  # noqa: F401 - re-exported
    cross_rank, cross_size, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    shutdown, size, start_timeline, stop_timeline)
from spark_dl.common.exceptions import (  # noqa: F401
    HorovodInternalError, InvalidArgumentError, NotInitializedError, SdlError)
from spark_dl.common.objects import allgather_object, broadcast_object  # noqa: F401
from spark_dl.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from spark_dl.common.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
from spark_dl.keras import _backend, callbacks  # noqa: F401
from spark_dl.keras._variables import broadcast_global_variables, broadcast_variables
from spark_dl.keras.compression import Compression  # noqa: F401
from spark_dl.keras.optimizer import (  # noqa: F401
    DistributedOptimizer, PartialDistributedOptimizer, is_distributed, wrap_in_place)
from spark_dl.keras.sync_batch_norm import SyncBatchNormalization
from spark_dl.keras import elastic  # noqa: F401,E402 - hvd.elastic.run, hvd.elastic.KerasState

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization",
    "Compression", "callbacks", "load_model",
    "broadcast_global_variables", "broadcast_variables", "allreduce", "allgather", "broadcast",
    "reducescatter", "alltoall", "broadcast_object", "allgather_object", "is_distributed",
    "elastic",
]


def allreduce(value, name=None, average=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduces a tensor or array over the process set; returns a backend tensor.

    Average by default (``op=Sum`` etc. as in :mod:`spark_dl.tensorflow`).
    """
    return _backend.allreduce(value, name=name, op=op, average=average,
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Concatenates every member's tensor along the first dimension."""
    return _backend.allgather(value, name=name, process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s tensor on every member."""
    return _backend.broadcast(value, root_rank, name=name, process_set=process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """Reduces a tensor over the set; returns this rank's slice of the first dimension."""
    return _backend.reducescatter(value, name=name, op=op, process_set=process_set)


def alltoall(value, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[j]`` rows to member j; see :func:`spark_dl.tensorflow.alltoall`."""
    return _backend.alltoall(value, splits=splits, name=name, process_set=process_set)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compile=True,
               compression=Compression.none, **distributed_kwargs):
    """Loads a ``.keras`` model and wraps its optimizer in :func:`DistributedOptimizer`.

    The optimizer keeps the state saved with the model (slots, iteration count).

    Args:
        filepath: a ``.keras`` file (what ``model.save()`` wrote).
        custom_optimizers: optimizer classes the file needs that Keras does not know
            (added to ``custom_objects`` by class name, as in Horovod).
        custom_objects: passed to ``keras.saving.load_model``.
        compression, **distributed_kwargs: passed to the wrapping (``op``,
            ``backward_passes_per_step``, ``average_aggregated_gradients``, ...; by default a
            saved ``gradient_accumulation_steps=k`` is kept as k passes, averaged).
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.saving.load_model(filepath, custom_objects=objects or None, compile=compile)
    opt = getattr(model, "optimizer", None)
    if opt is not None and compile and not is_distributed(opt):
        wrap_in_place(opt, compression=compression, **distributed_kwargs)
    return model
