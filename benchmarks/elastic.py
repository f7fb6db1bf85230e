"""Recovery from a worker's death: spark_dl's elastic training (the survivors re-form and go
on) against torchrun's restart of the whole worker group from a checkpoint (issue 36).

    PYTHONPATH=. .venv/bin/python benchmarks/elastic.py                  # 5 repeats of each
    PYTHONPATH=. .venv/bin/python benchmarks/elastic.py --repeats 9 --json out.json
    PYTHONPATH=. .venv/bin/python benchmarks/elastic.py --report out.json  # tables again
    PYTHONPATH=. .venv/bin/python benchmarks/elastic.py --peers spark_dl,spark_dl_gloo,torchrun

Every peer trains the same model (an MLP with two hidden layers of ``--width`` units, on
synthetic data; SGD with momentum; one torch thread per process) with 3 processes on this
host, and in each job the last process SIGKILLs itself at the start of step ``--die-at``,
after writing the wall-clock time of its death to a file:

* **spark_dl**: ``python -m spark_dl.runner -np 3 --min-np 2 <this script>``; the worker
  uses ``spark_dl.torch.elastic``: ``TorchState`` (model, optimizer, ``ElasticSampler``,
  the step counter), ``@hvd.elastic.run``, ``state.commit()`` after every step (in memory).
  The survivors roll back to the last commit, re-form a job of 2 and go on. Shared memory
  between the ranks (``SDL_SHM=1``); **spark_dl_gloo** is the same job over Gloo TCP
  (``SDL_SHM=0``), as between hosts;
* **torchrun**: ``python -m torch.distributed.run --nnodes=1:3 --nproc-per-node=3
  --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT`` (one elastic agent
  on this host, its c10d store on a free port); the worker trains
  ``DistributedDataParallel`` over gloo and rank 0 saves a checkpoint (``torch.save`` to a
  file, renamed into place) after every step. The death (only when
  ``TORCHELASTIC_RESTART_COUNT`` is 0) makes the agent stop every worker and start 3 new
  ones, which load the checkpoint and go on.

What is measured, per job: **recovery** = the wall-clock time at which rank 0 completed its
first step after the re-formation (spark_dl) or the restart (torchrun), minus the time of
the death. A step is completed after its optimizer step and its commit or checkpoint. Every
process writes a time-stamped line for every step and every stage it passes; the
launcher's own messages are stamped as this driver reads them. The recovery is split into
stages, each reported when the last process of the new group (torchrun's new processes,
spark_dl's survivors) reached it, as the group's first collective waits for that one:

* spark_dl: the launcher reports the worker failed ; the survivors catch the error (their
  ``restore()``) ; the new generation is joined (the reset callback: the core shut down,
  the launcher published generation 1, ``init()`` joined it) ; the state is synced from
  rank 0 (``sync()``) ; rank 0 completed the first step;
* torchrun: the agent reports the failure ; the new processes run this script (the agent
  noticed the death, stopped the group, ran the rendezvous again and started 3
  interpreters) ; ``import torch`` ; ``init_process_group`` ; model built ; DDP built (its
  first use imports torch._dynamo and sympy, and broadcasts the parameters) ; checkpoint
  loaded ; rank 0 completed the first step.

Two torchrun settings, both in its favour: its rendezvous with a node range
(``--nnodes=1:3``) waits ``last_call_timeout`` once the minimum of nodes is there (30 s by
default, whole seconds, at least 1): this benchmark passes ``--rdzv-conf
last_call_timeout=1`` (``--torchrun-last-call``); ``--torchrun-nnodes 1`` measures a
fixed-size job instead (no last call). And on torch 2.13 the restarted group hangs in
``init_process_group`` while it shares the agent's rendezvous store (torch's default since
2.5, pytorch issue 135712), so the jobs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(``--torchrun-share-store`` leaves the default, to see the hang). The peers alternate (the
order flips every repeat), so a noisy machine slows all alike; each job runs in a fresh
temporary directory and under a timeout (``--timeout``).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

T_START = time.time()  # a restarted torchrun worker's first moment in Python

import _harness as H  # noqa: E402  (cheap: standard library only)

PEERS = ("spark_dl", "spark_dl_gloo", "torchrun")
DEFAULT_PEERS = ("spark_dl", "torchrun")
LABELS = {"spark_dl": "spark_dl elastic (survivors go on)",
          "spark_dl_gloo": "spark_dl elastic, Gloo TCP (SDL_SHM=0)",
          "torchrun": "torchrun (group restarted from a checkpoint)"}
NP = 3
# The launcher lines the driver stamps: (peer, part name, text in the line).
LAUNCHER_MARKS = (("spark_dl", "launcher saw death", "failed with signal 9; the others go on"),
                  ("spark_dl", "generation published", "sdlrun: generation 1:"),
                  ("spark_dl_gloo", "launcher saw death",
                   "failed with signal 9; the others go on"),
                  ("spark_dl_gloo", "generation published", "sdlrun: generation 1:"),
                  ("torchrun", "agent saw death", "failed (exitcode: -9)"))
# The worker stages, in order, whose time after the death is reported (first after it).
STAGES = {"spark_dl": (("error caught", "error"), ("generation joined", "joined"),
                       ("state synced", "synced"), ("first step (rank 0)", "step")),
          "spark_dl_gloo": (("error caught", "error"), ("generation joined", "joined"),
                            ("state synced", "synced"), ("first step (rank 0)", "step")),
          "torchrun": (("new process runs", "start"), ("torch imported", "imported"),
                       ("process group", "group"), ("model built", "built"),
                       ("DDP built", "ddp"), ("checkpoint loaded", "loaded"),
                       ("first step (rank 0)", "step"))}


# ----------------------------------------------------------------------------- workers

class Events:
    """A process's time-stamped lines: ``{"t", "event", "attempt", "rank", "size", ...}``,
    one JSON object a line, flushed at once (the process may be killed at any moment)."""

    def __init__(self, path):
        self._f = open(path, "a", buffering=1)
        self.attempt, self.rank, self.size = 0, -1, 0

    def note(self, event, t=None, **extra):
        line = dict(t=time.time() if t is None else t, event=event, attempt=self.attempt,
                    rank=self.rank, size=self.size, **extra)
        self._f.write(json.dumps(line) + "\n")


def die(out):
    """Writes the time of death, then SIGKILLs this process (no clean-up of any kind)."""
    with open(os.path.join(out, "death"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def build(args, torch):
    """The model and data, identical in every process of both peers."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w, f = args.width, args.features
    model = torch.nn.Sequential(torch.nn.Linear(f, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                                torch.nn.ReLU(), torch.nn.Linear(w, args.classes))
    # Enough rows for every step on 3 ranks (2 ranks after a death need fewer per step).
    rows = args.batch * NP * args.steps
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, f, generator=gen)
    y = (x[:, :args.classes] + 0.1 * torch.randn(rows, args.classes, generator=gen)).argmax(1)
    return model, x, y


def worker_spark_dl(args):
    import torch

    import spark_dl.torch as hvd
    from spark_dl.common import basics

    wid = os.environ["SDL_ELASTIC_WORKER_ID"]
    victim = str(NP - 1)
    events = Events(os.path.join(args.out, f"events-w{wid}.jsonl"))
    hvd.init()
    model, x, y = build(args, torch)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(x)), shuffle=True, seed=2)

    class TimedState(hvd.elastic.TorchState):
        # restore() runs right after a survivor caught the peer's failure; sync() after the
        # new generation formed (and once at the start).
        def restore(self):
            events.note("error")
            super().restore()

        def sync(self):
            super().sync()
            events.note("synced")

    def on_reset():
        events.attempt += 1
        events.rank, events.size = hvd.rank(), hvd.size()
        events.note("joined")

    state = TimedState(model, optimizer, sampler=sampler, step=0)
    state.register_reset_callbacks([on_reset])
    events.rank, events.size = hvd.rank(), hvd.size()
    events.note("started", transport=basics.transport())

    @hvd.elastic.run
    def train(state):
        mine = list(state.sampler)  # this rank's rows of what is left of the epoch
        b = 0
        while state.step < args.steps:
            if state.step == args.die_at and wid == victim:
                die(args.out)
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

    train(state)
    events.note("done")


def worker_torchrun(args):
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ["LOCAL_RANK"])
    events = Events(os.path.join(args.out, f"events-r{restart}-{local_rank}.jsonl"))
    events.attempt = restart
    events.note("start", t=T_START)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    events.note("imported")
    dist.init_process_group("gloo")
    events.rank, events.size = dist.get_rank(), dist.get_world_size()
    events.note("group")
    model, x, y = build(args, torch)
    events.note("built")
    ddp = DistributedDataParallel(model)
    events.note("ddp")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    events.note("loaded", step=step)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(2))
    rank, size = events.rank, events.size
    while step < args.steps:
        if step == args.die_at and restart == 0 and local_rank == NP - 1:
            die(args.out)
        start = (step * size + rank) * args.batch
        rows = order[start:start + args.batch]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:  # written whole, then renamed: a kill mid-write leaves the last one
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        events.note("step", step=step, loss=loss.detach().item())
    dist.destroy_process_group()
    events.note("done")


# ----------------------------------------------------------------------------- driver

def _worker_args(args, out):
    return [sys.executable, os.path.abspath(__file__), "--out", out,
            "--steps", str(args.steps), "--die-at", str(args.die_at),
            "--batch", str(args.batch), "--width", str(args.width),
            "--features", str(args.features), "--classes", str(args.classes),
            "--lr", str(args.lr)]


def command(peer, args, out):
    if peer.startswith("spark_dl"):
        return [sys.executable, "-m", "spark_dl.runner", "-np", str(NP), "--min-np",
                str(NP - 1)] + _worker_args(args, out) + ["--worker", "spark_dl"]
    rdzv_conf = [] if args.torchrun_nnodes.isdigit() else [
        f"--rdzv-conf=last_call_timeout={args.torchrun_last_call}"]
    return ([sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.torchrun_nnodes}",
             f"--nproc-per-node={NP}", "--max-restarts=3", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{H._free_port()}", f"--rdzv-id=bench{os.getpid()}"]
            + rdzv_conf + _worker_args(args, out)[1:] + ["--worker", "torchrun"])


def _stop(proc):
    """Ends a launcher that overran: SIGTERM first (it stops its workers), then SIGKILL to
    its process group."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def run_job(peer, args):
    """Runs one job of ``peer``; returns its measurements (seconds after the death)."""
    out = tempfile.mkdtemp(prefix=f"sdl-elastic-{peer}-", dir=args.tmp)
    env = H._base_env()
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback for both peers
    if peer.startswith("spark_dl"):
        env["SDL_SHM"] = "0" if peer == "spark_dl_gloo" else "1"
    if peer == "torchrun" and not args.torchrun_share_store:
        # torch >= 2.5 lets the workers share the rendezvous' TCP store; on this torch
        # (2.13) the restarted group then hangs in init_process_group (stale keys of the
        # first attempt; pytorch issue 135712). Its documented way out: a store per attempt.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log, stamped = [], []
    proc = subprocess.Popen(command(peer, args, out), env=env, cwd=out, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def read():
        for line in proc.stdout:
            stamped.append((time.time(), line))
            log.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _stop(proc)
        reader.join(timeout=10)
    try:
        if rc != 0:
            what = "timed out" if rc is None else f"exited {rc}"
            raise RuntimeError(f"{peer} job {what}:\n{''.join(log)[-4000:]}")
        return measure(peer, out, stamped, "".join(log))
    finally:
        if args.keep:
            print(f"  kept {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)


def _events(out):
    lines = []
    for name in sorted(os.listdir(out)):
        if name.startswith("events-"):
            with open(os.path.join(out, name)) as f:
                lines.extend(dict(json.loads(line), file=name) for line in f if line.strip())
    return lines


def measure(peer, out, stamped, log):
    with open(os.path.join(out, "death")) as f:
        death = float(f.read())
    events = _events(out)
    after = [e for e in events if e["attempt"] >= 1 and e["rank"] == 0]
    steps = [e for e in after if e["event"] == "step"]
    if not steps:
        raise RuntimeError(f"{peer}: no step completed after the death:\n{log[-4000:]}")
    first = min(steps, key=lambda e: e["t"])
    # The stages after the death, each when the last process of the new group reached it
    # (its first collective waits for that one): torchrun's restarted processes, spark_dl's
    # survivors (whose "error caught" comes before their reset). The first step: rank 0's.
    group = {e["file"] for e in events if e["attempt"] >= 1}
    parts = {}
    for label, event in STAGES[peer]:
        if event == "step":
            parts[label] = first["t"] - death
            continue
        reached = [min((e["t"] for e in events if e["file"] == f and e["event"] == event
                        and e["t"] >= death), default=None) for f in group]
        if reached and None not in reached:
            parts[label] = max(reached) - death
    for who, label, text in LAUNCHER_MARKS:
        if who == peer:
            times = [t for t, line in stamped if text in line and t >= death]
            if times:
                parts[label] = times[0] - death
    before = sorted(e["t"] for e in events
                    if e["event"] == "step" and e["attempt"] == 0 and e["rank"] == 0)
    gaps = [b - a for a, b in zip(before, before[1:])]
    final = [e for e in steps if e["step"] == max(s["step"] for s in steps)]
    return {"recovery": first["t"] - death, "parts": parts, "size_after": first["size"],
            "resumed_at_step": first["step"], "step_time": statistics.median(gaps) if gaps
            else None, "first_loss": next((e["loss"] for e in events if e["event"] == "step"),
                                          None), "last_loss": final[0]["loss"],
            "transport": next((e.get("transport") for e in events if e.get("transport")),
                              None)}


def fmt(xs):
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def report(args, results):
    peers = list(results)
    setup = [f"spark_dl {args.revision}", f"torch {args.torch_version}"]
    for peer in ("spark_dl", "spark_dl_gloo"):
        if peer in results:
            setup.append(f"{peer} transport: {results[peer][0]['transport']}")
    if "torchrun" in results:
        setup.append(f"torchrun --nnodes={args.torchrun_nnodes}" + (
            "" if args.torchrun_nnodes.isdigit()
            else f" (last_call_timeout={args.torchrun_last_call} s)"))
    print(f"## Recovery from a worker's death ({NP} processes, one killed at step "
          f"{args.die_at} of {args.steps})\n")
    print(f"machine: {args.machine}; load average (1/5/15 min) at the start: "
          f"{args.load_before}, at the end: {args.load_after}")
    print("; ".join(setup) + f"; MLP {args.features}-{args.width}-{args.width}-"
          f"{args.classes}, batch {args.batch} per process; "
          f"{len(results[peers[0]])} repeat(s), alternating\n")
    rows = []
    for peer in peers:
        rs = results[peer]
        step = [r["step_time"] for r in rs if r["step_time"]]
        last = statistics.median(r["last_loss"] for r in rs)
        rows.append([LABELS[peer], fmt([r["recovery"] for r in rs]),
                     f"{statistics.median(step) * 1e3:.1f} ms" if step else "-",
                     "/".join(sorted({str(r["size_after"]) for r in rs})),
                     f"{rs[0]['first_loss']:.3f} -> {last:.3f}"])
    print(H.markdown_table(["peer", "death -> training again: median (min-max)",
                            "step before the death (median)", "processes after",
                            "loss (first -> last)"], rows))
    med = {p: statistics.median(r["recovery"] for r in results[p]) for p in peers}
    print()
    for peer in ("spark_dl", "spark_dl_gloo"):
        if peer in med and "torchrun" in med:
            print(f"torchrun / {peer} (medians): {med['torchrun'] / med[peer]:.1f}x")
    for peer in ("spark_dl", "spark_dl_gloo"):
        if peer in med:
            print(f"{peer} target (under 5 s): {'met' if med[peer] < 5 else 'NOT met'}")
    for peer in peers:
        labels = [label for label, _ in STAGES[peer]] + [
            label for who, label, _ in LAUNCHER_MARKS if who == peer]
        cols = {label: [r["parts"][label] for r in results[peer] if label in r["parts"]]
                for label in labels}
        order = sorted((label for label in labels if cols[label]),
                       key=lambda label: statistics.median(cols[label]))
        print(f"\n{peer}: when each stage was reached, seconds after the death (median, "
              "min-max; the last process of the new group to reach it)\n")
        print(H.markdown_table(["stage", "seconds after the death"],
                               [[label, fmt(cols[label])] for label in order]))


def driver(args):
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        for key, value in saved["args"].items():
            setattr(args, key, value)
        return report(args, saved["results"])
    import torch

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or any(p not in PEERS for p in peers):
        raise SystemExit(f"--peers: choose from {', '.join(PEERS)}")
    args.torch_version = torch.__version__
    args.machine, args.load_before = H.describe_machine(), H.load_average()
    args.revision = H.git_revision()
    results = {p: [] for p in peers}
    for r in range(args.repeats):
        for peer in (peers if r % 2 == 0 else peers[::-1]):
            t0 = time.monotonic()
            res = run_job(peer, args)
            results[peer].append(res)
            print(f"  repeat {r + 1}/{args.repeats}: {peer}: recovery {res['recovery']:.2f} s "
                  f"(job {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    args.load_after = H.load_average()
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("json", "report", "worker")}
        with open(args.json, "w") as f:
            json.dump({"args": keep, "results": results}, f, indent=1)
    report(args, results)


def main():
    doc = __doc__
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)} (default "
                             f"{','.join(DEFAULT_PEERS)})")
    parser.add_argument("--repeats", type=int, default=5,
                        help="jobs of each peer, alternating (default 5)")
    parser.add_argument("--steps", type=int, default=30, help="steps of a job (default 30)")
    parser.add_argument("--die-at", type=int, default=15,
                        help="the step at which the last process kills itself (default 15)")
    parser.add_argument("--batch", type=int, default=32, help="rows per process and step")
    parser.add_argument("--width", type=int, default=256, help="hidden units (default 256)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--torchrun-nnodes", default="1:3",
                        help="torchrun's --nnodes (default 1:3; 1: a fixed-size job)")
    parser.add_argument("--torchrun-last-call", type=int, default=1, metavar="S",
                        help="torchrun's rendezvous last_call_timeout with a node range "
                             "(default 1, the least it accepts; its own default is 30)")
    parser.add_argument("--torchrun-share-store", action="store_true",
                        help="leave torchrun's shared rendezvous store on (its default; the "
                             "restart then hangs on torch 2.13 until --timeout)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds one job may run (default 180)")
    parser.add_argument("--tmp", default=None, help="where the jobs' directories go")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' directories")
    parser.add_argument("--json", metavar="FILE", help="also save the raw results to FILE")
    parser.add_argument("--report", metavar="FILE",
                        help="run nothing: print the tables of a file saved with --json")
    args = parser.parse_args()
    if args.worker:
        {"spark_dl": worker_spark_dl, "torchrun": worker_torchrun}[args.worker](args)
        return
    if not 0 < args.die_at < args.steps:
        parser.error("--die-at must be between 0 and --steps")
    driver(args)


if __name__ == "__main__":
    main()
