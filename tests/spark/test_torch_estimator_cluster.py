"""TorchEstimator on ``local-cluster[2,1,1024]``: two executor JVMs, one worker each.

One pipeline (VectorAssembler + TorchEstimator) is fitted with validation; its predictions
must equal the returned torch model applied locally, and a saved and reloaded PipelineModel
must predict the same on the executors.
"""

import io
import sys
from contextlib import redirect_stdout

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator, TorchModel  # noqa: E402
from test_run_cases import spark_session  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

W = np.array([2.0, -1.0, 0.5])


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local-cluster[2,1,1024]", **{"spark.executor.memory": "512m"})
    yield session
    session.stop()


def test_pipeline_fit_transform_save_load_on_two_executors(spark, tmp_path):
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(5)
    x = rng.normal(size=(500, 3))
    df = spark.createDataFrame([tuple(float(v) for v in r) + (float(r @ W - 1.0),) for r in x],
                               ["a", "b", "c", "y"]).repartition(3)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    est = TorchEstimator(num_proc=2, model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], batch_size=32, epochs=3, validation=0.2,
                         store=Store.create(str(tmp_path / "store")), run_id="cluster")
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"],
                                                outputCol="features"), est])
    out = io.StringIO()
    with redirect_stdout(out):
        fitted = pipeline.fit(df)
    model = fitted.stages[-1]
    assert isinstance(model, TorchModel)
    history = model.getHistory()
    assert history["epoch"] == [1, 2, 3]
    assert history["loss"][-1] < history["loss"][0] and \
        history["val_loss"][-1] < history["val_loss"][0]
    assert "2 processes" in out.getvalue() and "Epoch 3/3" in out.getvalue()

    pdf = fitted.transform(df).orderBy("y").toPandas()
    with torch.no_grad():
        expected = model.getModel()(torch.tensor(pdf[["a", "b", "c"]].to_numpy(),
                                                 dtype=torch.float32)).numpy().ravel()
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-5)

    path = str(tmp_path / "pipeline_model")
    fitted.write().save(path)
    loaded = PipelineModel.load(path)
    again = loaded.transform(df).orderBy("y").select("y__output").toPandas()
    # Same weights; a row may land in another batch or executor (another BLAS path), which
    # moves float32 results by an ulp or so.
    np.testing.assert_allclose(again["y__output"].to_numpy(), pdf["y__output"].to_numpy(),
                               rtol=1e-6, atol=1e-6)
