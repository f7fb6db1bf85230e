"""Recovery from a worker's death on Spark: ``spark_dl.spark.run_elastic`` on a
``local-cluster[3,1,1024]`` session, the survivors re-form and go on (issue 36; the sdlrun
and torchrun side: benchmarks/elastic.py).

    PYTHONPATH=. .venv/bin/python benchmarks/elastic_spark.py                 # 3 repeats of each
    PYTHONPATH=. .venv/bin/python benchmarks/elastic_spark.py --deaths executor --repeats 5
    PYTHONPATH=. .venv/bin/python benchmarks/elastic_spark.py --json out.json
    PYTHONPATH=. .venv/bin/python benchmarks/elastic_spark.py --report out.json

One Spark session (3 executors of one core and 700 MiB each, the executors' Python is this
interpreter) runs every job: ``run_elastic(fn, num_proc=3, min_num_proc=2)``, one Spark job
of 3 tasks each hosting a worker. The workers train benchmarks/elastic.py's model (an MLP,
SGD with momentum, ``TorchState`` with an ``ElasticSampler``, a commit after every step),
and worker ``2.0`` (task 2, first attempt) dies at the start of step ``--die-at``, after
writing the wall-clock time of its death to a file. Two kinds of death, alternating:

* **worker**: the worker process SIGKILLs itself. Its task sees the exit at once and
  reports it to the caller (``failed with exit code -9``);
* **executor**: the worker SIGKILLs the executor JVM it runs under (a lost machine). Its
  task dies with it, so the caller only learns of it when the task's heartbeat is missing
  for ``DEAD_AFTER_S`` (3 s): ``is lost``.

Either way the task fails and Spark retries it (on the same executor, or on the executor
that the standalone master starts in place of the killed one); the retry joins the job as
a third worker later. Each job ends (the Spark job too) before the next starts, and the
next waits until the cluster has its 3 executors again.

What is measured, per job: **recovery** = the wall-clock time at which rank 0 completed
its first step in a job of 2, minus the time of the death. The executors run on this host,
so the workers write their time-stamped events (elastic.py's ``Events``) to files in a
shared temporary directory; the caller's log lines are stamped as they arrive. Stages,
each when the last of the two survivors reached it: the caller's report of the death, the
error caught (``restore()``), generation 1 published and joined, the state synced, rank
0's first step; and, after the recovery, when the retried task's worker started and
when it joined (the generation after 1). When it joins, the survivors stop until it has
synced (it imports torch and builds the model after its ``init()``): the report gives
that pause, the gap between rank 0's last step on 2 and its first on 3 (compare it with
the step time). With the default fast steps the job mostly ends before the retry joins;
``--step-sleep`` makes it last. Every job runs under a timeout (``--timeout``: the Spark
jobs are cancelled).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import _harness as H  # noqa: E402  (cheap: standard library only)
import elastic as E  # benchmarks/elastic.py: the model, the events, the death
from elastic import NP, Events, build, die

DEATHS = ("worker", "executor")
LABELS = {"worker": "worker process SIGKILLed (its task reports the exit)",
          "executor": "executor JVM SIGKILLed (heartbeat missing for 3 s)"}
VICTIM = f"{NP - 1}.0"  # task 2's first attempt
# The caller's lines stamped on arrival: (part name, text in the line).
CALLER_MARKS = (("caller saw death", "the others go on"),
                ("generation published", "generation 1:"),
                ("retried task started", f"worker {NP - 1}.1 started"),
                ("retried task joined", "generation 2:"))
# The survivors' stages, in order (each when the last survivor reached it).
STAGES = (("error caught", "error"), ("generation joined", "joined"),
          ("state synced", "synced"))


# ----------------------------------------------------------------------------- worker

def _executor_jvm():
    """The pid of the Spark executor JVM above this process (walks up its parents)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("not under a Spark executor JVM")


def kill_executor(out):
    """Writes the time of death, then SIGKILLs the executor JVM; this worker then ends
    with its task (its stdin closes), as a process on a lost machine would stop."""
    jvm = _executor_jvm()
    with open(os.path.join(out, "death"), "w") as f:
        f.write(repr(time.time()))
    os.kill(jvm, signal.SIGKILL)
    time.sleep(120)


def spark_worker(o):
    """What every task's worker runs (pickled by value: the executors need not find this
    file). ``o``: the options of the job (a dict)."""
    import torch

    import spark_dl.torch as hvd

    wid = os.environ["SDL_ELASTIC_WORKER_ID"]
    args = argparse.Namespace(**o)
    events = Events(os.path.join(args.out, f"events-w{wid}.jsonl"))
    hvd.init()
    model, x, y = build(args, torch)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(x)), shuffle=True, seed=2)

    class TimedState(hvd.elastic.TorchState):
        def restore(self):  # a survivor caught the peer's failure
            events.note("error")
            super().restore()

        def sync(self):  # the new generation formed (and once at the start)
            super().sync()
            events.note("synced")

    def on_reset():
        events.attempt += 1
        events.rank, events.size = hvd.rank(), hvd.size()
        events.note("joined")

    state = TimedState(model, optimizer, sampler=sampler, step=0)
    state.register_reset_callbacks([on_reset])
    events.rank, events.size = hvd.rank(), hvd.size()
    events.note("started")

    @hvd.elastic.run
    def train(state):
        mine = list(state.sampler)
        b = 0
        while state.step < args.steps:
            if state.step == args.die_at and wid == VICTIM:
                (kill_executor if args.death == "executor" else die)(args.out)
            rows = mine[b * args.batch:(b + 1) * args.batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(b, args.batch)
            b += 1
            state.step += 1
            state.commit()
            events.note("step", step=state.step, loss=loss.detach().item())
            if args.step_sleep:
                time.sleep(args.step_sleep)

    train(state)
    events.note("done")


# ----------------------------------------------------------------------------- driver

class Stamped:
    """A text stream for run_elastic's stdout/stderr: every line stamped on arrival."""

    def __init__(self):
        self.lines, self._part = [], ""

    def write(self, text):
        now = time.time()
        whole = (self._part + text).split("\n")
        self._part = whole.pop()
        self.lines.extend((now, line) for line in whole)

    def flush(self):
        pass

    def text(self):
        return "\n".join(line for _, line in self.lines) + self._part


def spark_session(args):
    """local-cluster[3,1,1024]: 3 executors of one core; the executors run this Python and
    find the repository (PYTHONPATH), as tests/spark/test_run_cases.py's sessions do."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = H._base_env()["PYTHONPATH"]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master(f"local-cluster[{NP},1,1024]")
               .appName(f"spark_dl-elastic-bench-{os.getpid()}")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", "1g")
               .config("spark.executor.memory", "700m")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def executors(sc):
    """Executors registered now (the driver is in the memory status too)."""
    return sc._jsc.sc().getExecutorMemoryStatus().size() - 1


def wait_for_executors(sc, timeout):
    """Waits until the cluster has NP executors (a killed one is replaced by the master)."""
    deadline = time.monotonic() + timeout
    while executors(sc) < NP:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {executors(sc)} of {NP} executors after {timeout:g} s")
        time.sleep(0.5)


def run_job(spark, death, args):
    """One run_elastic job with a death of kind ``death``; its measurements."""
    from spark_dl.spark import run_elastic

    sc = spark.sparkContext
    wait_for_executors(sc, args.executor_wait)
    out = tempfile.mkdtemp(prefix=f"sdl-elastic-spark-{death}-", dir=args.tmp)
    opts = dict(out=out, steps=args.steps, die_at=args.die_at, batch=args.batch,
                width=args.width, features=args.features, classes=args.classes, lr=args.lr,
                death=death, step_sleep=args.step_sleep)
    err, stdout = Stamped(), Stamped()
    # run_elastic has no deadline of its own: past --timeout the Spark job is cancelled,
    # which ends run_elastic with a RunError (its tasks, and so its workers, end).
    timer = threading.Timer(args.timeout, sc.cancelAllJobs)
    timer.daemon = True
    timer.start()
    started = time.monotonic()
    try:
        run_elastic(spark_worker, args=(opts,), num_proc=NP, min_num_proc=NP - 1,
                    start_timeout=args.timeout, elastic_timeout=args.timeout,
                    env={"SDL_SHM": "0" if args.gloo else "1"}, stdout=stdout, stderr=err,
                    verbose=2)
        return measure(out, err.lines, err.text() + stdout.text()[-3000:])
    except Exception as e:
        late = " (timed out: jobs cancelled)" if time.monotonic() - started >= args.timeout \
            else ""
        raise RuntimeError(f"{death} job failed{late}: {e}\n{err.text()[-3000:]}\n"
                           f"{stdout.text()[-3000:]}") from e
    finally:
        timer.cancel()
        if args.keep:  # the caller's lines too, stamped
            with open(os.path.join(out, "caller.log"), "w") as f:
                f.writelines(f"{t:.3f} {line}\n" for t, line in err.lines + stdout.lines)
            print(f"  kept {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)


def measure(out, stamped, log):
    with open(os.path.join(out, "death")) as f:
        death = float(f.read())
    events = E._events(out)
    # The survivors: the workers that were there before the death, less the victim (the
    # retried task's worker starts after it, and syncs only when it joins).
    survivors = {e["file"] for e in events if e["t"] < death}
    survivors.discard(f"events-w{VICTIM}.jsonl")
    steps = [e for e in events if e["event"] == "step" and e["rank"] == 0
             and e["size"] == NP - 1 and e["t"] >= death]
    if not steps:
        raise RuntimeError(f"no step of a job of {NP - 1} after the death:\n{log[-4000:]}")
    first = min(steps, key=lambda e: e["t"])
    parts = {"first step (rank 0)": first["t"] - death}
    for label, event in STAGES:
        reached = [min((e["t"] for e in events if e["file"] == f and e["event"] == event
                        and e["t"] >= death), default=None) for f in survivors]
        if reached and None not in reached:
            parts[label] = max(reached) - death
    for label, text in CALLER_MARKS:
        times = [t for t, line in stamped if text in line and t >= death]
        if times:
            parts[label] = times[0] - death
    before = sorted(e["t"] for e in events
                    if e["event"] == "step" and e["attempt"] == 0 and e["rank"] == 0)
    gaps = [b - a for a, b in zip(before, before[1:])]
    # When the retried task's worker joins, the survivors stop training until it has
    # synced: the gap between rank 0's last step of the job of 2 and its first of the job
    # of 3 (None: the job ended first). After the first step on 2: a survivor may note its
    # last step on 3 a moment after the victim wrote the time of its death.
    grown = [e["t"] for e in events if e["event"] == "step" and e["rank"] == 0
             and e["size"] == NP and e["t"] > first["t"]]
    pause = min(grown) - max(e["t"] for e in steps) if grown else None
    return {"recovery": first["t"] - death, "parts": parts, "resumed_at_step": first["step"],
            "join_pause": pause,
            "step_time": statistics.median(gaps) if gaps else None,
            "sizes": sorted({e["size"] for e in events if e["event"] == "step"})}


def report(args, results):
    print(f"## spark_dl.spark.run_elastic: recovery from a worker's death (local-cluster"
          f"[{NP},1,1024], {NP} workers, worker {VICTIM} dies at step {args.die_at} of "
          f"{args.steps})\n")
    print(f"machine: {args.machine}; load average (1/5/15 min) at the start: "
          f"{args.load_before}, at the end: {args.load_after}")
    print(f"spark_dl {args.revision}; pyspark {args.pyspark_version}; "
          f"{'Gloo TCP (SDL_SHM=0)' if args.gloo else 'shared memory (SDL_SHM=1)'}; MLP "
          f"{args.features}-{args.width}-{args.width}-{args.classes}, batch {args.batch} per "
          f"worker; {max(len(r) for r in results.values())} repeat(s), alternating\n")
    rows = []
    for death, rs in results.items():
        step = [r["step_time"] for r in rs if r["step_time"]]
        pauses = [r["join_pause"] for r in rs if r.get("join_pause") is not None]
        rows.append([LABELS[death], E.fmt([r["recovery"] for r in rs]),
                     f"{statistics.median(step) * 1e3:.1f} ms" if step else "-",
                     f"{E.fmt(pauses)} ({len(pauses)} of {len(rs)} jobs)" if pauses else
                     "- (the jobs ended first)"])
    print(H.markdown_table(["death", "death -> training again on 2: median (min-max)",
                            "step before the death (median)",
                            "training paused while the retry joined"], rows))
    print()
    for death, rs in results.items():
        med = statistics.median(r["recovery"] for r in rs)
        print(f"{death}: target (under 15 s on Spark): {'met' if med < 15 else 'NOT met'}")
    labels = [label for label, _ in CALLER_MARKS] + [label for label, _ in STAGES] + [
        "first step (rank 0)"]
    for death, rs in results.items():
        cols = {label: [r["parts"][label] for r in rs if label in r["parts"]]
                for label in labels}
        order = sorted((label for label in labels if cols[label]),
                       key=lambda label: statistics.median(cols[label]))
        print(f"\n{death}: when each stage was reached, seconds after the death (median, "
              "min-max; of the survivors, the last to reach it)\n")
        print(H.markdown_table(["stage", "seconds after the death"],
                               [[label + ("" if len(cols[label]) == len(rs) else
                                          f" ({len(cols[label])} of {len(rs)} jobs)"),
                                 E.fmt(cols[label])] for label in order]))


def driver(args):
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        for key, value in saved["args"].items():
            setattr(args, key, value)
        return report(args, saved["results"])
    import cloudpickle
    import pyspark

    # What the worker (in __main__: by value already) uses from elastic.py travels by value
    # too: the executors need not find benchmarks/ on their path.
    cloudpickle.register_pickle_by_value(E)
    deaths = [d.strip() for d in args.deaths.split(",") if d.strip()]
    if not deaths or any(d not in DEATHS for d in deaths):
        raise SystemExit(f"--deaths: choose from {', '.join(DEATHS)}")
    args.pyspark_version = pyspark.__version__
    args.machine, args.load_before = H.describe_machine(), H.load_average()
    args.revision = H.git_revision()
    spark = spark_session(args)
    results = {d: [] for d in deaths}
    try:
        for r in range(args.repeats):
            for death in (deaths if r % 2 == 0 else deaths[::-1]):
                t0 = time.monotonic()
                res = run_job(spark, death, args)
                results[death].append(res)
                print(f"  repeat {r + 1}/{args.repeats}: {death}: recovery "
                      f"{res['recovery']:.2f} s (job {time.monotonic() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        spark.stop()
    args.load_after = H.load_average()
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("json", "report")}
        with open(args.json, "w") as f:
            json.dump({"args": keep, "results": results}, f, indent=1)
    report(args, results)


def main():
    doc = __doc__
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deaths", default=",".join(DEATHS),
                        help=f"comma-separated subset of {','.join(DEATHS)} (default both)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="jobs of each kind of death, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="steps of a job (default 30)")
    parser.add_argument("--die-at", type=int, default=15,
                        help=f"the step at which worker {VICTIM} dies (default 15)")
    parser.add_argument("--batch", type=int, default=32, help="rows per worker and step")
    parser.add_argument("--width", type=int, default=256, help="hidden units (default 256)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds every step sleeps (default 0)")
    parser.add_argument("--gloo", action="store_true",
                        help="Gloo TCP between the workers (SDL_SHM=0; default shared memory)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds one job may run (default 240)")
    parser.add_argument("--executor-wait", type=float, default=120.0,
                        help="seconds to wait for the cluster's 3 executors before a job")
    parser.add_argument("--tmp", default=None, help="where the jobs' directories go")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' directories")
    parser.add_argument("--json", metavar="FILE", help="also save the raw results to FILE")
    parser.add_argument("--report", metavar="FILE",
                        help="run nothing: print the tables of a file saved with --json")
    args = parser.parse_args()
    if not 0 < args.die_at < args.steps:
        parser.error("--die-at must be between 0 and --steps")
    driver(args)


if __name__ == "__main__":
    main()
