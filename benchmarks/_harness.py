"""Shared launch, timing and report code for the collective benchmarks.

Every benchmark script runs in two modes:

* driver (default): launches one job (2 ranks unless ``--np``) per peer, each with that
  peer's own launcher, collects the result line that rank 0 prints, and prints Markdown tables;
* worker (``--worker PEER``): what each rank runs inside such a job.

Peers and their launchers:

* ``spark_dl``: ``python -m spark_dl.runner -np N`` (sdlrun), shared memory between the ranks
  of one host (``SDL_SHM=1``);
* ``spark_dl_gloo``: the same with ``SDL_SHM=0``, Gloo TCP for every exchange;
* ``torch``: N plain subprocesses, ``torch.distributed`` with the gloo backend (env://
  rendezvous on 127.0.0.1, ``GLOO_SOCKET_IFNAME=lo`` unless set);
* ``mpi``: ``mpirun -np N --oversubscribe --bind-to none`` (plus ``--mpi-args``), mpi4py on
  Open MPI.

A driver repeats the launches in rounds (the peer order rotates each round) so that a noisy,
shared machine slows every peer alike; statistics pool the samples of all rounds.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_MARK = "SDL_BENCH_RESULT "
# Rank 0 prints its result as lines of at most this many JSON characters, each marked
# "index count": launchers forward a longer line in pieces (sdlrun cuts at 64 KiB).
RESULT_PART_CHARS = 16000
PEERS = ("spark_dl", "spark_dl_gloo", "spark_dl_mpi", "torch", "mpi")
PEER_LABELS = {"spark_dl": "spark_dl", "spark_dl_gloo": "spark_dl (Gloo TCP)",
               "spark_dl_mpi": "spark_dl (MPI)",
               "torch": "torch gloo", "mpi": "Open MPI"}


# ----------------------------------------------------------------------------- driver side

def _base_env():
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_cmd(script, peer, args):
    return [sys.executable, os.path.abspath(script), "--worker", peer] + list(args)


def _launch_spark_dl(script, peer, args, np_, timeout, mpi_args):
    env = _base_env()
    env["SDL_SHM"] = "0" if peer == "spark_dl_gloo" else "1"
    cmd = ([sys.executable, "-m", "spark_dl.runner", "-np", str(np_)]
           + _worker_cmd(script, peer, args))
    return [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)]


def _launch_torch(script, peer, args, np_, timeout, mpi_args):
    env = _base_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(np_))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, as spark_dl uses
    procs = []
    for r in range(np_):
        procs.append(subprocess.Popen(_worker_cmd(script, peer, args), env=dict(env, RANK=str(r)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _launch_mpi(script, peer, args, np_, timeout, mpi_args):
    if shutil.which("mpirun") is None:
        raise RuntimeError("mpirun not found (Open MPI is needed for the mpi peer)")
    env = _base_env()
    if peer == "spark_dl_mpi":  # spark_dl's core on MPI for every exchange
        env.update(SDL_CONTROLLER="mpi", SDL_SHM="0")
        mpi_args = list(mpi_args) + ["-x", "SDL_CONTROLLER", "-x", "SDL_SHM"]
    # Benchmark containers often run as root; Open MPI refuses that unless told twice.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # No core binding: the other peers are not bound either, and the machine is shared.
    cmd = (["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH"]
           + list(mpi_args) + _worker_cmd(script, peer, args))
    return [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)]


_LAUNCHERS = {"spark_dl": _launch_spark_dl, "spark_dl_gloo": _launch_spark_dl,
              "spark_dl_mpi": _launch_mpi,
              "torch": _launch_torch, "mpi": _launch_mpi}


def run_peer(script, peer, args=(), np_=2, timeout=600, mpi_args=()):
    """Runs one job of ``script`` in worker mode under ``peer``'s launcher; returns rank 0's result.

    ``mpi_args`` are extra ``mpirun`` options (the mpi peer only).
    """
    procs = _LAUNCHERS[peer](script, peer, [str(a) for a in args], np_, timeout, mpi_args)
    if all(q.returncode == 0 for q in procs):
        for p in procs:
            result = parse_result(p.stdout)
            if result is not None:
                return result
    tail = "\n".join((p.stdout + p.stderr)[-3000:] for p in procs)
    raise RuntimeError(f"{peer} job failed (exit codes {[p.returncode for p in procs]}):\n{tail}")


def print_result(payload, mark=RESULT_MARK):
    """Prints a worker's result (JSON) for :func:`parse_result`, in marked lines of at most
    ``RESULT_PART_CHARS`` characters of JSON each."""
    text = json.dumps(payload)  # ASCII, one line
    parts = [text[i:i + RESULT_PART_CHARS] for i in range(0, len(text), RESULT_PART_CHARS)]
    for i, part in enumerate(parts):
        print(f"{mark}{i} {len(parts)} {part}", flush=True)


def parse_result(stdout, mark=RESULT_MARK):
    """The result :func:`print_result` printed in ``stdout`` (a launcher may put a rank tag
    before each line), or None when it is missing or incomplete."""
    parts, count = {}, None
    for line in stdout.splitlines():
        at = line.find(mark)
        if at < 0:
            continue
        index, total, text = (line[at + len(mark):].split(" ", 2) + ["", ""])[:3]
        if index.isdigit() and total.isdigit():
            parts[int(index)], count = text, int(total)
    if count is None or sorted(parts) != list(range(count)):
        return None
    return json.loads("".join(parts[i] for i in range(count)))


def cpu_idle_fraction(window):
    """Fraction of CPU time spent idle on this machine over the next ``window`` seconds."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total

    idle0, total0 = snap()
    time.sleep(window)
    idle1, total1 = snap()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(max_wait, threshold=0.8, window=1.0):
    """Waits up to ``max_wait`` s for a ``window`` in which the CPUs are mostly idle.

    On a shared machine other jobs come and go; starting each launch in a quiet moment makes
    the peers' numbers comparable. Returns the idle fraction last seen.
    """
    deadline = time.monotonic() + max_wait
    idle = cpu_idle_fraction(window)
    while idle < threshold and time.monotonic() < deadline:
        idle = cpu_idle_fraction(window)
    return idle


def run_rounds(script, peers, rounds, args=(), np_=2, timeout=600, mpi_args=(), wait_idle=0.0,
               log=None):
    """Launches every peer once per round (order rotated each round).

    With ``wait_idle`` > 0, each launch first waits up to that many seconds for idle CPUs.
    Returns {peer: [result of round 0, result of round 1, ...]}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = {p: [] for p in peers}
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        for peer in order:
            idle = wait_for_idle(wait_idle) if wait_idle > 0 else cpu_idle_fraction(0.5)
            t0 = time.perf_counter()
            results[peer].append(dict(run_peer(script, peer, args, np_, timeout, mpi_args),
                                      idle_before=idle))
            log(f"  round {r + 1}/{rounds}: {peer} done in {time.perf_counter() - t0:.1f} s "
                f"(CPUs {idle:.0%} idle before it)")
    return results


@contextlib.contextmanager
def busy_load(n):
    """Runs ``n`` processes that spin on the CPU until the block ends (an oversubscribed host:
    other tenants, data-loader threads, several tasks per executor)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def pooled(sample_lists):
    """One list of all samples of several rounds."""
    return [x for samples in sample_lists for x in samples]


def bench_main(doc, default_peers, default_rounds, add_args, quick, worker, driver):
    """Command line shared by the benchmark scripts; runs ``worker`` or ``driver`` with the args.

    ``add_args(parser)`` adds the script's own options; ``quick(args)`` shrinks them for
    ``--quick``.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--peers", default=",".join(default_peers),
                        help=f"comma-separated subset of {','.join(PEERS)} "
                             f"(default {','.join(default_peers)})")
    parser.add_argument("--rounds", type=int, default=default_rounds,
                        help=f"launches of each peer, interleaved (default {default_rounds})")
    parser.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--mpi-args", type=shlex.split, default=[],
                        help="extra mpirun options for the mpi peer, e.g. "
                             "'--mca btl_vader_single_copy_mechanism none'")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before each launch, wait up to S seconds for the CPUs to be at "
                             "least 80%% idle (for shared machines; default 0: do not wait)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="run N busy-loop processes during every launch, to measure a "
                             "host whose cores are oversubscribed (default 0)")
    parser.add_argument("--json", metavar="FILE",
                        help="also save the options and raw per-call results to FILE")
    parser.add_argument("--report", metavar="FILE",
                        help="run nothing: print the tables of a file saved with --json")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 1 round and fewer iterations")
    add_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
        quick(args)
    if args.worker:
        worker(args)
    else:
        driver(args)


def launch(args, script, worker_args, title, allowed=PEERS):
    """Driver side: runs ``args.rounds`` rounds of the chosen peers; returns (peers, results).

    With ``--json`` the options and every job's raw result are saved; with ``--report`` they
    are read back from such a file instead of running anything (the tables are re-printed).
    """
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        for key, value in saved["args"].items():
            setattr(args, key, value)
        return list(saved["raw"]), saved["raw"]
    peers = parse_peers(args.peers)
    bad = [p for p in peers if p not in allowed]
    if bad:
        raise SystemExit(f"{os.path.basename(script)} does not measure {', '.join(bad)}")
    args.machine, args.load_before = describe_machine(), load_average()
    args.revision = git_revision()
    print(f"{title}: {args.np} ranks, {args.machine}, {args.rounds} round(s) of "
          f"{', '.join(peers)}" + (f", {args.load} busy-loop processes" if args.load else ""),
          file=sys.stderr, flush=True)
    with busy_load(args.load):
        results = run_rounds(script, peers, args.rounds, worker_args, args.np,
                             mpi_args=args.mpi_args, wait_idle=args.wait_idle)
    args.load_after = load_average()
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("json", "report", "worker")}
        with open(args.json, "w") as f:
            json.dump({"args": keep, "raw": results}, f, indent=1)
    return peers, results


def print_header(title, args, results):
    print(f"## {title}\n")
    print(f"machine: {args.machine}; load average (1/5/15 min) at the start: "
          f"{args.load_before}, at the end: {args.load_after}")
    idle = sorted(r["idle_before"] for rounds in results.values() for r in rounds)
    print(f"CPUs idle just before each launch: min {idle[0]:.0%}, median {median(idle):.0%}"
          + (f" (each launch waited up to {args.wait_idle:g} s for 80%)" if args.wait_idle else "")
          + (f"; {args.load} busy-loop processes ran during every launch"
             if getattr(args, "load", 0) else ""))
    print(f"spark_dl: {getattr(args, 'revision', '?')}")
    info = []
    for peer, rounds in results.items():
        extra = {k: v for k, v in rounds[0].items() if k in ("transport", "version")}
        info.append(f"{peer} ({', '.join(extra.values())})" if extra else peer)
    print("peers: " + "; ".join(info))
    if args.mpi_args:
        print(f"extra mpirun options: {' '.join(args.mpi_args)}")
    print()


def git_revision():
    """The checkout's commit, noting uncommitted changes to tracked files."""
    def git(*cmd):
        return subprocess.run(["git", "-C", ROOT] + list(cmd), capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"
    return f"git {rev}" + (" + uncommitted changes" if dirty else "") if rev else "not a git checkout"


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def parse_peers(text):
    peers = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"unknown peers {bad}; choose from {', '.join(PEERS)}")
    return peers


def describe_machine():
    """One line naming the CPU, core count and memory of this machine."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
        mem = f"{mem_kib / 2**20:.0f} GiB"
    except OSError:
        mem = "? GiB"
    return f"{model}, {os.cpu_count()} cores, {mem}"


def counter_delta(before, after, keys, per=1):
    """{key: (after - before) / per} for the counters in ``keys`` (empty for non-spark_dl)."""
    return {k: (after[k] - before[k]) / per for k in keys} if before else {}


# ----------------------------------------------------------------------------- statistics, format

def median(xs):
    return statistics.median(xs)


def percentile(xs, q):
    """The q-th percentile (0..100) by linear interpolation."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt_time(seconds):
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_size(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text):
    """'4K', '64MiB', '1G' or a byte count -> bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", text.strip().upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4K, 64M, 1G)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def fmt_ratio(num, den):
    return f"{num / den:.2f}" if den else "-"


def markdown_table(headers, rows):
    """Rows of strings -> an aligned Markdown pipe table (first column left, others right)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells):
        out = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            out.append(str(c).ljust(w) if i == 0 else str(c).rjust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i else (":" + "-" * (w + 1))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


# ----------------------------------------------------------------------------- worker side

class Backend:
    """One rank's view of a peer: rank, size, in-place sum-allreduce of NumPy buffers, barrier."""

    def __init__(self, peer):
        self.peer = peer
        self.info = {"peer": peer}
        getattr(self, "_init_" + ("spark_dl" if peer.startswith("spark_dl") else peer))()

    # spark_dl: the NumPy front end; sdlrun set the rank environment (SDL_SHM picks the path).
    def _init_spark_dl(self):
        import spark_dl.numpy as sdl

        sdl.init()
        self.sdl = sdl
        self.rank, self.size = sdl.rank(), sdl.size()
        self.info["transport"] = sdl.transport()
        self.wrap = lambda arr: arr
        self.allreduce_ = lambda buf, name: sdl.allreduce_(buf, op=sdl.Sum, name=name)
        self.barrier = sdl.barrier
        self.close = sdl.shutdown

    def _init_torch(self):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.info["version"] = "torch " + torch.__version__
        self.wrap = torch.from_numpy  # shares the NumPy memory
        self.allreduce_ = lambda buf, name: dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        self.barrier = dist.barrier
        self.close = dist.destroy_process_group

    def _init_mpi(self):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.info["version"] = MPI.Get_library_version().split(",")[0].strip()
        self.wrap = lambda arr: arr
        self.allreduce_ = lambda buf, name: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        self.barrier = comm.Barrier
        self.close = lambda: None

    def counters(self):
        """The core's counters (spark_dl only; empty for the other peers)."""
        return self.sdl.counters() if self.peer.startswith("spark_dl") else {}

    def report(self, payload):
        """Rank 0 prints the result line the driver looks for."""
        if self.rank == 0:
            print_result(dict(self.info, **payload))


def check_sum(backend, arr, name):
    """Allreduces ones once and checks every element equals the number of ranks."""
    arr.fill(1)
    backend.allreduce_(backend.wrap(arr), name)
    if not (arr == backend.size).all():
        raise AssertionError(f"{backend.peer}: allreduce of ones gave {arr[:4]}..., "
                             f"expected {backend.size}")


def time_allreduce(backend, nbytes, iters, warmup, name):
    """Per-iteration seconds of in-place sum-allreduce of ``nbytes`` float32 under one name.

    A first call on ones checks the result; warm-up and timed calls then reduce zeros, so the
    values stay finite however many calls run.
    """
    import numpy as np

    arr = np.empty(nbytes // 4, dtype=np.float32)
    check_sum(backend, arr, name)
    arr.fill(0)
    buf = backend.wrap(arr)
    op = backend.allreduce_
    for _ in range(warmup):
        op(buf, name)
    backend.barrier()
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        op(buf, name)
        samples.append(clock() - t0)
    return samples


def fusion_step(sdl, tensors: int, elements: int):
    """The fusion benchmark's step for an initialized ``sdl`` front end: ``tensors``
    float32 tensors of ``elements`` each, submitted with ``allreduce_async_`` under the same
    names every step, then every handle waited on (benchmarks/fusion.py's "fused" step)."""
    import numpy as np

    arrays = [np.ones(elements, np.float32) for _ in range(tensors)]
    names = [f"grad.{i}" for i in range(tensors)]
    submit, op = sdl.allreduce_async_, sdl.Sum

    def step():
        handles = [submit(t, op=op, name=n) for t, n in zip(arrays, names)]
        for h in handles:
            h.wait()
    return step

