"""Tensor fusion: many small allreduces per step, as a data-parallel backward pass makes them.

    PYTHONPATH=. .venv/bin/python benchmarks/fusion.py             # 200 x 16 KiB per step
    PYTHONPATH=. .venv/bin/python benchmarks/fusion.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/fusion.py --tensors 500 --elements 1024

One step reduces --tensors float32 tensors of --elements elements (default 200 x 4096 =
16 KiB each) in place, with a sum. Variants, each timed per step on rank 0:

  spark_dl fused     allreduce_async_ for every tensor (same names every step), then wait
                     on every handle; default knobs, so the core packs what is ready into
                     one collective. Run over shared memory and over Gloo TCP (SDL_SHM=0).
  spark_dl fused (torch per-tensor)
                     the same loop through spark_dl.torch.allreduce_async_ and
                     synchronize on torch views of the same arrays: a Horovod program's
                     own per-gradient loop.
  spark_dl batched   spark_dl.torch.grouped_allreduce_async_ of the step's tensors (torch
                     views of the same arrays): one call enqueues all, one handle waits
                     for all (what DistributedOptimizer does with the gradients of a step).
  spark_dl batched, inline cycles off
                     the same after set_knob("inline_cycles", False): the background thread
                     runs every cycle and wakes the waiting caller (the hand-off that
                     inline cycles remove), in the same job for a same-job ratio.
  spark_dl unfused   the per-tensor loop after set_knob("fusion_threshold", 0).
  torch per-tensor   dist.all_reduce on each tensor in turn (gloo backend).
  torch one bucket   torch.cat into one flat tensor, one all_reduce, results copied back
                     into the tensors (DDP's gradient bucketing with a single bucket).

Both variants of a framework run in the same job, alternating blocks of steps; the jobs
alternate over --rounds. Targets (issue 18), printed at the end from this run's medians:
the faster of fused and batched takes at most 1.5 ms per step, is at least 3x faster than
torch's one bucket and at least 3x faster than unfused.
"""

import time

import _harness as H

DEFAULT_PEERS = ("spark_dl", "spark_dl_gloo", "torch")
VARIANTS = {"spark_dl": ("fused", "fused_torch", "batched", "batched_bg", "unfused"),
            "spark_dl_gloo": ("fused", "fused_torch", "batched", "batched_bg", "unfused"),
            "torch": ("per_tensor", "bucket")}
VARIANT_LABELS = {"fused": "fused", "fused_torch": "fused (torch per-tensor)",
                  "batched": "batched",
                  "batched_bg": "batched, inline cycles off", "unfused": "unfused",
                  "per_tensor": "per-tensor", "bucket": "one bucket"}
COUNTERS = ("collectives", "cycles", "fused_tensors", "cache_hits", "full_negotiations")


def spark_dl_steps(backend, tensors):
    """{variant: select()}; select() sets the variant's knobs and returns its step function."""
    import torch

    import spark_dl.torch as sdl_torch
    from spark_dl.common import knobs

    sdl = backend.sdl
    default_threshold = knobs.value("fusion_threshold")
    names = [f"grad.{i}" for i in range(len(tensors))]
    submit, op = sdl.allreduce_async_, sdl.Sum
    views = [torch.from_numpy(t) for t in tensors]  # the same memory

    def step():
        # Kept lean on purpose: the Python cost per tensor is part of what is measured.
        handles = [submit(t, op=op, name=n) for t, n in zip(tensors, names)]
        for h in handles:
            h.wait()

    def batched():
        sdl_torch.grouped_allreduce_async_(views, name="grads", op=op).wait()

    torch_submit, torch_sync = sdl_torch.allreduce_async_, sdl_torch.synchronize
    torch_op = sdl_torch.Sum

    def torch_loop():
        handles = [torch_submit(t, op=torch_op, name=n) for t, n in zip(views, names)]
        for h in handles:
            torch_sync(h)

    default_inline = knobs.value("inline_cycles")

    def with_threshold(value, fn, inline=None):
        def select():
            sdl.set_knob("fusion_threshold", value)
            sdl.set_knob("inline_cycles", default_inline if inline is None else inline)
            return fn
        return select

    return {"fused": with_threshold(default_threshold, step),
            "fused_torch": with_threshold(default_threshold, torch_loop),
            "batched": with_threshold(default_threshold, batched),
            "batched_bg": with_threshold(default_threshold, batched, inline=False),
            "unfused": with_threshold(0, step)}


def torch_steps(backend, tensors):
    torch, dist = backend.torch, backend.dist
    ts = [torch.from_numpy(t) for t in tensors]
    n = tensors[0].size
    op = dist.ReduceOp.SUM

    def per_tensor():
        for t in ts:
            dist.all_reduce(t, op=op)

    def bucket():
        flat = torch.cat(ts)
        dist.all_reduce(flat, op=op)
        for t, part in zip(ts, flat.split(n)):
            t.copy_(part)

    return {"per_tensor": lambda: per_tensor, "bucket": lambda: bucket}


def first_use(backend, tensors, step, variant, warmup):
    """Checks one step's sums on ones, then warms up on zeros (which stay zeros)."""
    for t in tensors:
        t.fill(1)
    step()
    if not all((t == backend.size).all() for t in tensors):
        raise AssertionError(f"{backend.peer} {variant}: wrong allreduce result")
    for t in tensors:
        t.fill(0)
    for _ in range(warmup):
        step()


def worker(args):
    import numpy as np

    backend = H.Backend(args.worker)
    tensors = [np.ones(args.elements, dtype=np.float32) for _ in range(args.tensors)]
    make = torch_steps if args.worker == "torch" else spark_dl_steps
    variants = make(backend, tensors)
    samples = {v: [] for v in variants}
    counters = {}
    clock = time.perf_counter
    for block in range(args.blocks):
        for v, select in variants.items():
            step = select()
            if block == 0:
                first_use(backend, tensors, step, v, args.warmup)
            backend.barrier()
            before = backend.counters()
            for _ in range(args.steps):
                t0 = clock()
                step()
                samples[v].append(clock() - t0)
            counters[v] = H.counter_delta(before, backend.counters(), COUNTERS, args.steps)
    backend.report({"samples": samples, "counters_per_step": counters})
    backend.close()


def driver(args):
    wargs = ["--tensors", args.tensors, "--elements", args.elements, "--steps", args.steps,
             "--blocks", args.blocks, "--warmup", args.warmup]
    kib = args.elements * 4 / 1024
    peers, results = H.launch(args, __file__, wargs, f"fusion benchmark, {args.tensors} x "
                              f"{kib:g} KiB", allowed=tuple(VARIANTS))
    med = {(p, v): H.median(H.pooled(r["samples"][v] for r in results[p]))
           for p in peers for v in VARIANTS[p]}
    base = med.get(("spark_dl", "fused"))
    step_bytes = args.tensors * args.elements * 4
    rows = [[f"{H.PEER_LABELS[p]} {VARIANT_LABELS[v]}", f"{m * 1e3:.2f}",
             H.fmt_ratio(m, base) if base else "-", f"{step_bytes / m / 1e9:.2f}",
             " / ".join(f"{H.median(r['samples'][v]) * 1e3:.2f}" for r in results[p])]
            for (p, v), m in med.items()]
    H.print_header(f"fusion: {args.tensors} tensors x {kib:g} KiB (float32) per step, "
                   f"{args.np} ranks: median ms per step ({args.rounds} round(s) x "
                   f"{args.blocks} block(s) x {args.steps} steps per variant)", args, results)
    print(H.markdown_table(["variant", "ms / step", "x spark_dl fused", "algbw GB/s",
                            "per-round medians ms"], rows))
    for p in peers:
        if p.startswith("spark_dl"):
            c = results[p][-1]["counters_per_step"]
            print(f"\n{H.PEER_LABELS[p]} core counters per step (last job): "
                  + "; ".join(f"{v}: " + ", ".join(f"{k} {x:g}" for k, x in c[v].items())
                              for v in c))
    print()

    def per_round(num, den):
        """Ratios of round medians, round by round: (peer, variant) over (peer, variant).
        Round i of every peer ran next to each other in time, so the spread shows how much
        of a ratio is the machine's noise."""
        pairs = zip(results[num[0]], results[den[0]])
        return " / ".join(f"{H.median(a['samples'][num[1]]) / H.median(b['samples'][den[1]]):.2f}"
                          for a, b in pairs)

    for p in peers:
        if not p.startswith("spark_dl"):
            continue
        best = min(("fused", "batched"), key=lambda v: med[(p, v)])
        ms = med[(p, best)] * 1e3
        speedup = med[(p, "unfused")] / med[(p, best)]
        # Shared memory is held to issue 18's targets; Gloo TCP (the multi-host wire) to parity.
        want = 3.0 if p == "spark_dl" else 1.0
        line = (f"{H.PEER_LABELS[p]} {best}: {ms:.2f} ms per step"
                + (f" (target <= 1.5 -> {'met' if ms <= 1.5 else 'NOT met'})"
                   if p == "spark_dl" else "")
                + f"; {speedup:.1f}x faster than unfused"
                + (f" (target >= 3x -> {'met' if speedup >= 3 else 'NOT met'})"
                   if p == "spark_dl" else "")
                + f" (per round {per_round((p, 'unfused'), (p, best))})")
        if (p, "batched_bg") in med:
            gain = med[(p, "batched_bg")] / med[(p, "batched")]
            line += f"; batched with inline cycles {gain:.2f}x faster than without (same job)"
        if ("torch", "bucket") in med:
            tb = med[("torch", "bucket")] / med[(p, best)]
            line += (f"; {tb:.2f}x torch one bucket (target >= {want:g}x -> "
                     f"{'met' if tb >= want else 'NOT met'}; per round "
                     f"{per_round(('torch', 'bucket'), (p, best))})")
        print(line)
        # Issue 34's per-tensor targets: a loop of per-tensor calls within 2x of the batched
        # call, and at least 3x faster than the same loop with fusion off.
        for v in ("fused", "fused_torch"):
            if (p, v) not in med:
                continue
            vs_batched = med[(p, v)] / med[(p, "batched")]
            vs_off = med[(p, "unfused")] / med[(p, v)]
            print(f"{H.PEER_LABELS[p]} {VARIANT_LABELS[v]}: {vs_batched:.2f}x the batched step "
                  f"(target <= 2x -> {'met' if vs_batched <= 2 else 'NOT met'}), "
                  f"{vs_off:.2f}x faster than fusion off (target >= 3x -> "
                  f"{'met' if vs_off >= 3 else 'NOT met'})")


def add_args(parser):
    parser.add_argument("--tensors", type=int, default=200, help="tensors per step (default 200)")
    parser.add_argument("--elements", type=int, default=4096,
                        help="float32 elements per tensor (default 4096 = 16 KiB)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--blocks", type=int, default=3,
                        help="alternating blocks of each variant per job (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")


def quick(args):
    args.blocks, args.steps = 1, min(args.steps, 10)


if __name__ == "__main__":
    H.bench_main(__doc__, DEFAULT_PEERS, 3, add_args, quick, worker, driver)
