"""NaN and infinities in the data fail at prepare time, naming the column (unless allowed)."""

import math

import pytest

from spark_dl.spark.common.cache import TrainingDataCache
from spark_dl.spark.common.store import LocalStore
from spark_dl.spark.common.util import prepare_data

pytestmark = pytest.mark.timeout(300)


def test_nonfinite_values_are_named_at_prepare_time(spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    store = LocalStore(str(tmp_path / "store"))
    rows = [(float(i), [1.0, 2.0], Vectors.dense([0.5, 1.5]), 1.0) for i in range(20)]
    cases = {
        "y": [(r[0] if i != 3 else math.nan,) + r[1:] for i, r in enumerate(rows)],
        "arr": [r[:1] + (([1.0, math.inf] if i in (4, 7) else r[1]),) + r[2:]
                for i, r in enumerate(rows)],
        "vec": [r[:2] + ((Vectors.dense([-math.inf, 0.0]) if i == 5 else r[2]),) + r[3:]
                for i, r in enumerate(rows)],
    }
    counts = {"y": 1, "arr": 2, "vec": 1}
    for column, data in cases.items():
        df = spark.createDataFrame(data, ["y", "arr", "vec", "w"])
        with pytest.raises(ValueError) as info:
            prepare_data(2, store, df, label_columns=["y"], feature_columns=["arr", "vec"],
                         sample_weight_col="w", cache=TrainingDataCache())
        text = str(info.value)
        assert f"column {column!r} has {counts[column]} rows out of 20 with NaN or infinite" \
            in text and "allow_nonfinite=True" in text
    # Allowed on request; clean data passes either way.
    df = spark.createDataFrame(cases["y"], ["y", "arr", "vec", "w"])
    assert prepare_data(2, store, df, label_columns=["y"], feature_columns=["arr", "vec"],
                        cache=TrainingDataCache(), allow_nonfinite=True)
    clean = spark.createDataFrame(rows, ["y", "arr", "vec", "w"])
    assert prepare_data(2, store, clean, label_columns=["y"], feature_columns=["arr", "vec"],
                        cache=TrainingDataCache())
