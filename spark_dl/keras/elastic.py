"""Elastic training for Keras 3: Horovod's ``horovod.keras.elastic`` /
``horovod.tensorflow.keras.elastic`` (docs/elastic.md).

::

    import spark_dl.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        x, y = shard_of(hvd.rank(), hvd.size())      # this membership's share of the data
        state.model.fit(x, y, batch_size=32, initial_epoch=state.epoch, epochs=epochs,
                        callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

    train(state)

On a failure the survivors roll the model and optimizer back to the last commit,
re-form, sync from rank 0 and call ``train`` again, which resumes at ``state.epoch``.
Keras cannot start an epoch in its middle: an epoch interrupted by a reset runs again
from its first batch, with the weights of the last commit (as in Horovod).

Runs on ``KERAS_BACKEND=tensorflow`` and ``torch``.
"""

from __future__ import annotations

import keras
import numpy as np

from spark_dl.common import basics
from spark_dl.common.elastic import HostsUpdatedInterrupt, ObjectState, State  # noqa: F401
from spark_dl.common.exceptions import InvalidArgumentError
from spark_dl.common.objects import allgather_object, broadcast_object
from spark_dl.keras import _backend
from spark_dl.keras._variables import broadcast_variables

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
           "HostsUpdatedInterrupt", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]

# The functions Keras traces once and keeps (Trainer.make_*_function): they hold what
# they read while being traced (the job's size, whether to allreduce at all).
_TRACED = ("train_function", "test_function", "predict_function")


def run(func):
    """Decorator: runs ``func(state, ...)`` and, when the job's membership changes,
    rolls back to the last commit (after a failure), re-forms the job and calls it again
    on every worker (newcomers included) after syncing ``state`` from rank 0."""
    _backend.require_supported("elastic.run")
    if _backend.BACKEND == "tensorflow":
        # Turns failures inside the compiled train step (tf.errors there) back into
        # spark_dl's, which the loop recovers from.
        from spark_dl.tensorflow.elastic import run as backend_run
    else:
        from spark_dl.torch.elastic import run as backend_run
    return backend_run(func)


def _snapshot(variables):
    # A copy: a NumPy view of a CPU tensor may share the variable's buffer.
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


def _optimizers(optimizer):
    """The optimizer and the ones it wraps (``LossScaleOptimizer.inner_optimizer``)."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


class KerasState(ObjectState):
    """The state of a Keras job: the model's weights, the optimizer's variables (slots,
    iteration count, learning rate) and any picklable attributes given as keywords
    (``epoch``, ``batch``, ...).

    ``commit()`` copies them in memory (no file), ``restore()`` assigns the copies back,
    ``sync()`` gives every rank rank 0's (one grouped broadcast). The optimizer is built
    before anything is saved or synced, so that a newcomer that has not trained yet has
    the same variables as the survivors. After every reset the model's compiled
    functions are dropped, so the next ``fit`` traces them for the new membership.

    Args:
        model: a built Keras model (a ``keras.Input``, or ``model.build(shape)``).
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: Horovod's Keras-backend argument; unused with Keras 3.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self.backend = backend
        super().__init__(broadcast_object, basics.rank, **kwargs)
        self._saved_model = self._saved_optimizer = None
        if model.built:
            self._save_variables()

    def _optimizer_variables(self):
        opt = self.optimizer
        if opt is None:
            return []
        if not opt.built:
            # Keras builds an optimizer on its first update; a newcomer has not had one.
            opt.build(self.model.trainable_variables)
        return list(opt.variables)

    def _save_variables(self) -> None:
        self._saved_model = _snapshot(self.model.weights)
        self._saved_optimizer = _snapshot(self._optimizer_variables())

    def save(self) -> None:
        if self.model.built:
            self._save_variables()
        super().save()

    def restore(self) -> None:
        if self._saved_model is not None:
            for v, value in zip(self.model.weights, self._saved_model):
                v.assign(value)
            for v, value in zip(self._optimizer_variables(), self._saved_optimizer):
                v.assign(value)
        super().restore()

    def reset(self) -> None:
        # The new membership: nothing traced or decided for the old one is kept.
        for opt in _optimizers(self.optimizer):
            if hasattr(opt, "_sdl_reset_step"):
                opt._sdl_reset_step()
        for attr in _TRACED:
            if getattr(self.model, attr, None) is not None:
                setattr(self.model, attr, None)

    def sync(self) -> None:
        if not self.model.built:
            raise InvalidArgumentError(
                "KerasState needs a built model, so that rank 0's weights can reach every "
                "worker: give a Sequential model a keras.Input, or call model.build(shape) "
                "before training")
        weights, opt_vars = list(self.model.weights), self._optimizer_variables()
        # Every rank must broadcast the same variables; a difference would stall the
        # broadcast, so it is refused on every rank alike.
        counts = allgather_object((len(weights), len(opt_vars)), name="elastic.keras_state.n")
        if len(set(counts)) > 1:
            raise InvalidArgumentError(
                f"KerasState: the ranks' (model weights, optimizer variables) differ: "
                f"{counts}; every worker must build the same model and optimizer")
        broadcast_variables(weights + opt_vars, 0, name="elastic.keras_state")
        super().sync()
        self._save_variables()


TensorFlowKerasState = KerasState  # Horovod's name in horovod.tensorflow.elastic


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every
    epoch (Horovod's ``CommitStateCallback``).

    A commit is a collective (every rank commits at the same batch) and raises
    :class:`HostsUpdatedInterrupt` when workers wait to join. It runs right before the
    next batch (or epoch, or the end of ``fit``), so that every callback's work for the
    batch just done (:class:`UpdateBatchStateCallback`, :class:`UpdateEpochStateCallback`)
    is in it, wherever this callback stands in the list.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise InvalidArgumentError(
                f"batches_per_commit must be >= 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._batches = 0     # batches done since the last commit
        self._due = False

    def _commit_if_due(self):
        if self._due:
            self._due, self._batches = False, 0
            self.state.commit()

    def on_train_begin(self, logs=None):
        # Each fit starts counting afresh (the same on every rank after a reset).
        self._batches, self._due = 0, False

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches >= self.batches_per_commit:
            self._due = True

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_train_end(self, logs=None):
        self._commit_if_due()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the number of batches of the current epoch done (0 at the
    end of an epoch).

    Horovod keeps the index of the last batch done there (one less) and shortens the
    progress bar of a resumed epoch; Keras cannot resume an epoch in its middle, so here
    ``state.batch`` is information only (the resumed epoch runs in full).
    """

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs done, counted across resets, so that
    a re-entered ``fit`` resumes where the last commit was.

    Either ``fit(..., initial_epoch=state.epoch, epochs=total)`` or Horovod's
    ``fit(..., epochs=total - state.epoch)``: the count starts from ``state.epoch`` when
    ``fit`` starts, whatever epoch number Keras gives its first epoch.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._start = None   # state.epoch when this fit began
        self._first = None   # Keras's number of this fit's first epoch

    def on_train_begin(self, logs=None):
        self._start, self._first = self.state.epoch, None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._start + (epoch - self._first) + 1
