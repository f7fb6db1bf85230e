"""Runs test functions on N spawned ranks that meet through a real KV store.

``run_ranks("module:function", np)`` starts a rendezvous server in the test
process and N Python processes with the rank environment sdlrun would give
them; each rank imports and calls the function and sends back its return
value or its traceback. Every wait is bounded: a hung rank fails the test
after ``timeout`` seconds and every process is killed.
"""

import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from spark_dl.runner.kvstore import KVStoreServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


class RankFailed(AssertionError):
    pass


def spawn_ranks(target, np_, env=None, args=()):
    """Starts np_ ranks running target; returns (procs, outdir, server)."""
    secret = secrets.token_bytes(32)
    server = KVStoreServer(secret, host="127.0.0.1")
    port = server.start()
    outdir = tempfile.mkdtemp(prefix="sdl-ranks-")
    job = secrets.token_hex(8)
    procs = []
    for r in range(np_):
        e = dict(os.environ)
        e.update({
            "SDL_RANK": str(r), "SDL_SIZE": str(np_), "SDL_LOCAL_RANK": str(r),
            "SDL_LOCAL_SIZE": str(np_), "SDL_CROSS_RANK": "0", "SDL_CROSS_SIZE": "1",
            "SDL_HOSTNAME": "127.0.0.1", "SDL_RENDEZVOUS_ADDR": "127.0.0.1",
            "SDL_RENDEZVOUS_PORT": str(port), "SDL_SECRET_KEY": secret.hex(), "SDL_JOB_ID": job,
            "PYTHONPATH": os.pathsep.join([REPO, HERE, e.get("PYTHONPATH", "")]),
        })
        e.update(env or {})
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "rank_main.py"), target, outdir] + list(args),
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    return procs, outdir, server


def collect(procs, outdir, server, timeout, wait_for=None):
    """Waits for the ranks in wait_for (default: all; bounded), kills the rest,
    and returns every rank's (returncode, result or None, output)."""
    deadline = time.monotonic() + timeout
    outputs = [""] * len(procs)
    wait_for = range(len(procs)) if wait_for is None else wait_for
    try:
        for i in wait_for:
            p = procs[i]
            left = max(0.1, deadline - time.monotonic())
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                out, _ = p.communicate()
                outputs[i] = out.decode(errors="replace")
                raise RankFailed(f"rank {i} did not finish within {timeout} s; output:\n{outputs[i]}")
            outputs[i] = out.decode(errors="replace")
    finally:
        for i, q in enumerate(procs):
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
            if not outputs[i]:
                outputs[i] = q.communicate()[0].decode(errors="replace")
        server.stop()
    results = []
    try:
        for r, p in enumerate(procs):
            path = os.path.join(outdir, f"rank.{r}")
            payload = None
            if os.path.exists(path):
                with open(path, "rb") as f:
                    payload = pickle.load(f)
            results.append((p.returncode, payload, outputs[r]))
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    return results


# Open MPI refuses to run as root without these; they belong to the test harness only.
MPI_TEST_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def run_ranks_mpi(target, np_, env=None, timeout=120, args=()):
    """Like run_ranks, but the ranks are started by mpirun and meet through MPI."""
    outdir = tempfile.mkdtemp(prefix="sdl-mpi-ranks-")
    e = dict(os.environ)
    for k in [k for k in e if k.startswith("SDL_RENDEZVOUS") or k in ("SDL_RANK", "SDL_SIZE")]:
        del e[k]
    e.update(MPI_TEST_ENV)
    e["PYTHONPATH"] = os.pathsep.join([REPO, HERE, e.get("PYTHONPATH", "")])
    e.update(env or {})
    cmd = ["mpirun", "-np", str(np_), sys.executable, os.path.join(HERE, "rank_main.py"), target,
           outdir] + list(args)
    try:
        p = subprocess.run(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, start_new_session=True)
        output = p.stdout.decode(errors="replace")
        values = []
        for r in range(np_):
            path = os.path.join(outdir, f"rank.{r}")
            if not os.path.exists(path):
                raise RankFailed(f"rank {r} wrote no result (mpirun exit {p.returncode}):\n"
                                 f"{output}")
            with open(path, "rb") as f:
                payload = pickle.load(f)
            if not payload["ok"]:
                raise RankFailed(f"rank {r} failed:\n{payload['traceback']}\noutput:\n{output}")
            values.append(payload["value"])
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    return values


def run_ranks(target, np_, env=None, timeout=120, args=(), launcher="store"):
    """Runs target on np_ ranks; returns each rank's return value, raising on any failure.

    launcher: "store" (ranks meet through a KV store, Gloo/shm) or "mpi" (mpirun).
    """
    if launcher == "mpi":
        return run_ranks_mpi(target, np_, env, timeout, args)
    procs, outdir, server = spawn_ranks(target, np_, env, args)
    values = []
    for r, (code, payload, output) in enumerate(collect(procs, outdir, server, timeout)):
        if payload is None or not payload["ok"]:
            tb = payload["traceback"] if payload else "(no result written)"
            raise RankFailed(f"rank {r} failed (exit {code}):\n{tb}\noutput:\n{output}")
        values.append(payload["value"])
    return values


def run_once(cache, key, launch):
    """``launch()`` once per ``key`` of a test module's ``cache``: every test that asks for
    the same key gets that launch's result, or its exception raised again (so one failed
    launch fails each of its tests, instead of relaunching per test)."""
    if key not in cache:
        try:
            cache[key] = launch()
        except Exception as e:  # noqa: BLE001 - re-raised for every test of this key
            cache[key] = e
    res = cache[key]
    if isinstance(res, Exception):
        raise res
    return res
