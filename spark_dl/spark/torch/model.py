"""``TorchModel``: a trained PyTorch model as a Spark ML Transformer.

``transform(df)`` adds one column per model output (``output_cols``; default
``<label>__output``) and keeps every column of ``df``. Prediction runs in a scalar-iterator
pandas UDF over Arrow batches: the model travels to the executors once per transform as a
Spark broadcast and is unpickled once per Python worker (a small cache keyed by the
transform), then applied in eval mode to ``batch_size`` rows at a time. Feature columns are
converted exactly as in training (:mod:`spark_dl.spark.torch.util`): vectors through
Spark's ``vector_to_array`` with the dtype training used, then cast to the model's dtype.

Output column types: one value per row -> double; a label that was a Spark ML vector ->
a DenseVector column; otherwise an array of the model's float type (multi-dimensional
outputs are flattened per row).
"""

import collections
import threading
import uuid
from typing import Dict, Iterator, Tuple

import numpy as np
import torch
from pyspark import keyword_only

from spark_dl.spark.common import constants
from spark_dl.spark.common.estimator import ModelBase
from spark_dl.spark.common.params import (MODEL_PARAMS, ParamSpec, _int, _shapes,
                                          define_params, params_doc, params_signature)
from spark_dl.spark.torch import util

__all__ = ["TorchModel", "TORCH_MODEL_PARAMS"]

TORCH_MODEL_PARAMS = (
    ParamSpec("optimizer", "the optimizer in its trained state (bound to model)", None,
              pickled=True),
    ParamSpec("input_shapes", "shape of each feature column's model input", None,
              _shapes("input_shapes")),
    ParamSpec("batch_size", "rows per forward pass in transform()", 1024,
              _int("batch_size", 1)),
)

_TMP_COL = "__spark_dl_outputs"


@define_params(TORCH_MODEL_PARAMS)
class TorchModel(ModelBase):
    """A trained PyTorch model (see the module doc). ``fit`` returns one; ``getModel()``
    gives the ``torch.nn.Module``, ``getHistory()`` the per-epoch metrics.

    ``timings`` (not persisted) holds the fit's durations: ``total_s``, ``prepare_s``,
    ``first_step_s`` (from ``fit()`` to the end of the first training step) and ``epoch_s``.
    """

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)
        self.timings = None

    @keyword_only
    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        return super().setParams(**self._input_kwargs)

    def _column_specs(self, df) -> Dict[str, dict]:
        """kind/dtype/shape of each feature column: from training, else from ``df``."""
        from spark_dl.spark.common.schema import classify

        features = self.getFeatureColumns()
        known = (self.getMetadata() or {}).get("columns", {})
        fields = {f.name: f.dataType for f in df.schema.fields}
        missing = [c for c in features if c not in fields]
        if missing:
            raise KeyError(f"feature columns {missing} are not in the DataFrame (columns: "
                           f"{list(fields)})")
        specs = {}
        first = None
        for col in features:
            info = classify(col, fields[col], "float64")
            if col in known:
                trained = known[col]
                if (trained["kind"] == constants.KIND_SCALAR) != \
                        (info.kind == constants.KIND_SCALAR):
                    raise TypeError(f"feature column {col!r} is {info.spark_type} here but "
                                    f"was {trained['kind']} in training")
                specs[col] = dict(trained, kind=info.kind)
                continue
            if info.kind == constants.KIND_SCALAR:
                specs[col] = {"kind": info.kind, "dtype": info.dtype, "shape": []}
                continue
            if first is None:  # a model built by hand: look at one row
                first = _first_row(df, features)
            specs[col] = {"kind": info.kind, "dtype": "float64",
                          "shape": [len(first[col])]}
        return specs

    def _transform(self, df):
        from pyspark.sql import functions as F
        from spark_dl.spark.common.schema import _col
        from spark_dl.spark.launch.pickling import pickler

        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError("this TorchModel has no model: setModel(torch_module) first")
        features = self.getFeatureColumns()
        if not features:
            raise ValueError("feature_columns is not set")
        specs = self._column_specs(df)
        dtype = util.model_dtype(model)
        vector_dtype = (self.getMetadata() or {}).get(
            "vector_dtype", "float64" if dtype == torch.float64 else "float32")
        shapes = self.getInputShapes() or util.default_input_shapes(features, specs)
        out_cols = self.getOutputCols()
        kinds, types = self._output_types(model, specs, shapes, dtype, len(out_cols))

        spark = df.sparkSession
        bc = spark.sparkContext.broadcast(pickler().dumps(model))
        predict_udf = _make_udf(uuid.uuid4().hex, bc, features, specs, shapes, dtype,
                                self.getBatchSize(), kinds, types)
        inputs = []
        for col in features:
            c = _col(col)
            if specs[col]["kind"] == constants.KIND_VECTOR:
                from pyspark.ml.functions import vector_to_array

                c = vector_to_array(c, dtype=vector_dtype)
            inputs.append(c)
        out = df.withColumn(_TMP_COL, predict_udf(*inputs))
        cols = [_col(c) for c in df.columns if c not in out_cols]
        for i, (name, kind) in enumerate(zip(out_cols, kinds)):
            field = F.col(f"`{_TMP_COL}`.`_{i}`")
            if kind == "vector":
                from pyspark.ml.functions import array_to_vector

                field = array_to_vector(field)
            cols.append(field.alias(name))
        return out.select(*cols)

    def _output_types(self, model, specs, shapes, dtype, n_cols):
        """(kind per output: scalar/array/vector, Spark type per output), from a forward
        pass on zeros."""
        from pyspark.sql import types as T

        zeros = {c: np.zeros([2] + list(s["shape"]), dtype=s["dtype"]) for c, s in specs.items()}
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            outputs = util.predict(model, zeros, self.getFeatureColumns(), shapes, dtype, 2)
        except Exception as e:
            raise ValueError(f"the model cannot be applied to inputs of shapes "
                             f"{[[2] + list(s['shape']) for s in specs.values()]} "
                             f"(input_shapes {shapes}): {type(e).__name__}: {e}") from e
        finally:
            for m, mode in modes:
                m.training = mode
        if len(outputs) != n_cols:
            raise ValueError(f"the model returns {len(outputs)} output(s) but output_cols "
                             f"names {n_cols} column(s): {self.getOutputCols()}")
        labels = self.getLabelColumns() or []
        known = (self.getMetadata() or {}).get("columns", {})
        element = T.DoubleType() if dtype == torch.float64 else T.FloatType()
        kinds, types = [], []
        for i, out in enumerate(outputs):
            per_row = int(np.prod(out.shape[1:])) if out.ndim > 1 else 1
            label_kind = known.get(labels[i], {}).get("kind") if i < len(labels) else None
            if label_kind == constants.KIND_VECTOR:
                kinds.append("vector")
                types.append(T.ArrayType(T.DoubleType(), True))
            elif per_row == 1 and label_kind in (None, constants.KIND_SCALAR):
                kinds.append("scalar")
                types.append(T.DoubleType())
            else:
                kinds.append("array")
                types.append(T.ArrayType(element, True))
        return kinds, types


def _first_row(df, features):
    from spark_dl.spark.common.schema import _col

    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    exprs = [vector_to_array(_col(f.name)).alias(f.name) if isinstance(f.dataType, VectorUDT)
             else _col(f.name) for f in df.schema.fields if f.name in features]
    row = df.select(*exprs).first()
    if row is None:
        raise ValueError("the DataFrame is empty, so the feature shapes cannot be read; "
                         "set input_shapes or metadata")
    return row.asDict()


# ----------------------------------------------------------------------------- executor side

_models: "collections.OrderedDict[str, torch.nn.Module]" = collections.OrderedDict()
_models_lock = threading.Lock()
_MAX_MODELS = 2


def _executor_model(key: str, bc) -> torch.nn.Module:
    """The model of transform ``key``, unpickled once per Python worker."""
    from spark_dl.spark.launch.pickling import pickler

    with _models_lock:
        model = _models.get(key)
        if model is None:
            model = pickler().loads(bc.value)
            model.eval()
            _models[key] = model
            while len(_models) > _MAX_MODELS:
                _models.popitem(last=False)
        else:
            _models.move_to_end(key)
        return model


def _column_array(col: str, series, spec: dict) -> np.ndarray:
    if series.isna().any():
        raise ValueError(f"feature column {col!r} has null values; drop or fill them before "
                         "transform()")
    if spec["kind"] == constants.KIND_SCALAR:
        return series.to_numpy()
    try:
        values = np.stack(series.to_numpy())
    except ValueError:
        lengths = sorted({len(v) for v in series.to_numpy()})
        raise ValueError(f"feature column {col!r} holds arrays of different lengths "
                         f"{lengths[:5]}; the model was trained on {spec['shape']}") from None
    if list(values.shape[1:]) != list(spec["shape"]):
        raise ValueError(f"feature column {col!r} has rows of shape {list(values.shape[1:])}; "
                         f"the model was trained on rows of shape {spec['shape']}")
    return values


def _make_udf(key, bc, features, specs, shapes, dtype, batch_size, kinds, types):
    import pandas as pd
    from pyspark.sql import types as T
    from pyspark.sql.functions import pandas_udf

    schema = T.StructType([T.StructField(f"_{i}", t, True) for i, t in enumerate(types)])

    def run(batches):
        model = _executor_model(key, bc)
        for columns in batches:
            if isinstance(columns, pd.Series):
                columns = (columns,)
            rows = len(columns[0])
            if not rows:
                yield pd.DataFrame({f"_{i}": pd.Series([], dtype=object)
                                    for i in range(len(kinds))})
                continue
            arrays = {c: _column_array(c, s, specs[c]) for c, s in zip(features, columns)}
            outputs = util.predict(model, arrays, features, shapes, dtype, batch_size)
            frame = {}
            for i, (out, kind) in enumerate(zip(outputs, kinds)):
                if kind == "scalar":
                    frame[f"_{i}"] = out.reshape(rows).astype(np.float64)
                else:
                    flat = out.reshape(rows, -1)
                    if kind == "vector":
                        flat = flat.astype(np.float64)
                    frame[f"_{i}"] = list(flat)
            yield pd.DataFrame(frame)

    if len(features) == 1:
        def predict(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
            return run(batches)
    else:
        def predict(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.DataFrame]:
            return run(batches)
    return pandas_udf(predict, schema)


TorchModel.__init__.__signature__ = params_signature(
    list(MODEL_PARAMS) + list(TORCH_MODEL_PARAMS))
TorchModel.__init__.__doc__ = ("Creates the model; every argument is a param.\n\n"
                               + params_doc(list(MODEL_PARAMS) + list(TORCH_MODEL_PARAMS)))
