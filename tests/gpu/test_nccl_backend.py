"""The NCCL backend's collectives on real GPUs, against torch.

One rank runs wherever a GPU is usable (NCCL refuses two ranks on one GPU); the
multi-rank test needs two GPUs and runs the same code path with a unique id
exchanged through a file. Uses the test-only binding _core._GpuSelftestNccl
(device pointers as integers; each call synchronized before it returns).
"""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from spark_dl import _core  # noqa: E402


def _skip_reason():
    if not _core.build_info()["nccl"]:
        return "spark_dl was built without NCCL: " + _core.gpu_runtime_info()["nccl_reason"]
    info = _core.gpu_runtime_info()
    if not info["nccl_usable"]:
        return "NCCL is not usable here: " + info["nccl_reason"]
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "GPU present")

DEV = "cuda:0"
FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
INTS = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64}


@pytest.fixture(scope="module")
def comm():
    return _core._GpuSelftestNccl(0)


def _sync():
    torch.cuda.synchronize()


@pytest.mark.parametrize("name,dtype", list({**FLOATS, **INTS}.items()))
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max", "Product"])
def test_allreduce_one_rank_is_identity(comm, name, dtype, op):
    x = (torch.arange(1001, device=DEV) % 50).to(dtype)
    out = torch.empty_like(x)
    _sync()
    comm.allreduce(x.data_ptr(), out.data_ptr(), x.numel(), name, op)
    assert torch.equal(out, x)
    comm.allreduce(x.data_ptr(), x.data_ptr(), x.numel(), name, op)  # in place
    assert torch.equal(out, x)


def test_fused_allreduce_applies_prescale_and_postscale(comm):
    xs = [torch.randn(n, device=DEV) for n in (1, 7, 4096, 65537)]
    outs = [torch.empty_like(x) for x in xs]
    _sync()
    comm.fused_allreduce([x.data_ptr() for x in xs], [o.data_ptr() for o in outs],
                         [x.numel() for x in xs], "float32", "Average", 2.0, 0.25)
    for x, o in zip(xs, outs):
        assert torch.allclose(o, x * 2.0 * 0.25)


def test_allgather_broadcast_alltoall_reducescatter_one_rank(comm):
    x = torch.arange(33, dtype=torch.int16, device=DEV)  # int16: bytes move, no reduction
    out = torch.empty_like(x)
    _sync()
    comm.allgather(x.data_ptr(), out.data_ptr(), [33], "int16")
    assert torch.equal(out, x)
    y = x.clone()
    comm.broadcast(y.data_ptr(), 33, "int16", 0)
    assert torch.equal(y, x)
    out.zero_()
    comm.alltoall(x.data_ptr(), [33], out.data_ptr(), [33], "int16")
    assert torch.equal(out, x)
    f = torch.randn(10, device=DEV)
    g = torch.empty_like(f)
    _sync()
    comm.reducescatter(f.data_ptr(), g.data_ptr(), [10], "float32", "Sum")
    assert torch.equal(g, f)


def test_unsupported_reductions_are_refused_clearly(comm):
    x = torch.zeros(4, dtype=torch.int16, device=DEV)
    with pytest.raises(_core.CoreError, match="NCCL has no int16 reduction"):
        comm.allreduce(x.data_ptr(), x.data_ptr(), 4, "int16", "Sum")
    b = torch.zeros(4, dtype=torch.bool, device=DEV)
    with pytest.raises(_core.CoreError, match="not defined for bool"):
        comm.allreduce(b.data_ptr(), b.data_ptr(), 4, "bool", "Sum")
    with pytest.raises(_core.CoreError, match="broadcast root 3"):
        comm.broadcast(b.data_ptr(), 4, "bool", 3)


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from spark_dl import _core
    rank, size, id_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.cuda.set_device(rank)
    def exchange(id_bytes):
        if id_bytes is not None:
            with open(id_file + ".tmp", "wb") as f:
                f.write(id_bytes)
            os.rename(id_file + ".tmp", id_file)
            return id_bytes
        deadline = time.time() + 60
        while not os.path.exists(id_file):
            if time.time() > deadline:
                raise TimeoutError("no NCCL id from rank 0")
            time.sleep(0.05)
        return open(id_file, "rb").read()
    comm = _core._GpuSelftestNccl(rank, rank, size, exchange, 60.0)
    dev = f"cuda:{rank}"
    x = torch.full((1001,), float(rank + 1), device=dev)
    torch.cuda.synchronize()
    comm.allreduce(x.data_ptr(), x.data_ptr(), x.numel(), "float32", "Average")
    assert torch.allclose(x, torch.full_like(x, (size + 1) / 2)), x[:4]
    counts = [r + 3 for r in range(size)]  # ragged
    mine = torch.full((counts[rank],), rank, dtype=torch.int64, device=dev)
    out = torch.empty(sum(counts), dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    comm.allgather(mine.data_ptr(), out.data_ptr(), counts, "int64")
    want = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in enumerate(counts)])
    assert torch.equal(out.cpu(), want), out
    send_counts = [p + 1 for p in range(size)]            # p+1 elements to rank p
    recv_counts = [rank + 1] * size                       # rank+1 from everyone
    send = torch.cat([torch.full((c,), 10 * rank + p, dtype=torch.float32)
                      for p, c in enumerate(send_counts)]).to(dev)
    recv = torch.empty(sum(recv_counts), device=dev)
    torch.cuda.synchronize()
    comm.alltoall(send.data_ptr(), send_counts, recv.data_ptr(), recv_counts, "float32")
    want = torch.cat([torch.full((rank + 1,), 10 * p + rank, dtype=torch.float32)
                      for p in range(size)])
    assert torch.equal(recv.cpu(), want), recv
    rs_counts = [2 + r for r in range(size)]  # ragged reducescatter
    full = torch.arange(sum(rs_counts), dtype=torch.float32, device=dev) * (rank + 1)
    part = torch.empty(rs_counts[rank], device=dev)
    torch.cuda.synchronize()
    comm.reducescatter(full.data_ptr(), part.data_ptr(), rs_counts, "float32", "Sum")
    start = sum(rs_counts[:rank])
    total = sum(r + 1 for r in range(size))
    want = torch.arange(start, start + rs_counts[rank], dtype=torch.float32) * total
    assert torch.equal(part.cpu(), want), part
    print("RANK_OK", rank)
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL refuses two "
                    "ranks on one GPU)")
def test_two_ranks_on_two_gpus(tmp_path):
    size = 2
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(size),
                               str(tmp_path / "nccl_id")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RANK_OK {r}" in out, out[-3000:]
    assert not os.path.exists(str(tmp_path / "nccl_id.tmp"))
