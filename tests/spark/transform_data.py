"""Data shared by the framework test modules' checks of ``transform``'s Arrow path
(:mod:`spark_dl.spark.common.inference`): one small DataFrame holding the same features as
a vector column (dense rows and some sparse ones), an array<float> and an array<double>
column, beside columns that must pass through untouched."""

import numpy as np

ROWS = 300
WIDTH = 4


def features() -> np.ndarray:
    """The ``(ROWS, WIDTH)`` float64 features; every 5th row has zeros (a sparse vector)."""
    x = np.random.default_rng(7).normal(size=(ROWS, WIDTH))
    x[::5, 1:3] = 0.0
    return x


def frame(spark):
    """Columns: id (long), name (string), vec (vector), af (array<float>), ad
    (array<double>); ``af`` holds ``features()`` rounded to float32."""
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import types as T
    from pyspark.ml.linalg import VectorUDT

    x = features()
    rows = []
    for i, r in enumerate(x):
        vec = Vectors.sparse(WIDTH, {j: float(v) for j, v in enumerate(r) if v}) \
            if i % 5 == 0 else Vectors.dense(r)
        rows.append((i, f"row{i}", vec, [float(v) for v in r.astype(np.float32)],
                     [float(v) for v in r]))
    schema = T.StructType([T.StructField("id", T.LongType()),
                           T.StructField("name", T.StringType()),
                           T.StructField("vec", VectorUDT()),
                           T.StructField("af", T.ArrayType(T.FloatType())),
                           T.StructField("ad", T.ArrayType(T.DoubleType()))])
    return spark.createDataFrame(rows, schema)


def column(pdf, name) -> np.ndarray:
    """An output column of ``pdf`` (ordered by id) as a NumPy array, rows first."""
    values = pdf[name].to_numpy()
    if len(values) and hasattr(values[0], "toArray"):
        return np.stack([v.toArray() for v in values])
    if len(values) and isinstance(values[0], (list, np.ndarray)):
        return np.stack([np.asarray(v) for v in values])
    return values.astype(np.float64)
