"""The torch side of GPU support that a CPU host can check honestly.

- :mod:`spark_dl.torch._device`: which devices the core takes, and the one error for the
  others (checked with real non-CPU tensors where the host has them, ``meta``; CUDA's
  message from its function, fed the core's answer, since no CUDA tensor exists here);
- the torch estimator's device choice: fallback to the CPU, the agreement across ranks
  (a fake ``allgather_object`` stands for the other ranks), the early error when the core
  cannot reduce CUDA tensors;
- ``TorchModel.transform``'s predictor: on the driver always the CPU; on an executor the
  task's GPU from a (fake) ``TaskContext``, the CPU on this host.
"""

import pickle
import warnings

import numpy as np
import pytest
import torch

import spark_dl.torch as hvd
from spark_dl import _core
from spark_dl.spark.launch.task import devices
from spark_dl.spark.launch.task.devices import GpuFallbackWarning, GpuNotVisibleError
from spark_dl.torch import _device

pytestmark = pytest.mark.timeout(60)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="checks the CPU-host behaviour; this host has CUDA")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for var in ("SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX", "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX",
                "SDL_AVAILABLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    devices._warned.clear()
    yield
    devices._warned.clear()


# ----------------------------------------------------------------------------- the core side

def test_core_cuda_support_agrees_with_the_build():
    ok, why = _device.core_cuda_support()
    if not _core.build_info()["cuda"]:
        assert not ok and "no CUDA support" in why
    if ok:
        assert why == ""


def test_cuda_refusal_names_tensor_device_and_what_to_do():
    text = _device.device_error("tensors[2]", "cuda:1", "grad.fc.weight",
                                support=(False, "this spark_dl build has no CUDA support"))
    assert text.startswith("tensors[2] ('grad.fc.weight') is on cuda:1, but this spark_dl "
                           "build has no CUDA support.")
    assert "nvcc" in text and "NCCL" in text and "tensor.cpu()" in text
    assert "use_gpu=False" in text and "docs/gpu.md" in text
    assert _device.device_error("tensor", "cuda:0", support=(True, "")) is None
    assert _device.device_error("tensor", "cpu") is None


def test_other_devices_are_refused_whatever_the_core_supports():
    text = _device.device_error("tensor", "mps:0", support=(True, ""))
    assert "is on mps:0" in text and "CPU and CUDA tensors only" in text


def test_meta_tensor_is_refused_before_anything_is_enqueued():
    hvd.init()
    try:
        ok = torch.ones(3)
        with pytest.raises(hvd.InvalidArgumentError, match=r"tensors\[1\] is on meta"):
            hvd.grouped_allreduce([ok, torch.ones(3, device="meta")], name="g")
        # Nothing of the group was enqueued: the next collective completes at once.
        assert torch.equal(hvd.allreduce(ok, op=hvd.Sum, name="after"), ok)
    finally:
        hvd.shutdown()


@no_cuda
def test_cuda_stream_helpers_need_cuda():
    with pytest.raises((RuntimeError, AssertionError)):
        _device.dlpack_stream(torch.device("cuda", 0))


# ----------------------------------------------------------------------------- estimator side

class FakeRanks:
    """allgather_object as N ranks would answer it."""

    def __init__(self, devices_of_ranks):
        self.devices = list(devices_of_ranks)

    def allgather_object(self, obj, name=None):
        assert name == "spark_dl.estimator.devices"
        return self.devices


def test_ranks_must_agree_on_the_kind_of_device():
    from spark_dl.spark.torch.adapter import _agree_on_device

    _agree_on_device(FakeRanks(["cpu", "cpu"]), torch.device("cpu"))
    _agree_on_device(FakeRanks(["cuda:0", "cuda:1"]), torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"rank 0: cuda:0, rank 1: cpu.*use_gpu=False"):
        _agree_on_device(FakeRanks(["cuda:0", "cpu"]), torch.device("cpu"))


@no_cuda
def test_torch_estimator_device_falls_back_once():
    from spark_dl.spark.torch.adapter import _device as choose

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert choose(True, 0) == torch.device("cpu")
        assert choose(True, 0) == torch.device("cpu")
        assert choose(False, 0) == torch.device("cpu")
    assert [w.category for w in seen] == [GpuFallbackWarning]


@no_cuda
def test_lightning_estimator_device_uses_the_same_rule(monkeypatch):
    pytest.importorskip("lightning")
    from spark_dl.spark.lightning.adapter import _device as choose

    with pytest.warns(GpuFallbackWarning):
        assert choose(True, 0, 0) == torch.device("cpu")
    monkeypatch.setenv("SDL_AVAILABLE_DEVICES", "0")
    with pytest.raises(GpuNotVisibleError, match="Spark assigned GPU"):
        choose(True, 0, 1)


def test_core_without_cuda_fails_before_training():
    from spark_dl.spark.torch.adapter import _check_core_takes

    _check_core_takes(torch.device("cpu"))
    if not _device.core_cuda_support()[0]:
        with pytest.raises(RuntimeError, match="use_gpu=True: the model is on cuda:0, but"):
            _check_core_takes(torch.device("cuda", 0))


# ----------------------------------------------------------------------------- transform side

class FakeResource:
    def __init__(self, addresses):
        self.addresses = addresses


class FakeTaskContext:
    def __init__(self, partition, gpus):
        self._partition, self._gpus = partition, gpus

    def partitionId(self):
        return self._partition

    def resources(self):
        return {"gpu": FakeResource(self._gpus)} if self._gpus else {}


def predictor(use_gpu=True):
    from spark_dl.spark.torch.adapter import TorchPredictor

    torch.manual_seed(0)
    return TorchPredictor(torch.nn.Linear(3, 2), ["x"], [[-1, 3]], 4, use_gpu=use_gpu)


def test_predictor_on_the_driver_stays_on_the_cpu():
    p = predictor()
    assert p.device() == torch.device("cpu")
    out = p.predict({"x": np.ones((5, 3), dtype=np.float32)})
    assert out[0].shape == (5, 2)
    p.prepare()
    assert p.on_executor
    assert pickle.loads(pickle.dumps(p)).on_executor is False  # a copy is for a new process


@pytest.mark.parametrize("kind", ["torch", "lightning"])
def test_predictor_of_a_bfloat16_model_returns_float32(kind):
    """NumPy has no bfloat16: a bf16 model's outputs come back as float32 (exactly), from
    TorchModel's and LightningModel's predictors alike."""
    if kind == "lightning":
        pytest.importorskip("lightning")
        from spark_dl.spark.lightning.adapter import LightningPredictor as Predictor
    else:
        from spark_dl.spark.torch.adapter import TorchPredictor as Predictor

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    p = Predictor(model, ["x"], [[-1, 3]], 4, use_gpu=False)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    out = p.predict({"x": x})[0]
    assert out.dtype == np.float32 and out.shape == (5, 2)
    expected = model(torch.from_numpy(x).to(torch.bfloat16)).float().detach().numpy()
    np.testing.assert_array_equal(out, expected)


@no_cuda
def test_predictor_on_a_cpu_executor(monkeypatch):
    pyspark = pytest.importorskip("pyspark")
    p = predictor()
    p.prepare()
    monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(lambda: FakeTaskContext(3, [])))
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transform falls back silently
        assert p.device() == torch.device("cpu")
        got = p.predict({"x": x})[0]
    np.testing.assert_allclose(got, p.model(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)
    # Spark gave this task a GPU that the executor's Python cannot see: a clear error.
    monkeypatch.setattr(pyspark.TaskContext, "get",
                        staticmethod(lambda: FakeTaskContext(0, ["0"])))
    with pytest.raises(GpuNotVisibleError, match="run transform on the CPU with use_gpu=False"):
        p.predict({"x": x})
    assert predictor(use_gpu=False).device() == torch.device("cpu")


def test_torch_model_carries_use_gpu():
    pytest.importorskip("pyspark")
    from spark_dl.spark.torch import TorchModel

    model = TorchModel(model=torch.nn.Linear(3, 1), feature_columns=["x"], input_shapes=[[-1, 3]])
    assert model.getUseGpu() is True
    assert model.setUseGpu(False)._predictor({"x": {}}).use_gpu is False


def test_batched_forms_send_device_tensors_one_by_one(monkeypatch):
    """The batched entry point (``submit_many``) takes host addresses only, so grouped
    allreduces and DistributedOptimizer's gradient batches must send device (CUDA)
    tensors one ``submit`` each, through DLPack with their stream. No CUDA tensor exists
    here: the dispatch is forced and the per-tensor form runs on CPU tensors, 1 rank."""
    from spark_dl.torch import _async_ops

    calls = []
    real_targets = _async_ops._batch_targets

    def as_if_on_device(tensors):  # in place: the buffers' specs say "not all in host memory"
        bufs, copy_backs, _ = real_targets(tensors)
        calls.append(len(bufs))
        return bufs, copy_backs, None

    def no_specs(bufs):  # out of place
        calls.append(len(bufs))
        return None

    monkeypatch.setattr(_async_ops, "_batch_targets", as_if_on_device)
    monkeypatch.setattr(_async_ops, "_batch_specs", no_specs)

    def batch_entry(*args, **kwargs):
        raise AssertionError("device tensors reached the batched entry point")

    monkeypatch.setattr(_async_ops._ops, "submit_many", batch_entry)
    hvd.init()
    try:
        xs = [torch.arange(4, dtype=torch.float32) + i for i in range(3)]
        out = hvd.grouped_allreduce(xs, op=hvd.Sum, postscale_factor=2.0, name="g")
        assert [o.tolist() for o in out] == [(2 * x).tolist() for x in xs]
        ys = [x.clone() for x in xs]
        assert hvd.grouped_allreduce_(ys, op=hvd.Sum, name="g_") is not None
        assert all(torch.equal(y, x) for x, y in zip(xs, ys))

        # DistributedOptimizer's gradient batch (a 1-rank optimizer does not communicate)
        zs = [x.clone() for x in xs]
        handle = _async_ops.batched_allreduce_async_(
            zs, ["w", "b", "c"], hvd.Sum, 1.0, 3.0, hvd.global_process_set)
        assert hvd.synchronize(handle) is zs
        assert all(torch.equal(z, 3 * x) for x, z in zip(xs, zs))
        assert calls == [3, 3, 3]
    finally:
        hvd.shutdown()


def test_a_device_tensor_is_enqueued_inside_its_device_scope(monkeypatch):
    """torch's ``__dlpack__`` exports a CUDA tensor only from the current device, so the
    enqueue runs inside the binding's device scope (here faked: no CUDA tensor exists on
    this machine); CPU tensors need no scope."""
    from spark_dl.common import handles, ops
    from spark_dl.torch import _device

    assert _device.device_scope(torch.ones(2)) is None
    events, calls = [], []

    class Scope:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    monkeypatch.setattr(ops, "_stream_of", lambda t: 7)
    monkeypatch.setattr(ops, "_device_scope", lambda t: Scope())
    monkeypatch.setattr(ops._core, "enqueue",
                        lambda *args: calls.append((list(events), args[-1])) or 987654321)
    ops.submit("allreduce", "x", torch.ones(2))
    handles._live.pop(987654321, None)
    assert calls == [(["enter"], 7)] and events == ["enter", "exit"]


def test_out_of_place_device_allreduce_writes_a_result_torch_allocated():
    """Device tensors' out-of-place allreduces get a result from torch's allocator (not a
    core allocation per call). The helper runs here on a CPU tensor, 1 rank: the result
    is a new tensor, scaled, and the input stays as it was."""
    from spark_dl.torch import _async_ops

    hvd.init()
    try:
        src = torch.arange(5, dtype=torch.float32)
        handle = _async_ops._allreduce_into_new(src, "into_new", hvd.Sum, 1.0, 3.0,
                                                hvd.global_process_set)
        out = hvd.synchronize(handle)
        assert out.data_ptr() != src.data_ptr()
        assert out.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert src.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        hvd.shutdown()


# ----------------------------------------------------------------------------- stream order

def test_a_result_is_ordered_after_its_stream_on_the_thread_that_takes_it(monkeypatch):
    """A device tensor's handle, when it completes, first orders the current stream after
    the one the tensor was enqueued from (which the core made wait for the result): a
    gradient hook enqueues on autograd's stream, step() reads on the caller's. Checked with
    a fake stream number on a CPU tensor (the core orders nothing for host memory)."""
    from spark_dl.common import ops

    calls = []

    def order(tensor, stream):
        calls.append((tensor, stream, len(built)))

    built = []
    monkeypatch.setattr(ops, "_stream_of", lambda t: 7)
    monkeypatch.setattr(ops, "_device_scope", None)
    monkeypatch.setattr(ops, "_order_after", order)
    hvd.init()
    try:
        x = torch.ones(3)
        h = ops.submit("allreduce", "ordered", x, x, finish=lambda o, i: built.append(1) or x)
        assert not calls, "ordered at enqueue"
        assert torch.equal(hvd.synchronize(h), torch.ones(3))
        assert calls == [(x, 7, 0)], "ordered once, before the result was built"
    finally:
        hvd.shutdown()


def test_order_after_is_a_no_op_on_the_same_stream_and_for_per_thread_streams():
    if not torch.cuda.is_available():
        # Without CUDA only the early exits can run: the per-thread stream needs no order.
        _device.order_after(torch.empty(0, device="meta"), 2)
        return
    t = torch.zeros(1, device="cuda")
    _device.order_after(t, _device.dlpack_stream(t.device))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _device.order_after(t, 1)  # the side stream now waits for the default stream


def test_a_batch_names_its_device_to_the_core():
    """enqueue_many carries the batch's device (a step's CUDA gradients in one call): where
    the core has no CUDA backend it refuses them naming the GPU, before anything is queued."""
    from spark_dl.common import ops

    if _device.core_cuda_support()[0]:
        pytest.skip("the core takes CUDA tensors here")
    x = torch.ones(4)
    hvd.init()
    try:
        with pytest.raises(hvd.InvalidArgumentError, match="cuda:3"):
            ops.submit_many("allreduce", ["g.0"], [x.data_ptr()], [x.data_ptr()], [x.shape],
                            [ops.DTYPES["float32"]], keep=(x,), finish=lambda o: None,
                            device=(ops.DEVICE_CUDA, 3), source=x)
        with pytest.raises(hvd.InvalidArgumentError, match="bad device type code 7"):
            ops.submit_many("allreduce", ["g.1"], [x.data_ptr()], [x.data_ptr()], [x.shape],
                            [ops.DTYPES["float32"]], keep=(x,), finish=lambda o: None,
                            device=(7, 0), source=x)
        # Nothing was queued: the same names run now on the host.
        h = ops.submit_many("allreduce", ["g.0"], [x.data_ptr()], [x.data_ptr()], [x.shape],
                            [ops.DTYPES["float32"]], keep=(x,), finish=lambda o: x)
        assert torch.equal(hvd.synchronize(h), torch.ones(4))
    finally:
        hvd.shutdown()
