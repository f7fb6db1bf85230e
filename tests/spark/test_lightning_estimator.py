"""LightningEstimator / LightningModel on local[2]: fit and transform, Lightning-format
checkpoints and resume (scheduler state included), loggers and ModelCheckpoint files in the
store, persistence and Pipeline, EarlyStopping agreed by every rank, the estimator's own
steps from loss/optimizer, and bad inputs failing before any worker starts.

Three fits in all (each starts two workers); the bad-input checks start none."""

import os
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("pyspark")

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from pyspark.ml import Pipeline, PipelineModel  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.lightning import LightningEstimator, LightningModel  # noqa: E402

# Classes of this module travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

F = torch.nn.functional
W = np.array([1.5, -2.0, 0.5, 1.0])
LR = 0.05


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


class Regression(pl.LightningModule):
    """Configures its own optimizer and a per-epoch StepLR; logs train/val metrics."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        out = self(batch["features"]).squeeze(-1)
        loss = F.mse_loss(out, batch["y"])
        self.log("train_loss", loss)
        self.log("train_mae", (out - batch["y"]).abs().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        out = self(batch["features"]).squeeze(-1)
        self.log("val_loss", F.mse_loss(out, batch["y"]), sync_dist=True)
        self.log("val_mae", (out - batch["y"]).abs().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=LR)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class Plain(pl.LightningModule):
    """Only forward(): the estimator's loss and optimizer supply the steps."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)


class StopRecorder(pl.Callback):
    """Writes the epoch at which each rank's fit ended into ``folder``."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}"), "w") as f:
            f.write(str(trainer.current_epoch))


def regression_df(spark, rows=480, seed=0):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4))
    y = x @ W + 0.3
    return spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                                 ["features", "y"])


def estimator(store, **kwargs):
    params = dict(num_proc=2, model=Regression(), feature_cols=["features"], label_cols=["y"],
                  batch_size=32, epochs=3, validation=0.2, store=store, verbose=1)
    params.update(kwargs)
    return LightningEstimator(**params)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("lightning_est") / "store"))


@pytest.fixture(scope="module")
def df(spark):
    return regression_df(spark).cache()


@pytest.fixture(scope="module")
def fitted(store, df):
    est = estimator(store, run_id="shared", logger=CSVLogger("ignored", name="csv"),
                    checkpoint_callback=ModelCheckpoint(monitor="val_loss"))
    return est, est.fit(df)


# ----------------------------------------------------------------------------- fit/transform


def test_fit_learns_with_own_optimizer_and_scheduler(fitted, store):
    est, model = fitted
    history = model.getHistory()
    assert history["epoch"] == [1, 2, 3]
    assert history["loss"][-1] < history["loss"][0] / 2
    assert set(history) >= {"loss", "val_loss", "mae", "val_mae", "rows_per_s"}
    # The run's checkpoint is Lightning's format: weights, optimizer, scheduler, loops.
    ckpt = torch.load(store.get_checkpoint_path("shared"), weights_only=False)
    assert ckpt["spark_dl"]["epoch"] == 3 and ckpt["epoch"] == 3  # both count from 1
    assert ckpt["lr_schedulers"][0]["_last_lr"] == [pytest.approx(LR * 0.5 ** 3)]
    assert "optimizer_states" in ckpt and "state_dict" in ckpt
    # The user's module is untouched; the returned one is trained.
    assert not torch.equal(est.getModel().net[0].weight, model.getModel().net[0].weight)
    assert model.getMetadata()["logged_metrics"]["val_loss"] == pytest.approx(
        history["val_loss"][-1], rel=1e-4)


def test_logger_and_checkpoint_callback_write_into_the_store(fitted, store):
    run = store.get_run_path("shared")
    files = [os.path.relpath(os.path.join(d, n), run) for d, _, names in os.walk(run)
             for n in names]
    logs = store.get_logs_subdir()
    assert any(p.startswith(logs + os.sep) and p.endswith("metrics.csv") for p in files), files
    assert any(p.startswith("checkpoints" + os.sep) and p.endswith(".ckpt") for p in files), \
        files


def test_transform_save_load_and_pipeline(fitted, df, tmp_path):
    # One transform (each costs a Spark job whose Python workers import Lightning): of the
    # model after a save/load round trip, against the fitted module applied locally.
    _, model = fitted
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = LightningModel.load(path)
    assert loaded.getHistory() == model.getHistory()
    out = loaded.transform(df)
    assert out.columns == ["features", "y", "y__output"]
    pdf = out.limit(50).toPandas()
    x = torch.tensor(np.stack([v.toArray() for v in pdf.features]), dtype=torch.float32)
    with torch.no_grad():
        expected = model.getModel()(x).numpy().reshape(-1)
    np.testing.assert_allclose(pdf["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-5)

    pipe_path = str(tmp_path / "pipeline")
    PipelineModel(stages=[model]).write().overwrite().save(pipe_path)
    stage = PipelineModel.load(pipe_path).stages[0]
    assert isinstance(stage, LightningModel)
    assert torch.equal(stage.getModel().net[0].weight, model.getModel().net[0].weight)
    # An unfitted Pipeline with the estimator round-trips too.
    Pipeline(stages=[estimator(None, epochs=1)]).write().overwrite().save(str(tmp_path / "p"))
    est = Pipeline.load(str(tmp_path / "p")).getStages()[0]
    assert isinstance(est, LightningEstimator) and est.getEpochs() == 1


class _Forward(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def test_arrow_transform_equals_the_module_on_numpy(spark):
    # A hand-built LightningModel over a vector column (dense and sparse rows) and an
    # array<float> column: bitwise the module on the same float32 rows, one row per call.
    import transform_data as data

    module = _Forward()
    x32 = torch.from_numpy(data.features().astype(np.float32))
    with torch.no_grad():
        want = np.concatenate([module(x32[i:i + 1]).numpy()
                               for i in range(len(x32))]).reshape(-1)
    df = data.frame(spark)
    for col in ("vec", "af"):
        model = LightningModel(model=module, feature_columns=[col], label_columns=["y"],
                               input_shapes=[[-1, 4]], batch_size=1)
        out = model.transform(df)
        assert out.columns == df.columns + ["y__output"]
        got = data.column(out.orderBy("id").toPandas(), "y__output")
        np.testing.assert_array_equal(got, want.astype(np.float64), err_msg=col)


def test_resume_continues_lightning_state(fitted, store, df):
    # The same run_id with one more epoch: only epoch 4 trains, from the checkpoint's
    # weights, optimizer and scheduler (the learning rate keeps halving).
    model = estimator(store, run_id="shared", epochs=4).fit(df)
    assert model.getHistory()["epoch"] == [1, 2, 3, 4]
    ckpt = torch.load(store.get_checkpoint_path("shared"), weights_only=False)
    assert ckpt["spark_dl"]["epoch"] == 4
    assert ckpt["lr_schedulers"][0]["_last_lr"] == [pytest.approx(LR * 0.5 ** 4)]
    assert model.getHistory()["loss"][:3] == fitted[1].getHistory()["loss"]


def test_early_stopping_stops_every_rank_at_the_same_epoch(store, df, tmp_path):
    # Plain module: steps from loss=, optimizer from optimizer=. An improvement must be
    # larger than 1e9, so the second epoch stops training on both ranks.
    module = Plain()
    folder = str(tmp_path)
    est = estimator(store, model=module, loss=F.mse_loss,
                    optimizer=torch.optim.SGD(module.parameters(), lr=0.01), epochs=5,
                    callbacks=[EarlyStopping(monitor="val_loss", min_delta=1e9, patience=0),
                               StopRecorder(folder)])
    model = est.fit(df)
    assert model.getHistory()["epoch"] == [1, 2]
    ends = {name: open(os.path.join(folder, name)).read() for name in os.listdir(folder)}
    assert ends == {"rank0": "2", "rank1": "2"}


# ----------------------------------------------------------------------------- bad input


class NoOptimizer(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch["features"]).squeeze(-1), batch["y"])


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(model=mlp()), TypeError, "LightningModule"),
    (dict(model=NoOptimizer(), validation=None), ValueError, "configure_optimizers"),
    (dict(model=Plain(), optimizer=None), ValueError, "configure_optimizers"),
    (dict(model=Plain(), loss=None, optimizer="set below"), ValueError, "training_step"),
    (dict(trainer_args={"max_epochs": 5, "gradient_clip_val": 1.0}), ValueError,
     "max_epochs=5 (use epochs; 3 agrees)"),
    (dict(callbacks=[object()]), TypeError, "callbacks[0]"),
    (dict(logger="tb"), TypeError, "logger"),
])
def test_bad_params_fail_before_any_spark_job(store, df, kwargs, error, words):
    if kwargs.get("optimizer") == "set below":
        kwargs["optimizer"] = torch.optim.SGD(kwargs["model"].parameters(), lr=0.1)
    with pytest.raises(error) as info:
        estimator(store, **kwargs)._check_params()
    assert words in str(info.value)


class WrongInput(Regression):
    def forward(self, x):
        return self.net(x[:, :3])  # the first layer wants 4 values


def test_module_that_fails_on_the_data_fails_on_the_driver(store, df):
    with pytest.raises(ValueError) as info:
        estimator(store, model=WrongInput(), run_id="never").fit(df)
    message = str(info.value)
    assert "two rows of the training data" in message and "features: (2, 4)" in message
    assert not store.exists(store.get_checkpoint_path("never"))
