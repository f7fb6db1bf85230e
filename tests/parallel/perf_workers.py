"""Rank functions for test_perf_batch.py: the batched enqueue path (one call, one handle for
many tensors) against per-tensor expectations, with every rank enqueueing in its own order."""

import random
import time

import torch

import spark_dl.torch as hvd
from spark_dl.common import basics, ops as _ops
from spark_dl.common.exceptions import DuplicateNameError, OpTimeoutError
from spark_dl.torch import _async_ops, optimizer as _optimizer

_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16)


def _value(rank, i, dtype, n):
    """Rank r's tensor i: distinct per rank and per tensor, exact in every dtype above."""
    base = torch.arange(n, dtype=torch.int64) % 7 + (rank + 1) * (i % 5 + 1)
    return base.to(dtype)


def _sum_over_ranks(size, i, dtype, n):
    return sum(_value(r, i, dtype, n).to(torch.float64) for r in range(size))


def _check(tensors, size, sizes, dtypes, what):
    for i, t in enumerate(tensors):
        want = _sum_over_ranks(size, i, dtypes[i], sizes[i])
        if not torch.equal(t.to(torch.float64), want):
            raise AssertionError(f"{what}: tensor {i} ({dtypes[i]}, {sizes[i]} elements) is "
                                 f"{t[:4].tolist()}..., expected {want[:4].tolist()}...")


def batched_orders():
    """Many tensors in batches whose order and boundaries differ per rank and per step.

    The first step negotiates (full exchange), the later ones run from the response cache;
    a fusion threshold smaller than one step's bytes splits the fused collectives, and per-
    tensor calls are mixed in, so that batched and per-tensor entries share cycles.
    """
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = random.Random(1000 + rank)  # a different order on every rank
    n = 300
    sizes = [1 + (i * 37) % 700 for i in range(n)]
    dtypes = [_DTYPES[i % len(_DTYPES)] for i in range(n)]
    names = [f"perf.t{i}" for i in range(n)]
    out = {}
    for step, threshold in enumerate([None, None, 16384, None]):
        basics.set_knob("fusion_threshold", threshold or 128 << 20)
        tensors = [_value(rank, i, dtypes[i], sizes[i]) for i in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        handles, k = [], 0
        while k < n:
            chunk = order[k:k + rng.randint(1, 60)]
            k += len(chunk)
            if len(chunk) == 1:  # a per-tensor call between the batches
                i = chunk[0]
                handles.append(hvd.allreduce_async_(tensors[i], name=names[i], op=hvd.Sum))
            else:
                handles.append(_async_ops.batched_allreduce_async_(
                    [tensors[i] for i in chunk], [names[i] for i in chunk], hvd.Sum, 1.0, 1.0,
                    None))
        rng.shuffle(handles)  # waited in any order
        for h in handles:
            hvd.synchronize(h)
        _check(tensors, size, sizes, dtypes, f"step {step}")
        out[f"step{step}"] = "ok"
    # Average with scale factors, and a non-contiguous tensor (copied back after the batch).
    a = torch.full((6, 4), float(rank + 1)).t()  # non-contiguous view
    b = torch.full((5,), float(2 * (rank + 1)))
    h = _async_ops.batched_allreduce_async_([a, b], ["perf.avg.a", "perf.avg.b"], hvd.Average,
                                            2.0, 0.5, None)
    got = hvd.synchronize(h)
    mean = sum(range(1, size + 1)) / size
    out["average"] = [got[0] is a, a.flatten().tolist() == [mean] * 24,
                      b.tolist() == [2 * mean] * 5]
    out["counters"] = basics.counters()
    hvd.shutdown()
    return out


def batched_grouped():
    """grouped_allreduce_async(_) through the batched path: mixed dtypes, out of place and
    in place (a non-contiguous member), members listed in a different order per rank."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    n = 40
    sizes = [3 + i for i in range(n)]
    dtypes = [_DTYPES[i % len(_DTYPES)] for i in range(n)]
    tensors = [_value(rank, i, dtypes[i], sizes[i]) for i in range(n)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="perf.grouped")
    _check(results, size, sizes, dtypes, "grouped out of place")
    out["inputs_untouched"] = all(torch.equal(t, _value(rank, i, dtypes[i], sizes[i]))
                                  for i, t in enumerate(tensors))
    nc = torch.zeros(8, 3).t()  # non-contiguous member: reduced through a copy
    nc.fill_(rank + 1)
    members = tensors + [nc]
    hvd.grouped_allreduce_(members, op=hvd.Sum, name="perf.grouped_")
    _check(tensors, size, sizes, dtypes, "grouped in place")
    out["noncontiguous"] = nc.flatten().tolist() == [float(sum(range(1, size + 1)))] * 24
    # A handle waits for all members; its result keeps the input order.
    h = hvd.grouped_allreduce_async([torch.full((2,), float(rank)), torch.ones(3)], op=hvd.Sum)
    first, second = hvd.synchronize(h)
    out["async_order"] = [first.tolist(), second.tolist()]
    hvd.shutdown()
    return out


def batched_errors():
    """A batch is enqueued all or nothing; a batch handle's wait honours its timeout."""
    hvd.init()
    rank = hvd.rank()
    out = {}
    x = torch.ones(4)
    y = torch.ones(4)
    try:
        _async_ops.batched_allreduce_async_([x, y], ["perf.dup", "perf.dup"], hvd.Sum, 1.0, 1.0,
                                            None)
        out["duplicate"] = "no error"
    except DuplicateNameError as e:
        out["duplicate"] = str(e)
    # Nothing of the refused batch stayed in flight: the name is free again.
    h = _async_ops.batched_allreduce_async_([x, y], ["perf.dup", "perf.other"], hvd.Sum, 1.0,
                                            1.0, None)
    hvd.synchronize(h)
    out["after_duplicate"] = [x.tolist(), y.tolist()]
    try:
        _async_ops.batched_allreduce_async_([torch.ones(2, dtype=torch.complex64)], ["perf.c"],
                                            hvd.Sum, 1.0, 1.0, None)
        out["bad_dtype"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test checks the type's name
        out["bad_dtype"] = type(e).__name__
    # Rank 1 enqueues its half late: rank 0's bounded wait expires, a later wait succeeds.
    z = torch.full((3,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)
    h = _async_ops.batched_allreduce_async_([z, torch.ones(2)], ["perf.late.z", "perf.late.w"],
                                            hvd.Sum, 1.0, 1.0, None)
    if rank == 0:
        try:
            h.wait(timeout=0.2)
            out["timeout"] = "no timeout"
        except OpTimeoutError:
            out["timeout"] = "timed out"
        out["poll_before"] = h.poll()
    h.wait(timeout=60)
    out["late"] = z.tolist()
    out["poll_after"] = h.poll()
    hvd.shutdown()
    return out


def optimizer_flushes():
    """DistributedOptimizer with many small parameters, batch boundaries that differ per
    rank (flush threshold per rank), a parameter unused on one rank, fp16 compression:
    the gradients are the average over ranks after every step."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _optimizer._FLUSH_BYTES = 256 if rank == 0 else 1 << 30
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(7 + i)) for i in range(30)]
    out = {}
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.0), compression=compression,
            named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
        for step in range(3):
            opt.zero_grad()
            loss = 0
            for i, p in enumerate(params):
                if i == 5 and rank == 1:
                    continue  # unused on rank 1: zeros there
                loss = loss + (p * float(rank + 1 + i + step)).sum()
            loss.backward()
            batches = len(opt._batches)
            opt.step()
            for i, p in enumerate(params):
                coeff = [r + 1 + i + step for r in range(size) if not (i == 5 and r == 1)]
                want = sum(coeff) / size
                if not torch.allclose(p.grad, torch.full_like(p, want)):
                    raise AssertionError(f"{compression.__name__} step {step} p{i}: "
                                         f"{p.grad[:3].tolist()} != {want}")
            out[f"{compression.__name__}.{step}.batches_in_backward"] = batches
        del opt
    hvd.shutdown()
    return out


def submit_many_refuses_other_kinds():
    hvd.init()
    try:
        _ops.submit_many("broadcast", ["x"], [0], [0], [[1]], [0], keep=(), finish=None)
        return "no error"
    except Exception as e:  # noqa: BLE001 - the test checks the message
        return str(e)
    finally:
        hvd.shutdown()


def small_allreduces():
    """Small allreduces on any number of ranks (Gloo picks recursive doubling from 4 ranks
    on): every reduce op, sizes around the doubling and allgather thresholds, float results
    identical in every bit on every rank."""
    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    out = {"transport": sdl.transport()}
    for elements in (1, 7, 1000, 16384, 16385):
        for dtype in (np.float32, np.float64, np.int64):
            base = (np.arange(elements) % 13).astype(dtype)
            mine = base + dtype(rank + 1) if dtype is np.int64 else base * dtype(1.1 + rank)
            every = [base + dtype(r + 1) if dtype is np.int64 else base * dtype(1.1 + r)
                     for r in range(size)]
            for op, ref in ((sdl.Sum, np.sum), (sdl.Min, np.min), (sdl.Max, np.max)):
                got = sdl.allreduce(mine, op=op)
                want = ref(np.stack(every), axis=0)
                tol = 0 if dtype is np.int64 else 1e-5 * size * 13
                if not np.allclose(got, want, rtol=0, atol=tol):
                    raise AssertionError(f"{elements} x {dtype.__name__}, op {op}: "
                                         f"{got[:3]} != {want[:3]}")
                out[f"{elements}.{dtype.__name__}.{op}"] = got.tobytes().hex()[:4096]
    sdl.shutdown()
    return out
