"""Functions run on spawned ranks by tests/gpu (see tests/parallel/harness.py), each on
CUDA tensors through the public ``spark_dl.torch`` API only, so that they hold whatever
backend the core picks (NCCL, or host staging when ranks share a GPU).

Every rank regenerates every rank's inputs from seeds on the CPU, computes the expected
result there in float64, and returns the list of its errors (empty: all good), so a
failure names the case, the rank and the values.
"""

import os
import time

import torch

import spark_dl.torch as hvd
from spark_dl import _core
from spark_dl.common.basics import counters

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.uint8, torch.int8, torch.int32, torch.int64)
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
# float64 comparison tolerance (rtol, atol) per dtype; integers compare exactly.
TOLERANCE = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2),
             torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}
# Odd sizes on purpose: the pack/unpack kernels must handle tails and misalignment.
SHAPES = ((1,), (7,), (33, 5), (1000, 3), (4097,))


def rank_env(extra=None):
    """The environment for spawned ranks: they import this module from tests/gpu."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    paths = [repo, here, os.path.join(repo, "tests", "parallel"),
             os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    env.update(extra or {})
    return env


def _device():
    """This rank's GPU: its local rank's, modulo the GPUs (ranks may share one)."""
    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _input(rank, shape, dtype, op, seed):
    """Rank ``rank``'s CPU input of one case: bounded so that no reduction overflows."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        if op == "Product":
            x = 0.5 + torch.rand(shape, generator=g, dtype=torch.float64)
        else:
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        return x.to(dtype)
    low, high = {"Product": (1, 3), "Sum": (-20, 20)}.get(op, (-100, 100))
    if dtype == torch.uint8:
        low = max(low, 0)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def _reduce(parts, op):
    x = torch.stack([p.to(torch.float64) for p in parts])
    if op in ("Sum", "Average"):
        out = x.sum(0)
        return out / len(parts) if op == "Average" else out
    if op == "Min":
        return x.min(0).values
    if op == "Max":
        return x.max(0).values
    return x.prod(0)


def _compare(case, got, expected, dtype, device, errors):
    if got.device != device:
        errors.append(f"{case}: result on {got.device}, expected {device}")
        return
    if got.dtype != dtype:
        errors.append(f"{case}: result dtype {got.dtype}, expected {dtype}")
        return
    if tuple(got.shape) != tuple(expected.shape):
        errors.append(f"{case}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        return
    g = got.cpu().to(torch.float64)
    e = expected.to(torch.float64)
    if dtype.is_floating_point:
        if dtype != expected.dtype:  # round the reference as the result was rounded
            e = e.to(dtype).to(torch.float64)
        rtol, atol = TOLERANCE[dtype]
        ok = torch.allclose(g, e, rtol=rtol, atol=atol * max(1.0, e.abs().max().item()))
    else:
        ok = torch.equal(g, e)
    if not ok:
        worst = (g - e).abs().flatten().argmax().item()
        errors.append(f"{case}: rank {hvd.rank()} got {g.flatten()[worst].item()} at flat "
                      f"index {worst}, expected {e.flatten()[worst].item()}")


# ----------------------------------------------------------------------------- every op

def allreduce_matrix():
    """allreduce (out of place and in place) for every dtype, op and odd size."""
    hvd.init()
    dev, n, me, errors = _device(), hvd.size(), hvd.rank(), []
    seed = 0
    for dtype in FLOATS + INTS:
        for op in OPS:
            if op == "Average" and not dtype.is_floating_point:
                continue  # integer averaging is the core's CPU suite's business
            for shape in SHAPES:
                seed += 1
                parts = [_input(r, shape, dtype, op, seed) for r in range(n)]
                expected = _reduce(parts, op)
                case = f"allreduce {dtype} {op} {shape}"
                got = hvd.allreduce(parts[me].to(dev), op=OPS[op], name=case)
                _compare(case, got, expected, dtype, dev, errors)
                t = parts[me].to(dev)
                hvd.allreduce_(t, op=OPS[op], name=case + " inplace")
                _compare(case + " in place", t, expected, dtype, dev, errors)
    # Scaling is fused into the pack/unpack kernels: check it apart.
    x = [_input(r, (1001,), torch.float32, "Sum", 99) for r in range(n)]
    got = hvd.allreduce(x[me].to(dev), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                        name="scaled")
    _compare("allreduce prescale/postscale", got, _reduce(x, "Sum") * 1.5, torch.float32,
             dev, errors)
    # A non-contiguous CUDA tensor, in place.
    base = _input(me, (64, 48), torch.float32, "Sum", 7).to(dev)
    view = base.t()
    hvd.allreduce_(view, op=hvd.Sum, name="noncontiguous")
    expected = _reduce([_input(r, (64, 48), torch.float32, "Sum", 7) for r in range(n)],
                       "Sum").t()
    _compare("allreduce_ non-contiguous", view, expected, torch.float32, dev, errors)
    _check_paths(errors)
    hvd.shutdown()
    return errors


def _check_paths(errors):
    """That the CUDA allreduces took the path under test (counters() by backend): NCCL
    wherever it is usable (it stages through host memory itself when ranks share a GPU),
    and its hierarchical path when SDL_HIERARCHICAL_ALLREDUCE=1."""
    counts = counters()
    if _core.gpu_runtime_info().get("nccl_usable") and not counts.get("backend.nccl"):
        errors.append(f"NCCL is usable but no allreduce ran on it: counters {counts}")
    if hvd.size() == 1 and counts.get("nccl.shared_gpu"):
        errors.append(f"one rank, yet allreduces were staged as for a shared GPU: {counts}")
    if os.environ.get("SDL_HIERARCHICAL_ALLREDUCE") == "1" and not counts.get("nccl.hierarchical"):
        errors.append(f"SDL_HIERARCHICAL_ALLREDUCE=1 but no allreduce took the hierarchical "
                      f"path: counters {counts}")


def other_ops():
    """allgather (ragged), broadcast (both forms, two roots), alltoall with splits,
    reducescatter, the grouped forms, a process set, and autograd through allreduce."""
    hvd.init()
    dev, n, me, errors = _device(), hvd.size(), hvd.rank(), []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.uint8):
        rows = [_input(r, (r + 2, 3), dtype, "Max", 11) for r in range(n)]
        got = hvd.allgather(rows[me].to(dev), name=f"allgather {dtype}")
        _compare(f"allgather {dtype}", got, torch.cat(rows), dtype, dev, errors)
        for root in sorted({0, n - 1}):
            data = [_input(r, (5, 7), dtype, "Max", 12 + root) for r in range(n)]
            got = hvd.broadcast(data[me].to(dev), root_rank=root, name=f"bcast {dtype} {root}")
            _compare(f"broadcast {dtype} root {root}", got, data[root], dtype, dev, errors)
            t = data[me].to(dev)
            hvd.broadcast_(t, root_rank=root, name=f"bcast_ {dtype} {root}")
            _compare(f"broadcast_ {dtype} root {root}", t, data[root], dtype, dev, errors)
        # alltoall: rank r sends j + 1 rows to rank j.
        sent = [_input(r, (sum(range(1, n + 1)), 4), dtype, "Max", 13) for r in range(n)]
        splits = list(range(1, n + 1))

        def part(r, j):
            start = sum(splits[:j])
            return sent[r][start:start + splits[j]]

        got, received = hvd.alltoall(sent[me].to(dev), splits=torch.tensor(splits),
                                     name=f"alltoall {dtype}")
        _compare(f"alltoall {dtype}", got, torch.cat([part(r, me) for r in range(n)]), dtype,
                 dev, errors)
        if [int(v) for v in received] != [me + 1] * n:
            errors.append(f"alltoall {dtype}: received splits {received}, expected "
                          f"{[me + 1] * n}")
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int32):
        for op in ("Sum", "Average") if dtype.is_floating_point else ("Sum",):
            full = [_input(r, (4 * n, 6), dtype, op, 14) for r in range(n)]
            got = hvd.reducescatter(full[me].to(dev), op=OPS[op], name=f"rs {dtype} {op}")
            expected = _reduce(full, op)[4 * me:4 * me + 4]
            _compare(f"reducescatter {dtype} {op}", got, expected, dtype, dev, errors)
    # Grouped ops: many small tensors of mixed dtypes and one large: the fused path.
    specs = [((17 + i,), (torch.float32, torch.float16, torch.bfloat16)[i % 3])
             for i in range(40)] + [((1 << 20,), torch.float32)]
    parts = [[_input(r, s, d, "Sum", 100 + i) for i, (s, d) in enumerate(specs)]
             for r in range(n)]
    got = hvd.grouped_allreduce([t.to(dev) for t in parts[me]], op=hvd.Sum, name="grouped")
    for i, (s, d) in enumerate(specs):
        _compare(f"grouped_allreduce member {i}", got[i],
                 _reduce([parts[r][i] for r in range(n)], "Sum"), d, dev, errors)
    gathered = hvd.grouped_allgather([parts[me][0].to(dev), parts[me][1].to(dev)], name="gag")
    for i in range(2):
        _compare(f"grouped_allgather member {i}", gathered[i],
                 torch.cat([parts[r][i] for r in range(n)]), specs[i][1], dev, errors)
    rs_in = [[_input(r, (2 * n, 3), torch.float32, "Sum", 200 + i) for i in range(3)]
             for r in range(n)]
    outs = hvd.grouped_reducescatter([t.to(dev) for t in rs_in[me]], op=hvd.Sum, name="grs")
    for i in range(3):
        expected = _reduce([rs_in[r][i] for r in range(n)], "Sum")[2 * me:2 * me + 2]
        _compare(f"grouped_reducescatter member {i}", outs[i], expected, torch.float32, dev,
                 errors)
    # A process set of the even ranks (every rank when there is one).
    evens = list(range(0, n, 2))
    ps = hvd.add_process_set(evens)
    if me in evens:
        x = [_input(r, (99,), torch.float32, "Sum", 300) for r in range(n)]
        got = hvd.allreduce(x[me].to(dev), op=hvd.Sum, name="ps", process_set=ps)
        _compare("allreduce on a process set", got, _reduce([x[r] for r in evens], "Sum"),
                 torch.float32, dev, errors)
    hvd.remove_process_set(ps)
    # Autograd: the gradient of sum(allreduce(x, Sum)) is size() on every element.
    x = torch.ones(10, device=dev, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, name="autograd").sum().backward()
    _compare("allreduce gradient", x.grad, torch.full((10,), float(n)), torch.float32, dev,
             errors)
    hvd.shutdown()
    return errors


def stream_order():
    """The core must read a tensor only after the work queued on the framework's current
    stream: a side stream sleeps, then writes the input; a core that read at once (or on
    another stream without waiting) would reduce zeros. The result must be ready on that
    stream, with no device-wide synchronize in between."""
    hvd.init()
    dev, n, errors = _device(), hvd.size(), []
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        for i in range(3):
            x = torch.zeros(1 << 22, device=dev)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the write
            x.fill_(float(hvd.rank() + 1 + i))
            handle = hvd.allreduce_async(x, op=hvd.Sum, name=f"stream.{i}")
            out = hvd.synchronize(handle)
            total = out.sum()  # queued on the side stream, after the result
        side.synchronize()
    expected = float(sum(r + 1 + 2 for r in range(n)) * (1 << 22))
    if abs(total.item() - expected) > 1e-3 * expected:
        errors.append(f"stream order: sum {total.item()}, expected {expected}")
    hvd.shutdown()
    return errors


def stream_overlap():
    """The core waits for what the framework's stream had queued when the tensor was
    enqueued, not for what the framework queues after (in a backward pass, the rest of
    the backward): here the stream sleeps ~1 s after the enqueue, and the result, read on
    a stream that waits for nothing, must be there well before the sleep ends."""
    hvd.init()
    dev, n, errors = _device(), hvd.size(), []
    side, reader = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = torch.zeros(1024, device=dev)
    seen = torch.empty_like(x)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(side):
        x.fill_(float(hvd.rank() + 1))
        # prescale 2: one rank's result differs from its input too
        handle = hvd.allreduce_async_(x, op=hvd.Sum, prescale_factor=2.0, name="overlap")
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued after the enqueue
    hvd.synchronize(handle)
    time.sleep(0.3)
    with torch.cuda.stream(reader):
        seen.copy_(x)  # not ordered after `side`: reads x as it is now
    reader.synchronize()
    early = seen[0].item()
    side.synchronize()
    expected = 2.0 * sum(r + 1 for r in range(n))
    if early != expected:
        errors.append(f"stream overlap: 0.3 s after the handle completed x held {early}, "
                      f"expected {expected}: the core waited for work queued after the "
                      "enqueue")
    if x[0].item() != expected:
        errors.append(f"stream overlap: final x {x[0].item()}, expected {expected}")
    hvd.shutdown()
    return errors


# ----------------------------------------------------------------------------- training

def _train(device, steps=20, compression=None):
    """A small MLP trained with DistributedOptimizer on ``device``; every rank sees its own
    batches (seeded by rank); returns the final parameters on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression or hvd.Compression.none)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    for _ in range(steps):
        x = torch.randn(64, 8, generator=g)
        y = x.sum(1, keepdim=True).sin()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def training_matches_cpu():
    """The same DistributedOptimizer run on the CPU and on CUDA gives the same model
    (float32, TF32 off); fp16 compression on CUDA stays close."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hvd.init()
    dev, errors = _device(), []
    cpu = _train(torch.device("cpu"))
    gpu = _train(dev)
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            errors.append(f"parameter {i}: CUDA training differs from CPU training by "
                          f"{(a - b).abs().max().item():.3g}")
    fp16 = _train(dev, compression=hvd.Compression.fp16)
    for i, (a, b) in enumerate(zip(cpu, fp16)):
        if not torch.allclose(a, b, rtol=5e-2, atol=5e-2):
            errors.append(f"parameter {i}: fp16-compressed CUDA training is off by "
                          f"{(a - b).abs().max().item():.3g}")
    # Every rank holds the same model after training.
    every = hvd.allgather_object([p.tolist() for p in gpu], name="final")
    if any(e != every[0] for e in every):
        errors.append("ranks ended CUDA training with different parameters")
    hvd.shutdown()
    return errors


def optimizer_state_on_cuda():
    """broadcast_optimizer_state of Adam on CUDA parameters: every rank receives the moments
    on its GPU and the step counter where torch keeps it (the CPU unless capturable), equal
    to the root's; an unused sparse embedding gets its empty gradient on its GPU."""
    hvd.init()
    dev, me, errors = _device(), hvd.rank(), []
    torch.manual_seed(me)
    model = torch.nn.Linear(4, 3).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if me == 0:  # only the root has stepped
        model(torch.randn(5, 4, device=dev)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].device != p.device:
                errors.append(f"param {i} {key} on {st[key].device}, expected {p.device}")
        every = hvd.allgather_object([st["exp_avg"].cpu().tolist(), float(st["step"])],
                                     name=f"adam.{i}")
        if any(e != every[0] for e in every):
            errors.append(f"param {i}: ranks hold different Adam state after the broadcast")
    emb = torch.nn.Embedding(10, 3, sparse=True).to(dev)
    lin = torch.nn.Linear(3, 1).to(dev)
    params = list(emb.named_parameters(prefix="emb")) + list(lin.named_parameters(prefix="lin"))
    sopt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                    named_parameters=params)
    for step in range(2):  # step 1: the embedding is unused on every rank but 0
        sopt.zero_grad()
        x = torch.randn(2, 3, device=dev)
        out = lin(x).sum()
        if step == 0 or me == 0:
            out = out + emb(torch.tensor([1, 2], device=dev)).sum()
        out.backward()
        try:
            sopt.step()
        except Exception as e:  # noqa: BLE001 - reported with the step
            errors.append(f"sparse step {step}: {type(e).__name__}: {e}")
            break
    hvd.shutdown()
    return errors


def sync_batch_norm_matches():
    """SyncBatchNorm on CUDA normalizes with the statistics of every rank's batch."""
    hvd.init()
    dev, n, me, errors = _device(), hvd.size(), hvd.rank(), []
    batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    bn = hvd.SyncBatchNorm(4).to(dev)
    out = bn(batches[me].to(dev))
    full = torch.cat(batches).to(torch.float64)
    mean, var = full.mean(0), full.var(0, unbiased=False)
    expected = (batches[me].to(torch.float64) - mean) / torch.sqrt(var + bn.eps)
    _compare("SyncBatchNorm", out.detach(), expected.to(torch.float32), torch.float32, dev,
             errors)
    hvd.shutdown()
    return errors


# ----------------------------------------------------------------------------- hierarchical

def hierarchical_allreduce():
    """allreduce_matrix with SDL_HIERARCHICAL_ALLREDUCE=1 (set by the test): per-host NCCL
    reduce-scatter, the CPU transport across "hosts", per-host NCCL allgather.

    SDL_TEST_FAKE_HOSTS (default 1) splits the ranks into that many hosts by SDL_HOST_ID
    (ranks r*hosts//size), so one machine with several GPUs exercises the cross-host step
    over Gloo; with one GPU and one rank it is the degenerate 1-rank host.
    """
    hosts = int(os.environ.get("SDL_TEST_FAKE_HOSTS", "1"))
    rank, size = int(os.environ["SDL_RANK"]), int(os.environ["SDL_SIZE"])
    os.environ["SDL_HOST_ID"] = f"fake-host-{rank * hosts // size}"
    return allreduce_matrix()
