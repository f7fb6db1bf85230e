"""Functions run on spawned ranks by tests/parallel/test_core_*.py (see harness.py)."""

import os
import signal
import time
import zlib

import numpy as np

import spark_dl.numpy as sdl
import core_cases
from core_cases import cases
from spark_dl.common import ops as _ops

_NP = {"bool": np.bool_}


def _rng(case, rank):
    return np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode()))


def _data(case, rank, shape, dtype):
    rng = _rng(case, rank)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    vals = rng.integers(1, 4, size=shape)
    return vals.astype(np.float32 if dtype == "bfloat16" else dtype)


def _reduce(arrs, op, dtype, size):
    if dtype == "bool":
        return (np.logical_or.reduce(arrs) if op == "Max" else np.logical_and.reduce(arrs))
    stack = np.stack(arrs)
    if op in ("Sum", "Average"):
        total = stack.sum(axis=0, dtype=stack.dtype)
        if op == "Average":
            if np.issubdtype(stack.dtype, np.floating) or dtype == "bfloat16":
                return total / size
            return total // size
        return total
    if op == "Min":
        return stack.min(axis=0)
    if op == "Max":
        return stack.max(axis=0)
    return stack.prod(axis=0, dtype=stack.dtype)


def _tol(dtype):
    return {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5}.get(dtype, 1e-12)


class _Torch:
    """bfloat16 has no NumPy dtype: those cases go through torch tensors (DLPack)."""

    @staticmethod
    def to(a):
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)

    @staticmethod
    def back(t):
        import torch

        return t.to(torch.float32).numpy()

    @staticmethod
    def from_capsule(c):
        import torch

        return torch.from_dlpack(_ops.DLPackTensor(c))


def _run(kind, name, arr, dtype, **kw):
    """Runs one op on arr (numpy, or torch for bfloat16) and returns numpy results."""
    if dtype != "bfloat16":
        fn = {"allreduce": sdl.allreduce, "allgather": sdl.allgather, "broadcast": sdl.broadcast,
              "alltoall": sdl.alltoall, "reducescatter": sdl.reducescatter}[kind]
        return fn(arr, name=name, **kw)
    import torch

    t = _Torch.to(arr)
    if kind == "allreduce":
        out = torch.empty_like(t)
        h = _ops.submit("allreduce", name, t, out, op=kw["op"], finish=lambda o, i: out,
                        prescale_factor=kw.get("prescale_factor", 1.0),
                        postscale_factor=kw.get("postscale_factor", 1.0))
        return _Torch.back(h.wait())
    if kind == "broadcast":
        out = t.clone()
        h = _ops.submit("broadcast", name, t, out, root=kw["root_rank"], finish=lambda o, i: out)
        return _Torch.back(h.wait())
    if kind == "allgather":
        h = _ops.submit("allgather", name, t, finish=lambda o, i: _Torch.from_capsule(o[0]))
        return _Torch.back(h.wait())
    if kind == "alltoall":
        h = _ops.submit("alltoall", name, t, splits=kw["splits"],
                        finish=lambda o, i: (_Torch.from_capsule(o[0]), np.asarray(i)))
        res, splits = h.wait()
        return _Torch.back(res), splits
    if kind == "reducescatter":
        h = _ops.submit("reducescatter", name, t, op=kw["op"],
                        finish=lambda o, i: _Torch.from_capsule(o[0]))
        return _Torch.back(h.wait())
    raise ValueError(kind)


def _check(got, want, dtype):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if dtype == "bfloat16" or np.issubdtype(want.dtype, np.floating):
        if not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=_tol(dtype),
                           atol=_tol(dtype)):
            return f"values differ: got {got.ravel()[:6]}, expected {want.ravel()[:6]}"
    elif not np.array_equal(got, want):
        return f"values differ: got {got.ravel()[:6]}, expected {want.ravel()[:6]}"
    if dtype not in ("bfloat16",) and got.dtype != np.dtype(_NP.get(dtype, dtype)):
        return f"dtype {got.dtype} != {dtype}"
    return None


def _one_case(case, rank, size):
    kind, dtype, extra, variant = core_cases.parse(case)
    shape = (5, 3)
    if kind in ("allreduce", "allreduce_scaled", "allreduce_inplace", "grouped_allreduce"):
        op_name = extra
        op = getattr(sdl, op_name)
        shape = core_cases.input_shape(variant)
        inputs = [_data(case, r, shape, dtype) for r in range(size)]
        mine = inputs[rank]
        pre, post = (0.5, 3.0) if kind == "allreduce_scaled" and dtype != "int32" else (2.0, 3.0)
        if kind == "allreduce_scaled":
            scaled = [(x * pre).astype(x.dtype) if dtype != "int32" else x * 2 for x in inputs]
            want = _reduce(scaled, op_name, dtype, size)
            want = (want * post).astype(want.dtype) if dtype != "int32" else want * 3
            got = _run("allreduce", case, mine, dtype, op=op, prescale_factor=pre,
                       postscale_factor=post)
        elif kind == "allreduce_inplace":
            want = _reduce(inputs, op_name, dtype, size)
            buf = mine.copy()
            got = sdl.allreduce_(buf, name=case, op=op)
            if got is not buf:
                return "in-place allreduce did not return its argument"
        elif kind == "grouped_allreduce":
            inputs2 = [_data(case + "b", r, (7,), dtype) for r in range(size)]
            want = [_reduce(inputs, op_name, dtype, size), _reduce(inputs2, op_name, dtype, size)]
            got = sdl.grouped_allreduce([mine, inputs2[rank]], name=case, op=op)
            return _check(got[0], want[0], dtype) or _check(got[1], want[1], dtype)
        else:
            want = _reduce(inputs, op_name, dtype, size)
            arg = mine
            if variant == "noncontiguous":
                big = np.zeros((5, 6), mine.dtype)
                big[:, ::2] = mine
                arg = big[:, ::2]
            got = _run("allreduce", case, arg, dtype, op=op)
        return _check(got, want, dtype)
    if kind == "reducescatter":
        op = getattr(sdl, extra)
        shape = (7, 2)
        inputs = [_data(case, r, shape, dtype) for r in range(size)]
        full = _reduce(inputs, extra, dtype, size)
        rows = [7 // size + (1 if q < 7 % size else 0) for q in range(size)]
        start = sum(rows[:rank])
        got = _run("reducescatter", case, inputs[rank], dtype, op=op)
        return _check(got, full[start:start + rows[rank]], dtype)
    if kind == "allgather":
        rows = [0 if extra == "zero_rows" and r == 0 else r + 1 for r in range(size)]
        inputs = [_data(case, r, (rows[r], 3), dtype) for r in range(size)]
        got = _run("allgather", case, inputs[rank], dtype)
        return _check(got, np.concatenate(inputs), dtype)
    if kind == "broadcast":
        root = 0 if extra == "root0" else size - 1
        inputs = [_data(case, r, shape, dtype) for r in range(size)]
        got = _run("broadcast", case, inputs[rank], dtype, root_rank=root)
        return _check(got, inputs[root], dtype)
    if kind == "alltoall":
        if extra == "even":
            splits_of = [[2] * size for _ in range(size)]
        else:
            splits_of = [[(r + q) % 3 for q in range(size)] for r in range(size)]
        inputs = [_data(case, r, (sum(splits_of[r]), 2), dtype) for r in range(size)]
        want_parts = []
        for src in range(size):
            off = sum(splits_of[src][:rank])
            want_parts.append(inputs[src][off:off + splits_of[src][rank]])
        splits = None if extra == "even" and dtype != "bfloat16" else splits_of[rank]
        got, got_splits = _run("alltoall", case, inputs[rank], dtype, splits=splits)
        if list(np.asarray(got_splits)) != [splits_of[src][rank] for src in range(size)]:
            return f"received splits {list(got_splits)} wrong"
        return _check(got, np.concatenate(want_parts), dtype)
    return f"unknown case {case}"


def op_matrix():
    """Runs every case; returns {case: None or error text}."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    results = {}
    for case in cases():
        try:
            results[case] = _one_case(case, rank, size)
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case] = f"{type(e).__name__}: {e}"
    results["__transport__"] = sdl.transport()
    return results


def process_sets():
    """Process sets registered at init and added later, concurrent with global ops."""
    sdl.init(process_sets=[[0, 1]])
    rank, size = sdl.rank(), sdl.size()
    out = {}
    first = sdl.ProcessSet([0, 1])
    # init-registered sets take ids 1..n; rebuild the object with that id
    first.process_set_id = 1
    if rank in (0, 1):
        out["init_set"] = float(sdl.allreduce(np.array([rank + 1.0]), op=sdl.Sum, process_set=first)[0])
        out["init_set_rank"] = first.rank()
    odd = sdl.add_process_set([r for r in range(size) if r % 2 == 1] or [0])
    evens = sdl.add_process_set(list(range(0, size, 2)))
    out["ids"] = (odd.process_set_id, evens.process_set_id)
    h_global = sdl.allreduce_async(np.array([1.0]), op=sdl.Sum, name="g")
    if evens.included():
        h = sdl.allreduce_async(np.array([float(rank)]), op=sdl.Sum, name="e", process_set=evens)
        out["evens"] = float(h.wait(timeout=30)[0])
        out["evens_gather"] = sdl.allgather(np.array([rank]), process_set=evens).tolist()
        out["evens_bcast"] = sdl.broadcast(np.array([rank]), root_rank=evens.ranks[-1],
                                           process_set=evens).tolist()
    else:
        try:
            sdl.allreduce(np.array([1.0]), process_set=evens)
            out["nonmember"] = "no error"
        except sdl.InvalidArgumentError as e:
            out["nonmember"] = str(e)
    out["global"] = float(h_global.wait(timeout=30)[0])
    out["removed"] = sdl.remove_process_set(odd)
    try:
        sdl.allreduce(np.array([1.0]), process_set=odd)
        out["after_remove"] = "no error"
    except sdl.InvalidArgumentError as e:
        out["after_remove"] = str(e)
    out["global_after"] = float(sdl.allreduce(np.array([2.0]), op=sdl.Sum)[0])
    return out


def fusion_and_cache():
    """Many small tensors at once, then the same names repeatedly."""
    sdl.init()
    c0 = sdl.counters()
    arrays = [np.full(64, float(i), np.float32) for i in range(40)]
    handles = [sdl.allreduce_async(a, name=f"t{i}", op=sdl.Sum) for i, a in enumerate(arrays)]
    results = [h.wait(timeout=30) for h in handles]
    ok = all(np.allclose(r, a * sdl.size()) for r, a in zip(results, arrays))
    c1 = sdl.counters()
    for step in range(20):
        hs = [sdl.allreduce_async(a, name=f"t{i}", op=sdl.Sum) for i, a in enumerate(arrays)]
        ok &= all(np.allclose(h.wait(timeout=30), a * sdl.size()) for h, a in zip(hs, arrays))
    c2 = sdl.counters()
    sdl.set_knob("fusion_threshold", 0)
    time.sleep(0.05)
    hs = [sdl.allreduce_async(a, name=f"u{i}", op=sdl.Sum) for i, a in enumerate(arrays[:10])]
    [h.wait(timeout=30) for h in hs]
    c3 = sdl.counters()
    return {"ok": ok, "c0": c0, "c1": c1, "c2": c2, "c3": c3}


def join_uneven():
    """Rank 0 runs out of data first; the others keep reducing with its zeros."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    sums = []
    steps = 2 + rank  # the last rank has the most steps
    for i in range(steps):
        sums.append(float(sdl.allreduce(np.array([1.0]), op=sdl.Sum, name="step")[0]))
    last = sdl.join()
    return {"sums": sums, "last": last}


def mismatch(kind):
    """Every rank passes a different shape/dtype/op/root for the same name."""
    sdl.init()
    rank = sdl.rank()
    try:
        if kind == "shape":
            sdl.allreduce(np.ones(rank + 1, np.float32), name="w")
        elif kind == "dtype":
            sdl.allreduce(np.ones(3, np.float32 if rank == 0 else np.float64), name="w")
        elif kind == "op":
            if rank == 0:
                sdl.allreduce(np.ones(3), name="w")
            else:
                sdl.allgather(np.ones(3), name="w")
        elif kind == "root":
            sdl.broadcast(np.ones(3), root_rank=rank, name="w")
        elif kind == "reduce":
            sdl.allreduce(np.ones(3), name="w", op=sdl.Sum if rank == 0 else sdl.Max)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        err = {"error": f"{type(e).__name__}: {e}"}
    # the runtime stays usable after a mismatch
    err["after"] = float(sdl.allreduce(np.array([1.0]), op=sdl.Sum, name="after")[0])
    return err


def duplicate_name():
    sdl.init()
    rank = sdl.rank()
    h = sdl.allreduce_async(np.ones(3), name="dup") if rank == 0 else None
    try:
        if rank == 0:
            sdl.allreduce_async(np.ones(3), name="dup")
        res = "no error"
    except sdl.DuplicateNameError as e:
        res = str(e)
    if rank != 0:
        time.sleep(0.2)
        sdl.allreduce(np.ones(3), name="dup")
    else:
        h.wait(timeout=30)
    return res


def die_mid_collective(how):
    """The last rank dies (SIGKILL) or hangs (SIGSTOP) while the others wait in a collective."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    sdl.allreduce(np.ones(4), name="warmup")
    if rank == size - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)
    start = time.monotonic()
    err = None
    try:
        sdl.allreduce(np.ones(1 << 20, np.float32), name="never")
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    later = None
    try:
        sdl.allreduce(np.ones(4), name="later")
    except Exception as e:  # noqa: BLE001
        later = type(e).__name__
    return {"error": err, "elapsed": elapsed, "later": later}


def mpi4py_split():
    """Each half of COMM_WORLD runs its own spark_dl next to the user's mpi4py code."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    color = world.Get_rank() % 2
    half = world.Split(color=color, key=world.Get_rank())
    sdl.init(comm=half)
    out = {"color": color, "size": sdl.size(), "rank": sdl.rank(),
           "sum": float(sdl.allreduce(np.array([1.0 + world.Get_rank()]), op=sdl.Sum)[0]),
           "user_sum": world.allreduce(1),  # the application's own MPI traffic still works
           "threads": sdl.mpi_threads_supported(), "mpi_enabled": sdl.mpi_enabled()}
    sdl.shutdown()
    return out


def grouped_allgather():
    """A group of allgathers is negotiated together and every member runs."""
    sdl.init()
    rank = sdl.rank()
    handles = [_ops.submit("allgather", f"gg.{i}", np.full(rank + 1, i, np.int32),
                           finish=lambda o, i: np.from_dlpack(_ops.DLPackTensor(o[0])),
                           group="gg", group_size=3) for i in range(3)]
    return [h.wait(timeout=30).tolist() for h in handles]


def objects():
    """broadcast_object / allgather_object of the NumPy front end, globally and on a set."""
    sdl.init()
    rank = sdl.rank()
    odd = sdl.add_process_set([r for r in range(sdl.size()) if r % 2])
    out = {"bcast": sdl.broadcast_object({"from": rank, "blob": b"x" * 5000} if rank == 1
                                         else None, root_rank=1, name="obj.b"),
           "gather": sdl.allgather_object(("rank", rank, [0] * rank), name="obj.g")}
    if rank % 2:
        out["odd_gather"] = sdl.allgather_object(rank, process_set=odd)
        out["odd_bcast"] = sdl.broadcast_object(f"root {rank}" if odd.rank() == 0 else None,
                                                root_rank=odd.ranks[0], process_set=odd)
    sdl.barrier()  # the others wait for the set's members before shutting down
    sdl.shutdown()
    return out


def idle_costs():
    """What an idle rank and a rank waiting for a late peer cost: cycles and CPU seconds."""
    sdl.init()
    rank = sdl.rank()
    sdl.allreduce(np.ones(4), name="warmup")
    before = sdl.counters()["cycles"]
    time.sleep(1.0)  # every rank idle
    idle_cycles = sdl.counters()["cycles"] - before
    sdl.allreduce(np.ones(4), name="together")
    cpu0, wall0 = time.process_time(), time.monotonic()
    if rank == sdl.size() - 1:
        time.sleep(1.5)  # the others wait for this rank inside the collective
    sdl.allreduce(np.ones(1 << 16, np.float32), name="late")
    return {"idle_cycles": idle_cycles, "wait_cpu": time.process_time() - cpu0,
            "wait_wall": time.monotonic() - wall0}


def subset_while_outsider_idles():
    """Ranks 0 and 1 run many small ops on their own set while the last rank idles."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    pair = sdl.add_process_set([0, 1])
    sdl.allreduce(np.ones(1), name="ready")
    elapsed = None
    if pair.included():
        start = time.monotonic()
        for i in range(50):
            sdl.allreduce(np.ones(4), name=f"pair.{i}", process_set=pair)
        elapsed = time.monotonic() - start
    else:
        time.sleep(2.0)
    sdl.allreduce(np.ones(1), name="done")
    return {"elapsed": elapsed}


def _error(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def mismatched_submissions():
    """Ranks that submit different names fail after SDL_TIMEOUT instead of hanging: cached
    names (seen before), new names, and names on a process set of non-contiguous ranks."""
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    out = {}
    # Cached: both names ran before, so the response cache knows them.
    for _ in range(2):
        sdl.allreduce(np.ones(2), name="a")
        sdl.allreduce(np.ones(2), name="b")
    start = time.monotonic()
    out["cached"] = _error(lambda: sdl.allreduce(np.ones(2), name="a" if rank == 0 else "b"))
    out["cached_s"] = time.monotonic() - start
    out["after"] = float(sdl.allreduce(np.array([1.0]), op=sdl.Sum, name="after")[0])
    out["fresh"] = _error(lambda: sdl.allgather(np.ones(2), name=f"fresh.{rank}"))
    if size == 3:
        ps = sdl.add_process_set([0, 2])
        if rank != 1:
            out["subset"] = _error(lambda: sdl.allreduce(np.ones(2), name=f"sub.{rank}",
                                                         process_set=ps))
            out["subset_after"] = float(sdl.allreduce(np.array([1.0]), op=sdl.Sum, name="s",
                                                      process_set=ps)[0])
            out["subset_root"] = _error(lambda: sdl.broadcast(np.ones(2), root_rank=rank,
                                                              name="r", process_set=ps))
    sdl.barrier()
    return out


def interrupted_wait():
    """A wait blocked on a silent peer is interrupted by a signal handler's exception; the
    handle stays pending and completes once the peer submits."""
    sdl.init()
    rank = sdl.rank()
    if rank == 0:
        class Interrupted(Exception):
            pass

        def on_alarm(signum, frame):
            raise Interrupted()

        signal.signal(signal.SIGALRM, on_alarm)
        h = sdl.allreduce_async(np.ones(2), op=sdl.Sum, name="late")
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        start = time.monotonic()
        try:
            h.wait()
            res = {"interrupted": False}
        except Interrupted:
            res = {"interrupted": True, "after_s": time.monotonic() - start}
        # Ctrl-C: SIGINT's default handler raises KeyboardInterrupt out of the wait.
        h2 = sdl.allreduce_async(np.ones(2), op=sdl.Sum, name="late2")
        import threading

        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            h2.wait()
            res["ctrl_c"] = False
        except KeyboardInterrupt:
            res["ctrl_c"] = True
        sdl.broadcast(np.zeros(1), root_rank=0, name="go")  # tells rank 1 to submit
        res["value"] = h.wait(30).tolist()
        res["value2"] = h2.wait(30).tolist()
        return res
    sdl.broadcast(np.zeros(1), root_rank=0, name="go")
    value = sdl.allreduce(np.ones(2), op=sdl.Sum, name="late").tolist()
    return {"value": value,
            "value2": sdl.allreduce(np.ones(2), op=sdl.Sum, name="late2").tolist()}
