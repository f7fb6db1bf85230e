"""The contract between the shared estimator machinery and one deep-learning framework.

Everything an estimator does that is not about tensors is shared
(:mod:`~spark_dl.spark.common.estimator`, :mod:`~spark_dl.spark.common.worker`,
:mod:`~spark_dl.spark.common.model`): checking params, preparing data, launching workers,
resuming, checkpoint files, progress, metrics averaging, TensorBoard, ``transform`` in Arrow
batches, persistence. A framework supplies three small pieces:

1. an :class:`~spark_dl.spark.common.estimator.EstimatorBase` subclass: its params table,
   :meth:`~.EstimatorBase._check_params_more`, :meth:`~.EstimatorBase._framework_spec` (what
   its workers need: model, optimizer, losses ...; the place for a driver-side dry run) and
   :meth:`~.EstimatorBase._trained_model` (the Model built from rank 0's result);
2. a :class:`WorkerAdapter` subclass: one rank's model, optimizer and steps;
3. a :class:`~spark_dl.spark.common.model.ModelBase` subclass whose ``_predictor()`` returns a
   :class:`Predictor`.

``tests/spark/test_adapter_contract.py`` implements all three for a linear model in plain
NumPy (about 150 lines), which is the smallest complete example; docs/estimators.md walks
through it. ``spark_dl.spark.torch`` is the full-size one.
"""

import abc
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["WorkerAdapter", "Predictor"]

#: ``(rows, loss, metric values)`` of one batch, as :meth:`WorkerAdapter.train_step` returns.
StepResult = Tuple[int, float, List[float]]


class WorkerAdapter(abc.ABC):
    """The framework's half of one worker's training (see
    :mod:`~spark_dl.spark.common.worker` for the loop that calls it).

    The worker loop builds it after ``init()`` with the :class:`~.worker.TrainSpec`
    (``spec.framework`` holds what the estimator's ``_framework_spec`` returned), this rank,
    the number of ranks and the local rank. The constructor picks the device, moves the model
    there and wraps the optimizer for distributed training. Every rank must make the same
    collective calls in the same order in every method.

    Attributes:
        device: where the model runs, shown in the start-up report (e.g. ``"cuda:0"``).
    """

    device: Any = "cpu"

    @classmethod
    def before_init(cls) -> None:
        """Called on every worker before ``init()``: start slow imports here (they overlap
        the rendezvous)."""

    @abc.abstractmethod
    def __init__(self, spec, rank: int, size: int, local_rank: int):
        """See the class doc."""

    # ------------------------------------------------------------------ state

    @abc.abstractmethod
    def load_checkpoint(self, payload: bytes) -> Tuple[int, Dict[str, list]]:
        """Loads a checkpoint written by :meth:`save_checkpoint` (rank 0 only) and returns
        (its epoch, counted from 1 as in the history: the number of epochs done, its
        history). Raises ValueError when it does not fit this model."""

    @abc.abstractmethod
    def save_checkpoint(self, epoch: int, history: Dict[str, list]) -> bytes:
        """The checkpoint after ``epoch`` (counted from 1, as the history's ``epoch``) as
        bytes: model, optimizer state, ``epoch`` and ``history`` (rank 0 only; the loop
        writes it atomically)."""

    @abc.abstractmethod
    def broadcast_state(self, root_rank: int) -> None:
        """Makes every rank's model and optimizer state equal to ``root_rank``'s."""

    @abc.abstractmethod
    def result(self) -> Any:
        """Rank 0's trained state, returned to the driver (picklable, CPU-only)."""

    def callback_objects(self) -> Tuple[Any, Any]:
        """(model, optimizer) set on the user's callbacks."""
        return None, None

    def attach_callbacks(self, callbacks: List[Any], params: Dict[str, Any]) -> None:
        """Gives the user's callbacks this rank's objects before training: by default the
        attributes ``model``, ``optimizer`` (:meth:`callback_objects`), ``rank``, ``size``
        and ``params`` (epochs, steps, val_steps, batch_size, run_id)."""
        model, optimizer = self.callback_objects()
        for cb in callbacks:
            cb.model, cb.optimizer, cb.params = model, optimizer, params
            cb.rank, cb.size = params["rank"], params["size"]

    def stop_requested(self) -> bool:
        """True when the framework itself asks to stop after this epoch (e.g. a Keras
        callback set ``model.stop_training``); the loop agrees on it across ranks."""
        return False

    # ------------------------------------------------------------------ steps

    @abc.abstractmethod
    def to_tensors(self, arrays: Dict[str, np.ndarray]) -> Dict[str, Any]:
        """A loader batch (column -> NumPy array, rows first) as the framework's tensors
        (column -> tensor); ``transformation_fn`` is applied to the result."""

    @abc.abstractmethod
    def metric_names(self) -> List[str]:
        """Names of the metric values the steps return, in order."""

    @abc.abstractmethod
    def train_step(self, batch: Dict[str, Any]) -> StepResult:
        """One training step on ``batch``: (rows, loss, metric values)."""

    @abc.abstractmethod
    def eval_step(self, batch: Dict[str, Any]) -> StepResult:
        """Loss and metrics of ``batch`` without training: (rows, loss, metric values)."""

    def begin_epoch(self, epoch: int, training: bool) -> None:
        """Before the training (``training``) or validation pass of ``epoch``."""

    def end_epoch(self, epoch: int, training: bool) -> None:
        """After the pass (e.g. the optimizer steps on gradients still accumulated)."""

    def first_batch_error(self, exc: Exception, batch: Dict[str, Any]) -> Exception:
        """The error to raise when the first training step fails (name shapes and what to
        change)."""
        shapes = {k: getattr(v, "shape", type(v).__name__) for k, v in batch.items()}
        return RuntimeError(f"training failed on the first batch: {type(exc).__name__}: "
                            f"{exc}\n  batch columns: {shapes}")


class Predictor(abc.ABC):
    """What ``transform`` ships to the executors (pickled once per transform, unpickled once
    per Python worker): the trained model and how to apply it to rows.

    Attributes:
        feature_cols: the input columns, in the order :meth:`predict` takes them.
    """

    feature_cols: Sequence[str] = ()

    def prepare(self) -> None:
        """Called once per executor process after unpickling (e.g. eval mode, device)."""

    @abc.abstractmethod
    def predict(self, arrays: Dict[str, np.ndarray]) -> List[np.ndarray]:
        """Outputs for rows given as NumPy arrays (column -> ``(rows, ...)``, dtype as the
        model was trained on): one ``(rows, ...)`` array per output. Floating outputs
        become float (float32) or double (float64) Spark columns."""
