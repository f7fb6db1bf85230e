"""One device rule for Keras and Lightning, checked on a CPU host through fakes.

:func:`spark_dl.spark.launch.task.devices.choose_gpu` decides for the torch estimator;
these tests check that the Keras estimator's workers (TensorFlow's visible GPU), the Keras
model's ``transform`` and the Lightning model's ``transform`` apply the same rule: Spark's
GPU for the task (a fake ``TaskContext`` or ``SDL_AVAILABLE_DEVICES``), the local rank's
(partition's) otherwise, the CPU with one warning in training and silently in transform,
and a clear error when Spark assigned a GPU the process cannot see. The GPUs themselves are
fakes (a device count, recorded TensorFlow calls): nothing here runs on a GPU.
"""

import pickle
import warnings

import numpy as np
import pytest

from spark_dl.spark.launch.task import devices
from spark_dl.spark.launch.task.devices import GpuFallbackWarning, GpuNotVisibleError
from test_gpu_torch import FakeTaskContext  # the same fake Spark task as the torch side

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for var in ("SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX", "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX",
                "SDL_AVAILABLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    devices._warned.clear()
    yield
    devices._warned.clear()


def in_task(monkeypatch, partition, gpus):
    pyspark = pytest.importorskip("pyspark")
    monkeypatch.setattr(pyspark.TaskContext, "get",
                        staticmethod(lambda: FakeTaskContext(partition, gpus)))


# ----------------------------------------------------------------------------- Keras training

@pytest.fixture
def fake_tf(monkeypatch):
    """TensorFlow with `n` fake GPUs: list_physical_devices answers them, the visible-device
    and memory-growth calls are recorded instead of made."""
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the Keras backend here is not TensorFlow")
    import tensorflow as tf

    calls = {"visible": [], "growth": [], "gpus": []}
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: list(calls["gpus"]) if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "set_visible_devices",
                        lambda devs, kind=None: calls["visible"].append(list(devs)))
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda dev, on: calls["growth"].append(dev))
    monkeypatch.setattr(tf.config.threading, "set_intra_op_parallelism_threads",
                        lambda n: None)
    return calls


def test_keras_worker_uses_sparks_gpu_by_its_cuda_ordinal(fake_tf, monkeypatch):
    from spark_dl.spark.keras.adapter import _configure_devices

    fake_tf["gpus"] = ["GPU0", "GPU1"]
    # Spark gave this task GPU "1", and CUDA_VISIBLE_DEVICES was not narrowed to it: the
    # old rule took GPU 0 (any assignment meant index 0); the shared rule takes ordinal 1.
    monkeypatch.setenv("SDL_AVAILABLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _configure_devices(True, 0, 2) == "gpu:1"
    assert fake_tf["visible"] == [["GPU1"]]
    assert fake_tf["growth"] == ["GPU1"]


def test_keras_worker_without_spark_gpus_uses_its_local_rank(fake_tf, monkeypatch):
    from spark_dl.spark.keras.adapter import _configure_devices

    fake_tf["gpus"] = ["GPU0", "GPU1"]
    assert _configure_devices(True, 3, 4) == "gpu:1"  # local rank 3 of 2 GPUs
    # The knob picks the local rank's GPU even when Spark assigned one.
    monkeypatch.setenv("SDL_AVAILABLE_DEVICES", "0")
    monkeypatch.setenv("SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX", "1")
    assert _configure_devices(True, 1, 2) == "gpu:1"
    assert fake_tf["visible"] == [["GPU1"], ["GPU1"]]


def test_keras_worker_hides_gpus_when_use_gpu_is_false(fake_tf):
    from spark_dl.spark.keras.adapter import _configure_devices

    fake_tf["gpus"] = ["GPU0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _configure_devices(False, 0, 1) == "cpu"
    assert fake_tf["visible"] == [[]]


def test_keras_worker_falls_back_to_the_cpu_once_with_a_warning(fake_tf):
    from spark_dl.spark.keras.adapter import _configure_devices

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _configure_devices(True, 0, 1) == "cpu"
        assert _configure_devices(True, 0, 1) == "cpu"
        assert _configure_devices(True, 1, 2, warn=False) == "cpu"
    assert [w.category for w in seen] == [GpuFallbackWarning]


def test_keras_worker_with_sparks_gpu_but_none_visible_is_an_error(fake_tf, monkeypatch):
    from spark_dl.spark.keras.adapter import _configure_devices

    monkeypatch.setenv("SDL_AVAILABLE_DEVICES", "0")
    with pytest.raises(GpuNotVisibleError,
                       match=r"Spark assigned GPU.*tf\.config\.list_physical_devices"):
        _configure_devices(True, 0, 1)
    assert fake_tf["visible"] == []  # nothing changed before the error


# ----------------------------------------------------------------------------- Keras transform

@pytest.fixture
def keras_predictor():
    keras = pytest.importorskip("keras")
    from spark_dl.spark.keras import util
    from spark_dl.spark.keras.adapter import KerasPredictor

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    def make(use_gpu=True):
        return KerasPredictor(util.model_to_bytes(model), None, ["x"], util.input_specs(model),
                              4, use_gpu=use_gpu), model
    return make


def test_keras_predictor_on_the_driver_stays_on_the_cpu(keras_predictor, monkeypatch):
    import spark_dl.spark.keras.adapter as adapter

    monkeypatch.setattr(adapter, "_gpu_count", lambda backend: 2)
    p, _ = keras_predictor()
    assert p.device_name() == "cpu:0"  # the driver's dry run, even with GPUs
    p.prepare()
    assert p.on_executor
    assert pickle.loads(pickle.dumps(p)).on_executor is False  # a copy is for a new process


def test_keras_predictor_picks_the_tasks_gpu(keras_predictor, monkeypatch):
    import spark_dl.spark.keras.adapter as adapter

    p, _ = keras_predictor()
    p.on_executor = True  # as prepare() sets it on an executor (without loading the model)
    monkeypatch.setattr(adapter, "_gpu_count", lambda backend: 2)
    in_task(monkeypatch, 3, [])
    assert p.device_name() == "gpu:1"   # partition 3 of 2 GPUs
    in_task(monkeypatch, 3, ["1"])
    assert p.device_name() == "gpu:1"   # Spark's GPU "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert p.device_name() == "gpu:0"   # ... which is ordinal 0 when it alone is visible
    assert keras_predictor(use_gpu=False)[0].device_name() == "cpu:0"


def test_keras_predictor_on_a_cpu_executor(keras_predictor, monkeypatch):
    import spark_dl.spark.keras.adapter as adapter

    monkeypatch.setattr(adapter, "_gpu_count", lambda backend: 0)
    p, model = keras_predictor()
    in_task(monkeypatch, 2, [])
    p.prepare()
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpuFallbackWarning)  # transform falls back silently
        assert p.device_name() == "cpu:0"
        got = p.predict({"x": x})[0]
    np.testing.assert_allclose(got, model.predict_on_batch(x), rtol=1e-5)
    in_task(monkeypatch, 0, ["0"])
    with pytest.raises(GpuNotVisibleError, match="run transform on the CPU with use_gpu=False"):
        p.predict({"x": x})


def test_keras_model_carries_use_gpu():
    pytest.importorskip("pyspark")
    keras = pytest.importorskip("keras")
    from spark_dl.spark.keras import KerasModel

    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model = KerasModel(model=net, feature_columns=["x"])
    assert model.getUseGpu() is True
    assert model._predictor(None).use_gpu is True
    assert model.setUseGpu(False)._predictor(None).use_gpu is False


# ----------------------------------------------------------------------------- Lightning transform

@pytest.fixture
def lightning_predictor():
    torch = pytest.importorskip("torch")
    from spark_dl.spark.lightning.adapter import LightningPredictor

    def make(use_gpu=True):
        torch.manual_seed(0)
        return LightningPredictor(torch.nn.Linear(3, 2), ["x"], [[-1, 3]], 4, use_gpu=use_gpu)
    return make


def fake_cuda(monkeypatch, count):
    import torch

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i))
    return chosen


def test_lightning_predictor_picks_the_tasks_gpu(lightning_predictor, monkeypatch):
    import torch

    p = lightning_predictor()
    chosen = fake_cuda(monkeypatch, 2)
    assert p.device() == torch.device("cpu")  # the driver's dry run
    p.prepare()
    in_task(monkeypatch, 3, [])
    assert p.device() == torch.device("cuda", 1)
    in_task(monkeypatch, 0, ["1"])
    assert p.device() == torch.device("cuda", 1)
    assert chosen == [1, 1]
    assert pickle.loads(pickle.dumps(p)).on_executor is False
    q = lightning_predictor(use_gpu=False)
    q.prepare()
    assert q.device() == torch.device("cpu")


def test_lightning_predictor_on_a_cpu_executor(lightning_predictor, monkeypatch):
    import torch

    fake_cuda(monkeypatch, 0)
    p = lightning_predictor()
    p.prepare()
    in_task(monkeypatch, 1, [])
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GpuFallbackWarning)
        assert p.device() == torch.device("cpu")
        got = p.predict({"x": x})[0]
    np.testing.assert_allclose(got, p.model(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)
    in_task(monkeypatch, 0, ["0"])
    with pytest.raises(GpuNotVisibleError, match="Spark assigned GPU"):
        p.predict({"x": x})


def test_lightning_model_carries_use_gpu():
    pytest.importorskip("pyspark")
    pytest.importorskip("lightning")
    import torch

    from spark_dl.spark.lightning import LightningModel

    model = LightningModel(model=torch.nn.Linear(3, 1), feature_columns=["x"],
                           input_shapes=[[-1, 3]])
    assert model.getUseGpu() is True
    assert model._predictor(None).use_gpu is True
    assert model.setUseGpu(False)._predictor(None).use_gpu is False


# ----------------------------------------------------------------------------- Lightning training

def test_lightning_strategy_trains_on_the_device_the_estimator_chose(monkeypatch):
    """The estimator's worker picks its GPU by choose_gpu and hands it to the strategy, whose
    own default (local rank modulo the GPUs) would differ when Spark's GPU is another one."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from spark_dl.lightning.strategy import strategy_class

    cls = strategy_class()
    fake_cuda(monkeypatch, 2)
    monkeypatch.setattr(cls, "local_rank", property(lambda self: 0))
    given = cls(device=torch.device("cuda", 1))
    given.parallel_devices = [torch.device("cuda", 0)]  # what Trainer(devices=1) sets
    assert given.root_device == torch.device("cuda", 1)
    assert cls(device=1)._device == torch.device("cuda", 1)
    default = cls()
    default.parallel_devices = [torch.device("cuda", 0)]
    assert default.root_device == torch.device("cuda", 0)  # local rank 0 of 2 GPUs
    cpu = cls(device=torch.device("cuda", 1))
    cpu.parallel_devices = [torch.device("cpu")]  # Trainer(accelerator="cpu") wins
    assert cpu.root_device == torch.device("cpu")
    with pytest.raises(ValueError, match="names the GPU"):
        cls(device="cpu")
