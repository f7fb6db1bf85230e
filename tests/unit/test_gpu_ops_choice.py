"""The operations layer's backend choice for CUDA tensors, checked on a CPU host.

``_core._ops_backend_choice_for_tests`` builds the operations layer of *this* build with
CUDA memory faked by host memory and the real NCCL backend class (when NCCL was compiled)
told whether NCCL is usable, then asks which backend runs a one-tensor response. So the
priority order (NCCL, then host staging, then the host transport) and NCCL's refusals
(int16 reductions, bool Sum/Average) are the code a GPU host runs, not a copy of it.
"""

import pytest

from spark_dl import _core

pytestmark = pytest.mark.timeout(60)

# Enum values of native/src/common/types.h.
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER = range(5)
UINT8, INT8, INT16, INT32, INT64, FLOAT16, BFLOAT16, FLOAT32, FLOAT64, BOOL = range(10)
AVERAGE, SUM, MIN, MAX, PRODUCT = range(5)
CPU, CUDA, CUDA_HOST = range(3)

NCCL = "NCCL"
STAGED = "host-staged transport"
HOST = "host transport"


def choice(op, dtype, reduce, device, nccl_usable):
    return _core._ops_backend_choice_for_tests(op, dtype, reduce, device, nccl_usable)


def nccl_if_built():
    return NCCL if _core.build_info()["nccl"] else STAGED


@pytest.mark.parametrize("device", [CPU, CUDA_HOST])
@pytest.mark.parametrize("usable", [False, True])
def test_host_tensors_use_the_host_transport(device, usable):
    for op in (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER):
        assert choice(op, FLOAT32, SUM, device, usable) == HOST


@pytest.mark.parametrize("op", [ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER])
def test_cuda_tensors_use_nccl_when_usable_else_host_staging(op):
    assert choice(op, FLOAT32, SUM, CUDA, True) == nccl_if_built()
    assert choice(op, FLOAT32, SUM, CUDA, False) == STAGED


@pytest.mark.parametrize("dtype", [UINT8, INT8, INT32, INT64, FLOAT16, BFLOAT16, FLOAT32,
                                   FLOAT64])
@pytest.mark.parametrize("reduce", [AVERAGE, SUM, MIN, MAX, PRODUCT])
def test_nccl_reductions(dtype, reduce):
    for op in (ALLREDUCE, REDUCESCATTER):
        assert choice(op, dtype, reduce, CUDA, True) == nccl_if_built()


def test_reductions_nccl_lacks_are_staged():
    for op in (ALLREDUCE, REDUCESCATTER):
        for reduce in (AVERAGE, SUM, MIN, MAX, PRODUCT):
            assert choice(op, INT16, reduce, CUDA, True) == STAGED  # NCCL has no int16
        assert choice(op, BOOL, SUM, CUDA, True) == STAGED
        assert choice(op, BOOL, AVERAGE, CUDA, True) == STAGED
        assert choice(op, BOOL, MAX, CUDA, True) == nccl_if_built()  # logical or on uint8


def test_byte_moving_ops_take_every_dtype_on_nccl():
    for op in (ALLGATHER, BROADCAST, ALLTOALL):
        for dtype in (INT16, BOOL):
            assert choice(op, dtype, SUM, CUDA, True) == nccl_if_built()


def test_cuda_usable_is_a_bool_and_false_without_a_gpu():
    usable = _core.cuda_usable()
    assert isinstance(usable, bool)
    if not _core.build_info()["cuda"]:
        assert usable is False
    assert usable == _core.gpu_runtime_info()["cuda_usable"]


# ----------------------------------------------------------------------------- the stream

def test_torch_registers_its_stream_lookup():
    torch = pytest.importorskip("torch")
    from spark_dl.common import ops
    from spark_dl.torch import _device

    assert ops._stream_of is _device.stream_of
    assert _device.stream_of(torch.ones(2)) == 0  # host tensors have no stream
    assert _device.stream_of(None) == 0


def test_submit_passes_the_framework_stream_to_the_core(monkeypatch):
    from spark_dl.common import ops

    calls = []

    class FakeCore:
        CoreError = _core.CoreError

        def enqueue(self, *args):
            calls.append(args)
            return 1

    monkeypatch.setattr(ops, "_core", FakeCore())
    monkeypatch.setattr(ops, "_stream_of", lambda t: 77 if t == "device tensor" else 0)
    ops.submit("allreduce", "a", "device tensor", None)
    ops.submit("allreduce", "b", "host tensor", None)
    ops.submit("allreduce", "c", None, "device tensor")  # no input: the output's stream
    assert [c[-1] for c in calls] == [77, 0, 77]
