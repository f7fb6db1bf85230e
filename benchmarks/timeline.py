"""What the timeline costs: step time with it on against off, on the DDP benchmark's model.

    PYTHONPATH=. .venv/bin/python benchmarks/timeline.py                 # 2 ranks, shm
    PYTHONPATH=. .venv/bin/python benchmarks/timeline.py --iters 40 --batches 5
    PYTHONPATH=. .venv/bin/python benchmarks/timeline.py --many 200     # worst case

How it measures. One ``sdlrun -np 2`` job; each rank trains benchmarks/torch_ddp.py's model
(examples/pytorch_synthetic_benchmark.py's SmallCNN) with ``DistributedOptimizer`` (one
allreduce per gradient, fused by the core, default knobs). Timed iterations of ``--batches``
steps alternate between timeline off and on, in the order off/on/on/off/..., so a shared
machine's noise hits both alike; for an "on" iteration every rank calls
``start_timeline(path)`` before it and ``stop_timeline()`` after it (only rank 0 writes, so
the start and stop stay outside the timed steps). Reported: the median step time of each,
their ratio with the spread of per-pair ratios (25th-75th percentile), and the records
written and dropped. ``--many N`` replaces the model by N tiny (64-byte) allreduces per
step, each waited for: almost no compute, so every timeline record weighs (the worst case).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _harness as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
MARK = "SDL_TIMELINE_BENCH "


def worker(args):
    import torch
    import torch.nn.functional as F

    import spark_dl.torch as hvd
    from spark_dl.common.basics import counters
    from pytorch_synthetic_benchmark import SmallCNN

    torch.set_num_threads(args.threads)
    hvd.init()
    torch.manual_seed(0)
    model = SmallCNN(width=args.width)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (args.batch_size,), generator=g)
    path = args.path

    tiny = [torch.ones(16) for _ in range(args.many)]

    def step():
        if args.many:
            handles = [hvd.allreduce_async(t, name=f"tiny.{i}") for i, t in enumerate(tiny)]
            for h in handles:
                hvd.synchronize(h)
            return
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def steps(n):
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - t0) / n

    steps(args.warmup)
    times = {"off": [], "on": []}
    records = dropped = 0
    for it in range(args.iters):
        on = it % 4 in (1, 2)  # off on on off: each pair sees the other first as often
        if on:
            hvd.start_timeline(path)
        times["on" if on else "off"].append(steps(args.batches))
        if on:
            hvd.stop_timeline()
            if hvd.rank() == 0:
                c = counters()
                records += c["timeline_records"]
                dropped += c["timeline_dropped"]
    rank = hvd.rank()
    size = os.path.getsize(path) if rank == 0 and os.path.exists(path) else 0
    hvd.shutdown()
    if rank == 0:
        H.print_result({"times": times, "records": records, "dropped": dropped,
                        "file_bytes": size,
                        "tensors": args.many or len(list(model.parameters()))}, MARK)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--iters", type=int, default=40, help="timed iterations (half of them on)")
    p.add_argument("--batches", type=int, default=5, help="steps per timed iteration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--many", type=int, default=0, help="N tiny allreduces per step, no model")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    path = os.path.join(tempfile.mkdtemp(prefix="sdl-timeline-bench-"), "timeline.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", "--path", path]
    for k in ("iters", "batches", "warmup", "batch_size", "threads", "width", "many"):
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    load = H.load_average()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    res = H.parse_result(r.stdout, MARK) if r.returncode == 0 else None
    if res is None:
        sys.exit(f"job failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    off, on = res["times"]["off"], res["times"]["on"]
    pairs = [b / a for a, b in zip(off, on)]
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    what = (f"{args.many} tiny allreduces per step" if args.many else
            f"SmallCNN width {args.width} ({res['tensors']} gradient tensors), batch "
            f"{args.batch_size}")
    print(f"{what}, {args.np} ranks, {args.iters} iterations of {args.batches} "
          f"steps, load average before {load}")
    print(f"step time, timeline off: {H.fmt_time(statistics.median(off))} (median of {len(off)})")
    print(f"step time, timeline on:  {H.fmt_time(statistics.median(on))} (median of {len(on)})")
    print(f"on/off: {statistics.median(on) / statistics.median(off):.3f} "
          f"(per-pair ratios: median {statistics.median(pairs):.3f}, "
          f"25-75% {q[0]:.3f}-{q[2]:.3f})")
    print(f"records written {res['records']}, dropped {res['dropped']}, last file "
          f"{res['file_bytes'] / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
