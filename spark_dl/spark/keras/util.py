"""How Keras models travel and how columns become Keras inputs and labels.

A model never travels pickled: it is saved as a ``.keras`` file (Keras' own format:
architecture, weights, compile settings) and loaded from those bytes with the estimator's
``custom_objects``, on the workers, on the executors for ``transform`` and in ML
persistence alike. So a layer that cannot be saved fails on the driver, before any worker
starts, with the layer named (:func:`check_round_trip`).

Columns become model inputs in order (``feature_cols[i]`` -> ``model.inputs[i]``): each
column's rows are reshaped to the input's shape (a vector of 784 values to ``(28, 28, 1)``
when the input is so declared) and cast to its dtype. Labels are reshaped to the matching
output's shape when the sizes agree (``label_shapes`` overrides), so a scalar label fits a
``(None, 1)`` output; float labels take the output's float type.
"""

import io
import os
import shutil
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from spark_dl.spark.launch.errors import strip_ansi

__all__ = ["model_to_bytes", "model_from_bytes", "check_round_trip", "input_specs",
           "output_shapes", "output_dtypes", "vector_dtype", "feature_arrays", "label_arrays",
           "describe", "pack", "unpack_outputs", "strip_ansi", "shape_advice",
           "with_shipped_classes"]


def model_to_bytes(model) -> bytes:
    """``model`` as the bytes of a ``.keras`` file."""
    tmp = tempfile.mkdtemp(prefix="spark_dl_keras_")
    try:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_from_bytes(data: bytes, custom_objects: Optional[dict] = None, compile: bool = False):
    """The model saved by :func:`model_to_bytes` (``compile``: restore its compile
    settings, as ``keras.saving.load_model`` does)."""
    import keras

    tmp = tempfile.mkdtemp(prefix="spark_dl_keras_")
    try:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=compile,
                                       safe_mode=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _config_classes(node, found: list) -> None:
    """(module, class_name, registered_name) of every serialized object in a ``.keras``
    config."""
    if isinstance(node, dict):
        if isinstance(node.get("module"), str) and isinstance(node.get("class_name"), str):
            found.append((node["module"], node["class_name"], node.get("registered_name")))
        for value in node.values():
            _config_classes(value, found)
    elif isinstance(node, list):
        for value in node:
            _config_classes(value, found)


def with_shipped_classes(model_bytes: bytes, custom_objects: Optional[dict]) -> Optional[dict]:
    """``custom_objects`` plus the model's classes and functions from the user's modules
    that executors cannot import (:func:`~spark_dl.spark.common.shipping.executors_lack`).

    The ``.keras`` file names a custom class by module and name, and Keras imports that
    module to load it: on workers without the module that fails. In ``custom_objects``
    (pickled with the training spec, those modules by value) Keras finds them by name."""
    import json
    import sys
    import zipfile

    from spark_dl.spark.common.shipping import executors_lack

    try:
        with zipfile.ZipFile(io.BytesIO(model_bytes)) as z:
            config = json.loads(z.read("config.json"))
    except (KeyError, ValueError, zipfile.BadZipFile):
        return custom_objects
    found: list = []
    _config_classes(config, found)
    merged = dict(custom_objects or {})
    for module_name, class_name, registered in found:
        module = sys.modules.get(module_name)
        obj = getattr(module, class_name, None) if module is not None else None
        key = registered or class_name
        if obj is not None and key not in merged and executors_lack(module_name):
            merged[key] = obj
    return merged if merged or custom_objects is not None else None


def _layer_hint(model) -> str:
    """Names of the model's layers whose classes are not Keras' own."""
    own = [f"{layer.name!r} ({type(layer).__module__}.{type(layer).__name__})" for layer in
           getattr(model, "_flatten_layers", lambda: [])(include_self=False)
           if not type(layer).__module__.startswith("keras.")]
    return f"; custom layers: {', '.join(own)}" if own else ""


def check_round_trip(model, custom_objects: Optional[dict]) -> bytes:
    """The model's ``.keras`` bytes, after checking that they load back; raises ValueError
    naming the custom layers and what to do when they do not."""
    try:
        data = model_to_bytes(model)
    except Exception as e:
        raise ValueError(
            f"the model cannot be saved as a .keras file, which is how it travels to the "
            f"workers: {type(e).__name__}: {e}{_layer_hint(model)}. Give custom layers a "
            "get_config() returning their constructor arguments (and "
            "@keras.saving.register_keras_serializable() or custom_objects)") from e
    try:
        model_from_bytes(data, custom_objects)
    except Exception as e:
        raise ValueError(
            f"the model's .keras file does not load back: {type(e).__name__}: {e}"
            f"{_layer_hint(model)}. Pass the custom classes and functions as "
            "custom_objects={'MyLayer': MyLayer, ...}, and give custom layers a get_config() "
            "returning their constructor arguments") from e
    return data


def input_specs(model) -> List[Tuple[str, List[Optional[int]], str]]:
    """(name, shape without the batch, dtype) of each model input; raises ValueError for a
    model that is not built."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError(
            "the model has no defined inputs: build it before fit(), e.g. start a "
            "Sequential model with keras.Input(shape=(n,)) or call model.build((None, n))")
    return [(getattr(t, "name", f"input_{i}"), list(t.shape[1:]), str(t.dtype))
            for i, t in enumerate(inputs)]


def vector_dtype(model) -> str:
    """The dtype Spark ML vector columns are read as for ``model``: float64 when an input
    takes float64, else float32."""
    return "float64" if any(d == "float64" for _, _, d in input_specs(model)) else "float32"


def output_shapes(model) -> List[List[Optional[int]]]:
    """Each model output's shape without the batch."""
    return [list(t.shape[1:]) for t in model.outputs]


def output_dtypes(model) -> List[str]:
    """Each model output's dtype (e.g. ``"float32"``)."""
    return [str(t.dtype) for t in model.outputs]


def _rows(values) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.asarray(values)


def feature_arrays(batch: Mapping[str, Any], feature_cols: Sequence[str],
                   specs: Sequence[Tuple[str, list, str]]) -> List[np.ndarray]:
    """One array per model input from the feature columns (see the module doc)."""
    arrays = []
    for col, (name, shape, dtype) in zip(feature_cols, specs):
        values = _rows(batch[col])
        rows = values.shape[0]
        known = [d for d in shape if d is not None]
        size = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
        if None not in shape and int(np.prod(known or [1])) == size:
            values = values.reshape([rows] + [int(d) for d in shape])
        elif len(shape) == 1 and values.ndim == 1:
            values = values.reshape(rows, 1)
        arrays.append(values.astype(dtype, copy=False) if dtype and dtype != "None"
                      else values)
    return arrays


def label_arrays(batch: Mapping[str, Any], label_cols: Sequence[str],
                 out_shapes: Sequence[list], label_shapes: Optional[Sequence[list]],
                 out_dtypes: Optional[Sequence[str]] = None) -> List[np.ndarray]:
    """One array per label column, shaped for its output (see the module doc); float
    labels take their output's float type (Keras' own losses cast, custom losses and
    metrics may not)."""
    arrays = []
    for i, col in enumerate(label_cols):
        values = _rows(batch[col])
        rows = values.shape[0]
        if label_shapes:
            values = values.reshape([rows] + [d for d in label_shapes[i][1:]]
                                    if label_shapes[i][0] == -1 else label_shapes[i])
        elif i < len(out_shapes) and None not in out_shapes[i]:
            size = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
            if int(np.prod(out_shapes[i] or [1])) == size:
                values = values.reshape([rows] + [int(d) for d in out_shapes[i]])
        out_dtype = out_dtypes[i] if out_dtypes and i < len(out_dtypes) else None
        if out_dtype and out_dtype.startswith("float") and values.dtype.kind == "f" and \
                values.dtype != np.dtype(out_dtype):
            values = values.astype(out_dtype)
        arrays.append(values)
    return arrays


def pack(arrays: List[np.ndarray]):
    """One array for a single input/output, else the list (as Keras takes them)."""
    return arrays[0] if len(arrays) == 1 else arrays


def unpack_outputs(outputs) -> List[np.ndarray]:
    """A model's prediction as a list of NumPy arrays (one per output)."""
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    return [np.asarray(o) for o in outputs]


_CLASSIFICATION = {"sparse_categorical_crossentropy": "multi", "categorical_crossentropy": "multi",
                   "binary_crossentropy": "binary", "binary_focal_crossentropy": "binary"}
_REGRESSION = {"mse", "mae", "mean_squared_error", "mean_absolute_error", "huber",
               "log_cosh", "mean_squared_logarithmic_error", "msle"}


def _loss_name(loss) -> Tuple[str, bool]:
    """(lower-case name, from_logits) of one Keras loss: a name, a loss object or a
    built-in loss function ("" for an unknown callable)."""
    if isinstance(loss, str):
        return loss.lower(), False
    config = getattr(loss, "get_config", lambda: {})() or {}
    fn = getattr(loss, "fn", loss)
    name = getattr(fn, "__name__", "") or config.get("name", "") or ""
    return name.lower(), bool(config.get("from_logits", False))


def _loss_of_output(loss, index: int, output_name: str):
    """The loss of output ``index`` when ``loss`` has one per output (else ``loss``)."""
    if isinstance(loss, dict):
        return loss.get(output_name)
    if isinstance(loss, (list, tuple)):
        return loss[index] if index < len(loss) else None
    return loss


def prediction_kind(loss) -> Optional[str]:
    """What the model's output means, from its Keras loss (a name, a loss object or a
    built-in loss function): None for several losses or an unknown one."""
    if isinstance(loss, (list, tuple, dict)):
        if len(loss) != 1:
            return None
        loss = list(loss.values())[0] if isinstance(loss, dict) else loss[0]
    name, from_logits = _loss_name(loss)
    if name in _REGRESSION:
        return "regression"
    kind = _CLASSIFICATION.get(name)
    if kind == "multi":
        return "logits" if from_logits else "probabilities"
    if kind == "binary":
        return "binary_logits" if from_logits else "binary_probabilities"
    return None


def describe(arrays) -> str:
    """``[(2, 4) float32, (2,) int64]`` for error messages."""
    if isinstance(arrays, (list, tuple)):
        return "[" + ", ".join(describe(a) for a in arrays) + "]"
    shape = getattr(arrays, "shape", None)
    if shape is None:
        return type(arrays).__name__
    return f"{tuple(shape)} {getattr(arrays, 'dtype', '')}".strip()


def custom_scope(custom_objects: Optional[Dict[str, Any]]):
    """``keras.saving.custom_object_scope`` over ``custom_objects`` (a no-op when None)."""
    import keras

    return keras.saving.custom_object_scope(custom_objects or {})


def _per_row(shape) -> int:
    return int(np.prod([d for d in shape if d is not None] or [1]))


def shape_advice(feature_cols: Sequence[str], x: Sequence[np.ndarray],
                 in_specs: Sequence[Tuple[str, list, str]], label_cols: Sequence[str],
                 y: Sequence[np.ndarray], out_shapes: Sequence[list], output_names: Sequence[str],
                 loss) -> List[str]:
    """The likely fixes, one line each, when a model cannot be evaluated on the columns'
    rows: compares each column's values per row with its input's or output's size and
    each integer label with its output's loss (empty when nothing stands out)."""
    advice = []
    for col, arr, (name, shape, _) in zip(feature_cols, x, in_specs):
        have, want = _per_row(np.shape(arr)[1:]), _per_row(shape)
        if None not in shape and have != want:
            advice.append(f"feature column {col!r} has {have} values per row but model input "
                          f"{name!r} takes {want} (shape {['batch'] + list(shape)}): declare "
                          f"the input as keras.Input(shape=({have},)) or give it a column "
                          f"of {want} values")
    for i, (col, arr, shape) in enumerate(zip(label_cols, y, out_shapes)):
        arr = np.asarray(arr)
        have, units = _per_row(arr.shape[1:]), _per_row(shape)
        loss_name, _ = _loss_name(_loss_of_output(
            loss, i, output_names[i] if i < len(output_names) else ""))
        integer = arr.dtype.kind in "iub" or (
            arr.size and arr.dtype.kind == "f" and bool(np.all(np.mod(arr, 1) == 0)))
        if have == 1 and units > 1 and integer and loss_name in (
                "categorical_crossentropy", "categoricalcrossentropy"):
            advice.append(f"label column {col!r} holds class indices (one integer per row) "
                          f"and output {i} scores {units} classes: use "
                          "loss='sparse_categorical_crossentropy' (or one-hot encode the "
                          "labels for categorical_crossentropy)")
        elif have == 1 and units > 1 and integer and "sparse_categorical" in loss_name:
            continue  # class indices against per-class scores: as intended
        elif have != units and None not in shape:
            advice.append(f"label column {col!r} has {have} value(s) per row but output {i} "
                          f"has {units} unit(s) (shape {['batch'] + list(shape)}): give the "
                          f"model one output per label column with {have} unit(s), e.g. "
                          f"keras.layers.Dense({have}) as its last layer"
                          + (", and sparse_categorical_crossentropy for integer class "
                             "labels against a softmax output" if have == 1 and integer
                             else ""))
    return advice
