"""Keras' side of the shared estimator machinery (the contract is
:mod:`spark_dl.spark.common.adapter`).

- :class:`KerasSpec`: what :class:`~spark_dl.spark.keras.KerasEstimator` sends its workers
  beyond the shared fields: the model as ``.keras`` bytes, the optimizer's config, the
  compile arguments, the input specs and the metric names found by the driver's dry run;
- :class:`KerasWorker`: one rank's model compiled with its optimizer wrapped in
  :class:`spark_dl.keras.DistributedOptimizer`, one ``train_on_batch`` per batch;
  checkpoints are NumPy archives of the model's and optimizer's variables;
- :class:`KerasPredictor`: what ``KerasModel.transform`` applies on the executors.

Works with the Keras backend the driver uses (``KERAS_BACKEND``, given to the workers):
TensorFlow or PyTorch.
"""

import dataclasses
import io
import json
import logging
import os
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from spark_dl.spark.common.adapter import Predictor, WorkerAdapter
from spark_dl.spark.keras import util

__all__ = ["KerasSpec", "KerasWorker", "KerasPredictor", "compile_kwargs"]

# 2: "epoch" counts from 1, as the history does (the number of epochs done); 1 (still read):
# counted from 0.
CHECKPOINT_FORMAT = 2


@dataclasses.dataclass
class KerasSpec:
    """Keras' part of a worker's :class:`~spark_dl.spark.common.worker.TrainSpec`."""

    model_bytes: bytes
    custom_objects: Optional[Dict[str, Any]]
    optimizer_config: dict
    compile_config: Optional[dict]
    loss: Any
    metrics: Optional[List[Any]]
    loss_weights: Optional[List[float]]
    input_specs: list
    output_shapes: list
    metric_names: List[str]
    compression: Any
    backward_passes_per_step: int
    checkpoint_callback: Any
    backend: str
    scale_learning_rate: bool = False
    output_dtypes: Optional[List[str]] = None


def compile_kwargs(fw: KerasSpec, optimizer) -> dict:
    """``model.compile`` arguments: the model's own compile settings (when it was
    compiled), overridden by the estimator's loss, metrics and loss weights; never XLA
    (the collectives run as host callbacks, which XLA cannot compile)."""
    import keras

    kwargs = {}
    if fw.compile_config:
        with util.custom_scope(fw.custom_objects):
            kwargs = dict(keras.saving.deserialize_keras_object(fw.compile_config) or {})
    kwargs["optimizer"] = optimizer
    if fw.loss is not None:
        kwargs["loss"] = fw.loss
    if fw.metrics is not None:
        kwargs["metrics"] = fw.metrics
    if fw.loss_weights is not None:
        kwargs["loss_weights"] = fw.loss_weights
    kwargs["jit_compile"] = False
    kwargs.pop("steps_per_execution", None)
    return kwargs


def make_optimizer(fw: KerasSpec, lr_factor: float = 1):
    """A fresh optimizer from the spec's config, its learning rate times ``lr_factor``
    (a learning rate schedule is left as it is)."""
    import copy

    import keras

    config = copy.deepcopy(fw.optimizer_config)
    inner = config.get("config", {}) if isinstance(config, dict) else {}
    if lr_factor != 1 and isinstance(inner.get("learning_rate"), (int, float)):
        inner["learning_rate"] = inner["learning_rate"] * lr_factor
    with util.custom_scope(fw.custom_objects):
        return keras.optimizers.deserialize(config)


#: The framework check that must see a GPU, per Keras backend (for GpuNotVisibleError).
_GPU_PROBES = {"tensorflow": "tf.config.list_physical_devices('GPU')",
               "torch": "torch.cuda.is_available()", "jax": "jax.devices('gpu')"}


def _gpu_count(backend: str) -> int:
    """GPUs the Keras backend sees in this process (0 without a driver, device or GPU
    build of the backend)."""
    if backend == "tensorflow":
        import tensorflow as tf

        return len(tf.config.list_physical_devices("GPU"))
    if backend == "torch":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "jax":
        try:
            import jax

            return len(jax.devices("gpu"))
        except RuntimeError:  # no GPU platform
            return 0
    return 0


def _configure_devices(use_gpu: Optional[bool], local_rank: int, local_size: int,
                       warn: bool = True) -> str:
    """Picks this rank's device before the backend creates any, by the rule of
    :func:`~spark_dl.spark.launch.task.devices.choose_gpu` (Spark's GPU for the task, the
    local rank's with the knob, the CPU with one warning, or for the default use_gpu=None
    an info line, when there is none; Spark's GPU
    that the worker cannot see is a GpuNotVisibleError). TensorFlow: only that GPU is made
    visible, with memory growth, and CPU ranks of a host share its cores. Returns the
    device's name for the start-up report."""
    import keras

    from spark_dl.spark.launch.task.devices import choose_gpu

    backend = keras.backend.backend()
    count = _gpu_count(backend)
    # Outside the try below: GpuNotVisibleError is a RuntimeError and must not be taken
    # for "devices already initialized".
    index = choose_gpu(use_gpu, local_rank, count, warn=warn,
                       probe=_GPU_PROBES.get(backend, "the Keras backend"))
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        try:
            if index is not None:
                tf.config.set_visible_devices([gpus[index]], "GPU")
                tf.config.experimental.set_memory_growth(gpus[index], True)
                return f"gpu:{index}"
            if gpus:
                tf.config.set_visible_devices([], "GPU")
            if "TF_NUM_INTRAOP_THREADS" not in os.environ and local_size > 1:
                # Ranks of one host share its cores instead of each using all of them.
                cores = os.cpu_count() or 1
                tf.config.threading.set_intra_op_parallelism_threads(
                    max(1, cores // local_size))
        except RuntimeError:  # devices already initialized in this process: keep them
            pass
        return "cpu" if index is None else f"gpu:{index}"
    if backend == "torch":
        import torch

        if index is not None:
            torch.cuda.set_device(index)
            return f"cuda:{index}"
        return "cpu"
    return backend if index is None else f"{backend} gpu:{index}"


def _save_arrays(meta: dict, groups: Dict[str, List[np.ndarray]]) -> bytes:
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    for group, values in groups.items():
        for i, a in enumerate(values):
            arrays[f"{group}_{i:05d}"] = np.asarray(a)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _load_arrays(payload: bytes):
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        groups: Dict[str, List[np.ndarray]] = {}
        for key in sorted(k for k in z.files if k != "meta"):
            group, _, _ = key.rpartition("_")
            groups.setdefault(group, []).append(z[key])
    return meta, groups


def assign_variables(variables, values, what: str) -> None:
    """Assigns ``values`` to ``variables`` in order; ValueError when they do not match."""
    variables = list(variables)
    if len(variables) != len(values):
        raise ValueError(f"{what}: {len(values)} saved values for {len(variables)} "
                         "variables")
    for var, value in zip(variables, values):
        if tuple(var.shape) != tuple(value.shape):
            raise ValueError(f"{what}: variable {getattr(var, 'path', var.name)} has shape "
                             f"{tuple(var.shape)}, the saved value {tuple(value.shape)}")
    for var, value in zip(variables, values):
        var.assign(value)


def _numpy(variables) -> List[np.ndarray]:
    return [np.array(v) for v in variables]


class KerasWorker(WorkerAdapter):
    """One rank's Keras training (see :class:`~spark_dl.spark.common.adapter.WorkerAdapter`)."""

    @classmethod
    def before_init(cls) -> None:
        # Importing Keras and its backend takes seconds: overlap it with the rendezvous.
        threading.Thread(target=lambda: __import__("keras"), name="spark_dl-preload",
                         daemon=True).start()

    def __init__(self, spec, rank: int, size: int, local_rank: int):
        import keras

        import spark_dl.keras as sdk
        import spark_dl.numpy as sdn

        fw: KerasSpec = spec.framework
        self.spec, self.fw, self.sdn = spec, fw, sdn
        self.device = _configure_devices(spec.use_gpu, local_rank, sdn.local_size(),
                                         warn=rank == 0)
        if spec.random_seed is not None:
            keras.utils.set_random_seed(spec.random_seed + rank)
        self.model = util.model_from_bytes(fw.model_bytes, fw.custom_objects)
        kwargs = {}
        if fw.compression is not None:
            kwargs["compression"] = fw.compression
        # Horovod's estimators train with the learning rate times the number of workers.
        self.lr_factor = size if fw.scale_learning_rate else 1
        self.opt = sdk.DistributedOptimizer(
            make_optimizer(fw, self.lr_factor),
            backward_passes_per_step=fw.backward_passes_per_step, **kwargs)
        self.model.compile(**compile_kwargs(fw, self.opt))
        if not self.opt.built:  # its variables exist before the first step: broadcast them
            self.opt.build(self.model.trainable_variables)
        self.checkpoint_callback = fw.checkpoint_callback if rank == 0 else None

    # ------------------------------------------------------------------ state

    def _optimizer_variables(self):
        return list(self.opt.variables)

    def _optimizer_values(self, accumulators: bool = True) -> List[np.ndarray]:
        """The optimizer's variables with the learning rate as the user gave it; without
        the gradient accumulators backward_passes_per_step adds when ``accumulators`` is
        False (the fitted model's optimizer is the user's, which has none)."""
        lr = getattr(self.opt, "_learning_rate", None)
        skip = set() if accumulators else \
            {id(v) for v in getattr(self.opt, "_accumulated_gradients", None) or ()}
        return [np.array(v) / self.lr_factor if v is lr else np.array(v)
                for v in self._optimizer_variables() if id(v) not in skip]

    def load_checkpoint(self, payload: bytes):
        try:
            meta, groups = _load_arrays(payload)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"it is not a Keras estimator checkpoint ({e})") from None
        fmt = meta.get("format")
        if fmt not in (1, CHECKPOINT_FORMAT):
            raise ValueError(f"it has format {fmt!r}; this spark_dl reads formats 1 to "
                             f"{CHECKPOINT_FORMAT}")
        assign_variables(self.model.weights, groups.get("model", []), "model weights")
        assign_variables(self._optimizer_variables(), groups.get("optimizer", []),
                         "optimizer state")
        lr = getattr(self.opt, "_learning_rate", None)
        if self.lr_factor != 1 and any(v is lr for v in self._optimizer_variables()):
            lr.assign(np.array(lr) * self.lr_factor)
        return int(meta["epoch"]) + (1 if fmt == 1 else 0), meta.get("history")

    def save_checkpoint(self, epoch: int, history: dict) -> bytes:
        meta = {"format": CHECKPOINT_FORMAT, "epoch": epoch, "run_id": self.spec.run_id,
                "history": history}
        return _save_arrays(meta, {"model": _numpy(self.model.weights),
                                   "optimizer": self._optimizer_values()})

    def broadcast_state(self, root_rank: int) -> None:
        variables = list(self.model.weights) + self._optimizer_variables()
        arrays = [np.array(v, order="C") for v in variables]  # (0-d stays 0-d)
        handles = [self.sdn.broadcast_async_(a, root_rank, name=f"keras.state.{i}")
                   for i, a in enumerate(arrays)]
        for h in handles:
            self.sdn.synchronize(h)
        if self.sdn.rank() != root_rank:
            for var, a in zip(variables, arrays):
                var.assign(a)

    def result(self) -> dict:
        return {"weights": _numpy(self.model.weights),
                "optimizer": self._optimizer_values(accumulators=False)}

    def callback_objects(self):
        return self.model, self.opt

    def attach_callbacks(self, callbacks, params) -> None:
        for cb in callbacks:
            if hasattr(cb, "set_model"):  # a Keras callback
                cb.set_model(self.model)
                cb.set_params(dict(params))
            else:
                super().attach_callbacks([cb], params)
        if self.checkpoint_callback is not None:
            synced = _StoreSyncedCheckpoint(self.checkpoint_callback, self.spec.remote_store)
            synced.inner.set_model(self.model)
            synced.inner.set_params(dict(params))
            callbacks.append(synced)  # rank 0's loop runs it after the user's callbacks

    def stop_requested(self) -> bool:
        return bool(getattr(self.model, "stop_training", False))

    # ------------------------------------------------------------------ steps

    def to_tensors(self, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        return dict(arrays)  # Keras takes NumPy arrays as they are

    def metric_names(self) -> List[str]:
        return list(self.fw.metric_names)

    def _xyw(self, batch):
        spec, fw = self.spec, self.fw
        x = util.feature_arrays(batch, spec.feature_cols, fw.input_specs)
        y = util.label_arrays(batch, spec.label_cols, fw.output_shapes, spec.label_shapes,
                              fw.output_dtypes)
        w = (np.asarray(batch[spec.sample_weight_col]).reshape(-1)
             if spec.sample_weight_col else None)
        return util.pack(x), util.pack(y), w, int(x[0].shape[0])

    def _result(self, logs: dict, rows: int):
        return rows, float(logs["loss"]), [float(logs[n]) for n in self.fw.metric_names]

    def train_step(self, batch):
        x, y, w, rows = self._xyw(batch)
        # Keras' metrics accumulate until reset: reset so each step reports its own batch.
        self.model.reset_metrics()
        return self._result(self.model.train_on_batch(x, y, sample_weight=w,
                                                      return_dict=True), rows)

    def eval_step(self, batch):
        x, y, w, rows = self._xyw(batch)
        self.model.reset_metrics()
        return self._result(self.model.test_on_batch(x, y, sample_weight=w,
                                                     return_dict=True), rows)

    def first_batch_error(self, exc, batch):
        spec = self.spec
        try:
            x, y, _, _ = self._xyw(batch)
        except Exception:
            return super().first_batch_error(exc, batch)
        return RuntimeError(
            f"training failed on the first batch: {type(exc).__name__}: {exc}\n"
            f"  inputs from feature columns {spec.feature_cols}: {util.describe(x)} (model "
            f"inputs {[s for _, s, _ in self.fw.input_specs]})\n"
            f"  labels from label columns {spec.label_cols}: {util.describe(y)} (model "
            f"outputs {self.fw.output_shapes})")


class _StoreSyncedCheckpoint:
    """The estimator's ``checkpoint_callback`` (a ``keras.callbacks.ModelCheckpoint``) on
    rank 0, writing into the run's ``checkpoints/`` directory: directly for a local store,
    else into a local directory copied to the store after every epoch."""

    def __init__(self, inner, remote_store):
        self.inner, self.remote_store = inner, remote_store
        self._output = remote_store.get_local_output_dir()
        self.local_dir = self._output.__enter__()
        name = os.path.basename(str(getattr(inner, "filepath", "") or "")) or \
            "checkpoint.keras"
        os.makedirs(os.path.join(self.local_dir, "checkpoints"), exist_ok=True)
        inner.filepath = os.path.join(self.local_dir, "checkpoints", name)

    def on_train_begin(self, logs=None):
        self.inner.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.inner.on_epoch_begin(epoch, logs)

    def on_batch_end(self, batch, logs=None):
        self.inner.on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.inner.on_epoch_end(epoch, logs)
        self.remote_store.sync(self.local_dir)

    def on_train_end(self, logs=None):
        self.inner.on_train_end(logs)
        self._output.__exit__(None, None, None)


class _PredictRetracing(logging.Filter):
    """Drops TensorFlow's warning "N out of the last N calls to <... make_predict_function
    ...> triggered tf.function retracing". ``transform`` loads the model anew in each
    Python worker for each transform (and on the driver for its dry run), and pads the
    last batches to powers of two, so Keras's predict function is traced once per model
    and batch shape by design; after five transforms in one process the warning appeared
    every time, with advice meant for a program that builds functions in a loop. Only
    Keras's predict function is concerned: the user's own functions still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message
                    and "make_predict_function" in message)


_PREDICT_RETRACING = _PredictRetracing()


def quiet_predict_retracing() -> None:
    """Installs :class:`_PredictRetracing` on TensorFlow's logger (once per process)."""
    logger = logging.getLogger("tensorflow")
    if _PREDICT_RETRACING not in logger.filters:
        logger.addFilter(_PREDICT_RETRACING)


class KerasPredictor(Predictor):
    """A Keras model from ``.keras`` bytes, applied ``batch_size`` rows at a time.

    With ``use_gpu`` it predicts on a GPU on the executors (never on the driver, whose
    two-row dry run only reads the output shapes): the GPU Spark assigned to the task, else
    the task's partition index modulo the executor's GPUs, by the rule of
    :func:`~spark_dl.spark.launch.task.devices.choose_gpu` (as ``TorchModel`` does); on
    hosts without a GPU it stays on the CPU, silently. The model is loaded and applied
    under ``keras.device`` of that choice.
    """

    def __init__(self, model_bytes: bytes, custom_objects, feature_cols, input_specs,
                 batch_size: int, use_gpu: bool = False):
        self.model_bytes = model_bytes
        self.custom_objects = custom_objects
        self.feature_cols = list(feature_cols)
        self.input_specs = input_specs
        self.batch_size = batch_size
        self.use_gpu = use_gpu
        self.on_executor = False  # set by prepare(), which only the executors call
        self._model = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_model"] = None
        state["on_executor"] = False
        return state

    def device_name(self) -> str:
        """The ``keras.device`` name this call predicts on (``"cpu:0"`` or ``"gpu:<i>"``);
        asked per call, as the task's GPU may differ between the tasks of one Python worker.

        Raises:
            GpuNotVisibleError: Spark assigned the task a GPU that this process cannot see.
        """
        if not (self.use_gpu and self.on_executor):
            return "cpu:0"
        import keras

        from spark_dl.spark.launch.task.devices import choose_transform_gpu

        backend = keras.backend.backend()
        index = choose_transform_gpu(True, _gpu_count(backend),
                                     probe=_GPU_PROBES.get(backend, "the Keras backend"))
        return "cpu:0" if index is None else f"gpu:{index}"

    def _load(self, device: str) -> None:
        if self._model is None:
            import keras

            with keras.device(device):
                self._model = util.model_from_bytes(self.model_bytes, self.custom_objects)

    def prepare(self) -> None:
        self.on_executor = True
        self._load(self.device_name())

    def predict(self, arrays):
        import keras

        quiet_predict_retracing()
        device = self.device_name()
        self._load(device)
        with keras.device(device):
            return self._predict(arrays)

    def _predict(self, arrays):
        x = util.feature_arrays(arrays, self.feature_cols, self.input_specs)
        rows = x[0].shape[0]
        chunks = []
        for start in range(0, rows, self.batch_size):
            part = [a[start:start + self.batch_size] for a in x]
            n = part[0].shape[0]
            # Padded to a power of two (or batch_size): few input shapes, few traces of
            # the compiled predict function.
            size = self.batch_size if n == self.batch_size else \
                min(self.batch_size, 1 << max(n - 1, 0).bit_length())
            if size > n:
                part = [np.concatenate([a, np.repeat(a[-1:], size - n, axis=0)]) for a in part]
            outs = util.unpack_outputs(self._model.predict_on_batch(util.pack(part)))
            chunks.append([o[:n] for o in outs])
        return [np.concatenate([c[i] for c in chunks]) for i in range(len(chunks[0]))]
