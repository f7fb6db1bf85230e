"""How columns become model inputs, and outputs meet labels: one set of rules for fit and
transform.

**Features.** Each feature column is one positional model input. Its values (whatever numeric
type: float or double arrays, Spark ML vectors, integer or boolean scalars) are cast to the
model's floating dtype (that of its first floating parameter) and reshaped to the column's
input shape: ``input_shapes`` when given (one row's shape, such as ``[2]``, read as
``[-1, 2]``: :func:`batch_input_shapes`), else ``[-1, 1]`` for a scalar column and
``[-1, n]`` for a column of ``n`` values. ``fit`` (on the workers, and in the driver's dry run)
and ``transform`` call the same :func:`feature_tensors`, so a model never sees float64 in one
and float32 in the other.

**Labels.** Output ``i`` is paired with label column ``i``. Without ``label_shapes``, a label
with as many values per row as the output is reshaped to the output's shape; with them, to the
given shape. Then, for a floating output: a label of the output's size is cast to the output's
dtype (regression, binary cross-entropy, soft targets); a label of one value per row for a
wider output is a class index and becomes int64 (Spark's ``StringIndexer`` yields doubles).
"""

import copy
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from spark_dl.spark.common.metrics import metric_pairs
from spark_dl.spark.common.prediction import torch_prediction_kind
from spark_dl.torch import _device as tensor_device

__all__ = ["model_dtype", "default_input_shapes", "batch_input_shapes", "torch_batch",
           "as_tensor", "feature_tensors", "label_tensors", "match_outputs", "loss_mismatch",
           "per_row", "make_loss_fn", "metric_names", "describe", "predict"]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype inputs are cast to: the model's first floating parameter or buffer's."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def numpy_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def default_input_shapes(feature_cols: Sequence[str], columns: Mapping[str, dict]) -> List[list]:
    """``[-1, 1]`` for scalar columns, ``[-1, *shape]`` otherwise."""
    return [[-1] + (list(columns[c]["shape"]) or [1]) for c in feature_cols]


def batch_input_shapes(feature_cols: Sequence[str], input_shapes: Sequence[Sequence[int]],
                       columns: Mapping[str, dict]) -> List[list]:
    """The shapes batches are reshaped to, in ``fit`` and ``transform`` alike: a shape
    without ``-1`` whose size is one row's (``[2]`` for a column of two values: Horovod's
    per-row form, which a batch fits only with ``batch_size=1``) is read as ``[-1] + shape``,
    so any batch fits it; other shapes as given (also where a column's row size is not
    known)."""
    out = []
    for col, shape in zip(feature_cols, input_shapes):
        shape = list(shape)
        row = (columns.get(col) or {}).get("shape")
        if -1 not in shape and row is not None and \
                int(np.prod(shape, dtype=np.int64)) == int(np.prod(row, dtype=np.int64)):
            shape = [-1] + shape
        out.append(shape)
    return out


def torch_batch(arrays: Mapping[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """A loader batch (column -> NumPy array) as CPU tensors sharing its memory (the
    loader's batches are writable; a read-only array would be copied, see ``as_tensor``)."""
    return {k: as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}


def as_tensor(value) -> torch.Tensor:
    """A batch column as a tensor: a tensor as it is, a NumPy array without a copy unless it
    is read-only (then copied once, see below). Lightning's batches are made by it too."""
    if isinstance(value, torch.Tensor):
        return value
    value = np.ascontiguousarray(value)
    if not value.flags.writeable:
        # Arrow's buffers (transform's batches) are read-only: a model that writes into its
        # input in place must not change them (they may pass through to the output), and
        # torch warns on every read-only array. One copy, small next to the model's work.
        value = value.copy()
    return torch.from_numpy(value)


def describe(tensors) -> str:
    """``[(2, 4) float32, (2,) int64]`` for error messages."""
    if isinstance(tensors, torch.Tensor):
        return f"{tuple(tensors.shape)} {numpy_dtype_name(tensors.dtype)}"
    if isinstance(tensors, (list, tuple)):
        return "[" + ", ".join(describe(t) for t in tensors) + "]"
    return type(tensors).__name__


def per_row(t: torch.Tensor) -> str:
    """A batch tensor's shape per row and dtype, ``(3,) float32``, or ``a scalar int64`` (for
    error messages: the size of the batch they were found on is an implementation detail)."""
    shape = tuple(t.shape[1:]) if t.dim() else ()
    return f"{shape if shape else 'a scalar'} {numpy_dtype_name(t.dtype)}"


def loss_mismatch(outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                  label_cols: Sequence[str]) -> Optional[str]:
    """Why a loss cannot pair outputs with labels, when the shapes per row say so: names the
    output's and the label's shape per row and the likely fix; None when they agree."""
    for out, lab, col in zip(outputs, labels, label_cols):
        if not out.dim() or not lab.dim():
            continue
        out_n, lab_n = out[0].numel() if len(out) else 0, lab[0].numel() if len(lab) else 0
        if out_n == lab_n:
            continue
        head = (f"label column {col!r}: the model's output is {per_row(out)} per row, the "
                f"label is {per_row(lab)} per row.")
        if lab_n == 1:
            return (f"{head} Either make the model return one value per label (e.g. end it "
                    f"with nn.Linear(..., 1)) for regression, or, if the {out_n} outputs are "
                    f"class scores, use a classification loss (e.g. "
                    f"torch.nn.functional.cross_entropy) with an integer class-index label.")
        return (f"{head} Make the model return {lab_n} value(s) per row for this label, or "
                f"set label_shapes (and a loss) that pair them.")
    return None


def feature_tensors(batch: Mapping[str, object], feature_cols: Sequence[str],
                    input_shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                    device=None) -> List[torch.Tensor]:
    """The model inputs of a batch (column -> NumPy array or tensor), see the module doc."""
    inputs = []
    for col, shape in zip(feature_cols, input_shapes):
        t = as_tensor(batch[col])
        if t.dtype != dtype:
            t = t.to(dtype)
        try:
            t = t.reshape(shape)
        except RuntimeError:
            per_row = t[0].numel() if t.dim() and len(t) else 0
            raise ValueError(f"feature column {col!r}: a batch of {len(t) if t.dim() else 1} "
                             f"row(s) of {per_row} value(s) does not fit input shape "
                             f"{list(shape)}; the first dimension of an input shape is the "
                             f"batch: use -1 there (e.g. [-1, {per_row}]), and the sizes after "
                             f"it must multiply to {per_row}") from None
        if device is not None:
            t = t.to(device, non_blocking=True)
        inputs.append(t)
    return inputs


def label_tensors(batch: Mapping[str, object], label_cols: Sequence[str],
                  label_shapes: Optional[Sequence[Sequence[int]]], device=None
                  ) -> List[torch.Tensor]:
    """The labels of a batch, reshaped to ``label_shapes`` if given (dtype left as read)."""
    labels = []
    for i, col in enumerate(label_cols):
        t = as_tensor(batch[col])
        if label_shapes is not None:
            try:
                t = t.reshape(label_shapes[i])
            except RuntimeError:
                raise ValueError(f"label column {col!r}: a batch of shape {tuple(t.shape)} "
                                 f"does not fit label shape {label_shapes[i]}") from None
        if device is not None:
            t = t.to(device, non_blocking=True)
        labels.append(t)
    return labels


def match_outputs(outputs, labels: List[torch.Tensor], reshape_labels: bool = True):
    """(list of outputs, list of labels) paired as the module doc says.

    Raises ValueError when the model returns another number of outputs than there are
    label columns.
    """
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    elif isinstance(outputs, (list, tuple)):
        outputs = list(outputs)
    else:
        raise TypeError(f"the model returned a {type(outputs).__name__}; it must return a "
                        "tensor, or a tuple/list of tensors (one per label column)")
    if len(outputs) != len(labels):
        raise ValueError(f"the model returned {len(outputs)} output(s) but there are "
                         f"{len(labels)} label column(s); return one output per label column")
    matched = []
    for out, lab in zip(outputs, labels):
        same_size = lab.numel() == out.numel()
        if same_size and reshape_labels:
            lab = lab.reshape(out.shape)
        if out.is_floating_point():
            if same_size:
                if lab.dtype != out.dtype:
                    lab = lab.to(out.dtype)
            elif out.dim() and lab.numel() == out.shape[0]:
                lab = lab.reshape(-1).long()
        matched.append(lab)
    return outputs, matched


def _per_sample(fn, output, label):
    """Loss per row (reduction 'none'), for sample weights."""
    if isinstance(fn, torch.nn.modules.loss._Loss):
        fn = copy.copy(fn)
        fn.reduction = "none"
        values = fn(output, label)
    else:
        try:
            values = fn(output, label, reduction="none")
        except TypeError as e:
            raise TypeError(f"sample_weight_col needs losses that take reduction='none' "
                            f"(as torch.nn.functional's do); {getattr(fn, '__name__', fn)} "
                            f"raised: {e}") from None
    return values.reshape(values.shape[0], -1).mean(dim=1) if values.dim() else values


def make_loss_fn(losses: Sequence, weights: Optional[Sequence[float]], num_labels: int):
    """``loss_fn(outputs, labels, sample_weights=None)``: the weighted sum of each output's
    loss (one loss is applied to every output). With sample weights, each row's loss is
    multiplied by its weight and the batch mean taken (as Horovod does)."""
    losses = list(losses)
    if len(losses) == 1 and num_labels > 1:
        losses = losses * num_labels
    weights = list(weights) if weights is not None else [1.0] * num_labels

    def loss_fn(outputs, labels, sample_weights=None):
        total = None
        for out, lab, fn, w in zip(outputs, labels, losses, weights):
            if sample_weights is None:
                value = fn(out, lab)
            else:
                value = (_per_sample(fn, out, lab) *
                         sample_weights.reshape(-1).to(out.dtype)).mean()
            value = value * w if w != 1.0 else value
            total = value if total is None else total + value
        return total

    return loss_fn


def metric_names(metrics, label_cols: Sequence[str]) -> List[str]:
    """Names of the (metric, output) pairs: ``mae`` with one label, ``y1_mae`` with more.
    ``metrics`` is what the ``metrics`` param takes (see
    :func:`~spark_dl.spark.common.params.metric_pairs`: a pair or dict key names a metric,
    else its ``__name__``)."""
    names = []
    for base, _ in metric_pairs(metrics):
        if len(label_cols) == 1:
            names.append(base)
        else:
            names.extend(f"{c}_{base}" for c in label_cols)
    return names


def metric_values(metrics, outputs, labels) -> List[float]:
    """The metric values of a batch, in :func:`metric_names` order (as floats)."""
    values = []
    for _, m in metric_pairs(metrics):
        for out, lab in zip(outputs, labels):
            v = m(out, lab)
            values.append(float(v.detach().float().mean()) if isinstance(v, torch.Tensor)
                          else float(v))
    return values


def default_train_minibatch():
    """Horovod's default step: ``train_minibatch(model, optimizer, transform_outputs,
    loss_fn, inputs, labels, sample_weights) -> (outputs, loss)``, extended with gradient
    accumulation: with ``backward_passes_per_step`` k, gradients are zeroed before every
    k-th batch and the optimizer steps after it (and at the end of each epoch)."""
    state = {"passes": 0, "k": 1}

    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                        sample_weights):
        if state["passes"] % state["k"] == 0:
            optimizer.zero_grad()
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        state["passes"] += 1
        if state["passes"] % state["k"] == 0:
            optimizer.step()
        return outputs, loss

    def flush(optimizer):
        """Steps on gradients accumulated since the last step (end of an epoch)."""
        if state["passes"] % state["k"]:
            optimizer.step()
            state["passes"] = 0

    train_minibatch.state = state
    train_minibatch.flush = flush
    return train_minibatch


def prediction_kind(losses: Sequence) -> Optional[str]:
    """What the model's output means, from its one loss (see the model's
    ``prediction_kind``): None when there are several losses or the loss is unknown. The
    rule is shared with the Lightning estimator
    (:func:`~spark_dl.spark.common.prediction.torch_prediction_kind`)."""
    return torch_prediction_kind(losses)


def predict(model: torch.nn.Module, arrays: Dict[str, np.ndarray], feature_cols: Sequence[str],
            inputs: Callable[[Dict[str, np.ndarray]], List[torch.Tensor]],
            batch_size: int) -> List[np.ndarray]:
    """Applies ``model`` (without gradients) to rows given as NumPy arrays (column ->
    ``(rows, ...)``), ``batch_size`` rows at a time; ``inputs`` turns a slice of the
    feature columns into the model's arguments. Returns one ``(rows, ...)`` array per
    output."""
    rows = len(next(iter(arrays.values())))
    parts: List[List[np.ndarray]] = []
    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            chunk = {c: arrays[c][start:start + batch_size] for c in feature_cols}
            outputs = model(*inputs(chunk))
            if isinstance(outputs, torch.Tensor):
                outputs = [outputs]
            if not parts:
                parts = [[] for _ in outputs]
            for i, out in enumerate(outputs):
                parts[i].append(tensor_device.host_array(out))
    return [np.concatenate(p) if len(p) > 1 else p[0] for p in parts]
