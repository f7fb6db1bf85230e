"""What every trained model does, whatever its framework: ``transform`` in Arrow batches.

``transform(df)`` adds one column per model output (``output_cols``; default
``<label>__output``) and keeps every column of ``df``. Prediction is one scalar-iterator
Arrow UDF where pyspark has one (4.1+: only the feature columns travel to Python, the other
columns stay in Spark), else one ``DataFrame.mapInArrow`` (pyspark 3.5: the whole rows
travel, and the outputs are appended to them) (:mod:`spark_dl.spark.common.inference`):
feature columns go from Arrow buffers to NumPy without a Python object per row, the model
runs on whole Arrow batches, and its outputs are built as Arrow arrays. The
framework's :class:`~spark_dl.spark.common.adapter.Predictor` travels to the executors
once per transform and is unpickled once per Python worker (a small cache keyed by the
transform). It travels as a Spark broadcast on classic sessions; Spark Connect has no
broadcast, so there it rides in the function itself when small and, when larger, as a
session artifact file that the executors read (see :func:`_ship_predictor`). Feature
columns are converted as in training: vectors (dense or sparse) to the dtype training
used, as Spark's ``vector_to_array`` casts them, and the predictor casts to the model's
dtype.

Output column types: one value per row -> double; several values per row -> a Spark ML
DenseVector (Horovod's format), or with ``output_format="array"`` an array of the model's
float type (float for float32 outputs, double for float64); multi-dimensional outputs are
flattened per row.

pyspark.ml's prediction columns: with ``prediction_kind`` set (estimators set it from
their loss) the model also writes ``predictionCol`` (the value, or the class index as a
double), and for classifiers ``probabilityCol`` and ``rawPredictionCol`` (vectors), so
the model plugs into pyspark.ml's evaluators, ``CrossValidator`` and pipelines with their
default column names. They come from the first output, for a model with one label.
"""

import dataclasses
import functools
import threading
import uuid
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
from pyspark.ml import Model
from pyspark.sql import types as T

from spark_dl.spark.common import constants
from spark_dl.spark.common.params import MODEL_PARAMS, TableParams, define_params
from spark_dl.spark.common.params_accessors import ModelParamsAccessors
from spark_dl.spark.common.persistence import PersistableParams

__all__ = ["ModelBase"]

_TMP_COL = "__spark_dl_outputs"


@define_params(MODEL_PARAMS)
class ModelBase(ModelParamsAccessors, TableParams, Model, PersistableParams):
    """Base of the framework models: params from :data:`MODEL_PARAMS`, persistence and
    ``transform`` (see the module doc). A framework supplies :meth:`_predictor` and, when
    the model's vector dtype is not float32, :meth:`_default_vector_dtype`.

    ``timings`` (not persisted) holds the fit's durations: ``total_s``, ``prepare_s``,
    ``first_step_s`` (from ``fit()`` to the end of the first training step) and ``epoch_s``.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.timings = None

    def getOutputCols(self) -> List[str]:
        """The columns transform() adds: ``output_cols``, else ``<label>__output`` each."""
        cols = self.getOrDefault("output_cols")
        if cols:
            return list(cols)
        return [f"{c}__output" for c in (self.getLabelColumns() or [])]

    def history_df(self):
        """The training history as a pandas DataFrame, one row per epoch (index ``epoch``;
        columns ``loss``, ``val_loss``, the metrics, ``rows_per_s``): see
        :func:`~spark_dl.spark.common.history.history_frame`."""
        from spark_dl.spark.common.history import history_frame

        return history_frame(self.getHistory())

    def plot_history(self, metrics=None, **kwargs):
        """The training curves as a matplotlib Figure, one panel per quantity with its
        ``val_`` twin: see :func:`~spark_dl.spark.common.history.plot_history`."""
        from spark_dl.spark.common.history import plot_history

        return plot_history(self.getHistory(), metrics, **kwargs)

    # ------------------------------------------------------------------ framework hooks

    def _predictor(self, specs: Dict[str, dict]):
        """The :class:`~spark_dl.spark.common.adapter.Predictor` of this model for feature
        columns described by ``specs`` (column -> kind/dtype/shape per row); raises
        ValueError when the model is not set."""
        raise NotImplementedError

    def _default_vector_dtype(self) -> str:
        """dtype vector columns are read as when training left no metadata."""
        return "float32"

    # ------------------------------------------------------------------ transform

    def _column_specs(self, df, positions: List[int]) -> Dict[str, dict]:
        """kind/dtype/shape of each feature column (at ``positions`` in ``df``): from
        training, else from ``df``."""
        from spark_dl.spark.common.schema import classify

        features = self.getFeatureColumns()
        known = (self.getMetadata() or {}).get("columns", {})
        fields = {col: df.schema.fields[i].dataType for col, i in zip(features, positions)}
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
            size = self._row_size_from_input_shapes(col)
            if size is None:
                if first is None:  # a model built by hand: look at one row
                    first = _first_row(df, features)
                size = len(first[col])
            specs[col] = {"kind": info.kind, "dtype": "float64", "shape": [size]}
        return specs

    def _row_size_from_input_shapes(self, col: str) -> Optional[int]:
        """How many values a row of feature ``col`` holds, where the model's
        ``input_shapes`` (torch, Lightning) say it: ``[-1, *row]``; else None (a shape
        without -1 may be one row's or a fixed batch's). KerasModel reads its inputs."""
        getter = getattr(self, "getInputShapes", None)
        shapes, features = getter() if getter else None, self.getFeatureColumns()
        if not shapes or len(shapes) != len(features):
            return None
        shape = list(shapes[features.index(col)])
        if len(shape) < 2 or shape[0] != -1 or -1 in shape[1:]:
            return None
        return int(np.prod(shape[1:], dtype=np.int64))

    def _transform(self, df):
        from spark_dl.spark.common.inference import ArrowPredict
        from spark_dl.spark.common.schema import column_positions
        from spark_dl.spark.common.shipping import dumps_for_workers
        from spark_dl.spark.launch.executor_python import use_driver_python_for_session

        features = self.getFeatureColumns()
        if not features:
            raise ValueError("feature_columns is not set")
        names = df.columns
        positions = column_positions(names, features, "feature columns")
        use_driver_python_for_session(df.sparkSession)
        specs = self._column_specs(df, positions)
        predictor = self._predictor(specs)
        vector_dtype = (self.getMetadata() or {}).get("vector_dtype",
                                                      self._default_vector_dtype())
        out_cols = self.getOutputCols()
        kinds, types = self._output_types(predictor, specs, len(out_cols))
        ml_cols = self._ml_columns()
        for name, kind in ml_cols:
            kinds.append(kind)
            types.append(T.DoubleType() if kind == "scalar" else
                         T.ArrayType(T.DoubleType(), True))
        out_cols = out_cols + [name for name, _ in ml_cols]
        twice = sorted({c for c in out_cols if out_cols.count(c) > 1})
        if twice:
            raise ValueError(f"transform() would write columns {twice} twice: output_cols and "
                             "predictionCol/probabilityCol/rawPredictionCol must differ")
        ml_kind = self.getPredictionKind() if ml_cols else None

        # The user's modules executors lack travel by value, as in fit (common.shipping).
        shipped = _ship_predictor(df.sparkSession, dumps_for_workers(predictor))
        elements = [None if kind != "array" else
                    np.float64 if t.elementType == T.DoubleType() else np.float32
                    for kind, t in zip(kinds, types)]
        predict = functools.partial(ArrowPredict, uuid.uuid4().hex, shipped, features,
                                    vector_dtype=vector_dtype, elements=elements,
                                    ml_kind=ml_kind, n_ml=len(ml_cols))
        # Spark looks columns up by name, mapInArrow's own arguments too: a name that a join
        # left twice is ambiguous, and one with a dot reads as a struct's field. So the
        # frame travels under positional names, and the columns get theirs back at the end.
        # A column named like an output is replaced (all of them, for a name held twice).
        keep = [i for i, name in enumerate(names) if name not in out_cols]
        positional = df.toDF(*[f"_{i}" for i in range(len(names))])
        # mapInArrow ships every column to Python and back, and Spark's conversions both
        # ways are most of a small model's transform (docs/benchmarks.md); an Arrow UDF,
        # where pyspark has one, ships only the features (vectors as arrays).
        carrier = _transform_by_arrow_udf if _arrow_udf() is not None else \
            _transform_by_map_in_arrow
        out = carrier(positional, _Carry(predict, features, positions, specs, vector_dtype,
                                         keep, kinds, types))
        return out.toDF(*[names[i] for i in keep], *out_cols)

    def predict_pandas(self, pdf):
        """The model's outputs for the rows of the pandas DataFrame ``pdf``, computed in
        this process without Spark: the values ``transform`` gives for those rows.

        Feature columns hold scalars, or per row a list, NumPy array or Spark ML vector.
        Returns a pandas DataFrame (``pdf``'s index) with the columns ``transform`` adds:
        ``output_cols``, then ``predictionCol``/``probabilityCol``/``rawPredictionCol``
        where ``prediction_kind`` asks for them; several values per row come as one NumPy
        array per row. MLflow's pyfunc flavor of a logged model calls this.

        Raises:
            KeyError: a feature column is missing; ValueError: nulls, or rows whose shape
                differs from training's.
        """
        import pandas as pd

        from spark_dl.spark.common.inference import check_output_rows, ml_columns
        from spark_dl.spark.common.schema import column_positions

        features = self.getFeatureColumns()
        if not features:
            raise ValueError("feature_columns is not set")
        column_positions(list(pdf.columns), features, "feature columns")
        ml_cols = self._ml_columns()
        names = self.getOutputCols() + [name for name, _ in ml_cols]
        rows = len(pdf)
        if not rows:
            return pd.DataFrame({name: [] for name in names}, index=pdf.index)
        known = (self.getMetadata() or {}).get("columns", {})
        vector_dtype = (self.getMetadata() or {}).get("vector_dtype",
                                                      self._default_vector_dtype())
        specs, arrays = {}, {}
        for col in features:
            specs[col], arrays[col] = _pandas_feature(col, pdf[col], known.get(col),
                                                      vector_dtype)
        predictor = self._predictor(specs)
        kinds, _ = self._output_types(predictor, specs, len(self.getOutputCols()))
        kinds += [kind for _, kind in ml_cols]
        outputs = check_output_rows(predictor.predict(arrays), rows)
        if ml_cols:
            outputs += ml_columns(self.getPredictionKind(), np.asarray(outputs[0]))
        columns = {}
        for name, kind, out in zip(names, kinds, outputs):
            out = np.asarray(out)
            if kind == "scalar":
                columns[name] = out.reshape(rows).astype(np.float64, copy=False)
            else:
                flat = out.reshape(rows, -1)
                if kind == "vector":
                    flat = flat.astype(np.float64, copy=False)
                columns[name] = list(flat)
        return pd.DataFrame(columns, index=pdf.index)

    def _ml_columns(self) -> List[Tuple[str, str]]:
        """(name, kind) of the pyspark.ml columns ``prediction_kind`` asks for."""
        kind = self.getPredictionKind()
        if kind is None:
            return []
        labels = self.getLabelColumns() or []
        if len(labels) > 1:
            raise ValueError(f"prediction_kind={kind!r} needs a model with one label column; "
                             f"this one has {labels}: set prediction_kind=None and use "
                             "output_cols")
        cols = [(self.getPredictionCol(), "scalar")]
        if kind != "regression":
            cols += [(self.getProbabilityCol(), "vector"),
                     (self.getRawPredictionCol(), "vector")]
        return cols

    def _output_types(self, predictor, specs, n_cols):
        """(kind per output: scalar/array/vector, Spark type per output), from a prediction
        on two rows of zeros."""
        from spark_dl.spark.common.inference import check_output_rows

        zeros = {c: np.zeros([2] + list(s["shape"]), dtype=s["dtype"]) for c, s in specs.items()}
        try:
            outputs = predictor.predict(zeros)
        except Exception as e:
            raise ValueError(f"the model cannot be applied to inputs of shapes "
                             f"{[[2] + list(s['shape']) for s in specs.values()]}: "
                             f"{type(e).__name__}: {e}") from e
        outputs = check_output_rows(outputs, 2)
        kind = self.getPredictionKind()
        if kind is not None:
            first = np.asarray(outputs[0])
            per_row = int(np.prod(first.shape[1:])) if first.ndim > 1 else 1
            if kind in ("regression", "binary_logits", "binary_probabilities") and per_row != 1:
                raise ValueError(f"prediction_kind={kind!r} needs one output value per row, "
                                 f"but the model gives {per_row}; for {per_row} classes use "
                                 "'logits', 'log_probabilities' or 'probabilities'")
            if kind in ("logits", "log_probabilities", "probabilities") and \
                    (first.ndim != 2 or per_row < 2):
                raise ValueError(f"prediction_kind={kind!r} needs outputs of shape (rows, "
                                 f"classes), but the model gives {list(first.shape[1:])} per "
                                 "row; for one value per row use 'binary_logits' or "
                                 "'binary_probabilities'")
        if len(outputs) != n_cols:
            raise ValueError(f"the model returns {len(outputs)} output(s) but output_cols "
                             f"names {n_cols} column(s): {self.getOutputCols()}")
        labels = self.getLabelColumns() or []
        known = (self.getMetadata() or {}).get("columns", {})
        kinds, types = [], []
        for i, out in enumerate(outputs):
            out = np.asarray(out)
            per_row = int(np.prod(out.shape[1:])) if out.ndim > 1 else 1
            label_kind = known.get(labels[i], {}).get("kind") if i < len(labels) else None
            element = T.DoubleType() if out.dtype == np.float64 else T.FloatType()
            if per_row == 1 and label_kind in (None, constants.KIND_SCALAR):
                kinds.append("scalar")
                types.append(T.DoubleType())
            elif label_kind == constants.KIND_VECTOR or self.getOutputFormat() != "array":
                kinds.append("vector")
                types.append(T.ArrayType(T.DoubleType(), True))
            else:
                kinds.append("array")
                types.append(T.ArrayType(element, True))
        return kinds, types


def _cell_values(value) -> np.ndarray:
    """One row's value of an array or vector feature column, as a NumPy array."""
    to_array = getattr(value, "toArray", None)  # a Spark ML vector
    return np.asarray(to_array() if to_array is not None else value)


def _pandas_feature(col: str, values, spec, vector_dtype: str):
    """(spec, NumPy array ``(rows, *shape)``) of the pandas feature column ``values``, as
    :func:`~spark_dl.spark.common.inference.feature_array` makes them of an Arrow column;
    ``spec`` is training's (None for a model built by hand: read off the first row)."""
    if values.isnull().any():
        raise ValueError(f"feature column {col!r} has null values; drop or fill them before "
                         "predicting")
    if spec is None:
        if values.dtype != object:
            spec = {"kind": constants.KIND_SCALAR, "dtype": str(values.dtype), "shape": []}
        else:
            first = _cell_values(values.iloc[0]) if len(values) else np.zeros(0)
            spec = {"kind": constants.KIND_ARRAY, "dtype": "float64",
                    "shape": list(first.shape)}
    if spec["kind"] == constants.KIND_SCALAR:
        return spec, values.to_numpy()
    shape = [int(s) for s in spec["shape"]]
    width = int(np.prod(shape)) if shape else 1
    dtype = vector_dtype if spec["kind"] == constants.KIND_VECTOR else spec["dtype"]
    cells = [_cell_values(v).reshape(-1) for v in values]
    widths = {len(c) for c in cells}
    if widths - {width}:
        raise ValueError(f"feature column {col!r} has rows of {sorted(widths)[:5]} values; "
                         f"the model takes rows of shape {spec['shape']}")
    flat = np.stack(cells).astype(dtype, copy=False) if cells else np.zeros((0, width), dtype)
    return spec, flat.reshape([len(cells)] + shape)


def _arrow_udf():
    """pyspark's ``arrow_udf`` (4.1 and later, classic and Connect), else None."""
    from pyspark.sql import functions

    return getattr(functions, "arrow_udf", None)


@dataclasses.dataclass
class _Carry:
    """What a carrier of ``transform`` is given besides the DataFrame, whose columns have
    positional names (``_0``, ``_1`` ...)."""

    predict: functools.partial  # ArrowPredict, given what every carrier passes alike
    features: List[str]
    positions: List[int]  # each feature's column
    specs: Dict[str, dict]  # kind/dtype/shape per feature
    vector_dtype: str
    keep: List[int]  # the columns that pass through, in order
    kinds: List[str]  # scalar/array/vector per output
    types: list  # the Spark type per output


def _transform_by_map_in_arrow(df, carry: _Carry):
    """``transform`` through ``mapInArrow`` (pyspark 3.5): whole rows travel to Python,
    and come back as the kept columns followed by the outputs, all under positional
    names."""
    from pyspark.ml.linalg import VectorUDT

    fields = df.schema.fields
    out_fields = [fields[i] for i in carry.keep]
    for j, (kind, spark_type) in enumerate(zip(carry.kinds, carry.types)):
        out_fields.append(T.StructField(f"_out{j}", VectorUDT() if kind == "vector" else
                                        spark_type, True))
    fn = carry.predict(carry.positions, carry.specs, keep=carry.keep,
                       names=[f.name for f in out_fields], kinds=carry.kinds)
    return df.mapInArrow(fn, T.StructType(out_fields))


def _transform_by_arrow_udf(df, carry: _Carry):
    """``transform`` through a scalar-iterator Arrow UDF: only the feature columns travel to
    Python (vectors as arrays, through Spark's ``vector_to_array``), and the other columns
    stay in Spark, which ``mapInArrow`` would ship to Python and back (its conversions both
    ways cost a small model's transform a third more on array columns, and vector columns
    far more: Spark builds their Arrow struct slowly). The result as
    :func:`_transform_by_map_in_arrow`'s."""
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.sql import functions as F

    inputs, udf_specs = [], {}
    for col, i in zip(carry.features, carry.positions):
        c, udf_specs[col] = F.col(f"_{i}"), carry.specs[col]
        if udf_specs[col]["kind"] == constants.KIND_VECTOR:
            c = vector_to_array(c, dtype=carry.vector_dtype)
            udf_specs[col] = dict(udf_specs[col], kind=constants.KIND_ARRAY)
        inputs.append(c)
    kinds, types = carry.kinds, carry.types
    fields = [f"_{i}" for i in range(len(kinds))]
    fn = carry.predict(list(range(len(inputs))), udf_specs, keep=[], names=fields,
                       kinds=["vector_values" if k == "vector" else k for k in kinds])
    # One output comes back as itself, several as one struct (a struct costs Spark more).
    schema = types[0] if len(types) == 1 else \
        T.StructType([T.StructField(f, t, True) for f, t in zip(fields, types)])
    with warnings.catch_warnings():
        # pyspark 4.1+ prefers type hints to the UDF type; the function is built here, so
        # the type is given and the user is not told about it.
        warnings.filterwarnings("ignore", message=".*type hints for arrow UDF.*")
        udf = _arrow_udf()(fn.scalar_iter, schema, _scalar_iter_type())
    out = df.withColumn(_TMP_COL, udf(*inputs))
    cols = [F.col(f"_{i}") for i in carry.keep]
    for i, kind in enumerate(kinds):
        field = F.col(f"`{_TMP_COL}`" if len(types) == 1 else f"`{_TMP_COL}`.`_{i}`")
        cols.append(array_to_vector(field) if kind == "vector" else field)
    return out.select(*cols)


def _scalar_iter_type():
    from pyspark.sql.functions import ArrowUDFType

    return ArrowUDFType.SCALAR_ITER


def _first_row(df, features):
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    from spark_dl.spark.common.schema import _col

    hint = ("use a model from fit(), whose metadata holds them, or set input_shapes="
            "[[-1, n], ...] (torch, Lightning; a Keras model's inputs say it where their "
            "shapes are complete) or the metadata: model.setMetadata({'columns': "
            "{'x': {'kind': 'array', 'dtype': 'float32', 'shape': [n]}}})")
    if df.isStreaming:
        raise ValueError("transform() needs the number of values per row of each array or "
                         "vector feature, and a model built by hand reads it from the first "
                         f"row, which a streaming DataFrame cannot give: {hint}")
    exprs = [vector_to_array(_col(f.name)).alias(f.name) if isinstance(f.dataType, VectorUDT)
             else _col(f.name) for f in df.schema.fields if f.name in features]
    row = df.select(*exprs).first()
    if row is None:
        raise ValueError(f"the DataFrame is empty, so the feature shapes cannot be read: {hint}")
    return row.asDict()


# ----------------------------------------------------------------------------- shipping

#: Pickled predictors up to this size ride in the UDF on Spark Connect. Every request that
#: carries the plan (each action, and each schema lookup of a DataFrame built on the
#: output) resends them, and each task's serialized function holds a copy in the JVM, so
#: larger ones go as an artifact file, uploaded once per session.
_INLINE_BYTES = 1 << 20
#: Without artifacts, the most a predictor may weigh in the plan: Spark Connect's gRPC
#: messages are capped at 128 MiB by default (client and server), and the plan holds
#: more than the predictor.
_INLINE_MAX_BYTES = 96 << 20
_ARTIFACT_PREFIX = "spark_dl_predictor_"
_uploaded = set()  # (session id, artifact name) already added in this process
_uploaded_lock = threading.Lock()


class _Inline:
    """A pickled predictor carried in the UDF's closure (Spark Connect)."""

    def __init__(self, blob: bytes):
        self.value = blob


class _ArtifactFile:
    """A pickled predictor in a session artifact file (Spark Connect): ``value`` reads it
    where the executors keep the session's files."""

    def __init__(self, name: str):
        self.name = name

    @property
    def value(self) -> bytes:
        from pyspark import SparkFiles

        with open(SparkFiles.get(self.name), "rb") as f:
            return f.read()


def _ship_predictor(spark, blob: bytes):
    """How the pickled predictor ``blob`` reaches the executors; the object has ``value``
    (the bytes) there.

    Classic sessions: a broadcast (one copy per executor, fetched once). Spark Connect: the
    bytes themselves up to :data:`_INLINE_BYTES`, else a session artifact file named after
    the bytes' SHA-256 (so the same model is uploaded once per session; artifacts stay
    until the session ends); where the server refuses artifacts, the bytes again up to
    :data:`_INLINE_MAX_BYTES`, beyond which a ValueError says what to do.
    """
    from spark_dl.spark.common.session import is_connect

    if not is_connect(spark):
        return spark.sparkContext.broadcast(blob)
    if len(blob) <= _INLINE_BYTES:
        return _Inline(blob)
    try:
        return _ArtifactFile(_upload_artifact(spark, blob))
    except Exception as e:  # a server without artifact support, or refusing files
        if len(blob) <= _INLINE_MAX_BYTES:
            import sys

            print(f"spark_dl: the Spark Connect server took no artifact file ({e}); the "
                  f"model ({len(blob) / 2 ** 20:.1f} MiB pickled) goes inside the query "
                  "instead", file=sys.stderr, flush=True)
            return _Inline(blob)
        raise ValueError(
            f"the model is {len(blob) / 2 ** 20:.0f} MiB pickled, too large to send inside a "
            f"Spark Connect query (gRPC messages are capped at 128 MiB by default), and the "
            f"server took no artifact file ({type(e).__name__}: {e}); transform on a classic "
            "Spark session, or with a smaller model") from e


def _upload_artifact(spark, blob: bytes) -> str:
    """Adds ``blob`` to the Connect session's files (once per session and content); returns
    its name."""
    import hashlib
    import os
    import shutil
    import tempfile

    name = f"{_ARTIFACT_PREFIX}{hashlib.sha256(blob).hexdigest()[:32]}.pkl"
    key = (getattr(spark, "session_id", None) or id(spark), name)
    with _uploaded_lock:
        if key in _uploaded:
            return name
    folder = tempfile.mkdtemp(prefix="spark_dl_artifact_")
    try:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(blob)
        spark.addArtifacts(path, file=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with _uploaded_lock:
        _uploaded.add(key)
    return name
