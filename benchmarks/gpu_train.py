"""GPU training benchmark: the estimators' worker loop on CUDA against the CPU, a training step
with ``DistributedOptimizer`` against DDP on NCCL, and two ranks sharing one GPU against
torch.distributed gloo; every comparison on the same machine in the same run.

    python benchmarks/gpu_train.py                          # on a GPU machine: all three parts
    python benchmarks/gpu_train.py --parts step --iters 50 --json out.json
    python benchmarks/gpu_train.py --device cpu --quick     # the same code on a CPU machine

Run it on a GPU machine after building there (``bash scripts/gpu_check.sh`` runs it). On
``--device cuda`` (the default) it fails when CUDA is not available instead of measuring
the CPU; ``--device cpu`` runs parts (a) and (b) with the CPU and gloo in place of CUDA and
NCCL, and part (c) on CPU tensors, which checks the code but measures nothing about GPUs.

How it runs. Parts with the same number of ranks share one ``sdlrun`` job (each job pays
the imports): on a one-GPU machine (a) and (b) with one rank, (c) with two; with
``--device cpu`` all with two (``--np``). A task that fails or hangs ends its job (every rank
prints its threads' stacks before the job is killed at ``--timeout``) and the tasks after
it run in a new job, so one failure costs only its own part. The driver and every rank
refuse to import pyspark, which the GPU machine does not have, and report who tried.

Parts:

``estimator`` (a)
    The worker loop every Spark task of ``TorchEstimator`` and ``LightningEstimator`` runs
    (:func:`spark_dl.spark.common.worker.train` with ``TorchWorker`` or
    ``LightningWorker``), without Spark: the driver writes synthetic images as
    ``prepare_data`` lays out a dataset (Parquet files of fixed row groups under the store's
    train directory, then the metadata document) into a ``LocalStore``; each rank builds the
    ``TrainSpec`` the estimator would (SmallCNN from examples/pytorch_synthetic_benchmark.py,
    SGD, cross-entropy, the estimators' defaults) and calls ``train`` on its cloudpickled
    bytes. Peers: ``use_gpu=True`` (``cuda``) and ``use_gpu=False`` (``cpu``) in the same
    processes, whole fits alternating between the devices in an order that rotates per
    round, after one short untimed fit on each. Reported per fit: the step time (from one
    step's end to the next, loader included, on rank 0; the first epoch is warm-up),
    rows/s, the time from ``train()`` to the end of the first step, and the first epoch's
    loss, which must agree between the devices (2 %).

``step`` (b)
    One training step (zero_grad, forward, cross-entropy, backward, step) of SmallCNN on
    the same batch per rank: ``spark_dl`` (``DistributedOptimizer``), ``ddp``
    (``DistributedDataParallel`` over NCCL; gloo with ``--device cpu``) and ``local`` (no
    communication: the ceiling). Iterations alternate between the peers in a rotating
    order, each after a barrier, timed on rank 0 until ``torch.cuda.synchronize()``.
    spark_dl's background thread is parked (cycle time 1 s) while the others run. Checked
    first: one step from the same weights gives ``spark_dl`` and ``ddp`` the same
    parameters; at the end the replicas of each are identical across ranks.

``shared_gpu`` (c)
    Two ranks on ``cuda:0`` (NCCL refuses that: the core must stage through host memory):
    benchmarks/gpu.py's ``small`` (200 x 16 KiB) and ``large`` (64 MiB) float32 allreduce
    workloads, spark_dl's three forms (per tensor, one batch, one group) against
    ``torch.distributed`` gloo on the same CUDA tensors (per tensor, flattened). Every
    peer's result is checked against the exact sum first, and on CUDA the core's counters
    must show staged allreduces and no direct NCCL one.

Reported: median and 10th/90th percentiles, ratios between peers of the same run. Exit
status 0: everything measured and checked; 1: a job failed, timed out or a check failed;
3: a peer could not be measured (NOT MEASURED in the report).
"""

import argparse
import datetime
import faulthandler
import functools
import gc
import importlib.abc
import importlib.util
import json
import os
import posixpath
import shutil
import socket
import sys
import tempfile
import time
import traceback

from gpu_train_jobs import MARK, run_tasks
from gpu_train_report import (FRAMEWORKS, SHARED_PEERS, STEP_PEERS, report_estimator,
                              report_shared, report_step)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("estimator", "step", "shared_gpu")
SHARED_WORKLOADS = ("small", "large")
PARKED_CYCLE_MS = 1000.0
ROW_GROUP_BYTES = 8 << 20   # prepare_data's default row_group_size_mb
IMAGE = 32                  # SmallCNN's input side
QUICK = dict(iters=3, warmup=0, rounds=1, rows=128, epochs=2, batch_size=16, width=4,
             large_mib=1, small_count=20)


# ----------------------------------------------------------------------------- no pyspark

class _NoPyspark(importlib.abc.MetaPathFinder):
    """Refuses ``import pyspark`` as the GPU machine (no pyspark, no Java) would, and keeps
    where each attempt came from (the first spark_dl frame), so a CPU run shows whether
    the worker path needs Spark."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name != "pyspark" and not name.startswith("pyspark."):
            return None
        # The importing line: the innermost spark_dl frame, else the innermost one outside
        # the import machinery (a third-party package probing for pyspark).
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith("<") and f.filename != __file__]
        ours = [f for f in frames if f"{os.sep}spark_dl{os.sep}" in f.filename]
        frame = (ours or frames or [None])[-1]
        where = "?" if frame is None else f"{frame.filename}:{frame.lineno}".replace(
            ROOT + os.sep, "")
        if where not in self.attempts:
            self.attempts.append(where)
        raise ModuleNotFoundError(f"No module named {name!r} (refused by benchmarks/gpu_train.py"
                                  ": the GPU machine has no pyspark)", name=name)


NO_PYSPARK = _NoPyspark()


def _refuse_pyspark():
    if NO_PYSPARK not in sys.meta_path:
        sys.meta_path.insert(0, NO_PYSPARK)


# ----------------------------------------------------------------------------- shared bits

@functools.lru_cache(maxsize=None)
def _gpu_bench():
    """benchmarks/gpu.py as a module: its workloads' sizes, allreduce forms, percentiles."""
    spec = importlib.util.spec_from_file_location(
        "sdl_gpu_bench", os.path.join(ROOT, "benchmarks", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _percentiles(xs):
    return _gpu_bench()._percentiles(xs) if xs else None


def _large_elems(args, gb):
    return gb.LARGE_ELEMS if args.large_mib is None else args.large_mib * (1 << 20) // 4


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_threads(local_size):
    """Ranks of one host share its cores (each would take them all)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))


def _small_cnn(width):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from pytorch_synthetic_benchmark import SmallCNN

    return SmallCNN(width=width, image_size=IMAGE)


# ----------------------------------------------------------------------------- (a) estimators

# Steps seen by the timing callbacks of this process: ("epoch", epoch, t, device) and
# ("step", epoch, t). The callbacks reach it through this module imported by name
# (gpu_train), so the copies train() unpickles record here too.
RECORDS = []


def record(kind, epoch, device=None):
    RECORDS.append((kind, int(epoch), time.perf_counter(), device))


class StepTimer:
    """The shared loop's callback hooks (duck-typed, as the torch estimator calls them)."""

    def on_epoch_begin(self, epoch, logs=None):
        record("epoch", epoch, str(next(self.model.parameters()).device))

    def on_batch_end(self, step, logs=None):
        record("step", -1)


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _lightning_parts(width):
    """(a LightningModule around SmallCNN, a step-timing Lightning callback)."""
    import torch

    pl = _lightning()

    class CNN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _small_cnn(width)

        def forward(self, x):
            return self.net(x)

    class LightningStepTimer(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            record("epoch", trainer.current_epoch, str(pl_module.device))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record("step", -1)

    torch.manual_seed(0)
    return CNN(), LightningStepTimer()


def _train_spec(args, framework, device, store, dataset, run_id, epochs, steps):
    """The TrainSpec the estimator's ``_fit`` would build (its defaults where the benchmark
    has no reason to differ)."""
    import torch
    import torch.nn.functional as F

    from spark_dl.spark.common.worker import TrainSpec

    shapes = [[-1, 3, IMAGE, IMAGE]]
    if framework == "torch":
        from spark_dl.spark.torch.adapter import TorchSpec, TorchWorker

        torch.manual_seed(0)
        model = _small_cnn(args.width)
        fw = TorchSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01,
                                                              momentum=0.9),
                       losses=[F.cross_entropy], loss_constructors=None, loss_weights=None,
                       input_shapes=shapes, compression=None, backward_passes_per_step=1,
                       train_minibatch_fn=None)
        adapter, timer = TorchWorker, StepTimer()
    else:
        from spark_dl.spark.lightning.adapter import LightningSpec, LightningWorker

        module, timer = _lightning_parts(args.width)
        fw = LightningSpec(module=module, optimizer=torch.optim.SGD(module.parameters(),
                                                                    lr=0.01, momentum=0.9),
                           losses=[F.cross_entropy], input_shapes=shapes, trainer_args={},
                           logger=None, checkpoint_callback=None, profiler=None,
                           log_every_n_steps=50, compression=None, backward_passes_per_step=1,
                           package=_lightning().__name__, metric_names=[])
        adapter = LightningWorker
    return TrainSpec(
        adapter=adapter, framework=fw, metrics=[], feature_cols=["features"],
        label_cols=["label"], sample_weight_col=None, label_shapes=None,
        batch_size=args.batch_size, val_batch_size=args.batch_size, epochs=epochs,
        train_steps=steps, val_steps=None, shuffle_buffer_size=None, transformation_fn=None,
        callbacks=[timer], remote_store=store.to_remote(run_id, dataset.idx), dataset=dataset,
        seed=0, random_seed=0, terminate_on_nan=True, cache_all=False, train_threads=2,
        val_threads=2, use_gpu=device == "cuda", verbose=0, run_id=run_id)


def _fit(args, framework, device, store, dataset, run_id, epochs=None, steps=None):
    """One fit through the worker loop; rank 0's numbers (others: None)."""
    import cloudpickle

    from spark_dl.spark.common.worker import train

    spec = _train_spec(args, framework, device, store, dataset, run_id,
                       epochs or args.epochs, steps)
    del RECORDS[:]
    out = train(cloudpickle.dumps(spec))
    seen = sorted({r[3] for r in RECORDS if r[0] == "epoch"})
    if [d.split(":")[0] for d in seen] != [device]:
        raise AssertionError(f"{framework} use_gpu={device == 'cuda'}: trained on {seen}, "
                             f"not on {device}")
    if "history" not in out:
        return None
    steps_s, epoch, last = [], None, None
    for kind, ep, t, _ in RECORDS:
        if kind == "epoch":
            epoch, last = ep, t
        elif last is not None:
            if epoch >= 1:  # the first epoch is warm-up
                steps_s.append(t - last)
            last = t
    hist, tm = out["history"], out["timings"]
    return {"device": seen[0], "step_s": steps_s, "rows_per_s": hist["rows_per_s"][1:],
            "first_step_s": tm["first_step"] - tm["start"], "loss": hist["loss"]}


def _estimator_worker(args, framework):
    import spark_dl.numpy as sdl
    from spark_dl.spark.common.dataset import Dataset
    from spark_dl.spark.common.store import Store

    sdl.init()  # train() calls it again (idempotent)
    _cpu_threads(sdl.local_size())
    store = Store.create(args.store)
    dataset = Dataset.from_store(store, args.idx)
    devices = ["cuda", "cpu"] if args.device == "cuda" else ["cpu"]
    tag = f"{framework}-{os.getpid() if sdl.rank() == 0 else 0}"
    tag = sdl.broadcast_object(tag, 0)  # one run_id per fit on every rank
    for d in devices if args.warmup else ():  # untimed: imports, CUDA context, cuDNN
        _fit(args, framework, d, store, dataset, f"{tag}-warmup-{d}", epochs=1, steps=2)
    fits = {d: [] for d in devices}
    for r in range(args.rounds):
        for d in devices[r % len(devices):] + devices[:r % len(devices)]:
            fits[d].append(_fit(args, framework, d, store, dataset, f"{tag}-{r}-{d}"))
    if sdl.rank() != 0:
        return None
    out = {}
    for d, runs in fits.items():
        out[d] = {"device": runs[0]["device"],
                  "step_s": _percentiles([s for x in runs for s in x["step_s"]]),
                  "rows_per_s": _percentiles([s for x in runs for s in x["rows_per_s"]]),
                  "first_step_s": _percentiles([x["first_step_s"] for x in runs]),
                  "first_epoch_loss": [x["loss"][0] for x in runs],
                  "final_loss": [x["loss"][-1] for x in runs]}
    return {"framework": framework, "size": sdl.size(), "devices": out,
            "pyspark_imports_refused": list(NO_PYSPARK.attempts)}


def _write_dataset(root, rows, seed=0):
    """Synthetic images as ``prepare_data`` lays out a dataset; returns its index. Features:
    ``array<float>`` of 3 x 32 x 32, label: ``bigint`` class 0-9 (the brightest of the first
    ten pixels, so there is something to learn)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.spark.common import constants
    from spark_dl.spark.common.store import Store

    store = Store.create(root)
    idx = "gputrain0"
    part_dir = store.get_train_data_path(idx)
    fs = store.get_filesystem()
    fs.create_dir(store.get_fs_path(part_dir), recursive=True)
    n_feat = 3 * IMAGE * IMAGE
    per_group = max(1, int(ROW_GROUP_BYTES // (n_feat * 4 + 8)))
    rng = np.random.default_rng(seed)
    files, half = [], (rows + 1) // 2  # two files, as two Spark partitions write
    for part, start in enumerate(range(0, rows, half)):
        n = min(half, rows - start)
        x = rng.standard_normal((n, n_feat), dtype=np.float32)
        y = x[:, :10].argmax(axis=1).astype(np.int64)
        offsets = pa.array(np.arange(0, (n + 1) * n_feat, n_feat, dtype=np.int32))
        table = pa.table({"features": pa.ListArray.from_arrays(offsets, pa.array(x.ravel())),
                          "label": pa.array(y)})
        name = constants.PART_FILE_TEMPLATE.format(partition=part)
        path = store.get_fs_path(posixpath.join(part_dir, name))
        pq.write_table(table, path, filesystem=fs, row_group_size=per_group,
                       compression="snappy")
        files.append({"name": name, "rows": n,
                      "row_groups": [min(per_group, n - i) for i in range(0, n, per_group)],
                      "file_bytes": fs.get_file_info(path).size})
    columns = {"features": {"kind": constants.KIND_ARRAY, "dtype": "float32",
                            "shape": [n_feat], "sparse": False, "spark_type": "array<float>",
                            "rows": rows, "bytes": rows * n_feat * 4},
               "label": {"kind": constants.KIND_SCALAR, "dtype": "int64", "shape": [],
                         "sparse": False, "spark_type": "bigint", "rows": rows,
                         "bytes": rows * 8}}
    meta = {"format_version": constants.METADATA_FORMAT_VERSION, "dataset_idx": idx,
            "cache_key": None, "created": time.time(), "label_columns": ["label"],
            "feature_columns": ["features"], "sample_weight_col": None, "validation": None,
            "columns": columns,
            "train": {"path": part_dir, "rows": rows,
                      "file_bytes": sum(f["file_bytes"] for f in files), "files": files},
            "val": None, "avg_row_size": n_feat * 4 + 8, "rows_per_row_group": per_group}
    store.write_text(store.get_data_metadata_path(idx), json.dumps(meta, indent=1))
    return idx


# ----------------------------------------------------------------------------- (b) one step

def _init_process_group(args, hvd, backend, device):
    """A torch.distributed group of spark_dl's ranks, on a port rank 0 picked (a task's
    group is destroyed at its end, and the next task of the job makes a new one)."""
    import torch.distributed as dist

    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="gpu_train.port")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=args.collective_timeout),
                            **kwargs)
    return dist


def _end_group(dist, hvd):
    """Ends a task's torch.distributed group alike on every rank: all done with it, then
    destroyed (the caller dropped its other users, such as DDP, first) and collected, then
    the ranks in step before the next task. Left to the garbage collector, the group was
    freed on one rank while the other had moved on, and twice in 14 CPU runs that rank hung
    there."""
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    hvd.barrier()


def _step_worker(args, _=None):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import spark_dl.torch as hvd
    from spark_dl.common.basics import set_knob
    from spark_dl.common.knobs import value as knob_value

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _cpu_threads(hvd.local_size())
    dist = _init_process_group(args, hvd, "nccl" if device.type == "cuda" else "gloo", device)

    def build():
        torch.manual_seed(0)
        return _small_cnn(args.width).to(device)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    m = build()
    peers = {"spark_dl": (m, hvd.DistributedOptimizer(sgd(m.parameters()),
                                                      named_parameters=m.named_parameters()))}
    ddp = DistributedDataParallel(build(), device_ids=[device.index] if device.index is not None
                                  else None)
    peers["ddp"] = (ddp, sgd(ddp.parameters()))
    m = build()
    peers["local"] = (m, sgd(m.parameters()))
    g = torch.Generator().manual_seed(1000 + rank)
    data = torch.randn(args.batch_size, 3, IMAGE, IMAGE, generator=g).to(device)
    target = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    default_cycle = knob_value("cycle_time_ms")

    def use(peer):
        set_knob("cycle_time_ms", default_cycle if peer == "spark_dl" else PARKED_CYCLE_MS)

    def step(peer):
        model, opt = peers[peer]
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def params(peer):
        model = peers[peer][0]
        return torch.cat([p.detach().reshape(-1) for p in getattr(model, "module", model)
                          .parameters()])

    # Same weights, same batch, one step: both must reduce the gradients alike.
    for peer in ("spark_dl", "ddp"):
        use(peer)
        step(peer)
    _sync(device)
    diff = float((params("spark_dl") - params("ddp")).abs().max())
    if not torch.allclose(params("spark_dl"), params("ddp"), rtol=1e-3, atol=1e-5):
        raise AssertionError(f"one step: spark_dl's parameters differ from DDP's by up to {diff}")
    for peer in STEP_PEERS:
        use(peer)
        for _ in range(args.warmup):
            step(peer)
    times = {p: [] for p in STEP_PEERS}
    before = _backend_counts()
    for it in range(args.iters):
        for peer in STEP_PEERS[it % 3:] + STEP_PEERS[:it % 3]:
            use(peer)
            _sync(device)
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            step(peer)
            _sync(device)
            times[peer].append(time.perf_counter() - start)
    set_knob("cycle_time_ms", default_cycle)
    # Which of the core's backends reduced spark_dl's gradients (only its steps use the core).
    after = _backend_counts()
    backends = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    if device.type == "cuda" and args.iters and not any(
            k in backends for k in ("backend.nccl", "backend.host_staged")):
        raise AssertionError(f"spark_dl's steps on CUDA ran no allreduce on a CUDA backend: "
                             f"{backends}")
    for peer in ("spark_dl", "ddp"):  # replicas must have stayed identical
        flat = params(peer)
        every = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(every, flat)
        if not all(torch.equal(every[0], e) for e in every):
            raise AssertionError(f"{peer}: replicas diverged across ranks")
    backend, n_params = dist.get_backend(), int(params("local").numel())
    peers.clear()
    del ddp, m
    _end_group(dist, hvd)
    if rank != 0:
        return None
    return {"size": size, "device": str(device), "backend": backend,
            "parameters": n_params, "one_step_max_diff": diff, "spark_dl_backends": backends,
            "step_s": {p: _percentiles(t) for p, t in times.items()},
            "pyspark_imports_refused": list(NO_PYSPARK.attempts)}


# ----------------------------------------------------------------------------- (c) shared GPU

def _shared_tensors(args, workload, device, rank, gb):
    import torch

    if workload == "small":
        return [torch.full((gb.SMALL_ELEMS,), float(rank + 1 + i % 7), device=device)
                for i in range(args.small_count or gb.SMALL_COUNT)]
    return [torch.full((_large_elems(args, gb),), float(rank + 1), device=device)]


def _backend_counts():
    from spark_dl.common.basics import counters

    return {k: v for k, v in counters().items() if k.startswith(("backend.", "nccl."))}


def _staging_counts():
    from spark_dl.common.basics import counters

    c = counters()
    return {"staged": c.get("nccl.shared_gpu", 0) + c.get("backend.host_staged", 0),
            "direct_nccl": c.get("backend.nccl", 0) - c.get("nccl.shared_gpu", 0)}


def _shared_gpu_worker(args, _=None):
    import torch

    import spark_dl.torch as hvd

    gb = _gpu_bench()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        _cpu_threads(hvd.local_size())
    dist = _init_process_group(args, hvd, "gloo", device)
    forms = gb._peer_fns(hvd, dist)  # nccl_*: plain dist.all_reduce, here over gloo
    fns = {p: forms[p.replace("gloo_", "nccl_")] for p in SHARED_PEERS}
    results, not_measured, staging = {}, {}, {}
    for workload in SHARED_WORKLOADS:
        peers = []
        for peer in SHARED_PEERS:
            before = _staging_counts()
            ts = _shared_tensors(args, workload, device, rank, gb)
            try:
                fns[peer](ts, f"check.{workload}.{peer}")
            except Exception as e:  # e.g. gloo without CUDA support: report, do not time
                not_measured[peer] = f"{type(e).__name__}: {e}"
                continue
            _sync(device)
            expected = _shared_tensors(args, workload, torch.device("cpu"), 0, gb)
            base = size * (size + 1) / 2 - size  # sum over ranks of (rank + 1) minus one each
            bad = [i for i, (t, e) in enumerate(zip(ts, expected))
                   if not torch.equal(t.cpu(), e * size + base)]
            if bad:
                raise AssertionError(f"{peer} {workload}: tensors {bad[:5]} are not the sum "
                                     "over the ranks")
            if peer.startswith("spark_dl"):
                after = _staging_counts()
                staging[f"{workload}.{peer}"] = {k: after[k] - before[k] for k in after}
            peers.append(peer)
        times = {p: [] for p in peers}
        for it in range(args.warmup + args.iters):
            for peer in peers[it % len(peers):] + peers[:it % len(peers)]:
                ts = _shared_tensors(args, workload, device, rank, gb)
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                fns[peer](ts, f"{workload}.{peer}")
                _sync(device)
                if it >= args.warmup:
                    times[peer].append(time.perf_counter() - start)
        results[workload] = {p: _percentiles(t) for p, t in times.items()}
    if device.type == "cuda":
        wrong = {k: v for k, v in staging.items() if v["staged"] == 0 or v["direct_nccl"]}
        if wrong:
            raise AssertionError(f"two ranks on one GPU, yet allreduces were not staged "
                                 f"through host memory (or ran on NCCL directly): {wrong}")
    _end_group(dist, hvd)
    if rank != 0:
        return None
    return {"size": size, "device": str(device), "allreduce_s": results,
            "not_measured": not_measured, "staging": staging,
            "large_bytes": _large_elems(args, gb) * 4,
            "small_count": args.small_count or gb.SMALL_COUNT,
            "pyspark_imports_refused": list(NO_PYSPARK.attempts)}


def worker(args):
    """Runs the job's tasks in order; rank 0 prints each one's result as it is done (a task
    that fails ends the job, and the driver runs the rest in a new one)."""
    _refuse_pyspark()
    if args.dump_at:  # a job about to be killed shows where every thread waits
        faulthandler.dump_traceback_later(max(1.0, args.dump_at - time.time()), exit=False)
    import spark_dl.numpy as sdl

    sdl.init()
    fns = {"estimator": _estimator_worker, "step": _step_worker,
           "shared_gpu": _shared_gpu_worker}
    for task in args.tasks.split(","):
        part, _, framework = task.partition(".")
        t0 = time.monotonic()
        result = fns[part](args, framework)
        # What the task left (Lightning's trainers, models) goes now, on every rank alike,
        # rather than whenever the garbage collector runs during the next task.
        gc.collect()
        sdl.barrier()
        if result is not None:
            result["seconds"] = time.monotonic() - t0
            result["pyspark_loaded"] = "pyspark" in sys.modules
            import torch

            result["device_name"] = (torch.cuda.get_device_name(0) if args.device == "cuda"
                                     else "CPU")
            print(MARK + json.dumps({"task": task, "result": result}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; fails without CUDA) or cpu (a check of the code)")
    p.add_argument("--parts", default=",".join(PARTS), help="of " + ", ".join(PARTS))
    p.add_argument("--quick", action="store_true", help="tiny sizes: " + json.dumps(QUICK))
    p.add_argument("--np", type=int, default=0,
                   help="ranks of (a) and (b) (default: one per GPU; 2 with --device cpu)")
    p.add_argument("--iters", type=int, help="(b), (c): timed iterations per peer (30)")
    p.add_argument("--warmup", type=int, help="(b), (c): untimed iterations first (5)")
    p.add_argument("--rounds", type=int, help="(a): timed fits per device and framework (2)")
    p.add_argument("--rows", type=int, help="(a): training rows (2048)")
    p.add_argument("--epochs", type=int, help="(a): epochs per fit, the first untimed (3)")
    p.add_argument("--batch-size", type=int, help="(a), (b): rows per step and rank (64)")
    p.add_argument("--width", type=int, help="SmallCNN's width (32)")
    p.add_argument("--small-count", type=int, help="(c): the small tensors (default gpu.py's 200)")
    p.add_argument("--large-mib", type=int, help="(c): the large tensor (default gpu.py's 64)")
    p.add_argument("--collective-timeout", type=int, default=120,
                   help="torch.distributed's timeout in the jobs, s")
    p.add_argument("--timeout", type=float, default=600.0, help="the whole run, s")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tasks", help=argparse.SUPPRESS)
    p.add_argument("--dump-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--idx", help=argparse.SUPPRESS)
    args = p.parse_args()
    defaults = dict(iters=30, warmup=5, rounds=2, rows=2048, epochs=3, batch_size=64, width=32)
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.worker:
        return worker(args)

    deadline = time.monotonic() + args.timeout
    _refuse_pyspark()
    import torch

    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        sys.exit(f"--parts takes {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_train.py: no CUDA device here (torch.cuda.is_available() is "
                 "False); --device cpu checks the code on the CPU")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    np_ = args.np or (max(1, gpus) if args.device == "cuda" else 2)
    print(f"benchmarks/gpu_train.py: --device {args.device}, "
          f"{torch.cuda.get_device_name(0) if gpus else 'CPU'}, {np_} rank(s) for (a) and (b), "
          f"2 for (c), torch {torch.__version__}, parts {', '.join(parts)}", flush=True)
    # Jobs: the tasks with the same number of ranks share one (each job pays the imports).
    tasks = ([f"estimator.{fw}" for fw in FRAMEWORKS] if "estimator" in parts else []) + \
        (["step"] if "step" in parts else [])
    groups = {np_: tasks} if tasks else {}
    if "shared_gpu" in parts:
        groups.setdefault(2, []).append("shared_gpu")
    results, failures = {}, {}
    tmp = tempfile.mkdtemp(prefix="sdl_gpu_train_")
    try:
        if "estimator" in parts:
            args.store = os.path.join(tmp, "store")
            args.idx = _write_dataset(args.store, args.rows)
        for n, group in groups.items():
            got, failed = run_tasks(os.path.abspath(__file__), args, group, n, deadline)
            results.update(got)
            failures.update(failed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    problems = [f"{task}: {why}" for task, why in failures.items()]
    not_measured = []
    if "estimator" in parts:
        report_estimator({fw: results.get(f"estimator.{fw}") for fw in FRAMEWORKS}, problems)
    if results.get("step"):
        report_step(results["step"])
    if results.get("shared_gpu"):
        report_shared(results["shared_gpu"])
        not_measured += [f"shared_gpu {k}" for k in results["shared_gpu"]["not_measured"]]
    refused = sorted({w for r in results.values() for w in r["pyspark_imports_refused"]}
                     | set(NO_PYSPARK.attempts))
    print("\npyspark imports refused (the GPU machine has none): "
          + (", ".join(refused) if refused else "none"))
    loaded = [t for t, r in results.items() if r.get("pyspark_loaded")]
    if loaded:  # then the refusal above did not hold, and the run proves nothing about it
        problems.append(f"pyspark was loaded in the workers of {', '.join(loaded)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "results": results, "failures": problems,
                       "not_measured": not_measured, "pyspark_imports_refused": refused,
                       "args": {k: v for k, v in vars(args).items() if k not in ("worker",)}},
                      f, indent=1)
    for line in problems:
        print(f"FAILED {line}")
    if problems:
        sys.exit(1)
    if not_measured:
        sys.exit(3)


if __name__ == "__main__":
    # Run as the module "gpu_train" (importable by that name from benchmarks/): the timing
    # callbacks pickled into train()'s spec then refer to this module's RECORDS, not to a
    # copy made by cloudpickle (which copies what __main__ defines).
    import gpu_train

    gpu_train.main()
