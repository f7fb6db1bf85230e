"""Cost as the job grows: negotiation and a small allreduce's latency at 2 to 32 ranks.

    PYTHONPATH=. .venv/bin/python benchmarks/scale.py                   # 2,4,8,16,32 ranks
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py --ranks 2,4,8 --quick
    PYTHONPATH=. .venv/bin/python benchmarks/scale.py --transports gloo --cache on,off

One sdlrun job per (ranks, transport, response cache) on this machine, oversubscribed when
there are more ranks than cores: the curve, not the absolute numbers, is what carries over
to many hosts (docs/benchmarks.md fits a cost model to it). Each rank times, back to back
under fixed names:

  negotiation   an allreduce of an empty float32 array: one negotiation cycle and the
                dispatch, no data (what every collective pays before moving bytes);
  4 KiB         an in-place 4 KiB float32 allreduce (cycle + data).

Transports: ``shm`` (every rank on one host: shared memory), ``gloo`` (``SDL_SHM=0``: Gloo
TCP for every exchange, as between hosts), ``hier`` (simulated hosts of --per-host ranks,
``SDL_HOST_ID`` per rank: shared memory within a host, Gloo TCP between one leader per
host). Response cache: ``on`` (default capacity: steady-state cycles exchange one bit
vector) or ``off`` (``SDL_CACHE_CAPACITY=0``: every cycle is a full negotiation, each rank's
request list to every rank, then rank 0's responses to all). Rank 0's clock; the tables
give medians (and p90) over all calls.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import _harness as H

TRANSPORT_ENV = {"shm": {"SDL_SHM": "1"}, "gloo": {"SDL_SHM": "0", "SDL_CONTROLLER": "gloo"},
                 "hier": {"SDL_SHM": "1", "SDL_CONTROLLER": "gloo"}}
CACHE_ENV = {"on": {}, "off": {"SDL_CACHE_CAPACITY": "0"}}
COUNTERS = ("cycles", "full_negotiations", "cache_hits", "collectives")


# ----------------------------------------------------------------------------- worker side

def worker(args):
    import numpy as np

    if args.per_host:  # simulated hosts: this rank's identity from its rank (set before init)
        rank = int(os.environ["SDL_RANK"])
        os.environ["SDL_HOST_ID"] = f"simulated-host-{rank // args.per_host}"
    import spark_dl.numpy as sdl

    sdl.init()
    out = {"transport": sdl.transport(), "size": sdl.size()}
    clock = time.perf_counter
    for label, elements in (("negotiation", 0), ("4KiB", 1024)):
        buf = np.ones(elements, dtype=np.float32)
        sdl.allreduce_(buf, op=sdl.Sum, name=label)
        if elements and not (buf == sdl.size()).all():
            raise AssertionError(f"{label}: wrong sum {buf[:4]}")
        buf.fill(0)
        for _ in range(args.warmup):
            sdl.allreduce_(buf, op=sdl.Sum, name=label)
        sdl.barrier()
        before = sdl.counters()
        samples = []
        for _ in range(args.iters):
            t0 = clock()
            sdl.allreduce_(buf, op=sdl.Sum, name=label)
            samples.append(clock() - t0)
        after = sdl.counters()
        out[label] = {"samples": samples,
                      "counters": {k: (after[k] - before[k]) / args.iters for k in COUNTERS}}
    if sdl.rank() == 0:
        H.print_result(out)
    sdl.shutdown()


# ----------------------------------------------------------------------------- driver side

def run_job(args, n, transport, cache):
    env = H._base_env()
    env.update(TRANSPORT_ENV[transport])
    env.update(CACHE_ENV[cache])
    wargs = ["--worker", "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if transport == "hier":
        wargs += ["--per-host", str(args.per_host)]
    cmd = ([sys.executable, "-m", "spark_dl.runner", "-np", str(n), sys.executable,
            os.path.abspath(__file__)] + wargs)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    result = H.parse_result(p.stdout) if p.returncode == 0 else None
    if result is not None:
        return result
    raise RuntimeError(f"{n} ranks over {transport}, cache {cache}: job failed (exit "
                       f"{p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def driver(args):
    ranks = [int(x) for x in args.ranks.split(",")]
    transports = args.transports.split(",")
    caches = args.cache.split(",")
    jobs = [(n, t, c) for n in ranks for t in transports for c in caches
            if not (t == "hier" and n <= args.per_host)]
    machine, load_before = H.describe_machine(), H.load_average()
    results = {}
    for r in range(args.rounds):
        for job in jobs:
            idle = H.wait_for_idle(args.wait_idle) if args.wait_idle else H.cpu_idle_fraction(0.5)
            t0 = time.perf_counter()
            results.setdefault(job, []).append(run_job(args, *job))
            print(f"  round {r + 1}/{args.rounds}: {job[0]} ranks, {job[1]}, cache {job[2]}: "
                  f"{time.perf_counter() - t0:.1f} s (CPUs {idle:.0%} idle before)",
                  file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": [[list(k), v] for k, v in results.items()]}, f)
    print(f"## scale: negotiation and 4 KiB allreduce latency by ranks ({args.rounds} round(s) "
          f"x {args.iters} calls per job)\n")
    print(f"machine: {machine} (ranks beyond the cores are oversubscribed); load average at "
          f"the start: {load_before}, at the end: {H.load_average()}")
    print(f"spark_dl: {H.git_revision()}\n")
    rows = []
    for (n, t, c), runs in results.items():
        cells = [str(n), t + (f" ({args.per_host}/host)" if t == "hier" else ""), c]
        for label in ("negotiation", "4KiB"):
            xs = H.pooled(r[label]["samples"] for r in runs)
            cells += [f"{H.median(xs) * 1e6:.0f}", f"{H.percentile(xs, 90) * 1e6:.0f}"]
        cnt = runs[-1]["4KiB"]["counters"]
        cells.append(f"{cnt['cycles']:.2f} / {cnt['full_negotiations']:.2f}")
        rows.append(cells)
    print(H.markdown_table(["ranks", "transport", "cache", "negotiation median us", "p90",
                            "4 KiB median us", "p90", "cycles / full negotiations per call"],
                           rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split(
        "\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--per-host", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ranks", default="2,4,8,16,32", help="rank counts (default 2,4,8,16,32)")
    p.add_argument("--transports", default="shm,gloo,hier", help="shm, gloo, hier")
    p.add_argument("--cache", default="on,off", help="response cache: on, off")
    p.add_argument("--hier-per-host", dest="hier_per_host", type=int, default=4,
                   help="ranks per simulated host for the hier transport (default 4)")
    p.add_argument("--rounds", type=int, default=1, help="jobs per configuration (default 1)")
    p.add_argument("--iters", type=int, default=300, help="timed calls per job and size")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--timeout", type=int, default=600, help="seconds per job")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each job, wait up to S s for the CPUs to be 80%% idle")
    p.add_argument("--json", help="also save the raw results here")
    p.add_argument("--quick", action="store_true", help="fewer calls per job")
    args = p.parse_args()
    if args.quick:
        args.iters, args.warmup = min(args.iters, 100), min(args.warmup, 10)
    if args.worker:
        worker(args)
    else:
        args.per_host = args.hier_per_host
        driver(args)


if __name__ == "__main__":
    main()
