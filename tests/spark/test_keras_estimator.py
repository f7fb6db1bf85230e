"""KerasEstimator / KerasModel on local[2]: fit and transform, resume, ML persistence and
Pipeline, custom objects, a multi-input/multi-output model, Keras callbacks, and bad inputs
(which must fail on the driver, before any worker starts).

Fits are few and small: each starts two workers that import TensorFlow."""

import io
import os
import sys
from contextlib import redirect_stdout

import cloudpickle
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
pytest.importorskip("pyspark")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.keras import KerasEstimator, KerasModel  # noqa: E402

# Functions and classes of this module travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

W = np.array([1.5, -2.0, 0.5, 1.0])


# ----------------------------------------------------------------------------- helpers


class Scale(keras.layers.Layer):
    """A custom layer (serializable through get_config): multiplies by a constant."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return dict(super().get_config(), factor=self.factor)


class Opaque:
    """Not serializable as a Keras config."""


class Unsavable(keras.layers.Layer):
    """A custom layer whose constructor takes an object no config can hold."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return x


def half_mse(y_true, y_pred):
    return 0.5 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


class LrProbe(keras.callbacks.Callback):
    """Fails the fit unless the workers train with ``expected`` as learning rate (Horovod's
    estimators scale the given rate by the number of workers)."""

    def __init__(self, expected):
        super().__init__()
        self.expected = expected

    def on_epoch_begin(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if abs(lr - self.expected) > 1e-6:
            raise AssertionError(f"epoch {epoch}: training with lr {lr}, not {self.expected}")


class BackendProbe(keras.callbacks.Callback):
    """Fails the fit unless the workers run Keras on the ``expected`` backend."""

    def __init__(self, expected):
        super().__init__()
        self.expected = expected

    def on_epoch_begin(self, epoch, logs=None):
        if keras.backend.backend() != self.expected:
            raise AssertionError(f"workers train on {keras.backend.backend()}, "
                                 f"not {self.expected}")


class BatchHookProbe(keras.callbacks.Callback):
    """Fails the fit unless Keras' batch hooks (``on_train_batch_begin``/``_end``, which
    Keras 3 callbacks override) run around every batch of every epoch."""

    def on_epoch_begin(self, epoch, logs=None):
        self.begun = self.ended = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.begun += 1

    def on_train_batch_end(self, batch, logs=None):
        self.ended += 1

    def on_epoch_end(self, epoch, logs=None):
        steps = self.params.get("steps")
        if not (self.begun == self.ended == steps and steps):
            raise AssertionError(f"epoch {epoch}: batch hooks ran {self.begun}/{self.ended} "
                                 f"times for {steps} steps")


def regression_df(spark, rows=600, seed=0):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4))
    y = x @ W + 0.3
    z = np.stack([x[:, 0] - x[:, 1], 2 * x[:, 2]], axis=1)
    data = [(Vectors.dense(r), float(t), float(r[3]), [float(v) for v in zz], 1.0 + (i % 2))
            for i, (r, t, zz) in enumerate(zip(x, y, z))]
    return spark.createDataFrame(data, ["features", "y", "x3", "z", "w"])


def mlp(custom=False):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
              keras.layers.Dense(1)]
    if custom:
        layers.insert(1, Scale(0.5))
    return keras.Sequential(layers)


def estimator(store, model=None, **kwargs):
    params = dict(num_proc=2, model=model or mlp(), optimizer=keras.optimizers.Adam(0.05),
                  loss="mse", metrics=["mae"], feature_cols=["features"], label_cols=["y"],
                  batch_size=32, epochs=3, validation=0.2, store=store, verbose=1)
    params.update(kwargs)
    return KerasEstimator(**params)


def features_of(pdf, col="features"):
    return np.stack([v.toArray() if hasattr(v, "toArray") else np.asarray(v) for v in pdf[col]])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("keras_est") / "store"))


@pytest.fixture(scope="module")
def df(spark):
    return regression_df(spark).cache()


@pytest.fixture(scope="module")
def fitted(spark, store, df):
    """One fit shared by the tests that only look at its result."""
    out = io.StringIO()
    est = estimator(store, run_id="shared", epochs=4, callbacks=[LrProbe(0.1), BatchHookProbe()],
                    checkpoint_callback=keras.callbacks.ModelCheckpoint("best.keras"))
    with redirect_stdout(out):
        model = est.fit(df)
    return est, model, out.getvalue()


# ----------------------------------------------------------------------------- fit/transform


def test_fit_learns_reports_and_checkpoints(fitted, store):
    est, model, printed = fitted
    history = model.getHistory()
    assert history["epoch"] == [1, 2, 3, 4]
    assert history["loss"][-1] < history["loss"][0] / 2
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert set(history) >= {"loss", "val_loss", "mae", "val_mae", "rows_per_s"}
    epoch_lines = [line for line in printed.splitlines() if line.startswith("Epoch ")]
    assert len(epoch_lines) == 4 and "val_mae" in epoch_lines[-1]
    # The user's model is untouched; the returned one is trained and compiled.
    trained = model.getModel()
    assert not np.allclose(est.getModel().get_weights()[0], trained.get_weights()[0])
    assert trained.compiled and trained.optimizer.iterations.numpy() > 0
    # The returned optimizer keeps the rate the user gave (the workers used it x 2).
    assert abs(float(trained.optimizer.learning_rate.numpy()) - 0.05) < 1e-7
    assert store.exists(store.get_checkpoint_path("shared"))
    # checkpoint_callback's file lands in the run's directory in the store.
    assert store.exists(os.path.join(store.get_run_path("shared"), "checkpoints",
                                     "best.keras"))
    assert model.timings["first_step_s"] > 0


def test_transform_matches_local_model(fitted, df):
    _, model, _ = fitted
    out = model.transform(df)
    assert out.columns == df.columns + ["y__output", "prediction"]  # mse: a regression
    pdf = out.orderBy("y").toPandas()
    expected = model.getModel().predict_on_batch(
        features_of(pdf).astype("float32")).reshape(-1)
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-5)
    err = np.abs(pdf["y__output"].to_numpy() - pdf["y"].to_numpy()).mean()
    assert err < 0.5


def test_arrow_transform_equals_the_model_on_numpy(spark, monkeypatch):
    # A hand-built KerasModel over a vector column (dense and sparse rows) and an
    # array<double> column: bitwise the model on the same float32 rows, one row per call
    # on both sides (other row counts may round differently). Each row's size comes from
    # the model's input, so no Spark job reads a row first.
    import transform_data as data

    import spark_dl.spark.common.model as model_module

    monkeypatch.setattr(model_module, "_first_row",
                        lambda *args: pytest.fail("transform read a row for the shapes"))

    keras.utils.set_random_seed(3)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(1)])
    x32 = data.features().astype("float32")
    want = np.concatenate([np.asarray(net.predict_on_batch(x32[i:i + 1]))
                           for i in range(len(x32))]).reshape(-1)
    df = data.frame(spark)
    for col in ("vec", "ad"):
        model = KerasModel(model=net, feature_columns=[col], label_columns=["y"],
                           batch_size=1)
        out = model.transform(df)
        assert out.columns == df.columns + ["y__output"]
        got = data.column(out.orderBy("id").toPandas(), "y__output")
        np.testing.assert_array_equal(got, want.astype(np.float64), err_msg=col)


def test_model_and_pipeline_persistence(fitted, df, store, tmp_path):
    est, model, _ = fitted
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = KerasModel.load(path)
    assert loaded.getHistory() == model.getHistory()
    for a, b in zip(model.getModel().get_weights(), loaded.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)
    a = model.transform(df).orderBy("y").select("y__output").toPandas()
    b = loaded.transform(df).orderBy("y").select("y__output").toPandas()
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-6)
    # The estimator saves and loads (its model as a Keras object through cloudpickle).
    est.write().overwrite().save(str(tmp_path / "est"))
    est2 = KerasEstimator.load(str(tmp_path / "est"))
    assert est2.getLoss() == "mse" and est2.getMetrics() == ["mae"]
    # A PipelineModel holding the KerasModel saves and loads.
    pm = PipelineModel(stages=[model])
    pm.write().overwrite().save(str(tmp_path / "pm"))
    got = PipelineModel.load(str(tmp_path / "pm")).transform(df).orderBy("y") \
        .select("y__output").toPandas()
    np.testing.assert_allclose(a.to_numpy(), got.to_numpy(), rtol=1e-6)


def test_resume_with_same_run_id(spark, store, df):
    est = estimator(store, run_id="resume", epochs=1, validation=None, verbose=0)
    first = est.fit(df)
    out = io.StringIO()
    with redirect_stdout(out):
        second = est.setEpochs(2).setVerbose(1).setCallbacks([LrProbe(0.1)]).fit(df)
    assert second.getHistory()["epoch"] == [1, 2]
    assert second.getHistory()["loss"][:1] == first.getHistory()["loss"]
    assert "resuming run resume after epoch 1" in out.getvalue()
    assert second.getHistory()["loss"][1] < first.getHistory()["loss"][0]


def test_accumulated_steps_keep_the_trained_optimizer_state(spark, store, df):
    """backward_passes_per_step adds gradient accumulators to the workers' optimizer; the
    fitted model's (the user's kind, without them) still gets the trained state."""
    import warnings

    est = estimator(store, epochs=1, validation=None, verbose=0, backward_passes_per_step=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trained = est.fit(df).getModel()
    opt = trained.optimizer
    assert int(opt.iterations.numpy()) > 0
    assert any(float(np.abs(np.array(v)).max()) > 0 for v in opt.variables
               if "momentum" in v.path)
    assert abs(float(opt.learning_rate.numpy()) - 0.05) < 1e-7


def test_custom_objects_multi_io_weights_and_early_stopping(spark, store, df, tmp_path):
    # Two inputs (a vector and a scalar column), two outputs (a scalar and a 2-vector), a
    # custom layer and a custom loss given through custom_objects, a sample weight column,
    # and Keras' EarlyStopping which must stop both ranks at the same epoch.
    keras.utils.set_random_seed(1)
    a = keras.Input((4,), name="a")
    b = keras.Input((1,), name="b")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([Scale(0.5)(a), b]))
    out_y = keras.layers.Dense(1, name="out_y")(h)
    out_z = keras.layers.Dense(2, name="out_z")(h)
    model = keras.Model([a, b], [out_y, out_z])
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)
    est = estimator(store, model=model, loss=[half_mse, "mse"], metrics=None,
                    feature_cols=["features", "x3"], label_cols=["y", "z"],
                    sample_weight_col="w", epochs=5, validation=None, callbacks=[stop],
                    custom_objects={"Scale": Scale, "half_mse": half_mse}, verbose=0)
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert history["epoch"] == [1, 2], history["epoch"]  # stopped after epoch 2 on all ranks
    assert {"out_y_loss", "out_z_loss"} <= set(history)
    out = fitted.transform(df)
    assert out.columns[-2:] == ["y__output", "z__output"]
    assert dict(out.dtypes)["z__output"] == "vector"
    row = out.select("z__output").first()[0]
    assert len(row) == 2
    path = str(tmp_path / "multi")
    fitted.write().overwrite().save(path)
    assert any(type(layer) is Scale for layer in KerasModel.load(path).getModel().layers)


def test_pipeline_fit(spark, store, df):
    pipe = Pipeline(stages=[estimator(store, epochs=1, validation=None, verbose=0)])
    pm = pipe.fit(df)
    assert "y__output" in pm.transform(df).columns


def test_torch_backend_workers(spark, store, df):
    # This driver imported Keras on TensorFlow; backend_env puts the workers on PyTorch
    # (fresh processes: KERAS_BACKEND is read when they import Keras). The .keras model
    # goes there and the trained weights come back to the driver's TensorFlow model.
    est = estimator(store, run_id="torch", epochs=3, validation=None, verbose=0,
                    backend_env={"KERAS_BACKEND": "torch"}, callbacks=[BackendProbe("torch")])
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert history["epoch"] == [1, 2, 3]
    assert history["loss"][-1] < history["loss"][0] / 2
    pdf = fitted.transform(df).orderBy("y").toPandas()
    expected = fitted.getModel().predict_on_batch(
        features_of(pdf).astype("float32")).reshape(-1)
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(pdf["y__output"].to_numpy() - pdf["y"].to_numpy()).mean() < 0.5


# ----------------------------------------------------------------------------- bad input


def _fails(est, df, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        est.fit(df)


def test_bad_inputs_fail_before_training(spark, store, df):
    _fails(estimator(store, feature_cols=["nope"]), df, "nope", Exception)
    # A backend the workers cannot train on.
    _fails(estimator(store, backend_env={"KERAS_BACKEND": "jax"}), df,
           r"tensorflow or torch Keras backend, not 'jax'")
    # A label with 2 values per row against an output of 1.
    _fails(estimator(store, label_cols=["z"]), df, r"label column 'z' has 2 values per row")
    # Two feature columns for a model with one input.
    _fails(estimator(store, feature_cols=["features", "x3"]), df, r"1 input\(s\)")
    # A custom layer that cannot be rebuilt from its config is named.
    model = keras.Sequential([keras.Input((4,)), Unsavable(Opaque()), keras.layers.Dense(1)])
    _fails(estimator(store, model=model, custom_objects={"Unsavable": Unsavable}), df,
           r"(?s)(cannot be saved|does not load back).*unsavable")
    # An input shape the column does not fit.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    _fails(estimator(store, model=model), df, r"(?s)cannot be evaluated.*model inputs")
    _fails(estimator(store, optimizer=3), df, "Keras optimizer", TypeError)
    _fails(estimator(store, optimizer="adamm"), df, "'adamm' is not a Keras optimizer")
    # A name or a config, as model.compile takes them.
    assert isinstance(estimator(store, optimizer="adam")._optimizer(), keras.optimizers.Adam)
    config = {"class_name": "SGD", "config": {"learning_rate": 0.5}}
    sgd = estimator(store, optimizer=config)._optimizer()
    assert isinstance(sgd, keras.optimizers.SGD) and float(sgd.learning_rate) == 0.5
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    _fails(estimator(store, model=unbuilt), df, "build it before fit")
