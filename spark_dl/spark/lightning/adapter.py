"""Lightning's side of the shared estimator machinery (the contract is
:mod:`spark_dl.spark.common.adapter`).

How ``Trainer.fit`` meets the shared worker loop
------------------------------------------------
The shared loop (:mod:`spark_dl.spark.common.worker`) owns the epochs: it reads the Arrow
batches, resumes, writes the run's checkpoint, averages loss and metrics, decides NaN stops
and reports to the driver. Lightning owns what happens in a step and around it: hooks,
``self.log``, callbacks, schedulers, gradient clipping, loggers, profilers. Both run in one
worker process as two threads that never run at the same time:

- :class:`LightningWorker` starts ``Trainer.fit`` in a helper thread with
  :class:`~spark_dl.lightning.SparkDLStrategy` and two sized iterables as its train and
  validation data; each ``next()`` on them hands control back to the shared loop and waits
  for the batch it gives (:class:`_Exchange`);
- ``train_step(batch)`` / ``eval_step(batch)`` give one batch and wait until Lightning asks
  for the next one: by then the step, its callbacks and (after an epoch's last batch) the
  validation or the epoch's end hooks have run, and a callback (:class:`_Tap`) has recorded
  the step's loss and logged values.

So every Lightning feature works unchanged, and checkpoints, resume, metrics and progress
have the same semantics as every other estimator. The run's checkpoint is Lightning's own
format (``Trainer.save_checkpoint``'s dict, plus a ``"spark_dl"`` entry with the epoch and
history), taken when the epoch's work is complete; a resumed fit restores it with
``Trainer.fit(ckpt_path=...)`` (weights, optimizers, schedulers, callback states, loop
counters).
"""

import atexit
import copy
import dataclasses
import importlib
import io
import logging
import os
import queue
import tempfile
import threading
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from spark_dl.spark.common.adapter import WorkerAdapter
from spark_dl.spark.launch.task.devices import choose_gpu
from spark_dl.spark.lightning import util
from spark_dl.spark.torch.adapter import TorchPredictor, cuda_device_count
from spark_dl.torch import _device as tensor_device

__all__ = ["LightningSpec", "LightningWorker", "LightningPredictor", "CHECKPOINT_FORMAT",
           "default_logger"]

# 2: "epoch" counts from 1, as the history (and Lightning's own "epoch") does; 1 (still
# read): counted from 0.
CHECKPOINT_FORMAT = 2


@dataclasses.dataclass
class LightningSpec:
    """Lightning's part of a worker's :class:`~spark_dl.spark.common.worker.TrainSpec`."""

    module: Any
    optimizer: Any
    losses: Optional[List[Any]]
    input_shapes: Optional[List[List[int]]]
    trainer_args: Dict[str, Any]
    logger: Any
    checkpoint_callback: Any
    profiler: Any
    log_every_n_steps: int
    compression: Any
    backward_passes_per_step: int
    package: str
    metric_names: List[str]
    loss_weights: Optional[List[float]] = None


class _Exchange:
    """Strict alternation between the worker loop (main thread) and ``Trainer.fit`` (helper
    thread): exactly one of them runs at any time, so the two never issue collectives
    concurrently and the step's records are read while Lightning waits."""

    def __init__(self):
        self.to_fit: "queue.Queue" = queue.Queue(maxsize=1)
        self.to_loop: "queue.Queue" = queue.Queue(maxsize=1)

    # Lightning's side (the fit thread).
    def request(self, kind: str):
        self.to_loop.put(("ready", kind))
        return self.to_fit.get()

    # The worker loop's side.
    def give(self, batch, thread: threading.Thread):
        self.to_fit.put(batch)
        return self.wait(thread)

    def wait(self, thread: threading.Thread):
        while True:
            try:
                return self.to_loop.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive():
                    # The thread always posts before it ends; one last look.
                    try:
                        return self.to_loop.get_nowait()
                    except queue.Empty:
                        raise RuntimeError("Lightning's fit thread ended without a "
                                           "word") from None


class _Feed:
    """A sized iterable of batches that the worker loop supplies through the exchange."""

    def __init__(self, exchange: _Exchange, kind: str, length: int):
        self.exchange, self.kind, self.length = exchange, kind, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for _ in range(self.length):
            yield self.exchange.request(self.kind)


def _tap_class(pl):
    """The Lightning callback (of ``pl``'s class tree) recording each step for the loop."""

    class _Tap(pl.Callback):
        def __init__(self, worker: "LightningWorker"):
            self.worker = worker
            self.epoch_starts = 0

        def _result(self, outputs, batch, scale=1):
            """(rows, loss, metric values) of the step that just ran: the loss the step
            returned (times ``scale``), else the one it logged
            (``train_loss``/``val_loss``/``loss``)."""
            w = self.worker
            logged = w.capture.values
            loss = util.loss_of_outputs(outputs)
            if loss is not None:
                loss *= scale
            if loss is None:
                loss = logged.get("loss")
            values = [logged.get(n, float("nan")) for n in w.fw.metric_names]
            return (util.rows_of(batch, w.spec.feature_cols),
                    float("nan") if loss is None else loss, values)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.worker.capture.clear()

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                      dataloader_idx=0):
            self.worker.capture.clear()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Automatic optimization hands callbacks the loss divided by
            # accumulate_grad_batches (what backward saw); the history wants the step's.
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self.worker.last_result = self._result(outputs, batch, scale)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                    dataloader_idx=0):
            self.worker.last_result = self._result(outputs, batch)

        def on_train_epoch_start(self, trainer, pl_module):
            # The previous epoch (training, validation, epoch-end hooks, schedulers) is
            # complete: its checkpoint, which resumes at the start of this epoch.
            self.epoch_starts += 1
            if self.epoch_starts > 1:
                self.worker.take_checkpoint(trainer, at_epoch_start=True)

        def on_train_end(self, trainer, pl_module):
            self.worker.take_checkpoint(trainer)

    return _Tap


def _between_epochs(ckpt: dict) -> dict:
    """A checkpoint dumped when an epoch starts, as one taken after the previous epoch.

    By then Lightning counts the new epoch as ready (its epoch progress says ready =
    completed + 1), and ``fit(ckpt_path=...)`` would take that epoch as under way and skip
    it, losing an epoch on every resume from a checkpoint before the last one."""
    loops = ckpt.get("loops") or {}
    progress = (loops.get("fit_loop") or {}).get("epoch_progress")
    if not progress:
        return ckpt
    progress = copy.deepcopy(progress)
    for part in ("current", "total"):
        if part in progress and "completed" in progress[part]:
            progress[part]["ready"] = progress[part]["completed"]
    fit_loop = dict(loops["fit_loop"], epoch_progress=progress)
    return dict(ckpt, loops=dict(loops, fit_loop=fit_loop))


class _LoopCallback:
    """What the shared loop sees of the user's callbacks: one object whose
    ``stop_training`` is True once Lightning's fit has ended (an EarlyStopping callback,
    ``trainer.should_stop``); Lightning decides that on every rank alike."""

    def __init__(self, worker: "LightningWorker"):
        self.worker = worker
        self.params: Dict[str, Any] = {}

    @property
    def stop_training(self) -> bool:
        return self.worker.stop_requested()


def _device(use_gpu: bool, local_rank: int, rank: int) -> torch.device:
    """The rule of :func:`~spark_dl.spark.launch.task.devices.choose_gpu`, as the torch
    estimator applies it (rank 0 alone warns of a fallback to the CPU). The strategy's
    ``root_device`` makes the same choice (local rank modulo the visible GPUs: with Spark's
    GPU pinned by CUDA_VISIBLE_DEVICES, index 0)."""
    index = choose_gpu(use_gpu, local_rank, cuda_device_count(), warn=rank == 0)
    if index is None:
        return torch.device("cpu")
    device = torch.device("cuda", index)
    # A core that cannot reduce CUDA tensors would fail at the first gradient: say so now.
    message = tensor_device.device_error("use_gpu=True: the model", str(device))
    if message is not None:
        raise RuntimeError(message)
    return device


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def redirect_logger(logger, root: str) -> None:
    """Points a Lightning TensorBoard/CSV logger at ``root`` (other loggers keep theirs)."""
    for attr in ("_root_dir", "_save_dir"):
        if hasattr(logger, attr):
            setattr(logger, attr, root)


def default_logger(pl, save_dir: str):
    """The logger of a fit that names none: Lightning's ``TensorBoardLogger`` in
    ``save_dir`` (``<save_dir>/lightning_logs/version_N``), or a ``CSVLogger`` there where
    neither ``tensorboard`` nor ``tensorboardX`` is installed."""
    try:
        return pl.loggers.TensorBoardLogger(save_dir)
    except ModuleNotFoundError:
        return pl.loggers.CSVLogger(save_dir)


class LightningWorker(WorkerAdapter):
    """One rank's Lightning training (see the module doc)."""

    def __init__(self, spec, rank: int, size: int, local_rank: int):
        fw: LightningSpec = spec.framework
        self.spec, self.fw, self.rank = spec, fw, rank
        self.pl = importlib.import_module(fw.package)
        self.device = _device(spec.use_gpu, local_rank, rank)
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed + rank)
        self.module = fw.module
        self.dtype = util.module_dtype(self.module)
        util.install_default_steps(self.module, fw.losses, fw.optimizer, spec.feature_cols,
                                   spec.label_cols, fw.loss_weights, spec.sample_weight_col)
        self.capture = util.LogCapture(self.module)
        # The user's callbacks are Lightning's; the shared loop gets one stand-in.
        self.callbacks = list(spec.callbacks or [])
        self.loop_callback = _LoopCallback(self)
        spec.callbacks = [self.loop_callback]
        self.exchange = _Exchange()
        self.thread: Optional[threading.Thread] = None
        self.state: Optional[str] = None      # what Lightning waits for: "train", "val"
        self.finished = False
        self.last_result = (0, float("nan"), [])
        self.resume_payload: Optional[bytes] = None
        self.ckpt_path: Optional[str] = None
        self.checkpoint: Optional[dict] = None
        self.trainer = None
        self._out: Optional[str] = None       # the run's local output directory

    # ------------------------------------------------------------------ state

    def load_checkpoint(self, payload: bytes):
        ckpt = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
        ours = ckpt.get("spark_dl") if isinstance(ckpt, dict) else None
        if not ours or ours.get("format") not in (1, CHECKPOINT_FORMAT):
            raise ValueError(f"it is not a spark_dl Lightning checkpoint of formats 1 to "
                             f"{CHECKPOINT_FORMAT}")
        try:
            self.module.load_state_dict(ckpt["state_dict"])
        except (RuntimeError, KeyError) as e:
            raise ValueError(f"it does not fit this module ({e})") from None
        self.resume_payload = payload
        return int(ours["epoch"]) + (1 if ours["format"] == 1 else 0), ours.get("history")

    def take_checkpoint(self, trainer, at_epoch_start: bool = False) -> None:
        """Lightning's checkpoint dict of the current state (rank 0; called in the fit
        thread at the points where an epoch is complete). ``at_epoch_start``: taken as
        the next epoch starts, it is made a checkpoint between the two epochs."""
        if self.rank == 0:
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            self.checkpoint = _between_epochs(ckpt) if at_epoch_start else ckpt

    def save_checkpoint(self, epoch: int, history: dict) -> bytes:
        if self.checkpoint is None:
            raise RuntimeError("no Lightning checkpoint was taken at the end of the epoch")
        ckpt = dict(self.checkpoint)
        ckpt["spark_dl"] = {"format": CHECKPOINT_FORMAT, "epoch": epoch, "history": history,
                            "run_id": self.spec.run_id}
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        self._sync_outputs()
        return buf.getvalue()

    def broadcast_state(self, root_rank: int) -> None:
        import spark_dl.torch as sdl

        payload = sdl.broadcast_object(self.resume_payload, root_rank=root_rank,
                                       name="lightning.resume")
        if payload is None:
            sdl.broadcast_parameters(self.module.state_dict(), root_rank=root_rank)
            return
        # Every rank restores the whole Lightning state from the same file.
        path = os.path.join(tempfile.mkdtemp(prefix="spark_dl_resume_"), "resume.ckpt")
        with open(path, "wb") as f:
            f.write(payload)
        self.ckpt_path = path
        if self.rank != root_rank:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
            self.module.load_state_dict(ckpt["state_dict"])

    def result(self) -> dict:
        self.capture.remove()
        metrics = {}
        if self.trainer is not None:
            for k, v in self.trainer.callback_metrics.items():
                value = util.scalar(v)
                if value is not None:
                    metrics[k] = value
        return {"state_dict": _to_cpu(self.module.state_dict()), "logged_metrics": metrics}

    def callback_objects(self):
        return self.module, None

    def attach_callbacks(self, callbacks, params) -> None:
        # Only the loop's stand-in is in ``callbacks``; it needs the step counts.
        self.loop_callback.params = dict(params)

    def stop_requested(self) -> bool:
        """True once Lightning's fit ended before the last epoch (e.g. EarlyStopping)."""
        return self.finished and (self.trainer is None or
                                  self.trainer.current_epoch < self.spec.epochs)

    # ------------------------------------------------------------------ outputs

    def _output_dir(self) -> Optional[str]:
        """This run's local output directory: the run directory of a local store, else a
        temporary directory that rank 0 publishes into the run directory after each epoch
        (removed when the worker process exits)."""
        store = self.spec.remote_store
        if self._out is None and store.run_path is not None:
            ctx = store.get_local_output_dir()
            self._out = ctx.__enter__()
            atexit.register(ctx.__exit__, None, None, None)
        return self._out

    def _sync_outputs(self) -> None:
        if self._out is not None and self.rank == 0:
            self.spec.remote_store.sync(self._out)

    # ------------------------------------------------------------------ the fit thread

    def _trainer(self):
        fw, spec = self.fw, self.spec
        from spark_dl.lightning.strategy import strategy_class

        # The worker's device by the shared GPU rule (_device), not the strategy's own
        # local-rank default: they differ when Spark's GPU is not the local rank's.
        strategy = strategy_class(fw.package)(
            compression=fw.compression,
            device=self.device if self.device.type == "cuda" else None)
        out = self._output_dir()
        callbacks = list(self.callbacks)
        logs = os.path.join(out, spec.remote_store.store.get_logs_subdir()) if out else None
        logger = fw.logger
        if logger is None:
            # Horovod's default: a TensorBoard logger in the run's logs directory, so
            # callbacks that need a logger (LearningRateMonitor ...) work.
            logger = default_logger(self.pl, logs or tempfile.mkdtemp(prefix="spark_dl_logs_"))
        if out is not None:
            if logger:
                redirect_logger(logger, logs)
            if fw.checkpoint_callback is not None and fw.checkpoint_callback.dirpath is None:
                fw.checkpoint_callback.dirpath = os.path.join(out, "checkpoints")
        if fw.checkpoint_callback is not None:
            callbacks.append(fw.checkpoint_callback)
        callbacks.append(_tap_class(self.pl)(self))
        checkpointing = any(isinstance(cb, self.pl.callbacks.ModelCheckpoint)
                            for cb in callbacks)
        kwargs = dict(fw.trainer_args or {})
        kwargs.update(
            strategy=strategy, accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=1, max_epochs=spec.epochs, callbacks=callbacks, logger=logger,
            enable_checkpointing=checkpointing, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, profiler=fw.profiler,
            # (Lightning warns on every rank when an epoch is shorter than the interval.)
            log_every_n_steps=max(1, min(fw.log_every_n_steps,
                                         self.loop_callback.params.get("steps") or 1)),
            accumulate_grad_batches=fw.backward_passes_per_step,
            default_root_dir=out or tempfile.mkdtemp(prefix="spark_dl_lightning_"))
        return self.pl.Trainer(**kwargs)

    def _start(self) -> None:
        if self.spec.verbose < 2:
            # The estimator reports progress; Lightning's start-up lines repeat per rank.
            logging.getLogger(self.fw.package).setLevel(logging.WARNING)
            warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")
        params = self.loop_callback.params
        train = _Feed(self.exchange, "train", params["steps"])
        val = _Feed(self.exchange, "val", params["val_steps"]) if params["val_steps"] else None
        self.trainer = trainer = self._trainer()

        def fit():
            try:
                trainer.fit(self.module, train_dataloaders=train, val_dataloaders=val,
                            ckpt_path=self.ckpt_path)
                self.exchange.to_loop.put(("finished", None))
            except BaseException as e:  # noqa: BLE001 - handed to the worker loop
                self.exchange.to_loop.put(("error", e))

        self.thread = threading.Thread(target=fit, name="spark_dl-lightning-fit", daemon=True)
        self.thread.start()
        self._take(self.exchange.wait(self.thread))

    def _take(self, message) -> None:
        kind, value = message
        if kind == "ready":
            self.state = value
        elif kind == "finished":
            self.state, self.finished = None, True
        else:
            self.state, self.finished = None, True
            raise value

    def _step(self, batch, kind: str):
        if self.finished:
            # Lightning stopped inside the epoch (a callback set should_stop): the shared
            # loop finishes the epoch without training and stops after it.
            return 0, 0.0, [0.0] * len(self.fw.metric_names)
        if self.state != kind:
            raise RuntimeError(f"Lightning waits for a {self.state} batch, the estimator gives "
                               f"a {kind} batch: a trainer argument or callback changed the "
                               "loop's shape")
        self._take(self.exchange.give(batch, self.thread))
        return self.last_result

    # ------------------------------------------------------------------ steps

    def to_tensors(self, arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        return util.to_batch(arrays, self.spec.feature_cols, self.fw.input_shapes, self.dtype)

    def metric_names(self) -> List[str]:
        return list(self.fw.metric_names)

    def begin_epoch(self, epoch: int, training: bool) -> None:
        if training and self.thread is None:
            self._start()

    def train_step(self, batch):
        return self._step(batch, "train")

    def eval_step(self, batch):
        return self._step(batch, "val")


class LightningPredictor(TorchPredictor):
    """A LightningModule's ``forward``, applied as :class:`TorchPredictor` applies a module
    (eval mode, ``torch.inference_mode`` as Lightning's own ``Trainer.predict``, the GPU
    rule), with the features converted as in Lightning training (:func:`~.util.to_batch`:
    only floating columns take the module's dtype, so integer features stay integers)."""

    @staticmethod
    def _dtype(model: torch.nn.Module) -> torch.dtype:
        return util.module_dtype(model)

    def inputs(self, chunk, device):
        batch = util.to_batch(chunk, self.feature_cols, self.input_shapes, self.dtype)
        inputs = util.feature_inputs(batch, self.feature_cols)
        return inputs if device is None else [t.to(device, non_blocking=True) for t in inputs]
