"""The README demo's start-up, against issue 17's target: the first training step within
10 s of ``fit()`` being called.

    .venv/bin/python benchmarks/demo.py               # 5 runs
    .venv/bin/python benchmarks/demo.py --runs 9 --json out.json

Runs ``examples/spark/torch_estimator_demo.py --timings`` ``--runs`` times, each in a fresh
Python process and Spark application (as ``scripts/demo.sh`` does: ``SPARK_CONF_DIR=conf``,
the executors on this interpreter), and prints per run and as medians (min-max): the
seconds from ``fit()`` to prepared data, to the launch of the training job, to the phases
of rank 0's worker (process started, framework imported, spark_dl initialized, set up:
model and optimizer state broadcast, loaders open) and to the end of the first training
step. There is no peer: the target is absolute, so the machine's load matters; the script
prints the load average before each run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 10.0
PHASES = [("data ready", "prepare_s"), ("job launched", "launch_s"),
          ("worker started", "start"), ("framework imported", "imported"),
          ("spark_dl initialized", "initialized"), ("set up", "ready"),
          ("first step done", "first_step_s")]


def one_run() -> dict:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               SPARK_CONF_DIR=os.environ.get("SPARK_CONF_DIR", os.path.join(ROOT, "conf")))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "spark",
                                                       "torch_estimator_demo.py"), "--timings"],
                         env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("timings: "):
            t = json.loads(line[len("timings: "):])
            row = dict(t, **t.pop("worker_phases_s"))
            return {name: row.get(key) for name, key in PHASES}
    raise RuntimeError(f"the demo printed no timings (exit {out.returncode}):\n"
                       f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the runs to this file")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        started = time.time()
        run = one_run()
        runs.append(run)
        print(f"run {i + 1}: load {load:.2f}, first step after {run['first step done']:.1f}s "
              f"(data ready after {run['data ready']:.1f}s; {time.time() - started:.0f}s "
              "in all)", flush=True)
    print("\n| seconds from fit() | median | min-max |")
    print("| --- | ---: | ---: |")
    for name, _ in PHASES:
        values = [r[name] for r in runs if r[name] is not None]
        if values:
            print(f"| {name} | {statistics.median(values):.2f} | "
                  f"{min(values):.2f}-{max(values):.2f} |")
    first = statistics.median(r["first step done"] for r in runs)
    print(f"\nfirst training step: median {first:.1f}s against the target of "
          f"{TARGET_S:.0f}s: {'met' if first <= TARGET_S else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
