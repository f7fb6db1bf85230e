"""Data pipeline benchmark: prepare_data rows/s, and rows/s from the same Parquet files to
torch batches for spark_dl's Arrow loader and for petastorm (make_batch_reader + its
BatchedDataLoader).

    PYTHONPATH=. .venv/bin/python benchmarks/dataloader.py                 # 2M rows x 64 float32
    PYTHONPATH=. .venv/bin/python benchmarks/dataloader.py --rows 200000   # smaller

petastorm 0.13.1 does not import with the pyarrow/numpy this project uses, so it runs in its own
virtual environment (``--petastorm-python``, default ``build/petastorm-venv/bin/python``),
reading the same files in the same benchmark run. ``--setup-petastorm`` creates that
environment (pyarrow 10, numpy < 2, torch pinned by constraints.txt, petastorm without its
setuptools pin). Results are printed as a table and written as JSON (``--json``).

Both loaders are measured single-rank, one epoch each after a warm-up epoch (so the files are
in the page cache for both), in two modes: no shuffling, and shuffling with the same row
buffer size (spark_dl: row-group order + shuffle pool; petastorm: row-group order +
``shuffling_queue_capacity``).

The same run also times pyarrow alone decoding the same row groups (memory-mapped, the
same number of threads, no batches made), alternated with the loader's in-order epochs: the
ceiling that the machine and the state of its page cache set that day.

spark_dl's loader also reads a copy of the same rows in the format-1 layout (features as a
Parquet ``list<float>``, same row groups) written by this script, alternated with the
prepared (raw, format 2) files for ``--rounds`` rounds; medians and ranges are printed, with
the bytes/s against a plain NumPy copy of the same array on this machine (``anchor_memcpy``).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from _spark import local_spark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PST_VENV = os.path.join(ROOT, "build", "petastorm-venv")


# ----------------------------------------------------------------------------- petastorm side
# Runs under the petastorm interpreter: imports nothing from spark_dl, pyspark or pyarrow>=15.

def petastorm_epoch(url, batch_size, shuffle, buffer_rows, workers):
    import torch
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    rows = 0
    t0 = time.perf_counter()
    with make_batch_reader(url, num_epochs=1, shuffle_row_groups=shuffle, seed=0,
                           reader_pool_type="thread", workers_count=workers) as reader:
        loader = BatchedDataLoader(reader, batch_size=batch_size,
                                   shuffling_queue_capacity=buffer_rows if shuffle else 0)
        for batch in loader:
            assert isinstance(batch["features"], torch.Tensor)
            rows += batch["features"].shape[0]
    return rows, time.perf_counter() - t0


def petastorm_main(args):
    import petastorm

    out = {"petastorm_version": petastorm.__version__}
    for mode, shuffle in (("no_shuffle", False), ("shuffle", True)):
        petastorm_epoch(args.url, args.batch_size, shuffle, args.buffer_rows, args.threads)
        rows, secs = petastorm_epoch(args.url, args.batch_size, shuffle, args.buffer_rows,
                                     args.threads)
        out[mode] = {"rows": rows, "seconds": secs, "rows_per_s": rows / secs}
    print("PETASTORM_RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- spark_dl side

def prepare(args, store):
    from pyspark.sql import functions as F

    from spark_dl.spark.common.cache import TrainingDataCache
    from spark_dl.spark.common.util import prepare_data

    spark = local_spark("spark_dl-bench-data", args.cores)
    df = spark.range(0, args.rows, numPartitions=args.cores * 2).select(
        F.array(*[F.rand(seed=i).cast("float") for i in range(args.dim)]).alias("features"),
        F.rand(seed=10_000).alias("label"))
    t0 = time.perf_counter()
    idx = prepare_data(args.cores, store, df, ["label"], ["features"], cache=TrainingDataCache(),
                       verbose=1)
    secs = time.perf_counter() - t0
    spark.stop()
    return idx, {"rows": args.rows, "seconds": secs, "rows_per_s": args.rows / secs}


def list_copy(source, workdir):
    """The prepared files rewritten in the format-1 layout: raw columns as Parquet lists, the
    same row groups; returns a DataSource over them with the same column specs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.spark.common import raw_columns
    from spark_dl.spark.common.data_loader_base import DataSource

    out_dir = os.path.join(workdir, "format1")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for i, path in enumerate(source.files):
        pf = pq.ParquetFile(path)
        out = os.path.join(out_dir, f"part-{i:05d}.parquet")
        writer = None
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g)
            cols = []
            for field, col in zip(table.schema, table.columns):
                raw = raw_columns.spec_of_field(field)
                if raw is not None:
                    dtype, length = raw
                    values = raw_columns.decode(col.combine_chunks(), dtype, length)
                    col = pa.ListArray.from_arrays(
                        pa.array(np.arange(0, values.size + 1, length, dtype=np.int32)),
                        pa.array(values.ravel()))
                cols.append(col)
            table = pa.table(cols, names=table.schema.names)
            if writer is None:
                writer = pq.ParquetWriter(out, table.schema, compression="snappy")
            writer.write_table(table, row_group_size=table.num_rows)
        writer.close()
        files.append(out)
    return DataSource(files=files, row_groups=source.row_groups, columns=source.columns)


def anchor_memcpy(rows, dim):
    """Bytes/s of a NumPy copy of a (rows, dim) float32 array plus a float64 column (the
    loader's output), best of 5."""
    import numpy as np

    src = [np.ones((rows, dim), np.float32), np.ones(rows)]
    dst = [np.empty_like(a) for a in src]
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for a, b in zip(src, dst):
            np.copyto(b, a)
        best = max(best, sum(a.nbytes for a in src) / (time.perf_counter() - t0))
    return best


def pyarrow_epoch(source, threads):
    """Rows/s of pyarrow alone decoding the same row groups as the loader (memory-mapped,
    ``threads`` threads, one row group per call, no batches made): the ceiling that the
    machine and its page cache set today, measured beside the loader in the same run."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(source.columns)

    def read(item):
        path, group = item
        return pq.ParquetFile(pa.memory_map(path)).read_row_group(
            group, columns=columns, use_threads=False).num_rows

    work = [(path, g) for path, groups in zip(source.files, source.row_groups)
            for g in range(len(groups))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        rows = sum(pool.map(read, work))
    return rows, time.perf_counter() - t0


def _spread(values):
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_main(args):
    """The loader measurements (run in their own process by main): both formats, both
    modes, alternated; prints one LOADER_RESULT line of JSON."""
    from spark_dl.spark.common.data_loader_base import DataSource
    from spark_dl.spark.common.store import Store

    source = DataSource.from_store(Store.create(args.workdir), args.idx)
    old = DataSource(files=sorted(os.path.join(args.workdir, "format1", f)
                                  for f in os.listdir(os.path.join(args.workdir, "format1"))),
                     row_groups=source.row_groups, columns=source.columns)
    sources = {"spark_dl": source, "spark_dl_format1": old}
    results = {name: {} for name in sources}
    results["pyarrow_read"] = {}
    for mode, shuffle in (("no_shuffle", False), ("shuffle", True)):
        samples = {name: [] for name in sources}
        for name, src in sources.items():
            ours_epoch(src, args, shuffle, 0)  # warm-up (page cache, lazy imports)
        for _ in range(args.rounds):  # alternated: the machine's load hits both alike
            for name, src in sources.items():
                rows, secs = ours_epoch(src, args, shuffle, 1)
                assert rows == args.rows, (rows, args.rows)
                samples[name].append(rows / secs)
            if not shuffle:
                samples.setdefault("pyarrow_read", [])
                rows, secs = pyarrow_epoch(source, args.threads)
                assert rows == args.rows, (rows, args.rows)
                samples["pyarrow_read"].append(rows / secs)
        for name, values in samples.items():
            results[name][mode] = dict(_spread(values), rows_per_s=_spread(values)["median"])
    print("LOADER_RESULT " + json.dumps(results), flush=True)


def ours_epoch(source, args, shuffle, epoch):
    from spark_dl.spark.common.data_loader import ArrowDataLoader
    from spark_dl.spark.torch.util import torch_batch

    loader = ArrowDataLoader(source, batch_size=args.batch_size, shuffle=shuffle, seed=0,
                             shuffle_buffer_size=args.buffer_rows, num_threads=args.threads)
    loader.set_epoch(epoch)
    rows = 0
    t0 = time.perf_counter()
    for batch in loader:
        batch = torch_batch(batch)  # as petastorm's torch loader yields tensors
        rows += batch["features"].shape[0]
    return rows, time.perf_counter() - t0


def run_petastorm(args, url):
    python = args.petastorm_python
    if not os.path.exists(python):
        if not args.setup_petastorm:
            return {"skipped": f"no petastorm interpreter at {python}; rerun with "
                               "--setup-petastorm or --petastorm-python PATH"}
        setup_petastorm_venv(os.path.dirname(os.path.dirname(python)))
    cmd = [python, os.path.abspath(__file__), "--petastorm-worker", "--url", url,
           "--batch-size", str(args.batch_size), "--buffer-rows", str(args.buffer_rows),
           "--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("PETASTORM_RESULT "):
            return json.loads(line[len("PETASTORM_RESULT "):])
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}


def setup_petastorm_venv(venv):
    """pyarrow 10 / numpy<2 / torch (pinned) / petastorm 0.13.1 in their own environment.
    petastorm is installed without dependencies because it declares setuptools<70, which
    torch 2.13 (setuptools>=77) excludes; it imports and runs without that pin."""
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    constraints = ["-c", os.path.join(ROOT, "constraints.txt")]
    subprocess.run([_base_python(), "-m", "venv", venv], check=True)
    subprocess.run(pip + ["pyarrow==10.0.1", "numpy<2", "pandas<2.2", "torch"] + constraints,
                   check=True)
    subprocess.run(pip + ["--no-deps", "petastorm==0.13.1"], check=True)
    subprocess.run(pip + ["dill", "diskcache", "future", "packaging", "psutil", "pyzmq", "six",
                          "fsspec"], check=True)


def _base_python():
    """The interpreter this venv was made from (a venv cannot be nested in another)."""
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}."
                                                f"{sys.version_info[1]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--buffer-rows", type=int, default=16384,
                   help="shuffle buffer rows, the same for both loaders")
    p.add_argument("--threads", type=int, default=2, help="reader threads for both loaders")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed epochs per format and mode, alternated")
    p.add_argument("--cores", type=int, default=2, help="Spark local[N] for prepare_data")
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench_dataloader"))
    p.add_argument("--petastorm-python", default=os.path.join(DEFAULT_PST_VENV, "bin", "python"))
    p.add_argument("--setup-petastorm", action="store_true")
    p.add_argument("--skip-petastorm", action="store_true")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--petastorm-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--measure-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--idx", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.petastorm_worker:
        return petastorm_main(args)
    if args.measure_worker:
        return measure_main(args)

    import shutil

    from spark_dl.spark.common.data_loader_base import DataSource
    from spark_dl.spark.common.store import Store

    shutil.rmtree(args.workdir, ignore_errors=True)
    store = Store.create(args.workdir)
    idx, prep = prepare(args, store)
    source = DataSource.from_store(store, idx)
    results = {"rows": args.rows, "dim": args.dim, "batch_size": args.batch_size,
               "buffer_rows": args.buffer_rows, "threads": args.threads,
               "files": len(source.files), "row_groups": sum(map(len, source.row_groups)),
               "prepare_data": prep, "spark_dl": {}, "spark_dl_format1": {}}
    list_copy(source, args.workdir)
    # The loaders run in a fresh process, as in a training worker: not beside this
    # driver's JVM and its Python heap (which cost up to 10% here).
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-worker", "--idx", idx]
    for flag in ("rows", "batch_size", "buffer_rows", "threads", "rounds", "workdir"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADER_RESULT ")]
    if not lines:
        raise RuntimeError(f"the loader measurement failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    results.update(json.loads(lines[-1][len("LOADER_RESULT "):]))
    row_bytes = args.dim * 4 + 8
    results["anchor_memcpy_bytes_per_s"] = anchor_memcpy(args.rows, args.dim)
    if not args.skip_petastorm:
        results["petastorm"] = run_petastorm(args, source.dataset_url)

    print(f"\n{args.rows} rows x {args.dim} float32 + 1 float64 label, batch {args.batch_size}, "
          f"{results['files']} files / {results['row_groups']} row groups, "
          f"{args.threads} reader threads")
    print(f"prepare_data: {prep['rows_per_s']:,.0f} rows/s ({prep['seconds']:.1f} s)")
    pst = results.get("petastorm", {})
    memcpy = results["anchor_memcpy_bytes_per_s"]
    print(f"anchor_memcpy: {memcpy / 1e9:.2f} GB/s = {memcpy / row_bytes:,.0f} rows/s")
    ceiling = results["pyarrow_read"]["no_shuffle"]
    print(f"pyarrow alone ({args.threads} threads, same row groups, no batches): "
          f"{ceiling['median']:,.0f} rows/s ({ceiling['min']:,.0f}-{ceiling['max']:,.0f}); "
          f"spark_dl in order = "
          f"{results['spark_dl']['no_shuffle']['median'] / ceiling['median']:.0%} of it, "
          f"shuffled {results['spark_dl']['shuffle']['median'] / ceiling['median']:.0%}")
    for mode in ("no_shuffle", "shuffle"):
        ours, old = results["spark_dl"][mode], results["spark_dl_format1"][mode]
        line = (f"{mode:>10}: spark_dl {ours['median']:>12,.0f} rows/s "
                f"({ours['min']:,.0f}-{ours['max']:,.0f}; "
                f"{ours['median'] * row_bytes / memcpy:.0%} of memcpy) | format-1 lists "
                f"{old['median']:>10,.0f} rows/s | {ours['median'] / old['median']:.2f}x")
        if mode in pst:
            theirs = pst[mode]["rows_per_s"]
            line += f" | petastorm {theirs:>10,.0f} rows/s | {ours['median'] / theirs:.1f}x"
        print(line)
    print(f"targets: no shuffle >= 6 M rows/s: "
          f"{'met' if results['spark_dl']['no_shuffle']['median'] >= 6e6 else 'NOT met'}; "
          f"shuffle >= 4 M rows/s: "
          f"{'met' if results['spark_dl']['shuffle']['median'] >= 4e6 else 'NOT met'}")
    if "skipped" in pst or "error" in pst:
        print("petastorm:", pst.get("skipped") or pst.get("error"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
