"""The driver side of benchmarks/gpu_train.py: its parts' tasks run in ``sdlrun`` jobs (one per
number of ranks), each job bounded and killed whole at the deadline, and a failed task's
successors rerun in a new job; rank 0 prints each task's result on a line marked
:data:`MARK`."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SDL_GPU_TRAIN "


def run_job(cmd, env, deadline):
    """Runs one job in its own process group, killed whole at the deadline; returns
    ({task: rank 0's result}, why it failed or None)."""
    left = deadline - time.monotonic()
    if left < 5:
        return {}, "no time left (--timeout)"
    cmd = cmd + ["--dump-at", f"{time.time() + left - 3:.0f}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    why = None
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        proc.terminate()  # sdlrun stops its workers (SIGTERM, SIGKILL after a grace period)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its workers' watchdog then ends them
            out, err = proc.communicate()
        why = "timed out (--timeout)"
    got = {}
    for line in out.splitlines():
        if MARK in line:
            item = json.loads(line.split(MARK, 1)[1])
            got[item["task"]] = item["result"]
    if why is None and proc.returncode != 0:
        why = f"the job failed (exit {proc.returncode}; its output is above)"
    if why is not None:
        sys.stderr.write(out[-6000:] + err[-20000:])
    return got, why


def run_tasks(script, args, tasks, np_, deadline):
    """Runs ``tasks`` in one ``sdlrun -np np_`` job of ``script --worker`` (with ``args``'
    sizes); after a failure the tasks not yet done run in a new job, without the one that
    failed. Returns (results, failures)."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    results, failures, pending = {}, {}, list(tasks)
    while pending:
        cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(np_), sys.executable,
               script, "--worker", "--tasks", ",".join(pending),
               "--device", args.device]
        for key in ("iters", "warmup", "rounds", "epochs", "batch_size", "width", "small_count",
                    "large_mib", "collective_timeout", "store", "idx"):
            value = getattr(args, key)
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        t0 = time.monotonic()
        got, why = run_job(cmd, env, deadline)
        print(f"  job of {len(pending)} task(s), {np_} rank(s): {time.monotonic() - t0:.0f} s",
              flush=True)
        for task in pending:
            if task in got:
                print(f"  {task}: done in {got[task]['seconds']:.0f} s", flush=True)
        results.update(got)
        pending = [t for t in pending if t not in got]
        if pending:
            failures[pending[0]] = why or "the job ended without its result"
            print(f"  {pending[0]}: FAILED: {failures[pending[0]]}", flush=True)
            pending = pending[1:]
    return results, failures
