"""The executor side of ``transform``: Arrow batches in, the model on whole batches, Arrow
batches out, with no Python object per row (see :mod:`spark_dl.spark.common.model`).

``transform`` is one scalar-iterator Arrow UDF where pyspark has one (4.1+, classic and
Spark Connect; :meth:`ArrowPredict.scalar_iter`): only the feature columns travel to Python
(vectors as arrays), and the outputs come back as one struct. On pyspark 3.5 it is one
``DataFrame.mapInArrow`` (:meth:`ArrowPredict.__call__`): each Arrow batch carries every
column of the DataFrame, and the outputs are appended to the untouched columns of the
batch. Either way the feature columns are turned into NumPy arrays straight from the Arrow
buffers (:func:`feature_array`: list and fixed-size-list columns through their flat values,
Spark ML vectors through the values of their struct, sparse ones scattered), the predictor
runs on the whole batch, and its outputs become Arrow arrays (:func:`output_array`).
"""

import collections
import threading
from typing import List, Sequence

import numpy as np

from spark_dl.spark.common import constants

__all__ = ["ArrowPredict", "feature_array", "output_array", "check_output_rows"]


def _shape_error(col: str, widths: np.ndarray, spec: dict) -> ValueError:
    found = sorted(set(int(w) for w in widths))
    if len(found) > 1:
        return ValueError(f"feature column {col!r} holds arrays of different lengths "
                          f"{found[:5]}; the model takes rows of shape {spec['shape']}")
    return ValueError(f"feature column {col!r} has rows of shape {found}; the model takes "
                      f"rows of shape {spec['shape']}")


def _list_values(col: str, arr, width: int, spec: dict) -> np.ndarray:
    """The ``(rows, width)`` values of a list, large-list or fixed-size-list column."""
    import pyarrow.compute as pc

    rows = len(arr)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if rows and not (lengths == width).all():
        raise _shape_error(col, lengths, spec)
    # flatten() honours the array's offset; nulls inside become NaN as pandas made them.
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(rows, width)


def _vector_values(col: str, arr, width: int, spec: dict) -> np.ndarray:
    """The ``(rows, width)`` float64 values of a Spark ML vector column (its Arrow form is
    struct<type: int8, size: int32, indices: list<int32>, values: list<double>>, type 1 for a
    DenseVector, 0 for a SparseVector)."""
    import pyarrow.compute as pc

    rows = len(arr)
    kind, size, indices, values = arr.flatten()
    dense = kind.to_numpy(zero_copy_only=False) == 1
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    flat = values.flatten().to_numpy(zero_copy_only=False)
    if dense.all():
        if rows and not (lengths == width).all():
            raise _shape_error(col, lengths, spec)
        return flat.reshape(rows, width)
    widths = np.where(dense, lengths, size.fill_null(0).to_numpy(zero_copy_only=False))
    if not (widths == width).all():
        raise _shape_error(col, widths, spec)
    out = np.zeros((rows, width), dtype=np.float64)
    row_of = np.repeat(np.arange(rows), lengths)
    dense_elem = np.repeat(dense, lengths)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(len(flat)) - np.repeat(starts, lengths)  # place within a dense row
    # Dense rows have null indices, so the flat indices are exactly the sparse rows'.
    pos[~dense_elem] = indices.flatten().to_numpy(zero_copy_only=False)
    out[row_of, pos] = flat
    return out


def feature_array(col: str, arr, spec: dict, vector_dtype: str) -> np.ndarray:
    """Feature column ``col`` of an Arrow batch as a NumPy array ``(rows, *shape)``.

    Args:
        col: the column name (for errors).
        arr: its Arrow array (scalar, list/large-list/fixed-size-list, or a Spark ML vector
            struct).
        spec: kind/dtype/shape per row, as training saw it.
        vector_dtype: the dtype vector values are cast to (as Spark's ``vector_to_array``
            casts them).

    Raises:
        ValueError: nulls, or rows whose shape differs from ``spec['shape']``.
    """
    if arr.null_count:
        raise ValueError(f"feature column {col!r} has null values; drop or fill them before "
                         "transform()")
    if spec["kind"] == constants.KIND_SCALAR:
        return arr.to_numpy(zero_copy_only=False)
    shape = [int(s) for s in spec["shape"]]
    width = int(np.prod(shape)) if shape else 1
    if spec["kind"] == constants.KIND_VECTOR:
        values = _vector_values(col, arr, width, spec).astype(vector_dtype, copy=False)
    else:
        values = _list_values(col, arr, width, spec)
    return values.reshape([len(arr)] + shape)


def check_output_rows(outputs: Sequence, rows: int) -> List[np.ndarray]:
    """The model's ``outputs`` as NumPy arrays, each checked to hold one row per input row
    (its first dimension the batch's): an output of another shape would otherwise be
    reshaped into rows that mix values of different rows, or fail in Spark's task.

    Raises:
        ValueError: an output whose first dimension is not ``rows``.
    """
    arrays = [np.asarray(out) for out in outputs]
    if rows == 1:
        return arrays  # any shape is one row's (``squeeze()`` drops a batch of one)
    for i, out in enumerate(arrays):
        if out.ndim == 0 or out.shape[0] != rows:
            raise ValueError(
                f"the model's output {i} has shape {list(out.shape)} for a batch of {rows} "
                "rows: transform needs one output row per input row, so the first dimension "
                "of every output is the batch (a model that reduces over the batch or "
                "transposes its result cannot be applied row by row)")
    return arrays


def output_array(out: np.ndarray, kind: str, element, rows: int):
    """One model output ``(rows, ...)`` as the Arrow array of its Spark column: ``scalar``
    -> double, ``array`` -> list of ``element`` (float32 or float64) flattened per row,
    ``vector`` -> a Spark ML DenseVector struct of doubles."""
    import pyarrow as pa

    out = np.asarray(out)
    if kind == "scalar":
        return pa.array(out.reshape(rows).astype(np.float64, copy=False))
    flat = out.reshape(rows, -1)
    width = flat.shape[1]
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    if kind == "array":
        values = pa.array(flat.astype(element, copy=False).reshape(-1))
        return pa.ListArray.from_arrays(offsets, values)
    values = pa.ListArray.from_arrays(
        offsets, pa.array(flat.astype(np.float64, copy=False).reshape(-1)))
    if kind == "vector_values":
        return values
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(rows, dtype=np.int8)), pa.nulls(rows, pa.int32()),
         pa.nulls(rows, pa.list_(pa.int32())), values],
        names=["type", "size", "indices", "values"])


class ArrowPredict:
    """The picklable function of one transform: a ``mapInArrow`` function (called) or a
    scalar-iterator Arrow UDF (:meth:`scalar_iter`).

    Args:
        key: the transform's id (the predictor is unpickled once per Python worker and key).
        shipped: the pickled predictor's carrier (see ``model._ship_predictor``).
        features: feature columns, in the predictor's order.
        positions: each feature column's position in the batch.
        specs: kind/dtype/shape per feature column.
        vector_dtype: dtype vector features are read as.
        keep: positions of the batch's columns that pass through, in order.
        names: every output column's name (the kept ones, then the model's).
        kinds: scalar/array/vector (or vector_values) per model output column.
        elements: the NumPy element dtype of each ``array`` output (None for others).
        ml_kind: ``prediction_kind`` when pyspark.ml columns follow the model's outputs.
        n_ml: how many pyspark.ml columns.
    """

    def __init__(self, key: str, shipped, features: Sequence[str], positions: List[int],
                 specs: dict, vector_dtype: str, keep: List[int], names: List[str],
                 kinds: List[str],
                 elements: List, ml_kind=None, n_ml: int = 0):
        self.key, self.shipped = key, shipped
        self.features, self.positions = list(features), list(positions)
        self.specs, self.vector_dtype = specs, vector_dtype
        self.keep, self.names, self.kinds, self.elements = keep, names, kinds, elements
        self.ml_kind, self.n_ml = ml_kind, n_ml

    def _outputs(self, predictor, columns, rows) -> list:
        """The model's output columns (Arrow arrays) for the feature ``columns``."""
        arrays = {c: feature_array(c, a, self.specs[c], self.vector_dtype)
                  for c, a in zip(self.features, columns)}
        outputs = check_output_rows(predictor.predict(arrays), rows)
        if self.ml_kind is not None:
            outputs += ml_columns(self.ml_kind, np.asarray(outputs[0]))[:self.n_ml]
        return [output_array(out, kind, element, rows)
                for out, kind, element in zip(outputs, self.kinds, self.elements)]

    def __call__(self, batches):
        """``mapInArrow``: whole batches in, the kept columns and the outputs out."""
        import pyarrow as pa

        predictor = _executor_predictor(self.key, self.shipped)
        for batch in batches:
            rows = batch.num_rows
            if not rows:
                continue
            outputs = self._outputs(predictor, [batch.column(i) for i in self.positions], rows)
            yield pa.RecordBatch.from_arrays([batch.column(i) for i in self.keep] + outputs,
                                             names=self.names)

    def scalar_iter(self, batches):
        """A scalar-iterator Arrow UDF (pyspark >= 4.1): the feature columns in, one struct
        of the outputs (fields ``_0``, ``_1`` ...) out, or the output itself when there is
        one; the other columns stay in Spark."""
        import pyarrow as pa

        predictor = _executor_predictor(self.key, self.shipped)
        for columns in batches:
            if isinstance(columns, (pa.Array, pa.ChunkedArray)):
                columns = (columns,)
            columns = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c
                       for c in columns]
            rows = len(columns[0])
            outputs = self._outputs(predictor, columns, rows) if rows else \
                [pa.array([], type=t) for t in self._empty_types()]
            yield outputs[0] if len(outputs) == 1 else \
                pa.StructArray.from_arrays(outputs, names=self.names)

    def _empty_types(self):
        import pyarrow as pa

        types = []
        for kind, element in zip(self.kinds, self.elements):
            if kind == "scalar":
                types.append(pa.float64())
            elif kind == "array":
                types.append(pa.list_(pa.from_numpy_dtype(element)))
            else:
                types.append(pa.list_(pa.float64()))
        return types


# ----------------------------------------------------------------------------- executor side

_predictors: "collections.OrderedDict[str, object]" = collections.OrderedDict()
_predictors_lock = threading.Lock()
_MAX_PREDICTORS = 2


def _executor_predictor(key: str, shipped):
    """The predictor of transform ``key``, unpickled once per Python worker from
    ``shipped.value`` (see :func:`_ship_predictor`)."""
    from spark_dl.spark.launch.pickling import pickler

    with _predictors_lock:
        predictor = _predictors.get(key)
        if predictor is None:
            predictor = pickler().loads(shipped.value)
            predictor.prepare()
            _predictors[key] = predictor
            while len(_predictors) > _MAX_PREDICTORS:
                _predictors.popitem(last=False)
        else:
            _predictors.move_to_end(key)
        return predictor


def ml_columns(kind: str, output: np.ndarray) -> List[np.ndarray]:
    """pyspark.ml's (prediction, probability, raw prediction) of a model ``output`` whose
    meaning is ``kind`` (see :data:`~spark_dl.spark.common.params.PREDICTION_KINDS`);
    regression gives the prediction alone. Rows first; computed in float64."""
    rows = output.shape[0]
    out = np.asarray(output, dtype=np.float64).reshape(rows, -1)
    if kind == "regression":
        return [out[:, 0]]
    if kind in ("binary_logits", "binary_probabilities"):
        z = out[:, 0]
        if kind == "binary_logits":
            p = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid, without overflow
            raw = np.stack([-z, z], axis=1)
        else:
            p = np.clip(z, 0.0, 1.0)
            raw = np.stack([1.0 - p, p], axis=1)
        return [(p > 0.5).astype(np.float64), np.stack([1.0 - p, p], axis=1), raw]
    if kind == "logits":
        shifted = np.exp(out - out.max(axis=1, keepdims=True))
        prob = shifted / shifted.sum(axis=1, keepdims=True)
    elif kind == "log_probabilities":
        prob = np.exp(out)
    else:
        prob = out
    return [np.argmax(out, axis=1).astype(np.float64), prob, out]
