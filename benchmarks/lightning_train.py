"""Lightning training throughput: spark_dl's ``SparkDLStrategy`` against Lightning's own
``DDPStrategy`` (gloo on CPU) on the same LightningModule, in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/lightning_train.py                 # 3 jobs
    PYTHONPATH=. .venv/bin/python benchmarks/lightning_train.py --rounds 1 --fits 4 --steps 20

How it measures. One ``sdlrun -np 2`` job holds both peers: each rank initializes spark_dl
and a torch.distributed gloo process group (Lightning's DDP then finds it initialized and
the processes created externally), and trains examples/pytorch_synthetic_benchmark.py's
SmallCNN wrapped in a LightningModule (SGD with momentum, synthetic images in a
``DataLoader`` that Lightning gives a ``DistributedSampler``).

Each timed sample is one ``Trainer.fit`` of ``--warmup + --steps`` steps with one peer's
strategy on a fresh module (same initial weights); a callback times the last ``--steps``
steps (from the start of the first timed batch to the end of the last), so Trainer set-up
is not counted. Fits alternate between the peers, in an order that rotates each time, so
the noise of a shared machine hits both alike. While DDP fits run, spark_dl's background
thread is parked (cycle time 1 s). Throughput is optimizer steps per second (rank 0's
clock); the report gives the median over fits and jobs, the spread (min-max) and the
ratio spark_dl / DDP.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import _harness as H

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

RESULT_MARK = "SDL_LIGHTNING_BENCH "
PEERS = ("spark_dl", "ddp")
LABELS = {"spark_dl": "SparkDLStrategy (spark_dl)", "ddp": "DDPStrategy (torch gloo)"}
PARKED_CYCLE_MS = 1000.0


# ----------------------------------------------------------------------------- worker side

def _module_class(args):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from pytorch_synthetic_benchmark import SmallCNN

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = SmallCNN(width=args.width)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, sync_dist=args.sync_dist)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Classifier


def _timer_class():
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        """Times the steps after ``skip`` (start of the first timed batch to the end of
        the last)."""

        def __init__(self, skip):
            self.skip, self.start, self.end = skip, None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == self.skip:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end = time.perf_counter()

    return Timer


def worker(args):
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl.torch as hvd
    from spark_dl.common.basics import set_knob
    from spark_dl.common.knobs import value as knob_value
    from spark_dl.lightning import SparkDLStrategy

    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, root_rank=0)
    # Lightning's DDP joins this process group and launches nothing (LOCAL_RANK is set).
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": str(size), "RANK": str(rank),
                       "LOCAL_RANK": str(hvd.local_rank()), "NODE_RANK": "0"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(1)
    n = steps * args.batch_size * size
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g),
                         torch.randint(0, 10, (n,), generator=g))
    Module, Timer = _module_class(args), _timer_class()
    default_cycle = knob_value("cycle_time_ms")

    def fit(peer):
        set_knob("cycle_time_ms", default_cycle if peer == "spark_dl" else PARKED_CYCLE_MS)
        strategy = SparkDLStrategy() if peer == "spark_dl" else "ddp"
        timer = Timer(args.warmup)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu",
                             devices=1 if peer == "spark_dl" else size, max_steps=steps,
                             max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[timer])
        module = Module()
        dist.barrier()
        trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=True))
        seconds = timer.end - timer.start
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        every = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(every, flat)
        if not all(torch.equal(every[0], e) for e in every):
            raise AssertionError(f"{peer}: replicas diverged across ranks")
        return args.steps / seconds

    fit("spark_dl")  # warm both code paths once, untimed
    fit("ddp")
    rates = {p: [] for p in PEERS}
    for i in range(args.fits):
        for peer in PEERS[i % 2:] + PEERS[:i % 2]:
            rates[peer].append(fit(peer))
    set_knob("cycle_time_ms", default_cycle)
    info = {"size": size, "torch": torch.__version__, "lightning": pl.__version__,
            "parameters": sum(p.numel() for p in Module().parameters()), "rates": rates}
    dist.destroy_process_group()
    if rank == 0:
        H.print_result(info, RESULT_MARK)


# ----------------------------------------------------------------------------- driver side

def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, timeout=1200):
    """One 2-rank sdlrun job; returns rank 0's result dict."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--fits",
           str(args.fits), "--threads", str(args.threads), "--width", str(args.width)]
    if args.sync_dist:
        cmd.append("--sync-dist")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    result = H.parse_result(p.stdout, RESULT_MARK) if p.returncode == 0 else None
    if result is not None:
        return result
    raise RuntimeError(f"job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")


def report(jobs, args):
    first = jobs[0]
    samples = {p: [x for j in jobs for x in j["rates"][p]] for p in PEERS}
    med = {p: statistics.median(samples[p]) for p in PEERS}
    lines = [f"SmallCNN LightningModule, {first['parameters'] / 1e6:.2f} M parameters, batch "
             f"{args.batch_size} per rank, {args.threads} torch thread(s) per rank, "
             f"{first['size']} ranks, Lightning {first['lightning']}, torch {first['torch']}"
             f"{', self.log(sync_dist=True) every step' if args.sync_dist else ''}; "
             f"{len(jobs)} job(s) x {args.fits} fits per peer x {args.steps} timed steps.", "",
             "| strategy | steps/s (median) | spread (min-max) | vs DDP |",
             "|:---|---:|---:|---:|"]
    for p in PEERS:
        lines.append(f"| {LABELS[p]} | {med[p]:.2f} | {min(samples[p]):.2f}-"
                     f"{max(samples[p]):.2f} | {med[p] / med['ddp']:.2f} |")
    paired = [a / b for j in jobs for a, b in zip(j["rates"]["spark_dl"], j["rates"]["ddp"])]
    lines += ["", f"per-fit ratio spark_dl / DDP (adjacent fits): median "
              f"{statistics.median(paired):.2f}, range {min(paired):.2f}-{max(paired):.2f}"]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3, help="sdlrun jobs")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of a fit")
    p.add_argument("--fits", type=int, default=6, help="timed fits per peer and job")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--width", type=int, default=32, help="SmallCNN width (gradient size)")
    p.add_argument("--sync-dist", action="store_true",
                   help="log the loss with sync_dist=True (one reduce per step)")
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"machine: {H.describe_machine()}", file=sys.stderr, flush=True)
    jobs = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        jobs.append(run_job(args))
        print(f"  job {r + 1}/{args.rounds} done in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    print(report(jobs, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": H.describe_machine(), "jobs": jobs},
                      f, indent=1)


if __name__ == "__main__":
    main()
