"""Broadcasting Keras variables (model weights and optimizer state) from one rank."""

import keras
import numpy as np

from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.handles import CompositeHandle
from spark_dl.common.process_sets import global_process_set
from spark_dl.keras import _backend

__all__ = ["broadcast_variables", "broadcast_global_variables", "model_variables"]


def _broadcast_numpy(variables, root_rank, name, process_set):
    """Eager, any backend: the values travel as NumPy arrays through the core."""
    # np.array, not np.ascontiguousarray: the latter turns 0-d values (a step counter) 1-d.
    arrays = [np.array(keras.ops.convert_to_numpy(v), order="C", copy=True) for v in variables]
    handles = [_ops.submit("broadcast", f"{name}.{i}", a, a, finish=lambda o, i, a=a: a,
                           process_set=process_set, root=root_rank)
               for i, a in enumerate(arrays)]
    for v, a in zip(variables, CompositeHandle(handles, list, name).wait()):
        v.assign(a)


def broadcast_variables(variables, root_rank, process_set=global_process_set,
                        name="broadcast_variables"):
    """Overwrites every Keras variable with ``root_rank``'s value (all in one batch).

    Eager on every supported backend; on TensorFlow it also works inside ``tf.function``.
    The variables must be listed in the same order on every rank.
    """
    _backend.require_supported("broadcast_variables")
    variables = list(variables)
    _ops.root_index(root_rank, process_set)  # a global rank, a member of the set
    if not variables:
        return None
    if _backend.BACKEND == "tensorflow":
        import spark_dl.tensorflow as sdl_tf
        return sdl_tf.broadcast_variables(variables, root_rank, process_set=process_set,
                                          name=name)
    _broadcast_numpy(variables, root_rank, name, process_set)
    return None


def model_variables(model):
    """The model's variables followed by its optimizer's (built first if it is not yet)."""
    variables = list(model.variables)
    opt = getattr(model, "optimizer", None)
    if opt is not None:
        if not opt.built and model.trainable_variables:
            opt.build(model.trainable_variables)
        variables += list(opt.variables)
    return variables


def broadcast_global_variables(root_rank, model=None, process_set=global_process_set):
    """Broadcasts a model's weights and its optimizer's state from ``root_rank``.

    Keras 3 has no global variable collection (Horovod's version broadcast TensorFlow's),
    so the model is an argument: ``broadcast_global_variables(0, model)``. The model must
    be built; its optimizer is built here if it is not yet, so that slots exist on every rank.
    """
    if model is None:
        raise InvalidArgumentError(
            "Keras 3 has no global variables: pass the model, "
            "broadcast_global_variables(root_rank, model), or use "
            "callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit")
    if not model.built:
        raise InvalidArgumentError(
            "the model is not built yet: call it on a batch (or model.build(shape)) before "
            "broadcasting its variables")
    return broadcast_variables(model_variables(model), root_rank, process_set=process_set,
                               name="broadcast_global_variables")
