"""Functions run on spawned ranks by tests/parallel/test_torch_*.py (see harness.py).

Every rank regenerates every rank's inputs from seeds, so it can compute the
expected result of a collective (or of a training run on the union of the
ranks' batches) by itself and return only its errors.
"""

import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import spark_dl.torch as hvd
import core_cases
from core_cases import cases as core_case_ids
from core_workers import _check, _data, _reduce

torch.set_num_threads(1)  # ranks share a small machine


# ----------------------------------------------------------------------------- op matrix

def torch_cases():
    """The core's op matrix plus what only the torch API has (in-place, async, groups, ...)."""
    extra = []
    for dt in ("float32", "bfloat16", "float16", "int32", "bool", "uint8"):
        extra.append(f"broadcast_inplace-{dt}-root0")
        extra.append(f"broadcast_inplace-{dt}-rootlast")
    for dt in ("float32", "bfloat16", "float16", "int64"):
        extra.append(f"allreduce_async-{dt}-Sum")
        extra.append(f"allreduce_inplace-{dt}-Average-noncontiguous")
        extra.append(f"grouped_allreduce_inplace-{dt}-Sum")
        extra.append(f"grouped_allgather-{dt}")
        extra.append(f"grouped_reducescatter-{dt}-Sum")
    extra += [
        "allreduce-float32-Sum-deprecated_average",
        "allreduce-float32-Average-fp16_compression",
        "alltoall-float32-tensor_splits",
        "alltoall-bfloat16-noncontiguous",
        "allgather-float32-noncontiguous",
        "reducescatter_scaled-float32-Average",
        "reducescatter_scaled-float64-Sum",
        "sparse_allreduce-float32-Sum",
        "sparse_allreduce-float32-Average",
    ]
    return core_case_ids() + extra


def _t(arr, dtype):
    """numpy -> torch (bfloat16 through float32, which numpy lacks)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.asarray(arr, dtype=np.float32, order="C")).to(torch.bfloat16)
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
    return torch.from_numpy(np.asarray(arr, order="C"))


def _n(t):
    return t.to(torch.float32).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _dtype_of(dtype):
    return torch.bool if dtype == "bool" else getattr(torch, dtype)


def _cmp(got, want, dtype):
    """None when ``got`` (torch) matches ``want`` (numpy) in value and keeps the dtype."""
    if isinstance(got, torch.Tensor) and got.dtype != _dtype_of(dtype):
        return f"dtype {got.dtype} != {dtype}"
    return _check(_n(got), want, dtype)


def _noncontiguous(t):
    """A non-contiguous tensor equal to ``t`` (every other column of a wider one)."""
    big = torch.zeros(t.shape[:-1] + (t.shape[-1] * 2,), dtype=t.dtype)
    big[..., ::2] = t
    view = big[..., ::2]
    assert not view.is_contiguous() or t.shape[-1] <= 1
    return view


def _one_case(case, rank, size):
    kind, dtype, extra, variant = core_cases.parse(case)
    shape = (5, 3)
    if kind in ("allreduce", "allreduce_scaled", "allreduce_inplace", "allreduce_async"):
        op_name = extra
        op = getattr(hvd, op_name)
        shape = core_cases.input_shape(variant)
        inputs = [_data(case, r, shape, dtype) for r in range(size)]
        mine = _t(inputs[rank], dtype)
        if kind == "allreduce_scaled":
            pre, post = (0.5, 3.0) if dtype != "int32" else (2.0, 3.0)
            scaled = [(x * pre).astype(x.dtype) if dtype != "int32" else x * 2 for x in inputs]
            want = _reduce(scaled, op_name, dtype, size)
            want = (want * post).astype(want.dtype) if dtype != "int32" else want * 3
            return _cmp(hvd.allreduce(mine, name=case, op=op, prescale_factor=pre,
                                      postscale_factor=post), want, dtype)
        want = _reduce(inputs, op_name, dtype, size)
        if kind == "allreduce_inplace":
            buf = _noncontiguous(mine) if variant == "noncontiguous" else mine.clone()
            got = hvd.allreduce_(buf, name=case, op=op)
            if got is not buf:
                return "in-place allreduce did not return its argument"
            return _cmp(buf, want, dtype)
        if kind == "allreduce_async":
            h = hvd.allreduce_async(mine, name=case, op=op)
            deadline = time.monotonic() + 30
            while not hvd.poll(h):
                if time.monotonic() > deadline:
                    return "poll() never became true"
                time.sleep(0.001)
            return _cmp(hvd.synchronize(h), want, dtype)
        if variant == "noncontiguous":
            return _cmp(hvd.allreduce(_noncontiguous(mine), name=case, op=op), want, dtype)
        if variant == "deprecated_average":  # average=False means Sum
            return _cmp(hvd.allreduce(mine, average=False, name=case), want, dtype)
        if variant == "fp16_compression":
            got = hvd.allreduce(mine, name=case, op=op, compression=hvd.Compression.fp16)
            if got.dtype != torch.float32:
                return f"decompressed dtype {got.dtype}"
            ok = np.allclose(got.numpy(), want, rtol=1e-2, atol=1e-2)
            return None if ok else f"values differ: {got.ravel()[:6]} vs {want.ravel()[:6]}"
        return _cmp(hvd.allreduce(mine, name=case, op=op), want, dtype)
    if kind in ("grouped_allreduce", "grouped_allreduce_inplace"):
        op_name = extra
        inputs = [[_data(case + str(k), r, (k + 2, 3), dtype) for k in range(3)]
                  for r in range(size)]
        wants = [_reduce([inputs[r][k] for r in range(size)], op_name, dtype, size)
                 for k in range(3)]
        mine = [_t(a, dtype) for a in inputs[rank]]
        if kind == "grouped_allreduce_inplace":
            mine[1] = _noncontiguous(mine[1])
            got = hvd.grouped_allreduce_(mine, name=case, op=getattr(hvd, op_name))
            if any(g is not m for g, m in zip(got, mine)):
                return "in-place grouped allreduce did not return its arguments"
        else:
            got = hvd.grouped_allreduce(mine, name=case, op=getattr(hvd, op_name))
        return next((e for e in (_cmp(g, w, dtype) for g, w in zip(got, wants)) if e), None)
    if kind in ("reducescatter", "reducescatter_scaled", "grouped_reducescatter"):
        op_name = extra
        op = getattr(hvd, op_name)
        n_tensors = 2 if kind == "grouped_reducescatter" else 1
        errors = []
        tensors, wants = [], []
        for k in range(n_tensors):
            rows_total = 7 + k
            inputs = [_data(f"{case}{k}", r, (rows_total, 2), dtype) for r in range(size)]
            full = _reduce(inputs, op_name, dtype, size)
            if kind == "reducescatter_scaled":
                full = _reduce([x * 0.5 for x in inputs], op_name, dtype, size) * 3.0
            rows = [rows_total // size + (1 if q < rows_total % size else 0) for q in range(size)]
            start = sum(rows[:rank])
            tensors.append(_t(inputs[rank], dtype))
            wants.append(full[start:start + rows[rank]])
        if kind == "grouped_reducescatter":
            got = hvd.grouped_reducescatter(tensors, name=case, op=op)
        elif kind == "reducescatter_scaled":
            got = [hvd.reducescatter(tensors[0], name=case, op=op, prescale_factor=0.5,
                                     postscale_factor=3.0)]
        else:
            got = [hvd.reducescatter(tensors[0], name=case, op=op)]
        errors = [_cmp(g, w, dtype) for g, w in zip(got, wants)]
        return next((e for e in errors if e), None)
    if kind in ("allgather", "grouped_allgather"):
        n_tensors = 2 if kind == "grouped_allgather" else 1
        tensors, wants = [], []
        for k in range(n_tensors):
            rows = [0 if extra == "zero_rows" and r == 0 else r + 1 + k for r in range(size)]
            inputs = [_data(f"{case}{k}", r, (rows[r], 3), dtype) for r in range(size)]
            t = _t(inputs[rank], dtype)
            tensors.append(_noncontiguous(t) if extra == "noncontiguous" else t)
            wants.append(np.concatenate(inputs))
        if kind == "grouped_allgather":
            got = hvd.grouped_allgather(tensors, name=case)
        else:
            got = [hvd.allgather(tensors[0], name=case)]
        return next((e for e in (_cmp(g, w, dtype) for g, w in zip(got, wants)) if e), None)
    if kind in ("broadcast", "broadcast_inplace"):
        root = 0 if extra == "root0" else size - 1
        inputs = [_data(case, r, shape, dtype) for r in range(size)]
        mine = _t(inputs[rank], dtype)
        if kind == "broadcast_inplace":
            got = hvd.broadcast_(mine, root_rank=root, name=case)
            if got is not mine:
                return "in-place broadcast did not return its argument"
        else:
            got = hvd.broadcast(mine, root_rank=root, name=case)
            if rank != root and size > 1 and torch.equal(mine, got) and \
                    not np.array_equal(inputs[rank], inputs[root]):
                return "broadcast modified its input"
        return _cmp(got, inputs[root], dtype)
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
        mine = _t(inputs[rank], dtype)
        if extra == "noncontiguous":
            mine = _noncontiguous(mine)
        want_splits = [splits_of[src][rank] for src in range(size)]
        if extra == "even":
            got = hvd.alltoall(mine, name=case)  # no splits: returns the tensor alone
            got_splits = torch.tensor(want_splits, dtype=torch.int32)
        else:
            splits = splits_of[rank]
            if extra == "tensor_splits":
                splits = torch.tensor(splits, dtype=torch.int32)
            got, got_splits = hvd.alltoall(mine, splits=splits, name=case)
        if got_splits.dtype != torch.int32 or got_splits.tolist() != want_splits:
            return f"received splits {got_splits} wrong (expected {want_splits})"
        return _cmp(got, np.concatenate(want_parts), dtype)
    if kind == "sparse_allreduce":
        dense = [np.zeros((6, 2), np.float32) for _ in range(size)]
        for r in range(size):
            dense[r][[r % 6, (r + 2) % 6]] = _data(case, r, (2, 2), "float32")
        mine = torch.from_numpy(dense[rank]).to_sparse()
        op = getattr(hvd, extra)
        handle = hvd.sparse_allreduce_async(mine, name=case, op=op)
        got = handle() if extra == "Sum" else hvd.synchronize(handle)  # Horovod's call form too
        if not got.is_sparse:
            return "sparse allreduce returned a dense tensor"
        want = _reduce(dense, extra, "float32", size)
        return _check(got.to_dense().numpy(), want, "float32")
    return f"unknown case {case}"


def _process_set_checks(rank, size):
    """Process sets through the torch API (3 ranks): ops, optimizer and broadcasts on a subset."""
    out = {}
    evens = hvd.add_process_set([0, 2])
    if evens.included():
        got = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=evens)
        out["sum"] = got.tolist()
        out["gather"] = hvd.allgather(torch.tensor([rank]), process_set=evens).tolist()
        out["bcast"] = hvd.broadcast(torch.tensor([rank]), root_rank=2,
                                     process_set=evens).tolist()
        out["object"] = hvd.broadcast_object(f"from {rank}", root_rank=2, process_set=evens)
        out["outside_root"] = _error_text(lambda: hvd.broadcast(torch.tensor([rank]),
                                                                root_rank=1, process_set=evens))
        out["objects"] = hvd.allgather_object(rank, process_set=evens)
        x = torch.tensor([1.0 + rank], requires_grad=True)
        hvd.allgather(x, process_set=evens).sum().backward()
        out["gather_grad"] = x.grad.tolist()
        sp = torch.sparse_coo_tensor([[rank, 3]], [1.0, 10.0 * (rank + 1)], (4,))
        out["sparse"] = hvd.sparse_allreduce_async(sp, name="sp", op=hvd.Sum,
                                                   process_set=evens)().to_dense().tolist()
    # An optimizer averaging over the subset only; rank 1 trains alone.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=evens)
    w0 = model.weight.detach().clone()
    (model(torch.ones(1, 2)) * (rank + 1) ** 2).sum().backward()
    opt.step()
    out["weight_delta"] = (w0 - model.weight.detach()).tolist()
    hvd.remove_process_set(evens)
    return out


def op_matrix():
    """Runs every torch case; returns {case: None or error text}."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = {}
    for case in torch_cases():
        try:
            results[case] = _one_case(case, rank, size)
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case] = f"{type(e).__name__}: {e}"
    if size == 3:
        results["__process_sets__"] = _process_set_checks(rank, size)
    return results


# ----------------------------------------------------------------------------- training

class _TwoPath(torch.nn.Module):
    """An MLP with an extra branch that only some batches use."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(8, 4)

    def forward(self, x, use_extra=False):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + self.extra(x) if use_extra else out


class _Embed(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, sparse=sparse)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, use_extra=False):
        if use_extra:  # this batch skips the embedding (its gradient stays None)
            return self.fc(x)
        idx = (x.abs() * 7).long().clamp(max=19)[:, :3]
        return self.fc(self.emb(idx).mean(1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


# name: (optimizer factory, DistributedOptimizer kwargs, passes per step, tolerance)
TRAIN_CONFIGS = {
    "sgd_momentum": (_sgd, {}, 1, 1e-5),
    "adam": (_adam, {}, 1, 1e-4),
    "backward_passes_per_step_2": (_sgd, {"backward_passes_per_step": 2}, 2, 1e-5),
    "fp16_compression": (_sgd, {"compression": hvd.Compression.fp16}, 1, 2e-2),
    "groups_2": (_sgd, {"groups": 2}, 1, 1e-5),
    "groups_list": (_adam, {"groups": "fc1"}, 1, 1e-4),
    "predivide_2": (_sgd, {"gradient_predivide_factor": 2.0}, 1, 1e-5),
    "op_sum": (_sgd, {"op": hvd.Sum}, 1, 1e-5),
    "unused_param": (_sgd, {}, 1, 1e-5),
    "synchronize_clip": (_sgd, {}, 1, 1e-5),
    "sparse_embedding": (lambda p: torch.optim.SGD(p, lr=0.5), {}, 1, 1e-5),
    "sparse_as_dense": (lambda p: torch.optim.SGD(p, lr=0.5), {"sparse_as_dense": True}, 1, 1e-5),
    # SparseAdam needs gradients that stay sparse; emb.weight is the first parameter. In
    # "_unused" the last rank skips the embedding after the first step.
    "sparse_adam": (lambda p: torch.optim.SparseAdam(list(p)[:1], lr=0.05), {}, 1, 1e-5),
    "sparse_adam_unused": (lambda p: torch.optim.SparseAdam(list(p)[:1], lr=0.05), {}, 1, 1e-5),
    # sparse_as_dense: reduced as dense tensors, handed back to SparseAdam as sparse ones
    # (Horovod's sparse-embedding test).
    "sparse_adam_as_dense": (lambda p: torch.optim.SparseAdam(list(p)[:1], lr=0.05),
                             {"sparse_as_dense": True}, 1, 1e-5),
    "sparse_adam_as_dense_unused": (lambda p: torch.optim.SparseAdam(list(p)[:1], lr=0.05),
                                    {"sparse_as_dense": True}, 1, 1e-5),
}
# Configs where the last rank's batches skip the embedding after the first step.
_SKIP_EMBEDDING = ("sparse_adam_unused", "sparse_adam_as_dense_unused")
STEPS = 4
PER_RANK = 4


def _model(config):
    torch.manual_seed(0)
    if config.startswith("sparse"):
        return _Embed(sparse=True)
    return _TwoPath()


def _step_data(step, size, passes):
    g = torch.Generator().manual_seed(1000 + step)
    n = size * passes * PER_RANK
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _train(config, rank, size):
    factory, kwargs, passes, tol = TRAIN_CONFIGS[config]
    kwargs = dict(kwargs)
    model, ref = _model(config), _model(config)
    if kwargs.get("groups") == "fc1":
        kwargs["groups"] = [[model.fc1.weight, model.fc1.bias]]
    opt = hvd.DistributedOptimizer(factory(model.parameters()),
                                   named_parameters=model.named_parameters(), **kwargs)
    ref_opt = factory(ref.parameters())
    # With Sum the ranks' gradients add up: the reference scales its (mean) loss to match.
    scale = size if kwargs.get("op") == hvd.Sum else 1.0
    for step in range(STEPS):
        x, y = _step_data(step, size, passes)
        chunks = list(zip(x.split(PER_RANK), y.split(PER_RANK)))  # rank-major, then pass
        opt.zero_grad()
        for p in range(passes):
            cx, cy = chunks[rank * passes + p]
            # The extra branch is used by the last rank's batches only.
            use = rank == size - 1 and (config == "unused_param" or
                                        (config in _SKIP_EMBEDDING and step > 0))
            (F.mse_loss(model(cx, use), cy) / passes).backward()
        if config == "synchronize_clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.zero_grad()
        loss = 0.0
        for i, (cx, cy) in enumerate(chunks):
            use = i // passes == size - 1 and (config == "unused_param" or
                                               (config in _SKIP_EMBEDDING and step > 0))
            loss = loss + F.mse_loss(ref(cx, use), cy)
        (loss * scale / len(chunks)).backward()
        if config == "synchronize_clip":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                           _model(config).parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    layout = str(model.emb.weight.grad.layout) if config.startswith("sparse") else None
    return {"diff": diff, "tol": tol, "moved": moved, "params": flat.tolist(),
            "emb_grad_layout": layout}


def train_equivalence():
    """Every training config: max difference to the 1-process reference, and the weights."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for config in TRAIN_CONFIGS:
        try:
            out[config] = _train(config, rank, size)
        except Exception as e:  # noqa: BLE001 - reported per config
            out[config] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ----------------------------------------------------------------------------- broadcasts

def _state_summary(opt):
    sd = opt.state_dict()
    state = {}
    for pid, entries in sd["state"].items():
        state[pid] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                      for k, v in entries.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "groups": groups}


def _local_steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
        opt.step()


def broadcast_state():
    """broadcast_parameters / broadcast_optimizer_state / objects from ranks that differ."""
    hvd.init()
    rank = hvd.rank()
    out = {}
    torch.manual_seed(rank)
    model = _TwoPath()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["state_dict_root0"] = [p.tolist() for p in model.state_dict().values()]
    torch.manual_seed(10 + rank)
    model = _TwoPath()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=1)
    out["named_root1"] = [p.tolist() for p in model.parameters()]
    torch.manual_seed(20 + rank)
    model = _TwoPath()
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    out["list_root0"] = [p.tolist() for p in model.parameters()]

    makers = {
        "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr),
        "sgd_momentum": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    }
    # (steps taken by rank 0, steps taken by rank 1) before the broadcast from rank 0
    scenarios = {"root_ahead": (2, 0), "other_ahead": (0, 3), "both_empty": (0, 0),
                 "both_stepped": (1, 2)}
    for opt_name, make in makers.items():
        for scen, steps in scenarios.items():
            torch.manual_seed(0)
            model = _TwoPath()
            opt = make(model.parameters(), 0.01 * (rank + 1))
            _local_steps(model, opt, steps[rank], seed=rank)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            after = _state_summary(opt)
            # The same further steps must now give the same weights on every rank.
            _local_steps(model, opt, 2, seed=99)
            out[f"{opt_name}/{scen}"] = {
                "summary": after, "weights": [p.tolist() for p in model.parameters()]}
    # Through a DistributedOptimizer, as Horovod scripts do it.
    torch.manual_seed(rank)
    model = _TwoPath()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _local_steps(model, opt, 2, seed=rank)  # different data, averaged gradients
    out["distributed_adam"] = {"summary": _state_summary(opt),
                               "weights": [p.tolist() for p in model.parameters()]}

    out["object"] = hvd.broadcast_object({"rank": rank, "t": torch.arange(3) * rank} if rank == 1
                                         else None, root_rank=1)
    out["object"]["t"] = out["object"]["t"].tolist()
    out["objects"] = hvd.allgather_object({"rank": rank, "payload": "x" * (rank * 1000)})
    return out


def broadcast_on_sets():
    """Roots are global ranks (3 ranks, set {0, 2}, root 2 = not its first member); optimizer
    state of parameters whose .grad is None; a new optimizer's state materialized on the root
    without moving its parameters."""
    hvd.init()
    rank = hvd.rank()
    ps = hvd.add_process_set([0, 2])
    out = {}
    # Global set, root 1: the root stepped with the extra branch unused (its .grad is None).
    torch.manual_seed(rank)
    model = _TwoPath()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    _local_steps(model, opt, 2 if rank == 1 else 0, seed=rank)
    out["none_grad_is_none"] = model.extra.weight.grad is None
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    out["global"] = _state_summary(opt)
    # SparseAdam needs sparse gradients in the step that creates its state (Horovod's model=)
    emb = _Embed(sparse=True)
    sparse_opt = torch.optim.SparseAdam(list(emb.emb.parameters()), lr=0.1)
    hvd.broadcast_optimizer_state(sparse_opt, 0, emb)
    out["sparse_adam_steps"] = [float(st["step"]) for st in sparse_opt.state.values()]
    if ps.included():
        # A new Adam with weight decay on every member: the root's state is created by a
        # zero-gradient step that must leave its parameters alone.
        torch.manual_seed(10 + rank)
        model = _TwoPath()
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.5)
        hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=ps)
        out["params_kept"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        out["grads_kept"] = all(p.grad is None for p in model.parameters())
        out["set_state"] = _state_summary(opt)
        hvd.broadcast_parameters(model.named_parameters(), root_rank=2, process_set=ps)
        out["set_params"] = [p.tolist() for p in model.parameters()]
        out["set_object"] = hvd.broadcast_object(f"from {rank}", root_rank=2, process_set=ps)
        out["set_bad_root"] = _error_text(
            lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=ps))
        out["set_bad_root_object"] = _error_text(
            lambda: hvd.broadcast_object(1, root_rank=1, process_set=ps))
        h = hvd.broadcast_async(torch.tensor([float(rank)]), root_rank=2, process_set=ps)
        out["set_async"] = hvd.synchronize(h).tolist()
    hvd.barrier()
    return out


def join_uneven():
    """Rank 0 runs out of data first; the others keep reducing with its zeros."""
    hvd.init()
    rank = hvd.rank()
    sums = [hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="step").item()
            for _ in range(2 + rank)]
    return {"sums": sums, "last": hvd.join()}


# ----------------------------------------------------------------------------- errors

def _error_text(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def errors():
    """Every error case on 2 ranks, each followed by a collective proving the runtime is usable."""
    hvd.init()
    rank = hvd.rank()
    out = {}
    out["dtype"] = _error_text(lambda: hvd.allreduce(
        torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), name="w_dtype"))
    out["shape"] = _error_text(lambda: hvd.allreduce(torch.ones(rank + 2), name="w_shape"))
    out["gather_dims"] = _error_text(lambda: hvd.allgather(torch.ones(2, rank + 1),
                                                           name="w_gather"))
    out["after_mismatch"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after").item()

    # A name reused while its first operation is still in flight (rank 0 only).
    def duplicate():
        h = hvd.allreduce_async(torch.ones(3), name="dup") if rank == 0 else None
        try:
            if rank == 0:
                hvd.allreduce_async(torch.ones(3), name="dup")
        finally:
            if rank != 0:
                time.sleep(0.2)
                hvd.allreduce(torch.ones(3), name="dup")
            else:
                hvd.synchronize(h, timeout=30)
    out["duplicate"] = _error_text(duplicate)

    # Models whose shapes differ between ranks: the optimizer's allreduce names the parameter.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3 + rank), torch.nn.Linear(3 + rank, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 4)).sum().backward()
    out["optimizer_shapes"] = _error_text(opt.step)
    del opt
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=1,
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    out["optimizer_group_shapes"] = _error_text(opt.step)
    del opt, model

    # Wrapping the same model again after dropping the first wrapper: the old hooks are
    # gone (each gradient reduced once: with Sum over identical ranks, exactly 2x).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), op=hvd.Sum,
                                     named_parameters=model.named_parameters())
    del first
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), op=hvd.Sum,
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 4)).sum().backward()
    # The hooks started the allreduces during backward, before step().
    out["started_in_backward"] = len(opt._handles) + sum(len(items) for _, items in opt._batches)
    opt.step()
    out["rewrapped_grad"] = model.bias.grad.tolist()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    out["zero_grad_race"] = _error_text(opt.zero_grad)
    opt.step()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    out["too_many_passes"] = _error_text(lambda: model(torch.ones(2, 4)).sum().backward())
    opt.step()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["step_after_synchronize_warns"] = [str(w.message)[:60] for w in caught]
    out["adasum"] = _error_text(lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum))
    out["bad_splits"] = _error_text(lambda: hvd.alltoall(torch.ones(4), splits=[1, 1]))
    out["uneven_default_splits"] = _error_text(lambda: hvd.alltoall(torch.ones(3)))
    out["final"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="final").item()
    return out


def recreated_optimizers():
    """Optimizers re-created over the same parameters while the old ones are still alive
    (held by a reference cycle, garbage collection off): only the newest one reduces."""
    import gc

    gc.disable()
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    keep = []
    for _ in range(3):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        opt.zero_grad()
        model(torch.ones(2, 4) * (hvd.rank() + 1)).sum().backward()
        opt.step()
        cycle = [opt]
        cycle.append(cycle)
        keep.append(cycle)
    gc.enable()
    # every step reduced (1 + 2) / 2 * ones: three steps of lr 0.1 from the same start
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 1).weight.detach().reshape(-1)
    expected = start - 3 * 0.1 * 2 * 1.5
    return [float(v) for v in model.weight.detach().reshape(-1)], \
        [float(v) for v in expected]
