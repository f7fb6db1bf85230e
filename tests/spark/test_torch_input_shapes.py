"""input_shapes given per row, as Horovod's tests do (``[[2]]`` for a column of two values):
read as ``[-1, 2]`` by one rule (``spark_dl.spark.torch.util.batch_input_shapes``) in fit and
in transform, so a model fitted with ``batch_size=1`` on prepared Parquet transforms in
batches, and a hand-built TorchModel with such a shape does too.

One local Spark session for the module (the ``spark`` fixture of conftest.py); one small fit.
"""

import os
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator, TorchModel  # noqa: E402
from spark_dl.spark.torch.util import batch_input_shapes  # noqa: E402

# Functions and classes of this module travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

W = np.array([1.0, -1.0])
ROWS = 64


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def _plain_parquet_store(path):
    """A store whose train folder holds one Parquet file: features (2 floats), y."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    store = Store.create(str(path))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 2)).astype(np.float32)
    table = pa.table({"features": pa.array(list(x), pa.list_(pa.float32())),
                      "y": pa.array((x @ W + 0.5).astype(np.float64))})
    train = store.get_fs_path(store.get_train_data_path())
    os.makedirs(train)
    pq.write_table(table, os.path.join(train, "part-0.parquet"))
    return store


def _transform_df(spark, rows=5):
    x = np.random.default_rng(4).normal(size=(rows, 2))
    return x, spark.createDataFrame([([float(v) for v in r],) for r in x], ["features"])


def _local(model, x):
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().reshape(-1)


def test_a_per_row_shape_is_read_with_a_batch_dimension():
    cols = {"a": {"shape": [2]}, "b": {"shape": []}, "c": {"shape": [4]}, "d": {"shape": None}}
    assert batch_input_shapes(["a"], [[2]], cols) == [[-1, 2]]
    assert batch_input_shapes(["a"], [[1, 2]], cols) == [[-1, 1, 2]]
    assert batch_input_shapes(["b"], [[1]], cols) == [[-1, 1]]
    assert batch_input_shapes(["c"], [[2, 2]], cols) == [[-1, 2, 2]]
    # Shapes with -1, shapes of another size (a fixed batch) and unknown rows: as given.
    assert batch_input_shapes(["a", "c"], [[-1, 2], [2, 2, 2]], cols) == [[-1, 2], [2, 2, 2]]
    assert batch_input_shapes(["d"], [[2]], cols) == [[2]]


def test_fit_on_parquet_with_batch_size_1_and_shape_2_transforms(spark, tmp_path):
    # Horovod's test of training on prepared Parquet: input_shapes=[[2]], batch_size=1.
    store = _plain_parquet_store(tmp_path / "store")
    net = _linear()
    est = TorchEstimator(num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(),
                                                                          lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], input_shapes=[[2]], batch_size=1, epochs=1,
                         validation=None, store=store, verbose=0)
    model = est.fit_on_parquet()
    x, df = _transform_df(spark)
    pdf = model.transform(df).toPandas()
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), _local(model.getModel(), x),
                               rtol=1e-5, atol=1e-6)


def test_hand_built_model_with_a_per_row_shape_transforms_in_batches(spark):
    net = _linear()
    model = TorchModel(model=net, feature_columns=["features"], label_columns=["y"],
                       input_shapes=[[2]], batch_size=4)
    x, df = _transform_df(spark, rows=6)  # batches of 4 and 2 rows
    pdf = model.transform(df).toPandas()
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), _local(net, x), rtol=1e-5,
                               atol=1e-6)
