"""spark_dl.torch in one process (rank 0 of 1): Horovod's names, tensor handling through
DLPack (layouts, dtypes, tensors that require grad), compression, argument checks."""

import json
import os
import tempfile

import pytest
import torch

import spark_dl.torch as hvd

pytestmark = pytest.mark.timeout(60)

# horovod.torch's public names (0.28), every one of which must exist here.
HOROVOD_TORCH_NAMES = """
init shutdown is_initialized size local_size cross_size rank local_rank cross_rank
is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built start_timeline stop_timeline
Average Sum Adasum Min Max Product
ProcessSet global_process_set add_process_set remove_process_set
allreduce allreduce_async allreduce_ allreduce_async_
grouped_allreduce grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_
sparse_allreduce_async allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async
reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async
join barrier poll synchronize
broadcast_object allgather_object broadcast_parameters broadcast_optimizer_state
Compression DistributedOptimizer SyncBatchNorm HorovodInternalError
""".split()


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def test_horovod_surface_is_complete():
    missing = [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)]
    assert not missing
    assert set(HOROVOD_TORCH_NAMES) <= set(hvd.__all__) | {"HorovodInternalError"}
    from spark_dl.torch import mpi_ops  # the module name Horovod scripts import from

    assert mpi_ops.allreduce is hvd.allreduce


def test_topology_of_a_single_process():
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() is True
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not hvd.mpi_threads_supported()
    assert hvd.global_process_set.ranks == [0]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.uint16, torch.int16,
                                   torch.int32, torch.int64, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64, torch.bool])
def test_every_dtype_round_trips(dtype):
    t = (torch.arange(12) % 3).reshape(3, 4).to(dtype)
    op = hvd.Max if dtype == torch.bool else hvd.Sum
    for out in (hvd.allreduce(t, op=op), hvd.allgather(t), hvd.broadcast(t, 0),
                hvd.alltoall(t), hvd.reducescatter(t, op=op)):
        assert out.dtype == dtype and torch.equal(out, t)


def test_in_place_ops_keep_the_tensor_and_its_memory():
    t = torch.arange(6, dtype=torch.float32)
    ptr = t.data_ptr()
    assert hvd.allreduce_(t, op=hvd.Sum) is t and t.data_ptr() == ptr
    assert hvd.broadcast_(t, 0) is t and t.data_ptr() == ptr
    group = [torch.ones(2), torch.zeros(3)]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(group), group))


def test_non_contiguous_inputs_are_copied_and_written_back():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()
    assert not view.is_contiguous()
    assert torch.equal(hvd.allreduce(view, op=hvd.Sum), view)
    assert hvd.allreduce_(view, op=hvd.Sum, prescale_factor=2.0) is view
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2)
    assert torch.equal(hvd.allgather(view), view)


def test_tensors_that_require_grad_are_accepted():
    # DLPack refuses to export them; the front end detaches first (see the core report).
    p = torch.nn.Parameter(torch.ones(3))
    assert torch.equal(hvd.allreduce(p).detach(), torch.ones(3))
    hvd.allreduce_(p, op=hvd.Sum)
    hvd.broadcast_(p, 0)
    assert torch.equal(p.detach(), torch.ones(3))


def test_per_tensor_async_allreduce_of_host_tensors_goes_by_address(monkeypatch):
    # allreduce_async_ of a contiguous CPU tensor skips DLPack (a batch of one by address):
    # same result, same memory, same handle behaviour; anything else takes the DLPack path.
    from spark_dl.common import ops as core_ops
    from spark_dl.common.handles import BatchHandle

    exported = []
    real_submit = core_ops.submit
    monkeypatch.setattr(core_ops, "submit", lambda *a, **k: exported.append(a[0]) or
                        real_submit(*a, **k))
    p = torch.nn.Parameter(torch.full((2, 3), 2.0))
    ptr = p.data_ptr()
    h = hvd.allreduce_async_(p, op=hvd.Sum, name="fast", prescale_factor=3.0)
    assert isinstance(h, BatchHandle) and h.name == "fast"
    assert hvd.synchronize(h) is p and p.data_ptr() == ptr
    assert torch.equal(p.detach(), torch.full((2, 3), 6.0)) and exported == []
    unnamed = hvd.synchronize(hvd.allreduce_async_(torch.ones(2), op=hvd.Average))
    assert torch.equal(unnamed, torch.ones(2)) and exported == []
    base = torch.ones(3, 2)
    hvd.synchronize(hvd.allreduce_async_(base.t(), op=hvd.Sum, postscale_factor=4.0))
    assert exported == ["allreduce"] and torch.equal(base, torch.full((3, 2), 4.0))
    with pytest.raises(hvd.InvalidArgumentError, match="dtype"):
        hvd.allreduce_async_(torch.ones(2, dtype=torch.complex64))


def test_async_handles():
    h = hvd.allreduce_async(torch.ones(4), name="h", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h, timeout=30), torch.ones(4))
    assert hvd.poll(h)
    out, splits = hvd.synchronize(hvd.alltoall_async(torch.arange(4), splits=[4]))
    assert splits.dtype == torch.int32 and splits.tolist() == [4]
    gh = hvd.grouped_allreduce_async([torch.ones(1), torch.ones(2)], name="gh")
    assert [t.tolist() for t in hvd.synchronize(gh)] == [[1.0], [1.0, 1.0]]


def test_alltoall_return_follows_horovod():
    t = torch.arange(4)
    assert isinstance(hvd.alltoall(t), torch.Tensor)
    out, splits = hvd.alltoall(t, splits=[4])
    assert torch.equal(out, t) and splits.tolist() == [4]


def test_sparse_allreduce_and_sparse_refused_elsewhere():
    s = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], size=(4,), check_invariants=True)
    out = hvd.synchronize(hvd.sparse_allreduce_async(s, name="sp", op=hvd.Sum))
    assert out.is_sparse and torch.equal(out.to_dense(), s.to_dense())
    with pytest.raises(hvd.InvalidArgumentError, match="only dense tensors"):
        hvd.allreduce(s)


@pytest.mark.parametrize("tensor,needle", [
    (torch.ones(2, dtype=torch.complex64), "dtype torch.complex64"),
    (torch.ones(2, device="meta"), "is on meta"),
])
def test_unsupported_tensors_raise_before_enqueueing(tensor, needle):
    with pytest.raises(hvd.InvalidArgumentError, match=needle):
        hvd.allreduce(tensor)
    with pytest.raises(hvd.InvalidArgumentError, match=needle):  # no half-enqueued group
        hvd.grouped_allreduce([torch.ones(2), tensor])


def test_reduce_op_arguments():
    with pytest.raises(hvd.InvalidArgumentError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(hvd.InvalidArgumentError, match="unknown reduce op"):
        hvd.allreduce(torch.ones(1), op=17)


@pytest.mark.parametrize("compressor", [hvd.Compression.fp16, hvd.Compression.bf16])
def test_compression_casts_floats_only(compressor):
    t = torch.linspace(0, 1, 5, dtype=torch.float64)
    wire, ctx = compressor.compress(t)
    assert wire.dtype == compressor.wire_dtype
    back = compressor.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, t, atol=1e-2)
    ints = torch.arange(3)
    wire, ctx = compressor.compress(ints)
    assert wire is ints and compressor.decompress(wire, ctx) is ints
    none_wire, none_ctx = hvd.Compression.none.compress(t)
    assert none_wire is t and hvd.Compression.none.decompress(none_wire, none_ctx) is t
    out = hvd.allreduce(t, compression=compressor)
    assert out.dtype == torch.float64 and torch.allclose(out, t, atol=1e-2)


def test_objects_and_timeline_on_one_rank():
    assert hvd.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert hvd.allgather_object(("x", 1)) == [("x", 1)]
    # One rank is rank 0: it writes the trace (a second start replaces the first file).
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    assert hvd.start_timeline(path) is True
    assert hvd.start_timeline(path, mark_cycles=True) is True
    hvd.allreduce(torch.ones(3), name="timeline.probe")
    hvd.stop_timeline()
    hvd.stop_timeline()  # idempotent
    with open(path) as f:
        events = json.load(f)
    assert any(e["name"] == "ALLREDUCE" for e in events)
    with pytest.raises(hvd.InvalidArgumentError, match="timeline"):
        hvd.start_timeline("/nonexistent-dir/timeline.json")


def test_broadcast_parameters_argument_checks():
    model = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(model.weight.sum().item(), root_rank=0)
    with pytest.raises(ValueError, match="not a tensor"):
        hvd.broadcast_parameters({"x": 1.0}, root_rank=0)


def test_sync_batch_norm_on_one_rank_is_batch_norm():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4)
    sbn, bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    assert torch.allclose(sbn(x), bn(x), atol=1e-6)
    assert torch.allclose(sbn.running_var, bn.running_var)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        sbn(torch.ones(3))
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    net[1].running_mean.fill_(0.5)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(net)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert converted[1].weight is net[1].weight
    assert torch.equal(converted[1].running_mean, torch.full((2,), 0.5))
