"""Variables and Python objects between ranks: ``broadcast_variables``, ``broadcast_object``,
``allgather_object``."""

import tensorflow as tf

from spark_dl.common import objects as _objects
from spark_dl.common.process_sets import global_process_set
from spark_dl.tensorflow.errors import translate_errors
from spark_dl.tensorflow.mpi_ops import _broadcast_raw, _check_root

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object",
           "allgather_object"]


# spark_dl's object functions, raising spark_dl.tensorflow.errors types as the ops do.
broadcast_object = translate_errors(_objects.broadcast_object)
allgather_object = translate_errors(_objects.allgather_object)


@translate_errors
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False,
                        name=None):
    """Overwrites every variable with ``root_rank``'s value (one op for all of them).

    Args:
        variables: ``tf.Variable`` or Keras 3 variables, in the same order on every rank.
        root_rank: the global rank (a member of ``process_set``) whose values everyone takes.
        inplace: accepted for Horovod compatibility (the assignment is always in place).

    Returns:
        None when run eagerly; inside ``tf.function`` the grouped assignment op.
    """
    _check_root(root_rank, process_set)
    variables = list(variables)
    if not variables:
        return None
    values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], root_rank,
                            name or "broadcast_variables", process_set)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_global_variables(root_rank):
    """Broadcasts TensorFlow's global variables (``tf.compat.v1.global_variables()``) from
    ``root_rank``; in graph mode only, as in Horovod.

    Raises:
        RuntimeError: when executing eagerly (TensorFlow 2 has no global variable
            collection there): use ``broadcast_variables(model.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() does not support eager execution: TensorFlow 2 "
            "keeps no global variables. Use spark_dl.tensorflow.broadcast_variables("
            "<model/optimizer variables>, root_rank) instead (Keras: "
            "spark_dl.keras.broadcast_global_variables(root_rank, model)).")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
