"""The shared estimator layer with a framework that is nothing but an adapter.

examples/spark/custom_framework_adapter.py implements the contract of
:mod:`spark_dl.spark.common.adapter` for a linear model in plain NumPy. Here it runs
fit -> transform -> save/load on local[2], resumes a run by ``run_id``, and rejects bad
input before workers start: everything but the adapter comes from spark/common."""

import importlib.util
import os
import sys

import cloudpickle
import numpy as np
import pytest

pytest.importorskip("pyspark")

from spark_dl.spark.common.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W = np.array([1.5, -2.0, 0.5, 1.0])


def _load_example():
    path = os.path.join(ROOT, "examples", "spark", "custom_framework_adapter.py")
    spec = importlib.util.spec_from_file_location("custom_framework_adapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # The workers cannot import it by name: its classes travel by value.
    cloudpickle.register_pickle_by_value(module)
    return module


ex = _load_example()


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 4))
    y = x @ W + 0.3
    return spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                                 ["features", "y"])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("adapter_store")))


def estimator(store, **kwargs):
    args = dict(num_proc=2, store=store, model=ex.Linear(4), feature_cols=["features"],
                label_cols=["y"], batch_size=16, epochs=3, validation=0.2, verbose=0,
                learning_rate=0.05, random_seed=1)
    args.update(kwargs)
    return ex.LinearEstimator(**args)


@pytest.fixture(scope="module")
def fitted(store, df):
    return estimator(store, run_id="linear_run").fit(df)


def test_fit_learns_and_reports_averaged_metrics(fitted, store):
    w, b = fitted.getModel().w.ravel(), fitted.getModel().b
    np.testing.assert_allclose(w, W, atol=0.05)
    np.testing.assert_allclose(b, [0.3], atol=0.05)
    history = fitted.getHistory()
    assert history["epoch"] == [1, 2, 3]
    assert history["loss"][-1] < history["loss"][0]
    assert set(history) >= {"loss", "mae", "val_loss", "val_mae", "rows_per_s"}
    assert fitted.timings["first_step_s"] > 0
    # The shared layer wrote the adapter's checkpoint and TensorBoard events for the run.
    assert store.exists(store.get_checkpoint_path("linear_run"))
    logs = store.get_logs_path("linear_run")
    assert any("tfevents" in p for p in store.listdir(logs))


def test_transform_and_persistence_round_trip(fitted, df, tmp_path):
    rows = fitted.transform(df).select("features", "y__output").limit(50).collect()
    x = np.array([r["features"].toArray() for r in rows])
    expected = x @ fitted.getModel().w.ravel() + fitted.getModel().b[0]
    np.testing.assert_allclose([r["y__output"] for r in rows], expected, rtol=1e-9)

    path = str(tmp_path / "linear_model")
    fitted.write().overwrite().save(path)
    loaded = ex.LinearModel.load(path)
    assert loaded.getHistory() == fitted.getHistory()
    again = loaded.transform(df).select("y__output").limit(50).collect()
    np.testing.assert_allclose([r[0] for r in again], [r["y__output"] for r in rows])

    est_path = str(tmp_path / "linear_estimator")
    est = estimator(None, learning_rate=0.2)
    est.write().overwrite().save(est_path)
    assert ex.LinearEstimator.load(est_path).getLearningRate() == 0.2


def test_resume_by_run_id_continues_from_the_adapters_checkpoint(fitted, store, df):
    more = estimator(store, run_id="linear_run", epochs=5).fit(df)
    assert more.getHistory()["epoch"] == [1, 2, 3, 4, 5]
    assert more.getHistory()["loss"][:3] == pytest.approx(fitted.getHistory()["loss"])


def test_bad_input_fails_before_workers_start(store, df, spark):
    with pytest.raises(TypeError, match="model must be a Linear"):
        estimator(store, model="nope").fit(df)
    with pytest.raises(ValueError, match="4 values per row; the model takes 3"):
        estimator(store, model=ex.Linear(3)).fit(df)
    with pytest.raises(ValueError, match="learning_rate must be a positive number"):
        estimator(store, learning_rate=-1)
