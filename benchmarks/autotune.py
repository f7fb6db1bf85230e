"""Autotune vs the default knobs on the fusion benchmark's workload.

    PYTHONPATH=. .venv/bin/python benchmarks/autotune.py            # 4 rounds
    PYTHONPATH=. .venv/bin/python benchmarks/autotune.py --quick

One step is the fusion benchmark's "fused" step (benchmarks/fusion.py): --tensors float32
tensors of --elements elements, each submitted with allreduce_async_ under the same names
every step, then every handle waited on. Each round runs two 2-rank sdlrun jobs (shared
memory), alternating (the order flips every round):

  defaults   the knobs' defaults, no autotune;
  autotuned  SDL_AUTOTUNE=1 with its defaults (3 warm-up + 20 samples of 50 working
             cycles); the job steps until rank 0 reports tuning done (the ranks agree on
             that through a one-element allreduce every 10 steps), then times --steps
             steps with the chosen values.

With --netns RATE (root only) the jobs run on 2 simulated hosts x 2 ranks instead
(tests/cluster/netns.py: network namespaces joined by links shaped to RATE, as in
benchmarks/multihost.py; SDL_HIERARCHICAL=1, the default): there autotune also tunes
hierarchical allreduce (on: shared memory in each host and Gloo between the hosts'
leaders; off: Gloo between all ranks).

Printed per round: both jobs' median step time, the ratio autotuned/defaults, the chosen
values and how many steps tuning took; then medians over rounds and the ratio's range. The
autotune values are fixed once chosen, so the two settings run in separate jobs; the spread
of the ratio across rounds is the noise floor on a loaded machine.
"""

import argparse
import importlib.util
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

import _harness as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SDL_AUTOTUNE_BENCH "


def worker(args):
    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    step = H.fusion_step(sdl, args.tensors, args.elements)

    for _ in range(args.warmup):
        step()
    tuning_steps = 0
    if os.environ.get("SDL_AUTOTUNE") == "1":
        while True:
            for _ in range(10):
                step()
            tuning_steps += 10
            done = sdl.rank() == 0 and sdl.autotune_state()["applied"]["done"]
            flag = sdl.allreduce(np.array([1.0 if done else 0.0], np.float32), op=sdl.Max,
                                 name="autotune.done")
            if flag[0] > 0:
                break
            if tuning_steps > 20000:
                raise RuntimeError("autotune did not finish within 20000 steps")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if sdl.rank() == 0:
        applied = sdl.autotune_state()["applied"]
        print(MARK + json.dumps({"median": statistics.median(times), "tuning_steps": tuning_steps,
                                 "applied": applied}), flush=True)
    sdl.shutdown()


def run_job(tuned, args):
    env = dict(os.environ, SDL_SHM="1")
    env.pop("SDL_AUTOTUNE", None)
    env.pop("HOROVOD_AUTOTUNE", None)
    if tuned:
        env["SDL_AUTOTUNE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", "2", sys.executable,
           os.path.abspath(__file__), "--worker", "--tensors", str(args.tensors),
           "--elements", str(args.elements), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in p.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise RuntimeError(f"job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def netns_cluster(rate):
    """2 namespace hosts with shaped links (tests/cluster/netns.py, imported by path)."""
    spec = importlib.util.spec_from_file_location(
        "netns", os.path.join(ROOT, "tests", "cluster", "netns.py"))
    netns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netns)
    cluster = netns.Cluster(2)
    for host in cluster.hosts:
        host.shape(rate=rate)
    return cluster


def run_netns_job(tuned, args, cluster, per_host=2):
    """One job of 2 x per_host ranks, each started on its namespace host (bounded wait)."""
    from spark_dl.runner.kvstore import KVStoreServer

    hosts = cluster.hosts
    secret = secrets.token_bytes(32)
    server = KVStoreServer(secret, host=cluster.gateway())
    port = server.start()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SDL_", "HOROVOD_"))}
    base["PYTHONPATH"] = os.pathsep.join([ROOT, base.get("PYTHONPATH", "")])
    base.update(SDL_RENDEZVOUS_ADDR=cluster.gateway(), SDL_RENDEZVOUS_PORT=str(port),
                SDL_SECRET_KEY=secret.hex(), SDL_JOB_ID=secrets.token_hex(8),
                SDL_CONTROLLER="gloo", SDL_SIZE=str(len(hosts) * per_host),
                SDL_LOCAL_SIZE=str(per_host), SDL_CROSS_SIZE=str(len(hosts)),
                SDL_START_TIMEOUT="60", SDL_HIERARCHICAL="1", PYTHONUNBUFFERED="1")
    if tuned:
        base["SDL_AUTOTUNE"] = "1"
    procs, logs = [], []
    try:
        for h, host in enumerate(hosts):
            for local in range(per_host):
                rank = h * per_host + local
                env = dict(base, SDL_RANK=str(rank), SDL_LOCAL_RANK=str(local),
                           SDL_CROSS_RANK=str(h), SDL_HOSTNAME=host.address)
                log = os.path.join(cluster._tmp, f"autotune.{int(tuned)}.rank{rank}.log")
                logs.append(log)
                with open(log, "w") as f:
                    procs.append(host.popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", "--tensors",
                         args.tensors, "--elements", args.elements, "--steps", args.steps,
                         "--warmup", args.warmup], env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
            p.wait(timeout=10)
        for host in hosts:
            host.kill_all()
        server.stop()
    with open(logs[0], errors="replace") as f:
        text = f.read()
    for line in text.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise RuntimeError(f"job failed (exits {[p.returncode for p in procs]}):\n{text[-3000:]}")


def describe(applied):
    hier = (f", hierarchical allreduce {'on' if applied['hierarchical_allreduce'] else 'off'}"
            if applied["hierarchical_tuned"] else "")
    return (f"fusion {applied['fusion_threshold'] / 2**20:.2f} MiB, cycle "
            f"{applied['cycle_time_ms']:g} ms, cache {'on' if applied['response_cache'] else 'off'}"
            + hier)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--elements", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 60 steps")
    ap.add_argument("--netns", metavar="RATE",
                    help="2 simulated hosts x 2 ranks on links of RATE (e.g. 1gbit; root only)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 60, 10
    base, tuned, ratios = [], [], []
    start = time.time()
    cluster = netns_cluster(args.netns) if args.netns else None
    try:
        rounds(args, cluster, base, tuned, ratios)
    finally:
        if cluster is not None:
            cluster.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    where = (f"2 simulated hosts x 2 ranks, links of {args.netns}" if args.netns
             else "2 ranks (shared memory)")
    print(f"\n{args.tensors} x {args.elements * 4 // 1024} KiB allreduces per step, {where}, "
          f"{args.rounds} rounds x {args.steps} steps, {time.time() - start:.0f} s; "
          f"load average {load:.2f} on {os.cpu_count()} cores")
    print(f"defaults:   median {statistics.median(base) * 1e3:.3f} ms/step "
          f"(range {min(base) * 1e3:.3f} .. {max(base) * 1e3:.3f})")
    print(f"autotuned:  median {statistics.median(tuned) * 1e3:.3f} ms/step "
          f"(range {min(tuned) * 1e3:.3f} .. {max(tuned) * 1e3:.3f})")
    print(f"autotuned/defaults: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} .. {max(ratios):.3f} (below 1: autotune faster)")


def rounds(args, cluster, base, tuned, ratios):
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {t: run_netns_job(t, args, cluster) if cluster else run_job(t, args)
               for t in order}
        base.append(got[False]["median"])
        tuned.append(got[True]["median"])
        ratios.append(tuned[-1] / base[-1])
        print(f"round {r + 1}: defaults {base[-1] * 1e3:.3f} ms/step, autotuned "
              f"{tuned[-1] * 1e3:.3f} ms/step, autotuned/defaults {ratios[-1]:.3f}; chose "
              f"{describe(got[True]['applied'])} after {got[True]['tuning_steps']} steps",
              flush=True)


if __name__ == "__main__":
    main()
