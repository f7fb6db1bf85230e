"""GPU benchmark: fused allreduce of CUDA tensors, spark_dl against torch.distributed NCCL on
the same GPU(s) in the same run, and the pack/unpack kernels against the device's copy.

    python benchmarks/gpu.py                    # one rank per GPU (at least one rank)
    python benchmarks/gpu.py --np 1 --iters 50 --json out.json
    python benchmarks/gpu.py --hierarchical    # spark_dl with SDL_HIERARCHICAL_ALLREDUCE=1

Run it on a GPU machine after building there (``bash scripts/gpu_check.sh`` does both).

How it measures. One ``sdlrun -np N`` job; every rank initializes spark_dl and a
``torch.distributed`` NCCL process group (env:// on 127.0.0.1) and pins the GPU of its local
rank. Workloads (float32):

=============  ===========================================================================
``small``      200 tensors of 16 KiB (a step's small gradients)
``large``      one tensor of 64 MiB
``mixed``      both at once
=============  ===========================================================================

Peers:

==================  =====================================================================
``spark_dl``        one ``allreduce_async_`` per tensor, then ``synchronize`` of each
                    (Horovod's pattern: the core fuses what is ready)
``spark_dl_batch``  the whole list in one call of independent allreduces, as
                    ``DistributedOptimizer`` hands over a step's gradients
``spark_dl_group``  ``grouped_allreduce_`` of the whole list (one fused unit)
``nccl_each``       ``dist.all_reduce`` per tensor (NCCL; one kernel each)
``nccl_flat``       flatten, one ``dist.all_reduce``, copy back (DDP's bucket)
==================  =====================================================================

Iterations alternate between the peers in an order that rotates each iteration; each
iteration ends with ``torch.cuda.synchronize()`` and is timed on rank 0's clock. Reported:
median and 10th/90th percentiles over the iterations. Before timing, every peer's result is
checked against ``nccl_flat``'s (Sum of rank-dependent values): a wrong result fails the run.

Kernels: the batched pack of the 200 small tensors into one buffer and the unpack back
(the core's test binding, see ``PACK_BINDING``) against the device-to-device copy of the
same bytes: one contiguous ``copy_`` (the roof), ``torch._foreach_copy_`` (a batched copy)
and 200 separate ``copy_`` calls (what the batched kernel replaces). Bandwidth counts bytes
read plus written.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SDL_GPU_BENCH "
PEERS = ("spark_dl", "spark_dl_batch", "spark_dl_group", "nccl_each", "nccl_flat")
WORKLOADS = ("small", "large", "mixed")
SMALL_COUNT, SMALL_ELEMS, LARGE_ELEMS = 200, 16 * 1024 // 4, 64 * 1024 * 1024 // 4

# --------------------------------------------------------------------------------------------
# The core's test-only binding of the CUDA pack/unpack kernels (issue 12, CUDA kernels).
# Named by the kernels' author; until it exists the kernel rows say "not measured".
# Expected form: PACK_BINDING(inputs: list of CUDA tensors, buffer: CUDA tensor, unpack: bool,
# scale: float) -> None, enqueued on the current stream.
PACK_BINDING = "cuda_pack_for_tests"
# --------------------------------------------------------------------------------------------


def _percentiles(xs):
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(xs), "p10": pick(0.1), "p90": pick(0.9), "n": len(xs)}


# ----------------------------------------------------------------------------- worker side

def _tensors(workload, device, rank):
    import torch

    small = [torch.full((SMALL_ELEMS,), float(rank + 1 + i % 7), device=device)
             for i in range(SMALL_COUNT)]
    large = [torch.full((LARGE_ELEMS,), float(rank + 1), device=device)]
    return {"small": small, "large": large, "mixed": small + large}[workload]


def _peer_fns(hvd, dist):
    import torch
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def spark_dl(ts, tag):
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"{tag}.{i}")
                   for i, t in enumerate(ts)]
        for h in handles:
            hvd.synchronize(h)

    def spark_dl_batch(ts, tag):
        from spark_dl.torch._async_ops import batched_allreduce_async_

        names = [f"{tag}.{i}" for i in range(len(ts))]
        hvd.synchronize(batched_allreduce_async_(ts, names, hvd.Sum, 1.0, 1.0,
                                                 hvd.global_process_set))

    def spark_dl_group(ts, tag):
        hvd.grouped_allreduce_(ts, op=hvd.Sum, name=tag)

    def nccl_each(ts, tag):
        for t in ts:
            dist.all_reduce(t)

    def nccl_flat(ts, tag):
        flat = _flatten_dense_tensors(ts)
        dist.all_reduce(flat)
        for t, r in zip(ts, _unflatten_dense_tensors(flat, ts)):
            t.copy_(r)

    del torch
    return {"spark_dl": spark_dl, "spark_dl_batch": spark_dl_batch,
            "spark_dl_group": spark_dl_group, "nccl_each": nccl_each, "nccl_flat": nccl_flat}


def _allreduce_bench(args, hvd, dist, device):
    import torch

    fns = _peer_fns(hvd, dist)
    rank, size = hvd.rank(), hvd.size()
    results, skipped = {}, {}
    for workload in WORKLOADS:
        # Correctness first: every peer must give nccl_flat's result.
        reference = _tensors(workload, device, rank)
        fns["nccl_flat"](reference, "ref")
        peers = []
        for peer in PEERS:
            ts = _tensors(workload, device, rank)
            try:
                fns[peer](ts, f"check.{workload}.{peer}")
            except Exception as e:  # the core refuses CUDA tensors: report, do not time
                skipped[peer] = f"{type(e).__name__}: {e}"
                continue
            torch.cuda.synchronize()
            bad = [i for i, (a, b) in enumerate(zip(ts, reference)) if not torch.equal(a, b)]
            if bad:
                raise AssertionError(f"{peer} {workload}: tensors {bad[:5]} differ from "
                                     "nccl_flat's result")
            peers.append(peer)
        times = {p: [] for p in peers}
        for it in range(args.warmup + args.iters):
            order = peers[it % len(peers):] + peers[:it % len(peers)]
            for peer in order:
                ts = _tensors(workload, device, rank)
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                fns[peer](ts, f"{workload}.{peer}")  # stable names, as training steps have
                torch.cuda.synchronize()
                if it >= args.warmup:
                    times[peer].append(time.perf_counter() - start)
        results[workload] = {p: _percentiles(ts) for p, ts in times.items()}
    return {"size": size, "allreduce_s": results, "not_measured": skipped}


def _kernel_bench(args, device):
    import torch

    from spark_dl import _core

    def timed(fn, reps=args.iters):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    srcs = [torch.randn(SMALL_ELEMS, device=device) for _ in range(SMALL_COUNT)]
    dsts = [torch.empty_like(s) for s in srcs]
    flat_src = torch.randn(SMALL_COUNT * SMALL_ELEMS, device=device)
    flat_dst = torch.empty_like(flat_src)
    moved = 2 * flat_src.numel() * 4  # bytes read + written

    def each():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    rows = {"contiguous copy_": timed(lambda: flat_dst.copy_(flat_src)),
            "_foreach_copy_": timed(lambda: torch._foreach_copy_(dsts, srcs)),
            "200 x copy_": timed(each)}
    pack = getattr(_core, PACK_BINDING, None)
    if pack is not None:
        rows["spark_dl pack"] = timed(lambda: pack(srcs, flat_dst, False, 1.0))
        rows["spark_dl unpack"] = timed(lambda: pack(dsts, flat_src, True, 1.0))
        missing = None
    else:
        missing = (f"spark_dl._core has no {PACK_BINDING}: the pack/unpack kernels' test "
                   "binding is not built into this core")
    return {"bytes_moved": moved,
            "gb_per_s": {k: moved / s / 1e9 for k, s in rows.items()},
            "pack_not_measured": missing}


def worker(args):
    import torch
    import torch.distributed as dist

    import spark_dl.torch as hvd

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    os.environ.update(RANK=str(hvd.rank()), WORLD_SIZE=str(hvd.size()))
    dist.init_process_group("nccl", device_id=device)
    try:
        result = _allreduce_bench(args, hvd, dist, device)
        result["device"] = torch.cuda.get_device_name(device)
        result["kernels"] = _kernel_bench(args, device) if hvd.rank() == 0 else None
    finally:
        dist.destroy_process_group()
        hvd.shutdown()
    if hvd.rank() == 0:
        print(MARK + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver side

def _report(result):
    mode = " (spark_dl: SDL_HIERARCHICAL_ALLREDUCE=1)" if result.get("hierarchical_allreduce") \
        else ""
    print(f"\n{result['device']}, {result['size']} rank(s){mode}; allreduce of float32 CUDA "
          "tensors, ms per step (median [p10, p90])\n")
    peers = [p for p in PEERS if p not in result["not_measured"]]
    print("| workload | " + " | ".join(peers) + " |")
    print("|---|" + "---|" * len(peers))
    for workload, rows in result["allreduce_s"].items():
        cells = [f"{rows[p]['median'] * 1e3:.3f} [{rows[p]['p10'] * 1e3:.3f}, "
                 f"{rows[p]['p90'] * 1e3:.3f}]" for p in peers]
        print(f"| {workload} | " + " | ".join(cells) + " |")
    for peer, why in result["not_measured"].items():
        print(f"\nNOT MEASURED {peer}: {why}")
    for line in _target_lines(result):
        print(line)
    k = result["kernels"]
    print(f"\nCopy bandwidth, {SMALL_COUNT} x 16 KiB ({k['bytes_moved'] / 1e6:.1f} MB read + "
          "written), GB/s:\n")
    for name, gbs in k["gb_per_s"].items():
        print(f"- {name}: {gbs:.1f}")
    if k["pack_not_measured"]:
        print(f"\nNOT MEASURED pack/unpack: {k['pack_not_measured']}")
    else:
        roof = k["gb_per_s"]["contiguous copy_"]
        for name in ("spark_dl pack", "spark_dl unpack"):
            share = k["gb_per_s"][name] / roof
            print(f"{name}: {share:.0%} of the contiguous copy's bandwidth (target >= 50% -> "
                  f"{'met' if share >= 0.5 else 'NOT met'})")


def _target_lines(result):
    """Per workload: the fastest spark_dl form against the faster torch.distributed NCCL
    form, medians of the same run (target: at least as fast, ratio >= 1)."""
    lines = [""]
    for workload, rows in result["allreduce_s"].items():
        ours = {p: r["median"] for p, r in rows.items() if p.startswith("spark_dl")}
        theirs = {p: r["median"] for p, r in rows.items() if p.startswith("nccl")}
        if not ours or not theirs:
            continue
        best_ours = min(ours, key=ours.get)
        best_theirs = min(theirs, key=theirs.get)
        ratio = theirs[best_theirs] / ours[best_ours]
        lines.append(f"{workload}: {best_ours} {ratio:.2f}x {best_theirs} (time ratio; target "
                     f">= 1.0 -> {'met' if ratio >= 1.0 else 'NOT met'})")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=0, help="ranks (default: one per GPU)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--hierarchical", action="store_true",
                        help="run spark_dl with SDL_HIERARCHICAL_ALLREDUCE=1 (per-host NCCL "
                        "reduce-scatter/allgather around the CPU transport; with SDL_HOST_ID "
                        "unset every rank is on one host)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False)")
    np_ = args.np or max(1, torch.cuda.device_count())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    if args.hierarchical:
        env["SDL_HIERARCHICAL_ALLREDUCE"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(np_), sys.executable,
           os.path.abspath(__file__), "--worker", "--iters", str(args.iters),
           "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if MARK in ln]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        sys.exit(f"benchmarks/gpu.py: the job failed (exit {proc.returncode})")
    result = json.loads(lines[-1].split(MARK, 1)[1])
    result["hierarchical_allreduce"] = bool(args.hierarchical)
    _report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if result["not_measured"] or result["kernels"]["pack_not_measured"]:
        sys.exit(3)  # loud: part of the comparison is missing (see NOT MEASURED above)


if __name__ == "__main__":
    main()
