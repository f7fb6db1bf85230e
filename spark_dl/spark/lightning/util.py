"""Batches, steps and logged values shared by the driver's dry run, the workers and
``transform`` (so all three see the same tensors).

A Lightning step receives the batch as a dict column -> tensor (Horovod's convention:
``x, y = batch["features"], batch["label"]``): floating columns in the module's dtype,
feature columns reshaped to ``input_shapes`` when given, other columns as loaded.
"""

import numbers
import types
from typing import Dict, List, Mapping, Optional

import numpy as np
import torch

__all__ = ["PACKAGES", "lightning_package", "module_dtype", "to_batch", "feature_inputs",
           "removed_hooks", "overrides", "install_default_steps", "LogCapture", "base_name", "scalar",
           "rows_of", "loss_of_outputs", "describe"]

#: Lightning's two distributions: the unified ``lightning`` package and ``pytorch_lightning``.
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_package(module) -> Optional[str]:
    """The Lightning package whose ``LightningModule`` ``module`` is, or None (a module's
    package is always imported already)."""
    import sys

    for name in PACKAGES:
        pl = sys.modules.get(name)
        if pl is not None and isinstance(module, pl.LightningModule):
            return name
    return None


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of the module's first floating parameter (float32 when it has none)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _reshape(t: torch.Tensor, shape: List[int], col: str) -> torch.Tensor:
    try:
        return t.reshape(shape)
    except RuntimeError as e:
        raise ValueError(f"input_shapes: feature column {col!r} ({tuple(t.shape)}) cannot be "
                         f"reshaped to {shape}: {e}") from None


def to_batch(arrays: Mapping[str, np.ndarray], feature_cols: List[str],
             input_shapes: Optional[List[List[int]]],
             dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """A loader batch (column -> NumPy array) as the dict a Lightning step receives."""
    from spark_dl.spark.torch.util import as_tensor

    out = {}
    shapes = dict(zip(feature_cols, input_shapes or []))
    for col, value in arrays.items():
        # transform's columns are views of Arrow's read-only buffers, which may pass through
        # to the output: as_tensor copies those, so a module writing into its input in place
        # cannot change them (and torch does not warn about them).
        t = as_tensor(value) if isinstance(value, np.ndarray) else value
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if col in shapes:
            t = _reshape(t, shapes[col], col)
        out[col] = t
    return out


def feature_inputs(batch: Mapping[str, torch.Tensor],
                   feature_cols: List[str]) -> List[torch.Tensor]:
    """The module's forward() arguments: one tensor per feature column, in order."""
    return [batch[c] for c in feature_cols]


def overrides(module, name: str) -> bool:
    """True when ``module``'s class (or the instance) defines ``name`` beyond LightningModule."""
    import sys

    package = lightning_package(module)
    base = sys.modules[package].LightningModule
    own = getattr(type(module), name, None)
    return name in vars(module) or (own is not None and own is not getattr(base, name, None))


# Hooks of Lightning 1.x that Lightning 2 no longer calls, and never says so: a Horovod
# program's callback or module that defines one loses what it did without a word. Each maps
# to what to use instead (the first ones were removed from callbacks and modules alike).
_REMOVED_EVERYWHERE = {
    "on_epoch_start": "on_train_epoch_start / on_validation_epoch_start",
    "on_epoch_end": "on_train_epoch_end / on_validation_epoch_end",
    "on_batch_start": "on_train_batch_start",
    "on_batch_end": "on_train_batch_end",
    "on_pretrain_routine_start": "on_fit_start",
    "on_pretrain_routine_end": "on_fit_start",
}
REMOVED_CALLBACK_HOOKS = dict(
    _REMOVED_EVERYWHERE,
    on_init_start="the callback's __init__",
    on_init_end="the callback's __init__",
    on_keyboard_interrupt="on_exception",
    on_configure_sharded_model="setup",
    on_before_accelerator_backend_setup="setup",
)
REMOVED_MODULE_HOOKS = dict(
    _REMOVED_EVERYWHERE,
    training_step_end="training_step (it sees the whole batch on each rank)",
    validation_step_end="validation_step",
    test_step_end="test_step",
)


def removed_hooks(module, callbacks) -> List[str]:
    """One line per hook that ``module`` or a callback defines and Lightning 2 never calls:
    ``"MyCallback.on_epoch_end (use on_train_epoch_end / on_validation_epoch_end)"``."""
    found = []
    for obj, table in [(module, REMOVED_MODULE_HOOKS)] + [(cb, REMOVED_CALLBACK_HOOKS)
                                                          for cb in callbacks]:
        for hook, instead in table.items():
            if callable(getattr(obj, hook, None)):
                found.append(f"{type(obj).__name__}.{hook} (use {instead})")
    return found


def _loss_of(losses, outputs, labels, loss_weights=None, sample_weights=None):
    """The default steps' loss: each output's loss (one loss for every output, or one per
    label), times its ``loss_weights`` entry, summed. With ``sample_weights``, each row's loss
    is weighted and the batch mean taken, as the torch estimator and Horovod do."""
    from spark_dl.spark.torch.util import _per_sample

    outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if len(outs) != len(labels):
        raise ValueError(f"the module returned {len(outs)} output(s) for {len(labels)} label "
                         "column(s): return one output per label column")
    fns = losses if len(losses) == len(labels) else losses * len(labels)
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(labels)
    total = 0
    for fn, out, label, weight in zip(fns, outs, labels, weights):
        if label.is_floating_point() and label.shape != out.shape and label.numel() == out.numel():
            label = label.reshape(out.shape)
        elif (label.is_floating_point() and out.is_floating_point() and out.dim() > 1
              and label.numel() == out.shape[0]):
            # One value per row for a wider output: a class index (Spark's StringIndexer
            # writes doubles), as the torch estimator reads it.
            label = label.reshape(-1).long()
        if sample_weights is None:
            value = fn(out, label)
        else:
            value = (_per_sample(fn, out, label) *
                     sample_weights.reshape(-1).to(out.dtype)).mean()
        total = total + (value * weight if weight != 1.0 else value)
    return total


def install_default_steps(module, losses, optimizer, feature_cols, label_cols,
                          loss_weights=None, sample_weight_col=None) -> None:
    """Gives ``module`` what it does not define itself, from the estimator's params:
    ``training_step``/``validation_step`` computing ``loss`` on ``forward(*features)``
    (weighted by ``loss_weights`` and the rows' ``sample_weight_col``) and logging
    ``train_loss``/``val_loss``, and ``configure_optimizers`` returning ``optimizer``. Bound
    on the instance; the class is left alone."""
    def step_loss(self, batch):
        out = self(*feature_inputs(batch, feature_cols))
        weights = batch[sample_weight_col] if sample_weight_col else None
        return _loss_of(losses, out, [batch[c] for c in label_cols], loss_weights, weights)

    if losses and not overrides(module, "training_step"):
        def training_step(self, batch, batch_idx):
            loss = step_loss(self, batch)
            self.log("train_loss", loss)
            return loss
        module.training_step = types.MethodType(training_step, module)
    if losses and not overrides(module, "validation_step"):
        def validation_step(self, batch, batch_idx):
            loss = step_loss(self, batch)
            self.log("val_loss", loss, sync_dist=True)
            return loss
        module.validation_step = types.MethodType(validation_step, module)
    if optimizer is not None and not overrides(module, "configure_optimizers"):
        module.configure_optimizers = types.MethodType(lambda self: optimizer, module)


def base_name(name: str) -> str:
    """The history key of a logged value: ``train_acc``/``val_acc``/``acc`` -> ``acc``."""
    for prefix in ("train_", "val_", "train/", "val/"):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


def scalar(value) -> Optional[float]:
    """A logged value as a float, or None (torchmetrics objects, tensors of several values)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


class LogCapture:
    """Records what the module's ``self.log``/``self.log_dict`` receive during one step
    (base name -> float), wrapping ``log`` on the instance (Lightning itself still gets
    every call)."""

    def __init__(self, module):
        self.values: Dict[str, float] = {}
        self.module = module
        original = module.log

        def log(name, value, *args, **kwargs):
            v = scalar(value)
            if v is not None:
                self.values[base_name(name)] = v
            return original(name, value, *args, **kwargs)

        module.log = log

    def clear(self) -> None:
        self.values = {}

    def remove(self) -> None:
        self.module.__dict__.pop("log", None)


def rows_of(batch, feature_cols: List[str]) -> int:
    """Rows of a step's batch: the first feature column's length (after
    ``transformation_fn``, the first tensor found)."""
    if isinstance(batch, Mapping):
        first = batch.get(feature_cols[0]) if feature_cols else None
        candidates = [first] + list(batch.values())
    elif isinstance(batch, (list, tuple)):
        candidates = list(batch)
    else:
        candidates = [batch]
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def loss_of_outputs(outputs) -> Optional[float]:
    """The loss a step returned (a tensor, or a dict with ``"loss"``), or None."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    return scalar(outputs) if outputs is not None else None


def describe(batch) -> str:
    """``{features: (2, 4) float32, y: (2,) float64}`` for error messages."""
    parts = []
    for k, v in batch.items():
        parts.append(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                     if hasattr(v, "shape") else f"{k}: {type(v).__name__}")
    return "{" + ", ".join(parts) + "}"
