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


def test_iterations_count_backward_passes_and_updates_stay_keras():
    x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1), backward_passes_per_step=2)
    model.compile(opt, "mse")
    model.fit(x, y, batch_size=2, verbose=0)  # 4 backward passes, 2 updates
    assert int(opt.iterations) == 4  # Horovod's count
    ref_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    ref_model.set_weights([np.zeros_like(w) for w in ref_model.get_weights()])
    model2 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model2.set_weights(ref_model.get_weights())
    ref = keras.optimizers.Adam(0.1, gradient_accumulation_steps=2)
    ref_model.compile(ref, "mse")
    ref_model.fit(x, y, batch_size=2, verbose=0)
    assert int(ref.iterations) == 2  # Keras alone counts updates
    model2.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.1),
                                            backward_passes_per_step=2,
                                            average_aggregated_gradients=True), "mse")
    model2.fit(x, y, batch_size=2, verbose=0)
    # The updates themselves (Adam's bias correction included) are Keras's.
    for a, b in zip(model2.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_partial_distributed_optimizer_checks_its_layers():
    with pytest.raises(hvd.InvalidArgumentError, match="local_layers"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=["dense"])
    layer = keras.layers.Dense(2)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=layer)
    assert hvd.is_distributed(opt)
    assert not opt.variables or all("dense" not in v.path for v in opt.variables)


def test_sync_batch_norm_on_one_rank_is_batch_norm_and_saves(tmp_path):
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    sync, plain = hvd.SyncBatchNormalization(), keras.layers.BatchNormalization()
    np.testing.assert_allclose(np.asarray(sync(x, training=True)),
                               np.asarray(plain(x, training=True)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)
    model = keras.Sequential([keras.Input((4,)), hvd.SyncBatchNormalization(momentum=0.7)])
    path = str(tmp_path / "bn.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.layers[0], hvd.SyncBatchNormalization)
    assert loaded.layers[0].momentum == 0.7


def test_broadcast_callback_takes_local_variables():
    v = keras.Variable(1.0)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=v)
    assert cb._local_vars == [v]
    with pytest.raises(ValueError, match="local variables"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["w"])
