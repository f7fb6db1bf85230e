"""Callbacks: code of the user's that runs on every worker during an estimator's ``fit``.

Pass instances in ``callbacks=[...]``; each worker gets its own copy (they are pickled with
the rest of the training function). Before ``on_train_begin`` each copy has ``model``,
``optimizer`` (the distributed one), ``rank``, ``size`` and ``params`` (epochs, steps,
batch_size ...) set. ``logs`` passed to ``on_epoch_end`` hold the epoch's metrics averaged
over all workers (``loss``, ``val_loss``, metric names), so every rank sees the same numbers.

Keras callbacks work as well: their ``on_train_batch_begin``/``on_train_batch_end`` run
around each batch (Keras' own callbacks and those written for ``model.fit`` override those
names; older ones ``on_batch_begin``/``on_batch_end``, which Keras forwards to).

Setting ``self.stop_training = True`` on any rank ends training after the current epoch on
all ranks (the ranks agree at each epoch's end).
"""

from typing import Optional

__all__ = ["Callback", "EarlyStopping"]


class Callback:
    """Base class; override the hooks you need."""

    model = None
    optimizer = None
    rank = 0
    size = 1
    params: dict = {}
    stop_training = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Before the first epoch (after a resumed run's checkpoint is loaded)."""

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Before epoch ``epoch`` (counted from 0)."""

    def on_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """Before each training batch (``batch`` counted from 0 in the epoch)."""

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """After each training batch; ``logs`` has this rank's ``loss`` of the batch."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """After the epoch's validation, with the averaged metrics."""

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        """After the last epoch."""


class EarlyStopping(Callback):
    """Stops when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Args:
        monitor: a name in the epoch logs (default ``val_loss``; ``loss`` without
            validation).
        patience: epochs without improvement before stopping.
        min_delta: the smallest change that counts as an improvement.
        mode: ``"min"`` (lower is better) or ``"max"``.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 2, min_delta: float = 0.0,
                 mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.mode = mode
        self.best = None
        self.wait = 0

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if value is None:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, which is not among the "
                           f"epoch's logs {sorted(logs or {})}")
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best = value
            self.wait = 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stop_training = True
