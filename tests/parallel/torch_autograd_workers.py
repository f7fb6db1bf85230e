"""Functions run on spawned ranks by tests/parallel/test_torch_autograd.py (see harness.py):
the gradients of every differentiable spark_dl.torch collective, against the same loss
computed on one process from every rank's inputs, and SyncBatchNorm against BatchNorm on
the union of the ranks' batches. Each rank returns {case: error or None}.
"""

import torch

import spark_dl.torch as hvd

torch.set_num_threads(1)  # ranks share a small machine


def _w(seed, shape):
    """Deterministic loss weights."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _x(seed, shape):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _err(got, want):
    if got is None:
        return "no gradient"
    if got.shape != want.shape:
        return f"gradient shape {tuple(got.shape)} != {tuple(want.shape)}"
    d = float((got - want).abs().max()) if got.numel() else 0.0
    return None if d < 1e-9 else f"max gradient error {d}"


def _grad_cases(rank, size):
    """{case: error or None}; each loss_r = sum(W_r * output_r), the total is the sum over ranks."""
    out = {}
    ranks = range(size)

    # allreduce: d/dx_r = sum_q W_q (Sum), / size (Average), * pre * post
    for op_name, pre, post in (("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 2.0, 3.0),
                               ("Average", 0.5, 4.0)):
        x = _x(rank, (3, 2)).requires_grad_()
        y = hvd.allreduce(x, op=getattr(hvd, op_name), prescale_factor=pre,
                          postscale_factor=post)
        (_w(rank, (3, 2)) * y).sum().backward()
        want = sum(_w(q, (3, 2)) for q in ranks) * pre * post
        out[f"allreduce-{op_name}-{pre}-{post}"] = _err(
            x.grad, want / size if op_name == "Average" else want)
    # Max: the summed gradient goes to the rank holding the maximum
    x = _x(rank, (4,)).requires_grad_()
    (_w(rank, (4,)) * hvd.allreduce(x, op=hvd.Max)).sum().backward()
    every = torch.stack([_x(q, (4,)) for q in ranks])
    want = sum(_w(q, (4,)) for q in ranks) * (every.argmax(0) == rank)
    out["allreduce-Max"] = _err(x.grad, want)
    # grouped allreduce
    xs = [_x(rank * 10 + k, (k + 1, 2)).requires_grad_() for k in range(3)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum((_w(rank * 10 + k, (k + 1, 2)) * y).sum() for k, y in enumerate(ys)).backward()
    out["grouped_allreduce-Sum"] = next(
        (e for e in (_err(x.grad, sum(_w(q * 10 + k, (k + 1, 2)) for q in ranks))
                     for k, x in enumerate(xs)) if e), None)

    # allgather with uneven rows: rank r's rows of the average over ranks (Horovod's convention)
    rows = [q + 1 for q in ranks]
    total = sum(rows)
    x = _x(rank, (rows[rank], 2)).requires_grad_()
    (_w(rank, (total, 2)) * hvd.allgather(x, name="ag")).sum().backward()
    off = sum(rows[:rank])
    out["allgather"] = _err(
        x.grad, sum(_w(q, (total, 2)) for q in ranks)[off:off + rows[rank]] / size)
    xs = [_x(rank + 5 * k, (rows[rank] + k, 2)).requires_grad_() for k in range(2)]
    ys = hvd.grouped_allgather(xs)
    sum((_w(rank + k, y.shape) * y).sum() for k, y in enumerate(ys)).backward()
    errs = []
    for k, x in enumerate(xs):
        rows_k = [r + 1 + k for r in ranks]
        off = sum(rows_k[:rank])
        full = sum(_w(q + k, (sum(rows_k), 2)) for q in ranks) / size
        errs.append(_err(x.grad, full[off:off + rows_k[rank]]))
    out["grouped_allgather"] = next((e for e in errs if e), None)

    # broadcast: the root gets the average of every rank's gradient, the others none
    for root in (0, size - 1):
        x = _x(rank, (2, 3)).requires_grad_()
        (_w(rank, (2, 3)) * hvd.broadcast(x, root_rank=root)).sum().backward()
        want = sum(_w(q, (2, 3)) for q in ranks) / size if rank == root \
            else torch.zeros(2, 3, dtype=torch.float64)
        out[f"broadcast-root{root}"] = _err(x.grad, want)

    # alltoall with splits: rows sent to q receive q's weights for the rows from this rank
    splits_of = [[(r + q) % 3 + 1 for q in ranks] for r in ranks]
    x = _x(rank, (sum(splits_of[rank]), 2)).requires_grad_()
    y, recv = hvd.alltoall(x, splits=splits_of[rank])
    (_w(rank, tuple(y.shape)) * y).sum().backward()
    parts = []
    for q in ranks:
        recv_q = [splits_of[src][q] for src in ranks]
        wq = _w(q, (sum(recv_q), 2))
        off = sum(recv_q[:rank])
        parts.append(wq[off:off + splits_of[rank][q]])
    out["alltoall"] = _err(x.grad, torch.cat(parts))

    # reducescatter (7 rows), Horovod's convention: the concatenation of every rank's weights,
    # times the set size for Sum, times the scale factors
    rows = [7 // size + (1 if q < 7 % size else 0) for q in ranks]
    for op_name, pre, post in (("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 2.0, 0.5),
                               ("Average", 3.0, 2.0)):
        x = _x(rank, (7, 2)).requires_grad_()
        y = hvd.reducescatter(x, op=getattr(hvd, op_name), prescale_factor=pre,
                              postscale_factor=post)
        (_w(rank, (rows[rank], 2)) * y).sum().backward()
        want = torch.cat([_w(q, (rows[q], 2)) for q in ranks]) * pre * post
        key = f"reducescatter-{op_name}" + ("" if pre == post == 1.0 else f"-{pre}-{post}")
        out[key] = _err(x.grad, want * size if op_name == "Sum" else want)
    xs = [_x(rank + k, (7, 2)).requires_grad_() for k in range(2)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    sum((_w(rank * 3 + k, tuple(y.shape)) * y).sum() for k, y in enumerate(ys)).backward()
    out["grouped_reducescatter"] = next(
        (e for e in (_err(x.grad, torch.cat([_w(q * 3 + k, (rows[q], 2)) for q in ranks]) * size)
                     for k, x in enumerate(xs)) if e), None)
    out.update(_set_grad_cases(rank, size))
    return out


def _set_grad_cases(rank, size):
    """The same conventions on a process set of non-contiguous ranks ({0, 2} of 3; {1, 0} of 2),
    with a root that is not the set's first member; keys start with 'set-'."""
    ps = hvd.add_process_set([0, 2] if size == 3 else [0, 1])
    members, n = ps.ranks, ps.size()
    keys = ["set-allreduce-Average", "set-allgather", "set-grouped_allgather", "set-broadcast",
            "set-broadcast_", "set-reducescatter-Sum", "set-reducescatter-Average",
            "set-grouped_reducescatter", "set-alltoall", "set-sync_bn"]
    if rank not in members:
        return {k: None for k in keys}
    out = {}
    i = members.index(rank)
    x = _x(rank, (3, 2)).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, process_set=ps)
    (_w(rank, (3, 2)) * y).sum().backward()
    out["set-allreduce-Average"] = _err(x.grad, sum(_w(q, (3, 2)) for q in members) * 2.0 / n)
    rows = [q + 1 for q in members]
    x = _x(rank, (rows[i], 2)).requires_grad_()
    (_w(rank, (sum(rows), 2)) * hvd.allgather(x, process_set=ps)).sum().backward()
    off = sum(rows[:i])
    out["set-allgather"] = _err(
        x.grad, sum(_w(q, (sum(rows), 2)) for q in members)[off:off + rows[i]] / n)
    xs = [_x(rank + k, (rows[i], 2)).requires_grad_() for k in range(2)]
    ys = hvd.grouped_allgather(xs, process_set=ps)
    sum((_w(rank * 7 + k, (sum(rows), 2)) * y).sum() for k, y in enumerate(ys)).backward()
    out["set-grouped_allgather"] = next((e for e in (
        _err(x.grad, sum(_w(q * 7 + k, (sum(rows), 2)) for q in members)[off:off + rows[i]] / n)
        for k, x in enumerate(xs)) if e), None)
    root = members[-1]  # a global rank, not the set's first member
    x = _x(rank, (2, 3)).requires_grad_()
    y = hvd.broadcast(x, root_rank=root, process_set=ps)
    value_ok = _err(y.detach(), _x(root, (2, 3)))
    (_w(rank, (2, 3)) * y).sum().backward()
    want = sum(_w(q, (2, 3)) for q in members) / n if rank == root \
        else torch.zeros(2, 3, dtype=torch.float64)
    out["set-broadcast"] = value_ok or _err(x.grad, want)
    t = _x(rank, (4,))
    hvd.broadcast_(t, root_rank=root, process_set=ps)
    out["set-broadcast_"] = _err(t, _x(root, (4,)))
    srows = [5 // n + (1 if k < 5 % n else 0) for k in range(n)]
    for op_name, pre, post in (("Sum", 1.0, 3.0), ("Average", 2.0, 1.0)):
        x = _x(rank, (5, 2)).requires_grad_()
        y = hvd.reducescatter(x, op=getattr(hvd, op_name), prescale_factor=pre,
                              postscale_factor=post, process_set=ps)
        (_w(rank, (srows[i], 2)) * y).sum().backward()
        want = torch.cat([_w(q, (srows[k], 2)) for k, q in enumerate(members)]) * pre * post
        out[f"set-reducescatter-{op_name}"] = _err(x.grad, want * n if op_name == "Sum" else want)
    xs = [_x(rank + k, (5, 2)).requires_grad_() for k in range(2)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Sum, process_set=ps)
    sum((_w(rank * 3 + k, tuple(y.shape)) * y).sum() for k, y in enumerate(ys)).backward()
    out["set-grouped_reducescatter"] = next((e for e in (
        _err(x.grad, torch.cat([_w(q * 3 + k, (srows[j], 2)) for j, q in enumerate(members)]) * n)
        for k, x in enumerate(xs)) if e), None)
    x = _x(rank, (2 * n, 2)).requires_grad_()
    y = hvd.alltoall(x, process_set=ps)
    (_w(rank, tuple(y.shape)) * y).sum().backward()
    # rows [2k, 2k+2) went to member k, arriving there at rows [2i, 2i+2)
    want = torch.cat([_w(q, (2 * n, 2))[2 * i:2 * i + 2] for q in members])
    out["set-alltoall"] = _err(x.grad, want)
    out["set-sync_bn"] = _sync_bn_case(rank, size, lambda q: (3 + q, 2, 4), ps=ps)
    return out


def _sync_bn_case(rank, size, shape_of, affine=True, ps=None):
    """SyncBatchNorm on each rank's batch vs BatchNorm on the union, forward and backward;
    on process set ``ps``, the union of its members' batches."""
    members = ps.ranks if ps is not None else list(range(size))
    me = members.index(rank)
    channels = shape_of(0)[1]
    xs = [_x(100 + q, shape_of(q)).float() for q in members]
    ws = [_w(200 + q, shape_of(q)).float() for q in members]
    torch.manual_seed(0)
    sbn = hvd.SyncBatchNorm(channels, affine=affine, process_set=ps or hvd.global_process_set)
    ref = torch.nn.BatchNorm1d(channels, affine=affine) if len(shape_of(0)) <= 3 \
        else torch.nn.BatchNorm2d(channels, affine=affine)
    if affine:
        with torch.no_grad():
            for m in (sbn, ref):
                m.weight.copy_(torch.linspace(0.5, 1.5, channels))
                m.bias.copy_(torch.linspace(-0.2, 0.2, channels))
    errors = []
    for it in range(2):  # twice: running statistics accumulate
        x = xs[me].clone().requires_grad_()
        y = sbn(x)
        (ws[me] * y).sum().backward()
        full = torch.cat(xs).requires_grad_()
        yr = ref(full)
        (torch.cat(ws) * yr).sum().backward()
        off = sum(shape_of(q)[0] for q in members[:me])
        n = shape_of(rank)[0]

        def close(a, b, what):
            d = float((a - b).abs().max())
            if d > 1e-4:
                errors.append(f"iteration {it}: {what} differs by {d}")

        close(y, yr[off:off + n], "output")
        close(x.grad, full.grad[off:off + n], "input gradient")
        close(sbn.running_mean, ref.running_mean, "running_mean")
        close(sbn.running_var, ref.running_var, "running_var")
        if affine:
            over = ps or hvd.global_process_set
            close(hvd.allreduce(sbn.weight.grad, op=hvd.Sum, process_set=over), ref.weight.grad,
                  "weight gradient")
            close(hvd.allreduce(sbn.bias.grad, op=hvd.Sum, process_set=over), ref.bias.grad,
                  "bias gradient")
            sbn.zero_grad()
            ref.zero_grad()
    sbn.eval()
    ref.eval()
    close(sbn(xs[me]), ref(xs[me]), "eval output")
    return errors[0] if errors else None


def autograd_and_sync_bn():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = _grad_cases(rank, size)
    out["sync_bn-3d-even"] = _sync_bn_case(rank, size, lambda q: (4, 3, 5))
    out["sync_bn-4d-uneven"] = _sync_bn_case(rank, size, lambda q: (2 + 3 * q, 2, 3, 3))
    out["sync_bn-2d-no_affine"] = _sync_bn_case(rank, size, lambda q: (5 + q, 4), affine=False)
    return out
