"""The training function every estimator runs on its workers, whatever the framework.

``train(blob)`` receives one cloudpickled :class:`TrainSpec` and, on every rank:

1. ``spark_dl`` ``init()``; builds the framework's :class:`~.adapter.WorkerAdapter` (which
   picks the device and wraps the optimizer);
2. rank 0 reads the run's checkpoint if there is one (the adapter decodes it) and tells the
   others where to resume;
3. the adapter broadcasts rank 0's model and optimizer state;
4. per epoch: trains on its share of the data (the Arrow loader gives every rank the same
   number of NumPy batches; the adapter turns them into tensors and runs one step each),
   validates, averages loss and metrics over all rows of all ranks (one allreduce), then
   rank 0 writes the checkpoint (atomically, through the store) and reports the epoch to the
   driver (which shows it and writes the TensorBoard scalars);
5. rank 0 returns the adapter's trained state and the history; the other ranks their
   timings.

Every rank must make the same collective calls in the same order; anything that could make
ranks diverge (NaN checks, callbacks asking to stop) is decided by an allreduce. The
skeleton's own collectives go through :mod:`spark_dl.numpy` (the same core as every
framework binding), so it needs no framework.
"""

import dataclasses
import math
import os
import posixpath
import shutil
import sys
import tempfile
import time
from typing import Any, List, Optional

import numpy as np

from spark_dl.common import elastic
from spark_dl.config import knobs

__all__ = ["TrainSpec", "train", "Sums", "callbacks_call"]


@dataclasses.dataclass
class TrainSpec:
    """Everything a worker needs; built by the estimator on the driver.

    ``adapter`` is the framework's :class:`~.adapter.WorkerAdapter` subclass and
    ``framework`` what it needs beyond the shared fields (its model, optimizer, losses ...).
    """

    adapter: Any
    framework: Any
    metrics: List[Any]
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    label_shapes: Optional[List[List[int]]]
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps: Optional[int]
    val_steps: Optional[int]
    shuffle_buffer_size: Optional[int]
    transformation_fn: Any
    callbacks: List[Any]
    remote_store: Any
    dataset: Any
    seed: int
    random_seed: Optional[int]
    terminate_on_nan: bool
    cache_all: bool
    train_threads: int
    val_threads: int
    #: True, False, or None for the default (a GPU when there is one, see ``choose_gpu``).
    use_gpu: Optional[bool]
    verbose: int
    run_id: str
    shuffle: bool = True

    @property
    def columns(self) -> List[str]:
        """The columns the loaders read: features, labels, the weight column."""
        return self.feature_cols + self.label_cols + (
            [self.sample_weight_col] if self.sample_weight_col else [])


def _batches(loader, steps: int, epoch: int):
    """``steps`` batches; passes over the loader again when it has fewer."""
    passes = max(1, math.ceil(steps / max(len(loader), 1)))
    loader.set_epoch(epoch * passes)
    done = 0
    while done < steps:
        it = iter(loader)
        try:
            for batch in it:
                yield batch
                done += 1
                if done >= steps:
                    break
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def callbacks_call(callbacks, hook: str, *args) -> None:
    """Calls ``hook`` on every callback that has it (duck-typed, as Keras callbacks).

    The batch hooks ``on_batch_begin``/``on_batch_end`` go to a callback's
    ``on_train_batch_begin``/``on_train_batch_end`` where it has one: Keras 3 callbacks
    override those, and Keras' base class forwards them to the legacy names, so both kinds
    of Keras callback run (the legacy name alone would skip the modern one)."""
    modern = _KERAS_BATCH_HOOKS.get(hook)
    for cb in callbacks:
        method = (modern and getattr(cb, modern, None)) or getattr(cb, hook, None)
        if method is not None:
            method(*args)


_KERAS_BATCH_HOOKS = {"on_batch_begin": "on_train_batch_begin",
                      "on_batch_end": "on_train_batch_end"}


class Sums:
    """Row-weighted sums of loss and metrics on this rank, averaged over ranks at the end."""

    def __init__(self, n_metrics: int):
        self.values = [0.0] * (1 + n_metrics)
        self.rows = 0

    def add(self, rows: int, loss: float, metrics: List[float]) -> None:
        self.rows += rows
        self.values[0] += loss * rows
        for i, m in enumerate(metrics):
            self.values[1 + i] += m * rows

    def average(self, sdl, name: str):
        """(averages over all ranks' rows, total rows); one allreduce."""
        t = np.array([float(self.rows)] + self.values, dtype=np.float64)
        t = sdl.allreduce(t, op=sdl.Sum, name=name)
        rows = float(t[0])
        return [float(v) / rows if rows else float("nan") for v in t[1:]], int(rows)


def _is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def train(blob: bytes) -> dict:
    """Trains on this worker; see the module doc. ``blob`` is a cloudpickled TrainSpec."""
    t_start = time.time()
    import cloudpickle

    spec: TrainSpec = cloudpickle.loads(blob)  # imports the framework (the slow import)
    t_imported = time.time()
    import spark_dl.numpy as sdl

    spec.adapter.before_init()  # e.g. start slow imports that overlap the rendezvous
    staging = _flight_recorder_in_run(spec.remote_store)
    timeline = None
    try:
        if elastic.is_elastic():
            return _train_elastic(blob, spec, sdl, dict(start=t_start, imported=t_imported))
        sdl.init()
        t_init = time.time()
        timeline = _start_timeline(spec, sdl)
        worker = _Worker(spec, sdl)
        worker.timings.update(start=t_start, imported=t_imported, initialized=t_init)
        return worker.run()
    finally:
        _upload_flight_dumps(spec.remote_store, staging)
        if timeline:
            try:
                _upload_timeline(spec, sdl, timeline)
            except Exception as e:  # never hide training's own outcome or error
                print(f"warning: the timeline could not be copied into the Store: {e}",
                      file=sys.stderr, flush=True)


def _train_elastic(blob: bytes, spec: TrainSpec, sdl, timings: dict) -> dict:
    """An elastic fit (``elastic=True``, docs/elastic.md): the run's checkpoint, written by
    rank 0 after every epoch, is the state the job rolls back to. A lost peer ends the
    generation on every survivor; each then joins the next one (``init()`` again, with its
    new rank and size) and trains again from a fresh copy of the model and optimizer, which
    rank 0 loads from the checkpoint: the epoch in flight is redone on the new membership,
    every row once. Workers waiting to join are taken in at the end of an epoch."""
    while True:
        try:
            sdl.init()
            worker = _Worker(spec, sdl, elastic=True)
            worker.timings.update(timings, initialized=time.time())
            return worker.run()
        except elastic.HostsUpdatedInterrupt:
            reason = "workers are joining or leaving"
        except Exception as e:
            # Also a failure raised inside compiled code (Keras' train step on TensorFlow
            # reports it as tf.errors.UnknownError naming it).
            lost = elastic.named_recoverable(e)
            if lost is None:
                raise
            reason = (f"a peer was lost ({type(lost).__name__}: "
                      f"{str(lost).splitlines()[0][:200]})")
        print(f"spark_dl: re-forming the job: {reason}; training resumes from the last "
              "epoch's checkpoint", file=sys.stderr, flush=True)
        sdl.shutdown()
        import cloudpickle

        spec = cloudpickle.loads(blob)  # the model and optimizer as the fit began


def _start_timeline(spec: TrainSpec, sdl) -> Optional[str]:
    """Rank 0 records the core's timeline to a local file when the knob
    ``SDL_SPARK_TIMELINE`` names one (docs/observability.md); its local path."""
    name = knobs.value("spark_timeline")
    if not name or sdl.rank() != 0 or not spec.remote_store.run_path:
        return None
    local = os.path.join(tempfile.mkdtemp(prefix="sdl-timeline-"), posixpath.basename(name))
    sdl.start_timeline(local, mark_cycles=knobs.value("timeline_mark_cycles"))
    return local


def _upload_timeline(spec: TrainSpec, sdl, local: str) -> None:
    """Stops the timeline and copies it into the run's folder in the Store (also when
    training failed: then it shows where)."""
    sdl.stop_timeline()
    name = posixpath.basename(local)
    with open(local, "rb") as f:
        spec.remote_store.write(posixpath.join(spec.remote_store.run_path, name), f.read())
    shutil.rmtree(os.path.dirname(local), ignore_errors=True)


def _flight_recorder_in_run(remote_store) -> Optional[str]:
    """Points the flight recorder's dumps (docs/observability.md) at the run's folder,
    unless SDL_FLIGHT_RECORDER_DIR chose a folder: directly when the Store's paths are
    local files; for other Stores at a local staging folder, returned, whose dumps
    :func:`_upload_flight_dumps` copies into the run's folder when training ends."""
    run_path = getattr(remote_store, "run_path", None)
    if knobs.value("flight_recorder_dir") or run_path is None:
        return None
    store = remote_store.store
    staging = None
    if store.capabilities.local_paths:
        folder = os.path.join(store.get_fs_path(run_path), "flight_recorder")
    else:
        folder = staging = tempfile.mkdtemp(prefix="sdl-flight-recorder-")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # the dumps still go to the log
    os.environ["SDL_FLIGHT_RECORDER_DIR"] = folder
    return staging


def _upload_flight_dumps(remote_store, staging: Optional[str]) -> None:
    """Copies the dumps the core wrote into ``staging`` (a failed run's) to
    ``flight_recorder/`` in the run's folder of the Store; never raises (training's own
    outcome or error is what the caller sees)."""
    if not staging:
        return
    try:
        for name in sorted(os.listdir(staging)):
            with open(os.path.join(staging, name), "rb") as f:
                remote_store.write(posixpath.join(remote_store.run_path, "flight_recorder",
                                                  name), f.read())
    except Exception as e:
        print(f"warning: the flight recorder's dump could not be copied into the Store: {e}",
              file=sys.stderr, flush=True)
    shutil.rmtree(staging, ignore_errors=True)


class _Worker:
    """One rank's training loop: set up in the constructor, :meth:`run` runs the epochs."""

    def __init__(self, spec: TrainSpec, sdl, elastic: bool = False):
        from spark_dl.spark.common.progress import Reporter

        self.spec, self.sdl = spec, sdl
        self.elastic = elastic
        self.rank, self.size = sdl.rank(), sdl.size()
        self.timings = {}
        # Rank 0 always reports epochs (the driver writes TensorBoard scalars from them);
        # steps only when the driver shows a progress bar.
        self.reporter = Reporter(enabled=self.rank == 0, steps=spec.verbose > 0)
        self.adapter = spec.adapter(spec, self.rank, self.size, sdl.local_rank())

        start, history = self._load_checkpoint() if self.rank == 0 else (0, {})
        self.start_epoch, self.history = sdl.broadcast_object((start, history), 0,
                                                              name="estimator.resume")
        self.adapter.broadcast_state(root_rank=0)

        self.train_loader = self._loader("train", spec.batch_size, spec.train_threads)
        self.val_loader = (self._loader("val", spec.val_batch_size, spec.val_threads)
                           if spec.dataset.val_rows else None)
        self.train_steps = spec.train_steps or len(self.train_loader)
        self.val_steps = ((spec.val_steps or len(self.val_loader))
                          if self.val_loader is not None else 0)
        self.metric_names = self.adapter.metric_names()
        params = {"epochs": spec.epochs, "steps": self.train_steps,
                  "val_steps": self.val_steps, "batch_size": spec.batch_size,
                  "run_id": spec.run_id, "rank": self.rank, "size": self.size,
                  "verbose": 0}
        # Decided before the adapter may add rank-local callbacks (e.g. rank 0's checkpoint
        # writer): whether ranks agree on stopping after each epoch (one allreduce).
        self.agree_on_stop = bool(spec.callbacks)
        self.adapter.attach_callbacks(spec.callbacks, params)

    # ------------------------------------------------------------------ checkpoints

    def _load_checkpoint(self):
        """(start epoch, history) from the run's checkpoint, loading its state (rank 0)."""
        spec = self.spec
        store = spec.remote_store
        path = store.checkpoint_path
        if path:
            # Checkpoint writes killed part way left hidden temporaries: nothing else
            # writes into the run directory yet, so they are stale.
            for leftover in store.remove_run_temporaries():
                self.reporter.note(f"removed {leftover}, left by an interrupted write")
        if not path or not store.exists(path):
            return 0, {}
        try:
            epoch, history = self.adapter.load_checkpoint(store.read(path))
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"the checkpoint of run {spec.run_id!r} ({path}) cannot be "
                             f"resumed: {e}; use a new run_id to start afresh") from None
        done = int(epoch)  # epochs completed: the history's number of the last one
        self.reporter.note(f"resuming run {spec.run_id} after epoch {done} (checkpoint "
                           f"{path})")
        return done, dict(history or {})

    def _save_checkpoint(self, epoch: int) -> None:
        """Writes the checkpoint after ``epoch`` (counted from 1, as the history counts)."""
        path = self.spec.remote_store.checkpoint_path
        if path:
            # The store writes to a temporary name and renames: a kill mid-write leaves the
            # previous checkpoint whole.
            self.spec.remote_store.write(path, self.adapter.save_checkpoint(epoch,
                                                                            self.history))

    # ------------------------------------------------------------------ data

    def _loader(self, split: str, batch_size: int, threads: int):
        from spark_dl.spark.common.data_loader import ArrowDataLoader

        spec = self.spec
        kwargs = {} if spec.shuffle_buffer_size is None else \
            {"shuffle_buffer_size": spec.shuffle_buffer_size}
        return ArrowDataLoader(spec.dataset.source(spec.remote_store, split),
                               batch_size=batch_size, rank=self.rank, size=self.size,
                               columns=spec.columns, shuffle=split == "train" and spec.shuffle,
                               seed=spec.seed,
                               num_threads=threads, cache_in_memory=spec.cache_all, **kwargs)

    def _batch(self, arrays):
        """A loader batch as the adapter's tensors, through ``transformation_fn``."""
        batch = self.adapter.to_tensors(arrays)
        if self.spec.transformation_fn is not None:
            batch = self.spec.transformation_fn(batch)
        return batch

    # ------------------------------------------------------------------ epochs

    def run(self) -> dict:
        spec, reporter = self.spec, self.reporter
        callbacks_call(spec.callbacks, "on_train_begin", {})
        self.timings["ready"] = time.time()
        reporter.event("start", epochs=spec.epochs, start_epoch=self.start_epoch,
                       steps=self.train_steps, val_steps=self.val_steps, size=self.size,
                       device=str(self.adapter.device))
        stopped = None
        epoch_times = []
        try:
            for epoch in range(self.start_epoch, spec.epochs):
                callbacks_call(spec.callbacks, "on_epoch_begin", epoch, {})
                t0 = time.time()
                logs, rows, stopped = self.train_epoch(epoch)
                train_s = time.time() - t0
                if stopped is not None:
                    reporter.note(f"training stopped: {stopped}")
                    break
                if self.val_loader is not None:
                    logs.update(self.validate(epoch))
                self._record(epoch, logs, rows, train_s, time.time() - t0)
                epoch_times.append(train_s)
                if self._callbacks_stop(epoch, logs):
                    reporter.note(f"training stopped by a callback after epoch {epoch + 1}")
                    break
                if (self.elastic and epoch + 1 < spec.epochs and
                        elastic.hosts_updated(self.sdl.broadcast_object, self.rank)):
                    raise elastic.HostsUpdatedInterrupt()  # the checkpoint is written
            if self.start_epoch >= spec.epochs:
                reporter.note(f"run {spec.run_id} already finished its {spec.epochs} "
                              "epoch(s); nothing to train")
            callbacks_call(spec.callbacks, "on_train_end", dict(self.history))
        finally:
            self.train_loader.close()
            if self.val_loader is not None:
                self.val_loader.close()
        self.timings.update(end=time.time(), epoch_s=epoch_times)
        if self.rank != 0:
            return {"timings": self.timings}
        return {"state": self.adapter.result(), "history": self.history,
                "start_epoch": self.start_epoch, "timings": self.timings, "stopped": stopped}

    def train_epoch(self, epoch: int):
        """(averaged logs, rows over all ranks, reason to stop or None) of one epoch."""
        spec, sdl, adapter = self.spec, self.sdl, self.adapter
        adapter.begin_epoch(epoch, training=True)
        sums = Sums(len(self.metric_names))
        stopped = None
        for step, arrays in enumerate(_batches(self.train_loader, self.train_steps, epoch)):
            batch = self._batch(arrays)
            callbacks_call(spec.callbacks, "on_batch_begin", step, {})
            try:
                rows, value, mvalues = adapter.train_step(batch)
            except Exception as e:
                if "first_step" not in self.timings:
                    raise adapter.first_batch_error(e, batch) from e
                raise
            self.timings.setdefault("first_step", time.time())
            sums.add(rows, value, mvalues)
            if spec.terminate_on_nan:
                # Every rank must stop at the same step (the next collectives must match).
                bad = np.array([0.0 if _is_finite(value) else 1.0])
                if float(sdl.allreduce(bad, op=sdl.Max, name="estimator.nan")[0]):
                    stopped = f"loss is not finite at epoch {epoch + 1}, step {step + 1}"
                    break
            callbacks_call(spec.callbacks, "on_batch_end", step, {"loss": value})
            if self.reporter.step_due():
                self.reporter.event("step", epoch=epoch + 1, step=step + 1,
                                    steps=self.train_steps,
                                    loss=sums.values[0] / max(sums.rows, 1))
        adapter.end_epoch(epoch, training=True)
        averages, rows = sums.average(sdl, "estimator.train_stats")
        return dict(zip(["loss"] + self.metric_names, averages)), rows, stopped

    def validate(self, epoch: int) -> dict:
        """Averaged ``val_`` loss and metrics of one epoch."""
        adapter = self.adapter
        adapter.begin_epoch(epoch, training=False)
        sums = Sums(len(self.metric_names))
        for arrays in _batches(self.val_loader, self.val_steps, epoch):
            sums.add(*adapter.eval_step(self._batch(arrays)))
        adapter.end_epoch(epoch, training=False)
        averages, _ = sums.average(self.sdl, "estimator.val_stats")
        return {f"val_{k}": v for k, v in zip(["loss"] + self.metric_names, averages)}

    def _record(self, epoch: int, logs: dict, rows: int, train_s: float, epoch_s: float):
        """History, checkpoint (rank 0) and the epoch's report."""
        history = self.history
        history.setdefault("epoch", []).append(epoch + 1)
        for key, value in logs.items():
            history.setdefault(key, []).append(value)
        history.setdefault("rows_per_s", []).append(rows / max(train_s, 1e-9))
        if self.rank == 0:
            self._save_checkpoint(epoch + 1)  # counted as in the history, from 1
        self.reporter.event("epoch", epoch=epoch + 1, logs=logs, rows=rows,
                            rows_per_s=rows / max(train_s, 1e-9), seconds=epoch_s)

    def _callbacks_stop(self, epoch: int, logs: dict) -> bool:
        """Runs ``on_epoch_end``; True when any rank's callback asks to stop."""
        callbacks = self.spec.callbacks
        callbacks_call(callbacks, "on_epoch_end", epoch, dict(logs))
        if not self.agree_on_stop:
            return False
        stop = float(self.adapter.stop_requested() or
                     any(getattr(cb, "stop_training", False) for cb in callbacks))
        return bool(float(self.sdl.allreduce(np.array([stop]), op=self.sdl.Max,
                                             name="estimator.stop")[0]))
