"""Elastic training for TensorFlow 2: Horovod's ``horovod.tensorflow.elastic`` (docs/elastic.md).

::

    import spark_dl.tensorflow as hvd

    hvd.init()
    model, optimizer = ..., ...

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                train_step(*batch_of(state.epoch, state.batch, hvd.rank(), hvd.size()))
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0))

Keras ``model.fit`` users want :mod:`spark_dl.keras.elastic` (its callbacks keep the
state current). Two things are TensorFlow's own:

- Inside ``tf.function`` TensorFlow rebuilds a collective's error from the op's status,
  so a peer's death reaches the caller as ``tf.errors.UnknownError`` naming
  ``PeerFailureError`` (docs/keras.md, "Errors"). :func:`run` turns such errors back
  into the spark_dl error they name, so that the retry loop recovers from them.
- A ``tf.function`` keeps what it read while it was traced. spark_dl's Average divides by
  the job's size when the op runs, so gradients stay correctly averaged after a reset;
  but a function traced while the job had one worker holds no allreduce at all, and
  sparse (``IndexedSlices``) averages, ``register_local_source`` scaling, ``rank_op()``
  and ``size_op()`` use the rank and size of the trace. Re-create such functions in a reset callback
  (``state.register_reset_callbacks``) when the size can reach 1 or they use those.
  :class:`TensorFlowKerasState` does that for the functions Keras compiles.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from spark_dl.common import basics
from spark_dl.common.elastic import (HostsUpdatedInterrupt,  # noqa: F401
                                     ObjectState, State, named_recoverable, run_fn)
from spark_dl.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "HostsUpdatedInterrupt"]


def recoverable_error(error: BaseException):
    """The spark_dl error (``PeerFailureError`` / ``ShutdownError``) that a TensorFlow op
    error from a collective inside ``tf.function`` stands for, or None. TensorFlow words an
    exception raised inside ``tf.numpy_function`` as a line "<ClassName>: <message>" in the
    OpError's message (tested in tests/unit/test_elastic_keras_api.py)."""
    if not isinstance(error, tf.errors.OpError):
        return None
    return named_recoverable(error)


def _reset() -> None:
    basics.shutdown()
    basics.init()


def run(func):
    """Decorator: runs ``func(state, ...)`` and, when the job's membership changes,
    rolls back to the last commit (after a failure), re-forms the job and calls it again
    on every worker (newcomers included) after syncing ``state`` from rank 0.

    A peer's failure raised by a collective inside ``tf.function`` (a
    ``tf.errors.UnknownError`` there) counts as the failure it names.
    """

    @functools.wraps(func)
    def translated(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            error = recoverable_error(e)
            if error is None:
                raise
            raise error from e

    return run_fn(translated, _reset)


def _snapshot(variables):
    # A copy: a NumPy view of a CPU tensor may share the variable's buffer.
    return [np.array(tf.convert_to_tensor(v), copy=True) for v in variables]


class TensorFlowState(ObjectState):
    """The state of a TensorFlow job: a list of variables (``tf.Variable`` or Keras
    variables) and any picklable attributes given as keywords.

    ``commit()`` copies the variables' values in memory, ``restore()`` assigns the copies
    back, ``sync()`` gives every rank rank 0's values (one grouped broadcast).

    Args:
        variables: the variables, in the same order on every rank. Without them (as in
            Horovod) TensorFlow's global variables, which exist in graph mode only.
    """

    def __init__(self, variables=None, **kwargs):
        if variables is None:
            if tf.executing_eagerly():
                raise ValueError("TensorFlowState needs the variables in eager mode "
                                 "(TensorFlow 2 keeps no global variables): pass "
                                 "model.variables + optimizer.variables")
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        super().__init__(broadcast_object, basics.rank, **kwargs)
        self._saved_values = _snapshot(self.variables)

    def save(self) -> None:
        self._saved_values = _snapshot(self.variables)
        super().save()

    def restore(self) -> None:
        for v, value in zip(self.variables, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, 0, name="elastic.variables")
        super().sync()
        self._saved_values = _snapshot(self.variables)


def __getattr__(name):
    # Keras-based, imported on first use: ``import spark_dl.tensorflow`` does not import
    # Keras for programs that use plain TensorFlow only.
    if name == "TensorFlowKerasState":
        from spark_dl.keras.elastic import TensorFlowKerasState
        return TensorFlowKerasState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
