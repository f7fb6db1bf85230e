"""PyTorch's side of the shared estimator machinery (the contract is
:mod:`spark_dl.spark.common.adapter`).

- :class:`TorchSpec`: what :class:`~spark_dl.spark.torch.TorchEstimator` sends its workers
  beyond the shared fields (model, optimizer, losses, input shapes, the custom step ...);
- :class:`TorchWorker`: one rank's model on its device, the optimizer wrapped in
  :class:`spark_dl.torch.DistributedOptimizer`, Horovod's default training step (with
  gradient accumulation), checkpoints in ``torch.save`` format;
- :class:`TorchPredictor`: what ``TorchModel.transform`` applies on the executors.

Features and labels become tensors by the rules of :mod:`spark_dl.spark.torch.util`, on
the driver's dry run, on the workers and in ``transform`` alike.
"""

import dataclasses
import io
import threading
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from spark_dl.spark.common.adapter import Predictor, WorkerAdapter
from spark_dl.spark.torch import util

__all__ = ["TorchSpec", "TorchWorker", "TorchPredictor", "preload_torch_dynamo"]

# 2: "epoch" counts from 1, as the history does (the number of epochs done); 1 (still read):
# counted from 0.
CHECKPOINT_FORMAT = 2


@dataclasses.dataclass
class TorchSpec:
    """PyTorch's part of a worker's :class:`~spark_dl.spark.common.worker.TrainSpec`."""

    model: Any
    optimizer: Any
    losses: Optional[List[Any]]
    loss_constructors: Optional[List[Any]]
    loss_weights: Optional[List[float]]
    input_shapes: List[List[int]]
    compression: Any
    backward_passes_per_step: int
    train_minibatch_fn: Any
    scale_learning_rate: bool = False


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


def _device(use_gpu: bool, local_rank: int) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        from spark_dl.spark.launch.task.devices import get_available_devices

        # With Spark GPU scheduling CUDA_VISIBLE_DEVICES holds only this task's GPU.
        index = 0 if get_available_devices() else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _scale_lr(groups, factor: float) -> None:
    """Multiplies the ``lr`` of optimizer param groups (or state-dict groups) by ``factor``."""
    if factor != 1:
        for group in groups:
            if isinstance(group.get("lr"), (int, float)):
                group["lr"] = group["lr"] * factor


def _unscaled(state: dict, factor: float) -> dict:
    """An optimizer state dict with the learning rate as the user gave it."""
    _scale_lr(state["param_groups"], 1.0 / factor)
    return state


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class TorchWorker(WorkerAdapter):
    """One rank's PyTorch training (see :class:`~spark_dl.spark.common.adapter.WorkerAdapter`)."""

    @classmethod
    def before_init(cls) -> None:
        preload_torch_dynamo()

    def __init__(self, spec, rank: int, size: int, local_rank: int):
        import spark_dl.torch as sdl

        fw: TorchSpec = spec.framework
        self.spec, self.fw, self.sdl = spec, fw, sdl
        self.device = _device(spec.use_gpu, local_rank)
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed + rank)
        model, optimizer = fw.model, fw.optimizer
        model.to(self.device)
        if self.device.type != "cpu" and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves its state
        self.model, self.optimizer, self.dtype = model, optimizer, util.model_dtype(model)
        # Horovod's estimators train with the learning rate times the number of workers.
        self.lr_factor = size if fw.scale_learning_rate else 1
        _scale_lr(optimizer.param_groups, self.lr_factor)
        self.opt = sdl.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=fw.compression or sdl.Compression.none,
            backward_passes_per_step=fw.backward_passes_per_step)
        losses = [c() for c in fw.loss_constructors] if fw.loss_constructors else fw.losses
        self.loss_fn = util.make_loss_fn(losses, fw.loss_weights, len(spec.label_cols))
        self.default_step = fw.train_minibatch_fn is None
        if self.default_step:
            self.train_minibatch = util.default_train_minibatch()
            self.train_minibatch.state["k"] = fw.backward_passes_per_step
        else:
            self.train_minibatch = fw.train_minibatch_fn

    # ------------------------------------------------------------------ state

    def load_checkpoint(self, payload: bytes):
        ckpt = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        fmt = ckpt.get("format")
        if fmt not in (1, CHECKPOINT_FORMAT):
            raise ValueError(f"it has format {fmt!r}; this spark_dl reads formats 1 to "
                             f"{CHECKPOINT_FORMAT}")
        try:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            _scale_lr(self.optimizer.param_groups, self.lr_factor)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"it does not fit this model/optimizer ({e})") from None
        return int(ckpt["epoch"]) + (1 if fmt == 1 else 0), ckpt.get("history")

    def save_checkpoint(self, epoch: int, history: dict) -> bytes:
        buf = io.BytesIO()
        torch.save({"format": CHECKPOINT_FORMAT, "epoch": epoch, "run_id": self.spec.run_id,
                    "model": _to_cpu(self.model.state_dict()),
                    "optimizer": _to_cpu(_unscaled(self.opt.state_dict(), self.lr_factor)),
                    "history": history}, buf)
        return buf.getvalue()

    def broadcast_state(self, root_rank: int) -> None:
        self.sdl.broadcast_parameters(self.model.state_dict(), root_rank=root_rank)
        self.sdl.broadcast_optimizer_state(self.opt, root_rank=root_rank)

    def result(self) -> dict:
        return {"model": _to_cpu(self.model.state_dict()),
                "optimizer": _to_cpu(_unscaled(self.opt.state_dict(), self.lr_factor))}

    def callback_objects(self):
        return self.model, self.opt

    # ------------------------------------------------------------------ steps

    def to_tensors(self, arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        return util.torch_batch(arrays)

    def metric_names(self) -> List[str]:
        return util.metric_names(self.spec.metrics, self.spec.label_cols)

    def _tensors(self, batch):
        """(inputs, labels, sample weights) of a batch, on the device."""
        spec = self.spec
        inputs = util.feature_tensors(batch, spec.feature_cols, self.fw.input_shapes,
                                      self.dtype, self.device)
        labels = util.label_tensors(batch, spec.label_cols, spec.label_shapes, self.device)
        weights = (util.feature_tensors(batch, [spec.sample_weight_col], [[-1]], self.dtype,
                                        self.device)[0] if spec.sample_weight_col else None)
        return inputs, labels, weights

    def transform_outputs(self, outputs, labels):
        return util.match_outputs(outputs, labels,
                                  reshape_labels=self.spec.label_shapes is None)

    def _metrics(self, outputs, labels) -> List[float]:
        metrics = self.spec.metrics
        return util.metric_values(metrics, outputs, labels) if metrics else []

    def begin_epoch(self, epoch: int, training: bool) -> None:
        self.model.train(training)

    def train_step(self, batch):
        inputs, labels, weights = self._tensors(batch)
        outputs, loss = self.train_minibatch(self.model, self.opt, self.transform_outputs,
                                             self.loss_fn, inputs, labels, weights)
        with torch.no_grad():
            metrics = (self._metrics(*self.transform_outputs(outputs, labels))
                       if self.spec.metrics else [])
        return int(inputs[0].shape[0]), float(loss.detach()), metrics

    def eval_step(self, batch):
        inputs, labels, weights = self._tensors(batch)
        with torch.no_grad():
            outputs, labels = self.transform_outputs(self.model(*inputs), labels)
            loss = float(self.loss_fn(outputs, labels, weights))
            return int(inputs[0].shape[0]), loss, self._metrics(outputs, labels)

    def end_epoch(self, epoch: int, training: bool) -> None:
        if training and self.default_step:
            self.train_minibatch.flush(self.opt)

    def first_batch_error(self, exc, batch):
        spec = self.spec
        try:
            inputs, labels, _ = self._tensors(batch)
        except Exception:  # the conversion itself failed: describe the raw batch
            return super().first_batch_error(exc, batch)
        return RuntimeError(
            f"training failed on the first batch: {type(exc).__name__}: {exc}\n"
            f"  inputs from feature columns {spec.feature_cols}: {util.describe(inputs)} "
            f"(input_shapes {self.fw.input_shapes})\n"
            f"  labels from label columns {spec.label_cols}: {util.describe(labels)}"
            + (f" (label_shapes {spec.label_shapes})" if spec.label_shapes else "") +
            "\nCheck input_shapes/label_shapes and the model's first layer and outputs.")


class TorchPredictor(Predictor):
    """A ``torch.nn.Module`` applied in eval mode, without gradients, ``batch_size`` rows at
    a time (see :func:`spark_dl.spark.torch.util.predict`)."""

    def __init__(self, model: torch.nn.Module, feature_cols, input_shapes, batch_size: int):
        self.model = model
        self.feature_cols = list(feature_cols)
        self.input_shapes = input_shapes
        self.batch_size = batch_size
        self.dtype = util.model_dtype(model)

    def prepare(self) -> None:
        self.model.eval()

    def predict(self, arrays):
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            return util.predict(self.model, arrays, self.feature_cols, self.input_shapes,
                                self.dtype, self.batch_size)
        finally:
            for m, mode in modes:
                m.training = mode
