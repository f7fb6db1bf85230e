"""Data-parallel training throughput: spark_dl's DistributedOptimizer against torch
DistributedDataParallel (gloo backend) on the same model, in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/torch_ddp.py                  # 3 jobs per transport
    PYTHONPATH=. .venv/bin/python benchmarks/torch_ddp.py --rounds 1 --iters 30
    PYTHONPATH=. .venv/bin/python benchmarks/torch_ddp.py --width 64       # 4x the gradient bytes

How it measures. One ``sdlrun -np 2`` job holds every peer: each rank initializes spark_dl
and a torch.distributed gloo process group, and builds four replicas of
examples/pytorch_synthetic_benchmark.py's SmallCNN (same initial weights, SGD with momentum):

================  =====================================================================
spark_dl          ``DistributedOptimizer`` as Horovod users write it: one allreduce per
                  gradient, started by its hook, fused by the core; default knobs
spark_dl_grouped  ``DistributedOptimizer(groups=1)``: every gradient in one grouped
                  allreduce, started when the last gradient is ready (DDP's single
                  bucket, for this model)
spark_dl_bg       the first with ``set_knob("inline_cycles", False)`` while it runs: the
                  background thread runs every cycle (the same-job before/after of
                  issue 18's inline cycles)
ddp               ``DistributedDataParallel`` over the gloo process group (TCP loopback)
local             no communication at all: every rank trains alone (the compute-only
                  ceiling under the same CPU contention)
================  =====================================================================

Timed iterations (``--batches`` steps each, default one) alternate between the peers, in an
order that rotates every iteration, so the noise of a shared machine hits every peer alike
(on a loaded 2-core machine, interleaving whole jobs or multi-second stretches instead moved
the ratios by +-30%). While ddp
and local run, spark_dl's background thread is parked (cycle time 1 s), so they do not pay for
it; spark_dl's own iterations run with its defaults. Throughput is images per second per rank
(rank 0's clock, as Horovod's benchmark reports), median over iterations and jobs. The run
ends by comparing the replicas across ranks: a peer whose ranks diverged fails the run.

Jobs run for each ``--transports`` value: ``shm`` (spark_dl's default on one host) and
``gloo`` (``SDL_SHM=0``: spark_dl over Gloo TCP too, the same wire as DDP).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _harness as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

RESULT_MARK = "SDL_TORCH_BENCH "
PEERS = ("spark_dl", "spark_dl_grouped", "spark_dl_bg", "ddp", "local")
LABELS = {"spark_dl": "spark_dl DistributedOptimizer", "ddp": "torch DDP (gloo)",
          "spark_dl_grouped": "spark_dl DistributedOptimizer(groups=1)",
          "spark_dl_bg": "spark_dl DistributedOptimizer, inline cycles off",
          "local": "no communication (ceiling)"}
SPARK_DL_PEERS = ("spark_dl", "spark_dl_grouped", "spark_dl_bg")
PARKED_CYCLE_MS = 1000.0


# ----------------------------------------------------------------------------- worker side

def _setups(args, hvd):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from pytorch_synthetic_benchmark import SmallCNN

    def model():
        torch.manual_seed(0)
        return SmallCNN(width=args.width)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    out = {}
    m = model()
    compression = getattr(hvd.Compression, args.compression)
    out["spark_dl"] = (m, hvd.DistributedOptimizer(sgd(m.parameters()),
                                                   named_parameters=m.named_parameters(),
                                                   compression=compression))
    m = model()
    out["spark_dl_grouped"] = (m, hvd.DistributedOptimizer(
        sgd(m.parameters()), compression=compression, groups=1,
        named_parameters=[("grouped." + n, q) for n, q in m.named_parameters()]))
    m = model()  # the first peer's setup with inline_cycles off while it runs (see run())
    out["spark_dl_bg"] = (m, hvd.DistributedOptimizer(
        sgd(m.parameters()), compression=compression,
        named_parameters=[("bg." + n, q) for n, q in m.named_parameters()]))
    ddp = DistributedDataParallel(model())
    out["ddp"] = (ddp, sgd(ddp.parameters()))
    m = model()
    out["local"] = (m, sgd(m.parameters()))
    return out


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import spark_dl.torch as hvd
    from spark_dl.common.basics import counters, set_knob, transport
    from spark_dl.common.knobs import value as knob_value

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    setups = _setups(args, hvd)
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (args.batch_size,), generator=g)
    default_cycle = knob_value("cycle_time_ms")
    default_inline = knob_value("inline_cycles")

    def run(peer, steps):
        set_knob("cycle_time_ms", default_cycle if peer in SPARK_DL_PEERS else PARKED_CYCLE_MS)
        set_knob("inline_cycles", default_inline and peer != "spark_dl_bg")
        dist.barrier()  # start together (gloo: leaves spark_dl's thread alone)
        model, opt = setups[peer]
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            opt.step()
        return time.perf_counter() - t0

    for peer in PEERS:
        run(peer, args.warmup)
    rates = {p: [] for p in PEERS}
    collectives = {p: 0 for p in SPARK_DL_PEERS}
    n = len(PEERS)
    for it in range(args.iters):
        for peer in PEERS[it % n:] + PEERS[:it % n]:
            before = counters()["collectives"]
            seconds = run(peer, args.batches)
            rates[peer].append(args.batch_size * args.batches / seconds)
            if peer in collectives:
                collectives[peer] += counters()["collectives"] - before
    set_knob("cycle_time_ms", default_cycle)

    for peer in SPARK_DL_PEERS + ("ddp",):  # the replicas must have stayed identical
        flat = torch.cat([p.detach().reshape(-1) for p in setups[peer][0].parameters()])
        every = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(every, flat)
        if not all(torch.equal(every[0], e) for e in every):
            raise AssertionError(f"{peer}: replicas diverged across ranks")
    info = {"transport": transport(), "size": size, "torch": torch.__version__,
            "parameters": sum(p.numel() for p in setups["local"][0].parameters()),
            "gradient_tensors": len(list(setups["local"][0].parameters())),
            "collectives_per_step": {p: c / (args.iters * args.batches)
                                     for p, c in collectives.items()},
            "rates": rates}
    dist.destroy_process_group()
    hvd.shutdown()
    if rank == 0:
        H.print_result(info, RESULT_MARK)


# ----------------------------------------------------------------------------- driver side

def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, transport, timeout=900):
    """One 2-rank sdlrun job; returns rank 0's result dict."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
    env["SDL_SHM"] = "1" if transport == "shm" else "0"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", "--batch-size", str(args.batch_size),
           "--batches", str(args.batches), "--iters", str(args.iters), "--warmup",
           str(args.warmup), "--threads", str(args.threads), "--width", str(args.width)]
    cmd += ["--compression", args.compression]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    result = H.parse_result(p.stdout, RESULT_MARK) if p.returncode == 0 else None
    if result is not None:
        return result
    raise RuntimeError(f"{transport} job failed (exit {p.returncode}):\n"
                       f"{(p.stdout + p.stderr)[-4000:]}")


def report(results, args):
    first = next(iter(results.values()))[0]
    lines = [f"SmallCNN, {first['parameters'] / 1e6:.2f} M parameters "
             f"({first['gradient_tensors']} gradient tensors, "
             f"{first['parameters'] * 4 / 2**20:.1f} MiB float32), batch {args.batch_size} per "
             f"rank, {args.threads} torch thread(s) per rank, {args.np} ranks"
             f"{'' if args.compression == 'none' else ', Compression.' + args.compression}"
             f"; median over "
             f"{args.rounds} job(s) x {args.iters} iterations x {args.batches} steps.", "",
             "| spark_dl transport | peer | img/s per rank | img/s total | vs DDP | "
             "vs no communication |",
             "|:---|:---|---:|---:|---:|---:|"]
    for transport, jobs in results.items():
        med = {p: statistics.median([x for j in jobs for x in j["rates"][p]]) for p in PEERS}
        for p in PEERS:
            lines.append(f"| {transport} | {LABELS[p]} | {med[p]:.1f} | {med[p] * args.np:.1f} | "
                         f"{med[p] / med['ddp']:.2f} | {med[p] / med['local']:.2f} |")
    lines.append("")
    for p in SPARK_DL_PEERS:
        cps = [j["collectives_per_step"][p] for jobs in results.values() for j in jobs]
        lines.append(f"{LABELS[p]}: {statistics.median(cps):.2f} collectives per step "
                     f"(after fusion)  ")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--transports", default="shm,gloo", help="spark_dl transports: shm, gloo")
    p.add_argument("--rounds", type=int, default=3, help="jobs per transport")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=1, help="steps per timed iteration")
    p.add_argument("--iters", type=int, default=100, help="timed iterations per peer and job")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per peer first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--width", type=int, default=32, help="SmallCNN width (gradient size)")
    p.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                   help="spark_dl peers: gradient compression (Compression.<name>)")
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if any(t not in ("shm", "gloo") for t in transports):
        raise SystemExit("--transports takes shm and/or gloo")
    print(f"machine: {H.describe_machine()}", file=sys.stderr, flush=True)
    results = {t: [] for t in transports}
    for r in range(args.rounds):
        for t in transports:
            t0 = time.perf_counter()
            results[t].append(run_job(args, t))
            print(f"  job {r + 1}/{args.rounds} ({t}) done in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": H.describe_machine(), "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
