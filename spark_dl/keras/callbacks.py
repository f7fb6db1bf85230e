"""Keras callbacks of ``horovod.keras.callbacks`` for Keras 3 (any supported backend).

They run eagerly between steps and move NumPy values through the core, so they work
the same on the TensorFlow and torch backends.
"""

import warnings

import keras
import numpy as np

from spark_dl.common import ops as _ops
from spark_dl.common import elastic as _elastic
from spark_dl.common.basics import rank, size
from spark_dl.common.handles import synchronize
from spark_dl.common.process_sets import global_process_set
from spark_dl.keras._variables import broadcast_variables, model_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from ``root_rank``'s weights and optimizer state.

    Broadcasts when training begins if the model is built by then (its optimizer is
    built first so that its slots exist); otherwise right after the first batch, when
    Keras has built both (Horovod's TensorFlow 2 behaviour). In an elastic job it
    broadcasts again in the first ``fit`` of every re-formed job: newcomers broadcast
    then, so the survivors must too.

    Args:
        root_rank: the rank whose values every rank takes.
        local_variables: a variable or list of variables that keep their own value on
            every rank (not broadcast), as in Horovod; usually the weights of the
            ``local_layers`` of :func:`spark_dl.keras.PartialDistributedOptimizer`.
        device: accepted for Horovod compatibility.
    """

    def __init__(self, root_rank, device="", local_variables=None,  # noqa: D107
                 process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False
        self._generation = None  # the elastic job's generation of the last broadcast
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (keras.Variable, _tf_variable_type())):
            local_variables = [local_variables]
        self._local_vars = []
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var):
        """Leaves ``var`` out of the broadcast (Horovod's ``register_local_var``)."""
        if not isinstance(var, (keras.Variable, _tf_variable_type())):
            raise ValueError(f"local variables must be Keras (or tf.Variable) variables, got "
                             f"{type(var).__name__}")
        self._local_vars.append(var)

    def _broadcast(self):
        local = {id(v) for v in self._local_vars}
        variables = [v for v in model_variables(self.model) if id(v) not in local]
        broadcast_variables(variables, self.root_rank, process_set=self.process_set,
                            name="BroadcastGlobalVariablesCallback")
        self.broadcast_done, self._generation = True, _current_generation()

    def on_train_begin(self, logs=None):
        if self.broadcast_done and self._generation != _current_generation():
            # A re-formed elastic job: every member broadcasts once more, the newcomers
            # (whose broadcast_done is False) included, so that nobody waits alone.
            self.broadcast_done = False
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


def _current_generation():
    """The elastic job's current generation (None outside an elastic job)."""
    return _elastic.membership().generation if _elastic.is_elastic() else None


def _tf_variable_type():
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        return tf.Variable
    return keras.Variable


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics in ``logs`` by their average over the ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping,
    learning-rate plateaus), so that they see the same values on every rank.
    """

    def __init__(self, device="", process_set=global_process_set):  # noqa: D107
        super().__init__()
        self.process_set = process_set

    def _average(self, logs):
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        out = np.empty_like(values)
        synchronize(_ops.submit("allreduce", "MetricAverageCallback." + ",".join(keys), values,
                                out, finish=lambda o, i: out, process_set=self.process_set,
                                op=_ops.Average))
        for k, v in zip(keys, out):
            logs[k] = float(v)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            self._average(logs)


def _set_lr(optimizer, value):
    lr = optimizer._learning_rate if hasattr(optimizer, "_learning_rate") else None
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr) and not \
            isinstance(lr, keras.Variable):
        raise ValueError("the optimizer's learning rate is a schedule; learning-rate callbacks "
                         "need a constant learning rate to adjust")
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``.

    Args:
        initial_lr: the base learning rate (usually the single-process rate times size()).
        multiplier: a number, or a function of the (fractional, unless ``staircase``) epoch.
        staircase: adjust once per epoch (True) or at every batch with the epoch
            fraction ``epoch + batch / steps_per_epoch``.
        momentum_correction: accepted for Horovod compatibility; Keras 3 compiles the
            momentum into the train step as a constant, so it is not corrected (a
            warning says so once when the optimizer has momentum).
        steps_per_epoch: batches per epoch (default: what ``model.fit`` reports).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):  # noqa: D107
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch, m=float(multiplier): m

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        value = self.initial_lr * self.multiplier(epoch)
        _set_lr(self.model.optimizer, value)
        return value

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("a per-batch learning-rate schedule needs steps_per_epoch "
                             "(model.fit did not report the number of steps)")
        if self.momentum_correction and getattr(self.model.optimizer, "momentum", 0):
            warnings.warn("momentum_correction is not applied with Keras 3 (momentum is a "
                          "constant of the compiled train step)", stacklevel=2)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if not self.staircase and self._in_range(epoch):
            self._adjust(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate linearly from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch ("Accurate, Large Minibatch SGD", Goyal et al.)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):  # noqa: D107
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch):
            n = size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and rank() == 0:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keeps the best model seen so far (``save_best_only``), written by rank 0 only.

    ``filepath`` may be left out when an estimator sets it (``callback.filepath = ...``)
    before training starts.
    """

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch",
                 filepath=None, save_weights_only=False):  # noqa: D107
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath: pass filepath= or set "
                             "callback.filepath before fit()")
        super().on_train_begin(logs)

    def _save_model(self, *args, **kwargs):
        if rank() == 0:
            return super()._save_model(*args, **kwargs)
        return None
