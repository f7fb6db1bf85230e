"""The training function :class:`~spark_dl.spark.torch.TorchEstimator` runs on each worker.

``train(blob)`` receives one cloudpickled :class:`TrainSpec` and, on every rank:

1. ``spark_dl.torch.init()``; picks the device (the GPU Spark assigned, else CPU);
2. rank 0 loads the run's checkpoint if there is one and tells the others where to resume;
3. wraps the optimizer in ``DistributedOptimizer`` and broadcasts rank 0's parameters and
   optimizer state;
4. per epoch: trains on its share of the data (the Arrow loader gives every rank the same
   number of batches), validates, averages loss and metrics over all rows of all ranks
   (one allreduce), then rank 0 writes the checkpoint (atomically) and reports the epoch to
   the driver (which shows it and writes the TensorBoard scalars);
5. rank 0 returns the trained state and the history; the other ranks their timings.

Every rank must make the same collective calls in the same order; anything that could
make ranks diverge (NaN checks, callbacks asking to stop) is decided by an allreduce.
"""

import dataclasses
import io
import math
import threading
import time
from typing import Any, List, Optional

__all__ = ["TrainSpec", "train"]

CHECKPOINT_FORMAT = 1


@dataclasses.dataclass
class TrainSpec:
    """Everything a worker needs; built by the estimator on the driver."""

    model: Any
    optimizer: Any
    losses: Optional[List[Any]]
    loss_constructors: Optional[List[Any]]
    loss_weights: Optional[List[float]]
    metrics: List[Any]
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    input_shapes: List[List[int]]
    label_shapes: Optional[List[List[int]]]
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps: Optional[int]
    val_steps: Optional[int]
    shuffle_buffer_size: Optional[int]
    compression: Any
    backward_passes_per_step: int
    transformation_fn: Any
    train_minibatch_fn: Any
    callbacks: List[Any]
    remote_store: Any
    dataset: Any
    seed: int
    random_seed: Optional[int]
    terminate_on_nan: bool
    cache_all: bool
    train_threads: int
    val_threads: int
    use_gpu: bool
    verbose: int
    run_id: str


def preload_torch_dynamo() -> threading.Thread:
    """Imports ``torch._dynamo`` in a background thread and returns the thread.

    The first call of any optimizer method (``state_dict``, ``zero_grad`` ...) imports it
    (torch wraps them with ``torch._disable_dynamo``), which takes 1-2 s; started early, the
    import overlaps the rendezvous and the broadcasts instead of delaying the first step.
    """
    def load():
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # the optimizer's own import will report it
            pass

    thread = threading.Thread(target=load, name="spark_dl-preload", daemon=True)
    thread.start()
    return thread


def _device(use_gpu: bool, local_rank: int):
    import torch

    if use_gpu and torch.cuda.is_available():
        from spark_dl.spark.launch.task.devices import get_available_devices

        # With Spark GPU scheduling CUDA_VISIBLE_DEVICES holds only this task's GPU.
        index = 0 if get_available_devices() else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


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


def _callbacks(spec, hook: str, *args) -> None:
    """Calls ``hook`` on every callback that has it (duck-typed, as Keras callbacks)."""
    for cb in spec.callbacks:
        method = getattr(cb, hook, None)
        if method is not None:
            method(*args)


def _first_batch_error(exc, inputs, labels, spec):
    from spark_dl.spark.torch.util import describe

    return RuntimeError(
        f"training failed on the first batch: {type(exc).__name__}: {exc}\n"
        f"  inputs from feature columns {spec.feature_cols}: {describe(inputs)} "
        f"(input_shapes {spec.input_shapes})\n"
        f"  labels from label columns {spec.label_cols}: {describe(labels)}"
        + (f" (label_shapes {spec.label_shapes})" if spec.label_shapes else "") +
        "\nCheck input_shapes/label_shapes and the model's first layer and outputs.")


def _load_checkpoint(spec, model, optimizer, reporter):
    """(start epoch, history) from the run's checkpoint, loading its state (rank 0 only)."""
    import torch

    store = spec.remote_store
    path = store.checkpoint_path
    if not path or not store.exists(path):
        return 0, {}
    ckpt = torch.load(io.BytesIO(store.read(path)), map_location="cpu", weights_only=True)
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} has format {ckpt.get('format')!r}; this spark_dl "
                         f"reads {CHECKPOINT_FORMAT}; use another run_id")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"the checkpoint of run {spec.run_id!r} ({path}) does not fit this "
                         f"model/optimizer ({e}); use a new run_id to start afresh") from None
    done = int(ckpt["epoch"]) + 1
    reporter.note(f"resuming run {spec.run_id} after epoch {done} (checkpoint {path})")
    return done, dict(ckpt.get("history") or {})


def _save_checkpoint(spec, epoch, model, optimizer, history) -> None:
    import torch

    path = spec.remote_store.checkpoint_path
    if not path:
        return
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "epoch": epoch, "run_id": spec.run_id,
                "model": _to_cpu(model.state_dict()),
                "optimizer": _to_cpu(optimizer.state_dict()), "history": history}, buf)
    spec.remote_store.write(path, buf.getvalue())


class _Sums:
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
        """(averages over all ranks' rows, total rows)."""
        import torch

        t = torch.tensor([float(self.rows)] + self.values, dtype=torch.float64)
        t = sdl.allreduce(t, op=sdl.Sum, name=name)
        rows = float(t[0])
        return [float(v) / rows if rows else float("nan") for v in t[1:]], int(rows)


def train(blob: bytes) -> dict:
    """Trains on this worker; see the module doc. ``blob`` is a cloudpickled TrainSpec."""
    t_start = time.time()
    import cloudpickle
    import torch  # noqa: F401 - the slow import, timed as such

    import spark_dl.torch as sdl

    t_imported = time.time()
    preload_torch_dynamo()  # overlaps the rendezvous below
    spec: TrainSpec = cloudpickle.loads(blob)
    sdl.init()
    t_init = time.time()
    worker = _Worker(spec, sdl)
    worker.timings.update(start=t_start, imported=t_imported, initialized=t_init)
    return worker.run()


class _Worker:
    """One rank's training: set up in the constructor, :meth:`run` runs the epochs."""

    def __init__(self, spec: TrainSpec, sdl):
        import torch

        from spark_dl.spark.common.progress import Reporter
        from spark_dl.spark.torch import util

        self.spec, self.sdl, self.util = spec, sdl, util
        self.rank, self.size = sdl.rank(), sdl.size()
        self.timings = {}
        # Rank 0 always reports epochs (the driver writes TensorBoard scalars from them);
        # steps only when the driver shows a progress bar.
        self.reporter = Reporter(enabled=self.rank == 0, steps=spec.verbose > 0)
        self.device = _device(spec.use_gpu, sdl.local_rank())
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed + self.rank)
        model, optimizer = spec.model, spec.optimizer
        model.to(self.device)
        if self.device.type != "cpu" and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves its state
        self.model, self.dtype = model, util.model_dtype(model)

        start, history = (_load_checkpoint(spec, model, optimizer, self.reporter)
                          if self.rank == 0 else (0, {}))
        self.start_epoch, self.history = sdl.broadcast_object((start, history), 0,
                                                              name="estimator.resume")
        self.opt = sdl.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=spec.compression or sdl.Compression.none,
            backward_passes_per_step=spec.backward_passes_per_step)
        sdl.broadcast_parameters(model.state_dict(), root_rank=0)
        sdl.broadcast_optimizer_state(self.opt, root_rank=0)

        self.train_loader = self._loader("train", spec.batch_size, spec.train_threads)
        self.val_loader = (self._loader("val", spec.val_batch_size, spec.val_threads)
                           if spec.dataset.val_rows else None)
        self.train_steps = spec.train_steps or len(self.train_loader)
        self.val_steps = ((spec.val_steps or len(self.val_loader))
                          if self.val_loader is not None else 0)

        losses = ([c() for c in spec.loss_constructors] if spec.loss_constructors
                  else spec.losses)
        self.loss_fn = util.make_loss_fn(losses, spec.loss_weights, len(spec.label_cols))
        self.metric_names = util.metric_names(spec.metrics, spec.label_cols)
        self.default_step = spec.train_minibatch_fn is None
        if self.default_step:
            self.train_minibatch = util.default_train_minibatch()
            self.train_minibatch.state["k"] = spec.backward_passes_per_step
        else:
            self.train_minibatch = spec.train_minibatch_fn
        params = {"epochs": spec.epochs, "steps": self.train_steps,
                  "val_steps": self.val_steps, "batch_size": spec.batch_size,
                  "run_id": spec.run_id}
        for cb in spec.callbacks:
            cb.model, cb.optimizer, cb.rank, cb.size, cb.params = \
                model, self.opt, self.rank, self.size, params

    def _loader(self, split: str, batch_size: int, threads: int):
        from spark_dl.spark.common.data_loader import ArrowDataLoader

        spec = self.spec
        kwargs = {} if spec.shuffle_buffer_size is None else \
            {"shuffle_buffer_size": spec.shuffle_buffer_size}
        columns = spec.feature_cols + spec.label_cols + (
            [spec.sample_weight_col] if spec.sample_weight_col else [])
        return ArrowDataLoader(spec.dataset.source(spec.remote_store, split),
                               batch_size=batch_size, rank=self.rank, size=self.size,
                               columns=columns, shuffle=split == "train", seed=spec.seed,
                               to_torch=True, num_threads=threads,
                               cache_in_memory=spec.cache_all, **kwargs)

    def transform_outputs(self, outputs, labels):
        return self.util.match_outputs(outputs, labels,
                                       reshape_labels=self.spec.label_shapes is None)

    def tensors(self, batch):
        """(inputs, labels, sample weights) of a loader batch, on the device."""
        spec, util = self.spec, self.util
        if spec.transformation_fn is not None:
            batch = spec.transformation_fn(batch)
        inputs = util.feature_tensors(batch, spec.feature_cols, spec.input_shapes, self.dtype,
                                      self.device)
        labels = util.label_tensors(batch, spec.label_cols, spec.label_shapes, self.device)
        weights = (util.feature_tensors(batch, [spec.sample_weight_col], [[-1]], self.dtype,
                                        self.device)[0] if spec.sample_weight_col else None)
        return inputs, labels, weights

    def run(self) -> dict:
        spec, reporter = self.spec, self.reporter
        _callbacks(spec, "on_train_begin", {})
        self.timings["ready"] = time.time()
        reporter.event("start", epochs=spec.epochs, start_epoch=self.start_epoch,
                       steps=self.train_steps, val_steps=self.val_steps, size=self.size,
                       device=str(self.device))
        stopped = None
        epoch_times = []
        try:
            for epoch in range(self.start_epoch, spec.epochs):
                _callbacks(spec, "on_epoch_begin", epoch, {})
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
            if self.start_epoch >= spec.epochs:
                reporter.note(f"run {spec.run_id} already finished its {spec.epochs} "
                              "epoch(s); nothing to train")
            _callbacks(spec, "on_train_end", dict(self.history))
        finally:
            self.train_loader.close()
            if self.val_loader is not None:
                self.val_loader.close()
        self.timings.update(end=time.time(), epoch_s=epoch_times)
        if self.rank != 0:
            return {"timings": self.timings}
        return {"model": _to_cpu(self.model.state_dict()),
                "optimizer": _to_cpu(self.opt.state_dict()), "history": self.history,
                "start_epoch": self.start_epoch, "timings": self.timings, "stopped": stopped}

    def train_epoch(self, epoch: int):
        """(averaged logs, rows over all ranks, reason to stop or None) of one epoch."""
        import torch

        spec, sdl = self.spec, self.sdl
        self.model.train()
        sums = _Sums(len(self.metric_names))
        stopped = None
        for step, batch in enumerate(_batches(self.train_loader, self.train_steps, epoch)):
            inputs, labels, weights = self.tensors(batch)
            try:
                outputs, loss = self.train_minibatch(self.model, self.opt,
                                                     self.transform_outputs, self.loss_fn,
                                                     inputs, labels, weights)
            except Exception as e:
                if "first_step" not in self.timings:
                    raise _first_batch_error(e, inputs, labels, spec) from e
                raise
            self.timings.setdefault("first_step", time.time())
            value = float(loss.detach())
            with torch.no_grad():
                mvalues = (self.util.metric_values(spec.metrics,
                                                   *self.transform_outputs(outputs, labels))
                           if spec.metrics else [])
            sums.add(int(inputs[0].shape[0]), value, mvalues)
            if spec.terminate_on_nan:
                # Every rank must stop at the same step (the next collectives must match).
                bad = torch.tensor([0.0 if self.util.is_finite(value) else 1.0])
                if float(sdl.allreduce(bad, op=sdl.Max, name="estimator.nan")[0]):
                    stopped = f"loss is not finite at epoch {epoch + 1}, step {step + 1}"
                    break
            _callbacks(spec, "on_batch_end", step, {"loss": value})
            if self.reporter.step_due():
                self.reporter.event("step", epoch=epoch + 1, step=step + 1,
                                    steps=self.train_steps,
                                    loss=sums.values[0] / max(sums.rows, 1))
        if self.default_step:
            self.train_minibatch.flush(self.opt)
        averages, rows = sums.average(sdl, "estimator.train_stats")
        return dict(zip(["loss"] + self.metric_names, averages)), rows, stopped

    def validate(self, epoch: int) -> dict:
        """Averaged ``val_`` loss and metrics of one epoch."""
        import torch

        spec = self.spec
        self.model.eval()
        sums = _Sums(len(self.metric_names))
        with torch.no_grad():
            for batch in _batches(self.val_loader, self.val_steps, epoch):
                inputs, labels, weights = self.tensors(batch)
                outputs, labels = self.transform_outputs(self.model(*inputs), labels)
                loss = float(self.loss_fn(outputs, labels, weights))
                mvalues = (self.util.metric_values(spec.metrics, outputs, labels)
                           if spec.metrics else [])
                sums.add(int(inputs[0].shape[0]), loss, mvalues)
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
            _save_checkpoint(self.spec, epoch, self.model, self.opt, history)
        self.reporter.event("epoch", epoch=epoch + 1, logs=logs, rows=rows,
                            rows_per_s=rows / max(train_s, 1e-9), seconds=epoch_s)

    def _callbacks_stop(self, epoch: int, logs: dict) -> bool:
        """Runs ``on_epoch_end``; True when any rank's callback asks to stop."""
        import torch

        spec = self.spec
        if not spec.callbacks:
            return False
        _callbacks(spec, "on_epoch_end", epoch, dict(logs))
        stop = max(float(bool(getattr(cb, "stop_training", False))) for cb in spec.callbacks)
        return bool(float(self.sdl.allreduce(torch.tensor([stop]), op=self.sdl.Max,
                                             name="estimator.stop")[0]))
