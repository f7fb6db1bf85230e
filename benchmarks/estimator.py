"""TorchEstimator vs pyspark's TorchDistributor with a hand-written DDP loop: same model,
data, epochs, batch size and processes, in the same Spark application.

    PYTHONPATH=. PYSPARK_PYTHON=.venv/bin/python .venv/bin/python benchmarks/estimator.py
    ... --rows 100000 --features 32 --epochs 2 --batch-size 64 --rounds 3 --json out.json

Both start from the same cached DataFrame (``features`` array<float> of ``--features``
values, ``label`` double) and end with the trained model on the driver:

* **spark_dl**: ``TorchEstimator(num_proc=N, ...).fit(df)``: prepare_data (Parquet in a
  LocalStore), N Spark-hosted workers, DistributedOptimizer over spark_dl's core, a
  checkpoint per epoch, the returned TorchModel.
* **TorchDistributor**: ``df.write.parquet(tmp)``, then
  ``TorchDistributor(num_processes=N, local_mode=False, use_gpu=False).run(train)``, where
  ``train`` is the usual DDP loop: ``init_process_group("gloo")``, each rank reads the Parquet
  files, ``DistributedSampler`` + ``DataLoader``, ``DistributedDataParallel``, Adam; rank 0
  returns its ``state_dict``.

Measured per fit: the total time (the call until the trained model is on the driver) and
the time from the call to the end of the first training step (taken on the rank 0 worker;
driver and workers share the clock on one machine); for spark_dl also the split of that
time into phases (:data:`SPLIT`: prepare, dry run, job and worker start, framework import,
init, set-up, first step), printed as medians after the table. The prepared-data cache is cleared
before each spark_dl fit, and the order of the two alternates by round, so that a noisy
machine slows both alike. Both use one torch thread per process.

Two modes: by default all fits run in one application that is warmed up first (one Spark
job with a Python UDF), as later fits of a session run; ``--cold`` runs each fit in a fresh
application (a subprocess per fit; the JVM is up and the data cached, but the fit pays the
application's first Python workers), as the first fit of a session runs.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(features: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def ddp_train(files, features, epochs, batch_size, lr, seed, model_bytes):
    """The TorchDistributor side: what each torchrun process runs."""
    import pickle
    import time

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    table = pq.read_table(files)
    n = table.num_rows
    x = table.column("features").combine_chunks().flatten().to_numpy().reshape(n, features)
    y = table.column("label").to_numpy().astype(np.float32)
    dataset = TensorDataset(torch.from_numpy(x.copy()), torch.from_numpy(y))
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model = pickle.loads(model_bytes)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=lr)
    first_step = None
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, rows = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(xb).reshape(-1), yb)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(xb)
            rows += len(xb)
            if first_step is None:
                first_step = time.time()
        losses.append(total / rows)
    dist.destroy_process_group()
    if rank == 0:
        return {"first_step": first_step, "losses": losses, "state": model.state_dict()}
    return None


def run_torch_distributor(spark, df, args, workdir):
    import pickle

    import torch
    from pyspark.ml.torch.distributor import TorchDistributor

    path = os.path.join(workdir, f"tdist_{time.time_ns()}")
    started = time.time()
    df.write.parquet(path)
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    model = make_model(args.features)
    result = TorchDistributor(num_processes=args.num_proc, local_mode=False, use_gpu=False) \
        .run(ddp_train, files, args.features, args.epochs, args.batch_size, args.lr, 0,
             pickle.dumps(model))
    model.load_state_dict(result["state"])
    total = time.time() - started
    shutil.rmtree(path, ignore_errors=True)
    assert isinstance(model, torch.nn.Module)
    return {"total_s": total, "first_step_s": result["first_step"] - started,
            "final_loss": result["losses"][-1]}


def run_spark_dl(spark, df, args, workdir):
    import torch

    from spark_dl.spark.common.store import Store
    from spark_dl.spark.common.util import clear_training_cache
    from spark_dl.spark.torch import TorchEstimator

    clear_training_cache()
    model = make_model(args.features)
    est = TorchEstimator(num_proc=args.num_proc, model=model,
                         optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["label"], batch_size=args.batch_size, epochs=args.epochs,
                         store=Store.create(os.path.join(workdir, "store")), verbose=0,
                         random_seed=0)
    started = time.time()
    trained = est.fit(df)
    total = time.time() - started
    t = trained.timings
    return {"total_s": total, "first_step_s": t["first_step_s"], "prepare_s": t["prepare_s"],
            "launch_s": t["launch_s"], "worker_phases_s": t["worker_phases_s"],
            "split_s": split(t), "final_loss": trained.getHistory()["loss"][-1]}


#: The split of a spark_dl fit up to its first training step: (name, what it covers).
SPLIT = (
    ("prepare", "fit() to data ready: prepare_data's Spark jobs (stats, Parquet write)"),
    ("dry run", "data ready to launch: the model tried on a sample batch on the driver"),
    ("job + worker start", "barrier job, task services, worker processes up"),
    ("framework import", "the worker unpickles its TrainSpec (imports torch)"),
    ("init", "spark_dl init(): rendezvous of the ranks"),
    ("set-up", "model, optimizer, broadcasts (torch._dynamo import), loaders"),
    ("first step", "first batch read, forward, backward, allreduce, optimizer step"),
)


def split(timings):
    """Durations of the phases in :data:`SPLIT`, from the fit's timings (rank 0's worker
    phases are seconds from fit(); driver and workers share the clock on one machine)."""
    w = timings["worker_phases_s"]
    marks = [0.0, timings["prepare_s"], timings["launch_s"], w.get("start"), w.get("imported"),
             w.get("initialized"), w.get("ready"), timings["first_step_s"]]
    return {name: (b - a if a is not None and b is not None else None)
            for (name, _), a, b in zip(SPLIT, marks, marks[1:])}


def print_split(samples):
    rows = [s["split_s"] for s in samples if s.get("split_s")]
    if not rows:
        return
    print("\nspark_dl: fit() to the first training step, median seconds per phase "
          "(min-max):\n")
    print("| phase | what | median | min-max |")
    print("| --- | --- | --- | --- |")
    for name, what in SPLIT:
        values = [r[name] for r in rows if r.get(name) is not None]
        if values:
            print(f"| {name} | {what} | {statistics.median(values):.2f} s | "
                  f"{min(values):.2f}-{max(values):.2f} s |")


def make_data(spark, rows: int, features: int):
    from pyspark.sql import functions as F

    cols = [F.rand(seed=i) * 2 - 1 for i in range(features)]
    weights = [((i % 7) - 3) / 3.0 for i in range(features)]
    label = sum(c * w for c, w in zip(cols, weights)) + F.lit(0.5)
    df = spark.range(rows, numPartitions=4).select(
        F.array(*cols).cast("array<float>").alias("features"), label.alias("label"))
    df = df.cache()
    df.count()
    return df


def warm_up(spark):
    """One Spark job with a Python UDF, so neither side pays the JVM's first job."""
    import pandas as pd

    def double(batches):
        for b in batches:
            yield pd.DataFrame({"id": b["id"] * 2})

    spark.range(1000, numPartitions=2).mapInPandas(double, "id long").count()


def warm_samples(args):
    """All fits in one application, warmed up first."""
    spark = _session(args.master)
    workdir = tempfile.mkdtemp(prefix="spark_dl_bench_est_")
    samples = {name: [] for name in RUNNERS}
    try:
        warm_up(spark)
        df = make_data(spark, args.rows, args.features)
        for r in range(args.rounds):
            order = list(RUNNERS) if r % 2 == 0 else list(reversed(RUNNERS))
            for name in order:
                sample = RUNNERS[name](spark, df, args, workdir)
                sample["round"] = r
                samples[name].append(sample)
                print(f"round {r + 1}/{args.rounds} {name}: total {sample['total_s']:.1f}s, "
                      f"first step after {sample['first_step_s']:.1f}s, "
                      f"final loss {sample['final_loss']:.4f}", flush=True)
    finally:
        spark.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return samples


def summarize(samples):
    return {k: statistics.median(s[k] for s in samples) for k in ("total_s", "first_step_s")}


def _session(master):
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("spark_dl estimator benchmark")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


RUNNERS = {"spark_dl": run_spark_dl, "TorchDistributor": run_torch_distributor}
ONE_MARK = "ESTIMATOR_BENCH_ONE "


def run_one_cold(name, args):
    """``--one NAME``: one fit in a fresh Spark application (no warm-up: the fit pays the
    application's first Python-worker job); prints the sample."""
    spark = _session(args.master)
    workdir = tempfile.mkdtemp(prefix="spark_dl_bench_est_")
    try:
        df = make_data(spark, args.rows, args.features)
        sample = RUNNERS[name](spark, df, args, workdir)
    finally:
        spark.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(ONE_MARK + json.dumps(sample), flush=True)


def cold_samples(args):
    import subprocess

    samples = {name: [] for name in RUNNERS}
    for r in range(args.rounds):
        order = list(RUNNERS) if r % 2 == 0 else list(reversed(RUNNERS))
        for name in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("master", "num_proc", "rows", "features", "epochs", "batch_size",
                         "lr")]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ONE_MARK)]
            if proc.returncode or not lines:
                raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            sample = json.loads(lines[-1][len(ONE_MARK):])
            sample["round"] = r
            samples[name].append(sample)
            print(f"cold round {r + 1}/{args.rounds} {name}: total {sample['total_s']:.1f}s, "
                  f"first step after {sample['first_step_s']:.1f}s", flush=True)
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the samples here")
    parser.add_argument("--cold", action="store_true",
                        help="each fit in a fresh Spark application (first use)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
    if args.one:
        return run_one_cold(args.one, args)
    samples = cold_samples(args) if args.cold else warm_samples(args)

    med = {name: summarize(s) for name, s in samples.items()}
    print(f"\n{args.rows:,} rows x {args.features} float32 features, MLP "
          f"{args.features}-64-64-1, Adam, batch {args.batch_size}, {args.epochs} epochs, "
          f"{args.num_proc} processes on {args.master}, "
          f"{'each fit in a fresh application' if args.cold else 'warm application'}; "
          f"medians of {args.rounds} rounds\n")
    print("| | total fit time | fit() to first training step |")
    print("| --- | --- | --- |")
    for name in samples:
        print(f"| {name} | {med[name]['total_s']:.1f} s | {med[name]['first_step_s']:.1f} s |")
    ratio = med["TorchDistributor"]["total_s"] / med["spark_dl"]["total_s"]
    print(f"\nspark_dl total time: {ratio:.2f}x faster than TorchDistributor")
    print_split(samples["spark_dl"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(),
                       "cpus": os.cpu_count(), "samples": samples, "medians": med}, f,
                      indent=1)


if __name__ == "__main__":
    main()
