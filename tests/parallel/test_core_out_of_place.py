"""Out-of-place allreduce: the core allocates the result and the transport reduces straight
from the input. Its bits must equal the in-place form's for every dtype, reduce op, scale
factor, size (one and several shared-memory chunks, pooled and heap outputs), fused and
grouped tensors and process sets, on every transport; the input must stay unchanged and
results held by the caller must never be reused underneath it."""

import zlib

import pytest

from harness import run_once, run_ranks

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
OPS = ["Average", "Sum", "Min", "Max", "Product"]
# (): scalar; (5, 3): odd, tiny; 20001: heap output, odd split; 1_300_001: above the 1 MiB
# pooled-output threshold and several 2 MiB shared-memory chunks for 4-byte and wider types.
SHAPES = [(), (5, 3), (20001,), (1_300_001,)]
BIG_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "uint8")
BIG_OPS = ("Sum", "Average", "Max")

TRANSPORTS = {"shm": {"SDL_SHM": "1"}, "gloo": {"SDL_SHM": "0", "SDL_CONTROLLER": "gloo"},
              "hier": {"SDL_SHM": "1", "SDL_CONTROLLER": "gloo"}}
# Every allreduce over 64 KiB pipelined in 64 KiB chunks (see test_core_ops).
TRANSPORTS["hier_chunks"] = {**TRANSPORTS["hier"], "SDL_HIERARCHICAL_CHUNK_BYTES": "65536"}


def _bits(t):
    import torch

    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _data(torch, dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        # Non-integer values: the order of the additions shows in the low bits.
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(getattr(torch, dtype))
    lo, hi = (1, 4) if dtype in ("uint8", "int8") else (-1000, 1000)
    return torch.randint(lo, hi, shape, generator=g).to(getattr(torch, dtype))


def identical():
    """Every case: out-of-place result vs in-place on a copy; returns {case: error or None}."""
    import torch

    import spark_dl.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    from spark_dl.common.basics import transport

    out = {"__transport__": transport()}

    def check(case, x, got, want):
        errs = []
        if not torch.equal(_bits(x), _bits(before[case])):
            errs.append("input changed")
        if got.dtype != want.dtype or got.shape != want.shape:
            errs.append(f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
        elif not torch.equal(_bits(got), _bits(want)):
            errs.append(f"bits differ: {got.reshape(-1)[:4]} vs in place {want.reshape(-1)[:4]}")
        out[case] = "; ".join(errs) or None

    before = {}
    for dtype in DTYPES:
        for op in OPS:
            if dtype == "bool" and op in ("Sum", "Average"):
                continue
            for shape in SHAPES:
                if len(shape) == 1 and shape[0] > 100000 and (dtype not in BIG_DTYPES or op not in BIG_OPS):
                    continue
                case = f"{dtype}-{op}-{shape}"
                x = _data(torch, dtype, shape, seed=zlib.crc32(f"{case}/{rank}".encode()))
                before[case] = x.clone()
                ref = x.clone()
                hvd.allreduce_(ref, op=getattr(hvd, op), name=f"in.{case}")
                got = hvd.allreduce(x, op=getattr(hvd, op), name=f"out.{case}")
                check(case, x, got, ref)
    # Scale factors (the core copies and scales first there; results must still agree).
    for dtype in ("float16", "float32", "int32"):
        for op in ("Sum", "Average"):
            for shape in ((7,), (300001,)):
                case = f"scaled-{dtype}-{op}-{shape}"
                x = _data(torch, dtype, shape, seed=rank + 7)
                before[case] = x.clone()
                kw = dict(op=getattr(hvd, op), prescale_factor=0.5, postscale_factor=3.0)
                ref = x.clone()
                hvd.allreduce_(ref, name=f"in.{case}", **kw)
                got = hvd.allreduce(x, name=f"out.{case}", **kw)
                check(case, x, got, ref)
    # Fused: several asynchronous allreduces negotiated together, each form on its own.
    # Which of them share a cycle depends on timing, and on 3+ ranks the layout decides
    # which rank reduces an element (and so the order of its additions): integer values,
    # whose sums are exact in any order.
    shapes = [(3,), (1000, 3), (400001,), (), (17, 1)]
    xs = [_data(torch, "int32", s, seed=rank * 10 + i).float() for i, s in enumerate(shapes)]
    refs = [x.clone() for x in xs]
    hs = [hvd.allreduce_async_(r, op=hvd.Sum, name=f"fin.{i}") for i, r in enumerate(refs)]
    [hvd.synchronize(h) for h in hs]
    hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"fout.{i}") for i, x in enumerate(xs)]
    gots = [hvd.synchronize(h) for h in hs]
    for i, (x, got, ref) in enumerate(zip(xs, gots, refs)):
        before[f"fused.{i}"] = x.clone()
        check(f"fused.{i}", x, got, ref)
    # Grouped.
    refs = [x.clone() for x in xs]
    hvd.grouped_allreduce_(refs, op=hvd.Average, name="gin")
    gots = hvd.grouped_allreduce(xs, op=hvd.Average, name="gout")
    for i, (x, got, ref) in enumerate(zip(xs, gots, refs)):
        before[f"grouped.{i}"] = x.clone()
        check(f"grouped.{i}", x, got, ref)
    # A process set of the first and last rank (shared memory with 2 members on 3 ranks).
    pair = hvd.add_process_set([0, size - 1])
    if pair.included():
        x = _data(torch, "float32", (1_300_001,), seed=rank + 99)
        before["set"] = x.clone()
        ref = x.clone()
        hvd.allreduce_(ref, op=hvd.Sum, name="sin", process_set=pair)
        got = hvd.allreduce(x, op=hvd.Sum, name="sout", process_set=pair)
        check("set", x, got, ref)
    hvd.remove_process_set(pair)
    # Results the caller holds are never handed out again; dropped ones may be.
    n = 1 << 20  # 4 MiB of float32: pooled outputs
    a = hvd.allreduce(torch.full((n,), 1.0), op=hvd.Sum, name="hold")
    b = hvd.allreduce(torch.full((n,), 2.0), op=hvd.Sum, name="hold")
    pa, pb = a.data_ptr(), b.data_ptr()
    del a
    c = hvd.allreduce(torch.full((n,), 3.0), op=hvd.Sum, name="hold")
    ok_b = bool((b == 2.0 * size).all())
    ok_c = bool((c == 3.0 * size).all())
    c += 1  # results are ordinary writable tensors
    out["pool"] = None if (pa != pb and ok_b and ok_c and bool((c == 3.0 * size + 1).all())) \
        else f"pa={pa:#x} pb={pb:#x} b ok {ok_b} c ok {ok_c}"
    out["pool_reused"] = c.data_ptr() == pa
    hvd.shutdown()
    return out


def _env(transport, np_):
    env = dict(TRANSPORTS[transport])
    if transport.startswith("hier"):
        env["SDL_TEST_HOSTS"] = ",".join(["a"] * (np_ - 1) + ["b"])
    return env


_results = {}


@pytest.mark.parametrize("transport,np_", [("shm", 2), ("shm", 3), ("hier", 3), ("hier_chunks", 3),
                                           ("gloo", 2)])
def test_out_of_place_matches_in_place(transport, np_):
    per_rank = run_once(_results, (transport, np_), lambda: run_ranks(
        "test_core_out_of_place:identical", np_, env=_env(transport, np_), timeout=400))
    want_kind = "hierarchical" if transport.startswith("hier") else transport
    assert {r["__transport__"] for r in per_rank} == {want_kind}
    errors = {(rank, case): err for rank, r in enumerate(per_rank) for case, err in r.items()
              if not case.startswith("__") and case != "pool_reused" and err is not None}
    assert not errors, errors
    assert len(per_rank[0]) > 100
    # The third result took the dropped first one's memory (the pool at work).
    assert all(r["pool_reused"] for r in per_rank)
