"""The flight recorder's cost when nothing fails: fusion benchmark steps, recorder on vs off.

    PYTHONPATH=. .venv/bin/python benchmarks/flight_recorder.py            # 6 rounds
    PYTHONPATH=. .venv/bin/python benchmarks/flight_recorder.py --quick

One step is the fusion benchmark's "fused" step (benchmarks/fusion.py): --tensors float32
tensors of --elements elements, each submitted with allreduce_async_ under the same names
every step, then every handle waited on; the recorder sees every tensor (taken in,
negotiated, started, done). The ring's size is fixed at init, so on and off are separate
2-rank sdlrun jobs (SDL_FLIGHT_RECORDER_SIZE=256 vs 0, shared memory), alternating within
each round (the order flips every round). Printed: the median step time of each job, the
median over rounds per setting, and the on/off ratio of each round (median and spread):
on a loaded machine the spread between rounds is the noise floor the ratio must stay in.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import _harness as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SDL_FR_BENCH "


def worker(args):
    import spark_dl.numpy as sdl

    sdl.init()
    step = H.fusion_step(sdl, args.tensors, args.elements)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if sdl.rank() == 0:
        print(MARK + str(statistics.median(times)), flush=True)
    sdl.shutdown()


def run_job(size, args):
    env = dict(os.environ, SDL_FLIGHT_RECORDER_SIZE=str(size), SDL_SHM="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", "2", sys.executable,
           os.path.abspath(__file__), "--worker", "--tensors", str(args.tensors),
           "--elements", str(args.elements), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if MARK in line:
            return float(line.split(MARK, 1)[1])
    raise RuntimeError(f"job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--elements", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 60 steps")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 60, 10
    on, off, ratios = [], [], []
    for r in range(args.rounds):
        order = (256, 0) if r % 2 == 0 else (0, 256)
        got = {size: run_job(size, args) for size in order}
        on.append(got[256])
        off.append(got[0])
        ratios.append(got[256] / got[0])
        print(f"round {r + 1}: on {got[256] * 1e3:.3f} ms/step, off {got[0] * 1e3:.3f} ms/step, "
              f"on/off {ratios[-1]:.3f}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{args.tensors} x {args.elements * 4 // 1024} KiB allreduces per step, 2 ranks, "
          f"{args.rounds} rounds x {args.steps} steps; load average {load:.2f} on "
          f"{os.cpu_count()} cores")
    print(f"recorder on (256):  median {statistics.median(on) * 1e3:.3f} ms/step")
    print(f"recorder off (0):   median {statistics.median(off) * 1e3:.3f} ms/step")
    print(f"on/off ratio:       median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} .. {max(ratios):.3f}")


if __name__ == "__main__":
    main()
