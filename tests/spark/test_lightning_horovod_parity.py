"""A Horovod Lightning program runs on spark_dl's Lightning estimator (issue 33, "Lightning
on Spark"): Horovod's class names, every param of Horovod 0.28.1's
``horovod.spark.lightning.TorchEstimator``, ``trainer_args`` that agree with the estimator,
a default TensorBoard logger (so ``LearningRateMonitor`` works), the user's callbacks in the
driver's dry run, a plain ``torch.nn.Module`` with ``optimizer`` and ``loss`` (Horovod's
legacy path), and ``prediction_kind`` carried to the model for pyspark.ml's evaluators.

One fit starts workers (the legacy module with Horovod's params); the dry-run failure
prepares nothing new (the prepared data is cached by plan) and starts none; the rest needs
no Spark job."""

import os
import sys
import types

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("pyspark")

from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402

import spark_dl.spark.lightning as hvd  # noqa: E402 - the way Horovod programs import it
from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.lightning import LightningEstimator, LightningModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

F = torch.nn.functional
CENTERS = np.array([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])

#: Every keyword of Horovod 0.28.1's horovod.spark.lightning.TorchEstimator.__init__.
HOROVOD_PARAMS = [
    "num_proc", "model", "backend", "store", "optimizer", "loss", "loss_constructors",
    "metrics", "loss_weights", "sample_weight_col", "gradient_compression", "feature_cols",
    "input_shapes", "validation", "label_cols", "callbacks", "batch_size", "val_batch_size",
    "epochs", "verbose", "random_seed", "shuffle_buffer_size", "shuffle",
    "partitions_per_process", "run_id", "train_minibatch_fn", "train_steps_per_epoch",
    "validation_steps_per_epoch", "transformation_fn", "transformation_edit_fields",
    "transformation_removed_fields", "train_reader_num_workers", "trainer_args",
    "val_reader_num_workers", "reader_pool_type", "label_shapes", "inmemory_cache_all",
    "num_gpus", "logger", "log_every_n_steps", "data_module", "loader_num_epochs",
    "terminate_on_nan", "profiler", "debug_data_loader",
    "train_async_data_loader_queue_size", "val_async_data_loader_queue_size", "use_gpu",
    "mp_start_method"]

#: Horovod params that mean nothing here, as a Horovod program sets them.
HOROVOD_ONLY = dict(
    num_gpus=0, loader_num_epochs=None, debug_data_loader=True, metrics=[F.l1_loss],
    reader_pool_type="process", data_module=object, mp_start_method="spawn",
    train_async_data_loader_queue_size=4, val_async_data_loader_queue_size=4,
    transformation_edit_fields=[("extra", np.float32, (), False)],
    transformation_removed_fields=["extra"], loss_constructors=[lambda: F.mse_loss],
    train_minibatch_fn=lambda *args: None)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class Classifier(pl.LightningModule):
    """Its own steps (log-probabilities, nll_loss), as in Horovod's Lightning MNIST."""

    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x):
        return F.log_softmax(self.net(x), -1)

    def training_step(self, batch, batch_idx):
        loss = F.nll_loss(self(batch["features"]), batch["label"].long())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def legacy_estimator(store, **kwargs):
    """Horovod's legacy path: a plain module with optimizer and loss."""
    module = net()
    params = dict(num_proc=2, model=module, store=store, feature_cols=["features"],
                  label_cols=["label"], validation=0.2, batch_size=16, epochs=4,
                  optimizer=torch.optim.Adam(module.parameters(), lr=0.05),
                  loss=F.cross_entropy, verbose=1)
    params.update(kwargs)
    return hvd.TorchEstimator(**params)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("lightning_parity") / "store"))


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, size=300)
    x = CENTERS[labels] + rng.normal(scale=0.5, size=(300, 4))
    # Labels as doubles, as Spark's StringIndexer writes them.
    return spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, labels)],
                                 ["features", "label"]).cache()


# ----------------------------------------------------------------------------- no Spark job


def test_horovod_names_are_the_lightning_classes():
    assert hvd.TorchEstimator is LightningEstimator
    assert hvd.TorchModel is LightningModel
    assert {"TorchEstimator", "TorchModel"} <= set(hvd.__all__) and "TorchModel" in dir(hvd)
    # The docstring names Horovod's real class (there is no
    # horovod.spark.lightning.LightningEstimator).
    assert "horovod.spark.lightning.TorchEstimator" in LightningEstimator.__doc__
    assert "horovod.spark.lightning.LightningEstimator" not in LightningEstimator.__doc__


def test_every_horovod_param_is_accepted_with_a_note_where_it_means_nothing(store, capsys):
    missing = [p for p in HOROVOD_PARAMS if not LightningEstimator().hasParam(p)]
    assert missing == []
    est = legacy_estimator(store, **HOROVOD_ONLY)
    est.setNumGPUs(1)  # Horovod's accessor spelling
    assert est.getNumGPUs() == 1
    est._check_params()
    printed = capsys.readouterr().out
    for name in HOROVOD_ONLY:
        if HOROVOD_ONLY[name] is not None:
            assert f"LightningEstimator: {name} is ignored: " in printed, name
    assert "metrics is ignored: log metrics from the module's steps with self.log" in printed
    assert len([line for line in printed.splitlines() if "is ignored" in line]) == \
        len([v for v in HOROVOD_ONLY.values() if v is not None])


@pytest.mark.parametrize("args", [
    {"num_sanity_val_steps": 0},
    {"num_sanity_val_steps": 0, "max_epochs": 4, "accumulate_grad_batches": 1,
     "log_every_n_steps": 50, "limit_train_batches": 1.0, "devices": 1,
     "accelerator": "auto", "enable_checkpointing": False, "gradient_clip_val": 1.0,
     "use_distributed_sampler": False},
])
def test_trainer_args_that_agree_with_the_estimator_are_accepted(store, args):
    legacy_estimator(store, trainer_args=args)._check_params()


@pytest.mark.parametrize("args, words", [
    ({"num_sanity_val_steps": 2}, "num_sanity_val_steps=2 (the driver's dry run checks the "
                                  "steps before training; 0 agrees)"),
    ({"max_epochs": 3}, "max_epochs=3 (use epochs; 4 agrees)"),
    ({"accelerator": "cpu"}, "accelerator='cpu' (use use_gpu;"),
    ({"limit_train_batches": 1}, "limit_train_batches=1 (use train_steps_per_epoch; 1.0 "
                                 "agrees)"),
    ({"logger": "tb"}, "logger='tb' (use logger; None or the logger param's value agrees)"),
])
def test_trainer_args_that_conflict_are_refused_saying_why(store, args, words):
    with pytest.raises(ValueError) as info:
        legacy_estimator(store, trainer_args=args)._check_params()
    assert words in str(info.value)


def test_plain_module_without_optimizer_or_loss_is_refused_with_the_fix(store):
    for kwargs in (dict(optimizer=None), dict(loss=None)):
        with pytest.raises(TypeError) as info:
            legacy_estimator(store, **kwargs)._check_params()
        assert ("plain torch.nn.Module (Sequential), not a LightningModule: pass optimizer= "
                "(built over its parameters) and loss=") in str(info.value)


def _trained(est):
    """The estimator's model from a made-up rank-0 result (no training)."""
    state = {"state_dict": est._module().state_dict(), "logged_metrics": {}}
    dataset = types.SimpleNamespace(columns={"features": {}, "label": {}})
    return est._trained_model({"state": state, "history": {}}, "run", dataset,
                              types.SimpleNamespace(input_shapes=None))


def test_prediction_kind_is_carried_to_the_model_or_inferred_from_the_loss(store):
    module = Classifier()
    est = hvd.TorchEstimator(model=module, feature_cols=["features"], label_cols=["label"],
                             prediction_kind="log_probabilities")
    assert _trained(est).getPredictionKind() == "log_probabilities"
    # A module training with its own steps: the estimator's loss says nothing about it.
    est = hvd.TorchEstimator(model=module, feature_cols=["features"], label_cols=["label"],
                             loss=F.cross_entropy)
    assert _trained(est).getPredictionKind() is None
    # The estimator's steps train with the loss: inferred by the torch estimator's rule.
    assert _trained(legacy_estimator(store)).getPredictionKind() == "logits"
    assert _trained(legacy_estimator(store, loss=F.mse_loss)).getPredictionKind() == \
        "regression"


# ----------------------------------------------------------------------------- Spark


def test_callback_needing_a_logger_without_one_fails_before_any_spark_job(store):
    est = legacy_estimator(store, logger=False, callbacks=[LearningRateMonitor()])
    with pytest.raises(ValueError) as info:
        est._check_params()
    assert ("LearningRateMonitor need(s) a logger, and logger=False turns it off: leave "
            "logger unset") in str(info.value)


def test_hooks_lightning_2_never_calls_are_named_before_any_spark_job(store):
    # Lightning 2.6 ignores these silently: a ported Horovod program would lose what they do.
    class Counter(pl.Callback):
        def on_epoch_end(self, trainer, module):
            pass

        def on_init_start(self, trainer):
            pass

    class StepEnd(Classifier):
        def training_step_end(self, outputs):
            return outputs

    est = hvd.TorchEstimator(num_proc=2, model=StepEnd(), store=store, epochs=1,
                             feature_cols=["features"], label_cols=["label"],
                             callbacks=[Counter(), LearningRateMonitor()])
    with pytest.warns(UserWarning, match="Lightning 2 never calls these hooks") as record:
        est._check_params()
    (message,) = [str(w.message) for w in record if "never calls" in str(w.message)]
    assert ("StepEnd.training_step_end (use training_step" in message
            and "Counter.on_epoch_end (use on_train_epoch_end / on_validation_epoch_end)"
            in message and "Counter.on_init_start" in message)
    assert "LearningRateMonitor" not in message and "Classifier" not in message


def test_user_callbacks_run_in_the_dry_run_before_training(store, df):
    # EarlyStopping on a key nobody logs fails in Lightning's validation end: on the
    # driver, before any worker starts.
    est = legacy_estimator(store, run_id="no_key", callbacks=[
        pl.callbacks.EarlyStopping(monitor="val_acc")])
    with pytest.raises(ValueError) as info:
        est.fit(df)
    message = str(info.value)
    assert "dry run" in message and "with the callbacks and trainer_args given" in message
    assert "val_acc" in message
    assert not store.exists(store.get_checkpoint_path("no_key"))


def test_legacy_module_with_horovod_params_trains_logs_and_predicts(store, df):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    monitor = LearningRateMonitor()
    est = legacy_estimator(store, run_id="legacy", callbacks=[monitor],
                           trainer_args={"num_sanity_val_steps": 0}, **HOROVOD_ONLY)
    model = est.fit(df)
    assert isinstance(model, hvd.TorchModel)
    # Horovod's legacy path returns the plain module, trained.
    trained = model.getModel()
    assert type(trained) is torch.nn.Sequential
    assert not torch.equal(trained[0].weight, est.getModel()[0].weight)
    history = model.getHistory()
    assert history["loss"][-1] < history["loss"][0]
    # The default logger: Lightning's TensorBoard files in the run's logs folder (what
    # LearningRateMonitor wrote to), beside the driver's own event file.
    logs = os.path.join(store.get_run_path("legacy"), store.get_logs_subdir())
    written = [os.path.relpath(os.path.join(d, n), logs) for d, _, names in os.walk(logs)
               for n in names]
    assert any(p.startswith(os.path.join("lightning_logs", "version_0")) and
               "tfevents" in p for p in written), written
    # prediction_kind inferred from cross_entropy: pyspark.ml's columns for the evaluator.
    assert model.getPredictionKind() == "logits"
    out = model.transform(df)
    assert {"prediction", "probability", "rawPrediction", "label__output"} <= set(out.columns)
    accuracy = MulticlassClassificationEvaluator(labelCol="label",
                                                 metricName="accuracy").evaluate(out)
    assert accuracy > 0.8
