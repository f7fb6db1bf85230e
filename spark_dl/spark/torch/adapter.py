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
from spark_dl.spark.launch.task.devices import choose_gpu, choose_transform_gpu
from spark_dl.spark.torch import util
from spark_dl.torch import _device as tensor_device

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


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without a driver, device or CUDA build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(use_gpu: bool, local_rank: int, warn: bool = True, what: str = "training",
            environ=None) -> torch.device:
    """This process's device by :func:`~spark_dl.spark.launch.task.devices.choose_gpu`'s
    rule (Spark's GPU, the local rank's, or the CPU), made current for CUDA."""
    index = choose_gpu(use_gpu, local_rank, cuda_device_count(), environ, warn=warn, what=what)
    if index is None:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _check_core_takes(device: torch.device) -> None:
    """Fails before training when the core cannot reduce tensors on ``device`` (a build
    without CUDA: the first gradient allreduce would fail)."""
    message = tensor_device.device_error("use_gpu=True: the model", str(device))
    if message is not None:
        raise RuntimeError(message)


def _agree_on_device(sdl, device: torch.device) -> None:
    """Every rank trains on the same kind of device, else a clear error on every rank
    (gradients cannot be reduced between CPU and GPU ranks)."""
    devices = sdl.allgather_object(str(device), name="spark_dl.estimator.devices")
    if len({d.split(":")[0] for d in devices}) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(devices))
        raise RuntimeError(
            f"the workers would train on different kinds of device ({listing}): with "
            "use_gpu=True every worker needs a usable GPU (give every task one through "
            "Spark's GPU resources), or set use_gpu=False to train on the CPUs")


def _scale_lr(groups, factor: float) -> list:
    """Multiplies the ``lr`` of optimizer param groups (or state-dict groups) by ``factor``.
    Returns, per group, (the scaled rate, the given one) for :func:`_unscaled` (None where
    the rate is not a number)."""
    pairs = []
    for group in groups:
        lr = group.get("lr")
        if not isinstance(lr, (int, float)):
            pairs.append(None)
            continue
        if factor != 1:
            group["lr"] = lr * factor
        pairs.append((group["lr"], lr))
    return pairs


def _unscaled(state: dict, factor: float, given=()) -> dict:
    """An optimizer state dict with the learning rate as the user gave it: exactly the given
    rate (``given``: what :func:`_scale_lr` returned) where a group still trains at its
    scaled rate, else (a scheduler changed it) the rate divided by ``factor``."""
    if factor == 1:
        return state
    for i, group in enumerate(state["param_groups"]):
        lr = group.get("lr")
        if isinstance(lr, (int, float)):
            pair = given[i] if i < len(given) else None
            group["lr"] = pair[1] if pair is not None and pair[0] == lr else lr / factor
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
        # Rank 0 alone tells of a fallback to the CPU (one warning per job, not per rank).
        self.device = _device(spec.use_gpu, local_rank, warn=rank == 0)
        if self.device.type == "cuda":
            _check_core_takes(self.device)
        _agree_on_device(sdl, self.device)
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed + rank)
        model, optimizer = fw.model, fw.optimizer
        model.to(self.device)
        if self.device.type != "cpu" and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves its state
        self.model, self.optimizer, self.dtype = model, optimizer, util.model_dtype(model)
        # Horovod's estimators train with the learning rate times the number of workers.
        self.lr_factor = size if fw.scale_learning_rate else 1
        self.lr_given = _scale_lr(optimizer.param_groups, self.lr_factor)
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
            # Into the DistributedOptimizer, which trains: load_state_dict replaces the
            # state and param_groups objects, which the wrapped optimizer only shared.
            self.opt.load_state_dict(ckpt["optimizer"])
            self.lr_given = _scale_lr(self.opt.param_groups, self.lr_factor)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"it does not fit this model/optimizer ({e})") from None
        return int(ckpt["epoch"]) + (1 if fmt == 1 else 0), ckpt.get("history")

    def save_checkpoint(self, epoch: int, history: dict) -> bytes:
        buf = io.BytesIO()
        torch.save({"format": CHECKPOINT_FORMAT, "epoch": epoch, "run_id": self.spec.run_id,
                    "model": _to_cpu(self.model.state_dict()),
                    "optimizer": self._optimizer_state(), "history": history}, buf)
        return buf.getvalue()

    def broadcast_state(self, root_rank: int) -> None:
        self.sdl.broadcast_parameters(self.model.state_dict(), root_rank=root_rank)
        self.sdl.broadcast_optimizer_state(self.opt, root_rank=root_rank)

    def result(self) -> dict:
        return {"model": _to_cpu(self.model.state_dict()), "optimizer": self._optimizer_state()}

    def _optimizer_state(self) -> dict:
        """The optimizer's state dict on the CPU, with the learning rate as the user gave it."""
        return _to_cpu(_unscaled(self.opt.state_dict(), self.lr_factor, self.lr_given))

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
    """A ``torch.nn.Module`` applied in eval mode, under ``torch.inference_mode``,
    ``batch_size`` rows at a time, features converted as in training (see
    :func:`spark_dl.spark.torch.util.predict`).

    With ``use_gpu`` it predicts on a GPU on the executors (never on the driver, whose
    two-row dry run only reads the output shapes): the GPU Spark assigned to the task,
    else the task's partition index modulo the executor's GPUs, by the rule of
    :func:`~spark_dl.spark.launch.task.devices.choose_gpu`; on hosts without CUDA it stays
    on the CPU, silently (transform has no worker to warn from once).

    Subclasses change how a slice of the feature columns becomes the model's arguments
    (:meth:`inputs`), as ``LightningPredictor`` does.
    """

    def __init__(self, model: torch.nn.Module, feature_cols, input_shapes, batch_size: int,
                 use_gpu: bool = False):
        self.model = model
        self.feature_cols = list(feature_cols)
        self.input_shapes = input_shapes
        self.batch_size = batch_size
        self.dtype = self._dtype(model)
        self.use_gpu = use_gpu
        self.on_executor = False  # set by prepare(), which only the executors call

    def __getstate__(self):
        state = dict(self.__dict__)
        state["on_executor"] = False
        return state

    @staticmethod
    def _dtype(model: torch.nn.Module) -> torch.dtype:
        """The dtype features are cast to (every feature here; LightningPredictor casts
        only floating ones)."""
        return util.model_dtype(model)

    def prepare(self) -> None:
        self.model.eval()
        self.on_executor = True

    def device(self) -> torch.device:
        """Where this call predicts (the task's GPU may differ between the tasks that one
        Python worker runs, so it is asked per call).

        Raises:
            GpuNotVisibleError: Spark assigned the task a GPU that this process cannot see.
        """
        if not (self.use_gpu and self.on_executor):
            return torch.device("cpu")
        index = choose_transform_gpu(True, cuda_device_count())
        if index is None:
            return torch.device("cpu")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def inputs(self, chunk: Dict[str, np.ndarray], device) -> List[torch.Tensor]:
        """The model's arguments for a slice of the feature columns, on ``device`` (None:
        the CPU)."""
        return util.feature_tensors(chunk, self.feature_cols, self.input_shapes, self.dtype,
                                    device)

    def predict(self, arrays):
        device = self.device()
        if self.on_executor:
            self.model.to(device)  # the executor's own copy: a no-op once it is there
        on = None if device.type == "cpu" else device
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            return util.predict(self.model, arrays, self.feature_cols,
                                lambda chunk: self.inputs(chunk, on), self.batch_size)
        finally:
            for m, mode in modes:
                m.training = mode
