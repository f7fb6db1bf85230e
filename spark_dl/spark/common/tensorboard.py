"""TensorBoard scalars of a fit, written by the driver into the run's logs path.

Rank 0 reports each epoch's averaged metrics to the driver (see
:mod:`spark_dl.spark.common.progress`); this writer turns them into TensorBoard scalars
(``loss``, ``val_loss``, each metric; step = epoch) as they arrive, so TensorBoard pointed at
``store.get_logs_path(run_id)`` follows the training live. The events are written with the
``tensorboard`` package's own event-file writer, so no framework is needed for them; writing
on the driver keeps that import off the workers' path to their first step. The driver imports
it in the background once training has started (the first step or epoch event), not while
the data is prepared: on a small machine that import would take CPU from Spark's first jobs.

On stores with local paths the event file is written in place; on others it is written to a
temporary directory and uploaded after each epoch. Without the ``tensorboard`` package
nothing is written and :meth:`TensorBoardLogger.close` returns a note saying so.
"""

import os
import shutil
import sys
import tempfile
import threading
import time
import types
from typing import Optional

from spark_dl.spark.common.history import epochs_after

__all__ = ["TensorBoardLogger"]


class _ScalarWriter:
    """Scalar summaries into one TensorBoard event file."""

    def __init__(self, events):
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._events = events
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._events.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                                     summary=summary))

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()


def _use_tensorflow_stub() -> None:
    """Writing scalars needs no TensorFlow, but where it is installed the writer imports it
    (seconds, on every fit). Unless this process already imported it, select TensorBoard's
    own TensorFlow stub the way its no-TensorFlow build does: a ``tensorboard.compat.notf``
    module (TensorBoard decides once per process, at its first use of ``compat.tf``)."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf",
                               types.ModuleType("tensorboard.compat.notf"))


class TensorBoardLogger:
    """Epoch scalars of run ``run_id`` into ``store``'s logs path (None: store keeps no runs).

    Args:
        store: the estimator's Store.
        run_id: the run.

    Attributes:
        first_epoch: epochs up to this one belong to an earlier fit of the run (set from
            the ``start`` event of a resumed run).
    """

    def __init__(self, store, run_id: str):
        self.store = store
        self.path = store.get_logs_path(run_id)
        self.first_epoch = 0
        self._lock = threading.Lock()
        self._pending = []
        self._written = set()
        self._writer = None
        self._error = None
        self._local_dir = None
        self._thread = None

    def start(self) -> None:
        """Opens the event file in a background thread (once; no-op without a logs path)."""
        with self._lock:  # started under the lock: close() never joins an unstarted thread
            if self.path is None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._open, name="spark_dl-tensorboard",
                                            daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            _use_tensorflow_stub()
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            if self.store.capabilities.local_paths:
                self._local_dir = self.store.get_fs_path(self.path)
            else:
                self._local_dir = tempfile.mkdtemp(prefix="spark_dl_tb_")
            os.makedirs(self._local_dir, exist_ok=True)
            writer = _ScalarWriter(EventFileWriter(self._local_dir))
        except Exception as e:  # the package is missing or broken: a note, not a failure
            self._error = e
            return
        with self._lock:
            self._writer = writer
            self._flush_pending()

    def on_event(self, event: dict) -> None:
        """Listener for progress events: records ``epoch`` events; the first ``step`` or
        ``epoch`` event starts the writer."""
        kind = event.get("kind")
        if kind == "start":
            self.first_epoch = int(event.get("start_epoch") or 0)
        elif kind in ("step", "epoch"):
            self.start()
            if kind == "epoch":
                self.add(int(event["epoch"]), event.get("logs") or {})

    def add(self, epoch: int, logs: dict) -> None:
        """Queues the scalars of ``epoch`` and writes what is queued if the writer is ready."""
        if self.path is None or epoch in self._written:
            return
        with self._lock:
            self._written.add(epoch)
            self._pending.append((epoch, dict(logs)))
            if self._writer is not None:
                self._flush_pending()

    def _flush_pending(self) -> None:
        for epoch, logs in self._pending:
            for key, value in logs.items():
                self._writer.add_scalar(key, value, epoch)
        self._pending = []
        self._writer.flush()
        if not self.store.capabilities.local_paths:
            for name in os.listdir(self._local_dir):
                self.store.upload(os.path.join(self._local_dir, name), f"{self.path}/{name}")

    def close(self, history: Optional[dict] = None) -> Optional[str]:
        """Writes epochs of ``history`` not reported live (a backend that forwards no
        output), closes the writer. Returns a note when TensorBoard logs were skipped."""
        if self.path is None:
            return None
        for epoch, logs in epochs_after(history, self.first_epoch):
            if epoch not in self._written:
                self.add(epoch, {k: v for k, v in logs.items()
                                 if k not in ("epoch", "rows_per_s")})
        if self._thread is None and not self._pending:
            return None  # training never started and reported nothing: no event file
        self.start()
        self._thread.join()
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                if not self.store.capabilities.local_paths:
                    self._flush_uploads()
                self._writer = None
        if self._error is not None:
            return (f"TensorBoard logs skipped ({type(self._error).__name__}: {self._error}); "
                    f"install the tensorboard package to get them in {self.path}")
        return None

    def _flush_uploads(self) -> None:
        for name in os.listdir(self._local_dir):
            self.store.upload(os.path.join(self._local_dir, name), f"{self.path}/{name}")
        shutil.rmtree(self._local_dir, ignore_errors=True)
