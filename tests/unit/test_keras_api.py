"""spark_dl.keras in one process (TensorFlow backend): DistributedOptimizer wraps any Keras 3
optimizer and stays one (compile, serialization, state), argument errors, the facade at
Horovod's path, callbacks' argument checks."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

import spark_dl.keras as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
              "Ftrl", "Lion", "Lamb"]


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    hvd.init()
    yield


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if hasattr(keras.optimizers, n)])
def test_wraps_any_optimizer_and_saves_as_the_plain_one(name):
    base = getattr(keras.optimizers, name)(learning_rate=0.01)
    opt = hvd.DistributedOptimizer(base)
    assert isinstance(opt, type(base)) and isinstance(opt, keras.optimizers.Optimizer)
    assert hvd.is_distributed(opt) and not hvd.is_distributed(base)
    assert opt.get_config() == base.get_config()
    assert keras.saving.serialize_keras_object(opt) == keras.saving.serialize_keras_object(base)


def test_backward_passes_become_gradient_accumulation():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=3)
    assert opt.gradient_accumulation_steps == 3
    with pytest.raises(hvd.InvalidArgumentError, match="gradient_accumulation_steps=2"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2),
                                 backward_passes_per_step=3)


@pytest.mark.parametrize("bad, match", [
    (dict(optimizer="sgd"), "Keras 3 optimizer instance"),
    (dict(backward_passes_per_step=0), "backward_passes_per_step"),
    (dict(compression="fp16"), "compressor"),
    (dict(op=hvd.Adasum), "Adasum"),
    (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor"),
])
def test_bad_arguments(bad, match):
    kwargs = dict(optimizer=keras.optimizers.SGD())
    kwargs.update(bad)
    with pytest.raises(hvd.InvalidArgumentError, match=match):
        hvd.DistributedOptimizer(**kwargs)


def test_refuses_loss_scale_and_double_wrapping():
    with pytest.raises(hvd.InvalidArgumentError, match="LossScaleOptimizer"):
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(hvd.InvalidArgumentError, match="already"):
        hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD()))


def test_state_of_a_built_optimizer_is_carried_over():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    base = keras.optimizers.Adam(0.1)
    model.compile(base, "mse")
    model.fit(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), verbose=0)
    opt = hvd.DistributedOptimizer(base)
    assert int(opt.iterations) == int(base.iterations) == 1
    for a, b in zip(opt.variables, base.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_rank_training_and_load_model(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 1), np.float32), verbose=0, epochs=2)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = hvd.load_model(path, op=hvd.Sum)
    assert hvd.is_distributed(loaded.optimizer) and loaded.optimizer._sdl_op == hvd.Sum
    assert int(loaded.optimizer.iterations) == 2


def test_facade_at_horovods_path():
    import spark_dl.tensorflow.keras as tfk
    import spark_dl.tensorflow.keras.callbacks as cbs
    assert tfk.DistributedOptimizer is hvd.DistributedOptimizer
    assert cbs is hvd.callbacks
    assert set(hvd.__all__) <= set(dir(tfk))


def test_broadcast_global_variables_needs_a_model():
    with pytest.raises(hvd.InvalidArgumentError, match="pass the model"):
        hvd.broadcast_global_variables(0)


def test_best_model_checkpoint_needs_a_path(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = (np.ones((4, 3), np.float32), np.ones((4, 1), np.float32))
    with pytest.raises(ValueError, match="no filepath"):
        model.fit(*data, verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint()])
    cb = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    cb.filepath = str(tmp_path / "best.keras")
    model.fit(*data, verbose=0, epochs=2, callbacks=[cb])
    assert os.path.exists(cb.filepath)
