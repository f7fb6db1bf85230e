"""The collectives of :mod:`spark_dl.keras` for the active Keras backend.

Keras 3 picks its backend once, at import (``KERAS_BACKEND``). On ``tensorflow`` the
tensors go through :mod:`spark_dl.tensorflow` (ops that also run inside the
``tf.function`` Keras compiles); on ``torch`` through :mod:`spark_dl.torch` (Keras runs
torch eagerly). Nothing else of spark_dl.keras depends on the backend. ``jax`` is not
supported: its train step is a pure function compiled by XLA, which cannot call back
into the core (docs/keras.md).
"""

import keras

from spark_dl.common.exceptions import InvalidArgumentError

__all__ = ["BACKEND", "require_supported", "grouped_allreduce", "allreduce", "allgather",
           "broadcast", "reducescatter", "alltoall", "is_sparse"]

BACKEND = keras.backend.backend()
SUPPORTED = ("tensorflow", "torch")


def require_supported(what):
    """Raises a clear error when ``what`` needs a backend spark_dl.keras does not run on."""
    if BACKEND not in SUPPORTED:
        raise InvalidArgumentError(
            f"{what} needs KERAS_BACKEND=tensorflow or torch; this process runs Keras on "
            f"'{BACKEND}' (spark_dl cannot reach into a jax-compiled train step; "
            "see docs/keras.md)")


def _tf():
    import spark_dl.tensorflow as sdl_tf
    return sdl_tf


def _torch():
    import spark_dl.torch as sdl_torch
    return sdl_torch


def is_sparse(g):
    if BACKEND == "tensorflow":
        import tensorflow as tf
        return isinstance(g, tf.IndexedSlices)
    return False


def grouped_allreduce(tensors, op, prescale, postscale, name, process_set):
    """One grouped allreduce of backend tensors (no autograd on torch)."""
    require_supported("allreduce")
    if BACKEND == "tensorflow":
        return _tf().grouped_allreduce(tensors, op=op, prescale_factor=prescale,
                                       postscale_factor=postscale, name=name,
                                       process_set=process_set)
    sdl_torch = _torch()
    handle = sdl_torch.grouped_allreduce_async([t.contiguous() for t in tensors], name=name,
                                               op=op, prescale_factor=prescale,
                                               postscale_factor=postscale,
                                               process_set=process_set)
    return sdl_torch.synchronize(handle)


def _convert(value):
    return keras.ops.convert_to_tensor(value)


def allreduce(value, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=None, average=None, compression=None):
    require_supported("allreduce")
    kw = dict(name=name, op=op, average=average, prescale_factor=prescale_factor,
              postscale_factor=postscale_factor)
    if process_set is not None:
        kw["process_set"] = process_set
    if BACKEND == "tensorflow":
        return _tf().allreduce(_convert(value), **kw)
    return _torch().allreduce(_convert(value), **kw)


def allgather(value, name=None, process_set=None):
    require_supported("allgather")
    kw = {} if process_set is None else {"process_set": process_set}
    mod = _tf() if BACKEND == "tensorflow" else _torch()
    return mod.allgather(_convert(value), name=name, **kw)


def broadcast(value, root_rank, name=None, process_set=None):
    require_supported("broadcast")
    kw = {} if process_set is None else {"process_set": process_set}
    mod = _tf() if BACKEND == "tensorflow" else _torch()
    return mod.broadcast(_convert(value), root_rank, name=name, **kw)


def reducescatter(value, name=None, op=None, process_set=None):
    require_supported("reducescatter")
    kw = {} if process_set is None else {"process_set": process_set}
    mod = _tf() if BACKEND == "tensorflow" else _torch()
    if op is not None:
        kw["op"] = op
    return mod.reducescatter(_convert(value), name=name, **kw)


def alltoall(value, splits=None, name=None, process_set=None):
    require_supported("alltoall")
    kw = {} if process_set is None else {"process_set": process_set}
    if BACKEND == "tensorflow":
        return _tf().alltoall(_convert(value), splits=splits, name=name, **kw)
    out = _torch().alltoall(_convert(value), splits=splits, name=name, **kw)
    return out
