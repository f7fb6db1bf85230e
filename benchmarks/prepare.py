"""prepare_data against a plain ``df.write.parquet`` of the same columns and partitions.

    PYTHONPATH=. .venv/bin/python benchmarks/prepare.py                 # 1M rows, 3 repeats
    PYTHONPATH=. .venv/bin/python benchmarks/prepare.py --quick         # 100k rows, 2 repeats

One ``local[--cores]`` application. The data (``--rows`` rows: 8 double columns, an
``array<float>`` of ``--width`` and the same values as a dense Spark ML vector, and a double
label) is generated, cached and counted first, so both peers read it from Spark's cache. Per
column kind (``scalar``: the 8 doubles; ``array``; ``vector``; each with the label) the two
peers run alternately ``--repeats`` times after one warm-up pair:

* ``prepare_data``: ``prepare_data(cores, store, df, ["label"], features)`` with a fresh
  cache each time (so it writes: its checks, the split, Parquet through the store), then
  the dataset is removed;
* ``write.parquet``: ``df.select(features + ["label"]).coalesce(n).write.parquet(path)``
  with ``n`` the file count ``prepare_data`` uses (``cores * partitions_per_process``, or
  the DataFrame's own partitions when fewer).

Prints the medians, min-max and the ratio of medians (prepare_data / write.parquet; the
target is <= 1.3x) per kind, and the load average before and after.
"""

import argparse
import json
import os
import shutil
import statistics
import time

from _spark import local_spark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"scalar": [f"s{i}" for i in range(8)], "array": ["features"], "vector": ["vec"]}


def make_data(spark, rows, width, partitions):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    df = spark.range(0, rows, numPartitions=partitions)
    df = df.select(*[F.rand(seed=100 + i).alias(f"s{i}") for i in range(8)],
                   F.array(*[F.rand(seed=i).cast("float") for i in range(width)])
                   .alias("features"), F.rand(seed=10_000).alias("label"))
    df = df.withColumn("vec", array_to_vector("features")).cache()
    df.count()
    return df


def run_prepare(df, store, cols, cores):
    from spark_dl.spark.common.cache import TrainingDataCache
    from spark_dl.spark.common.util import prepare_data, remove_dataset

    cache = TrainingDataCache()
    t0 = time.perf_counter()
    idx = prepare_data(cores, store, df, ["label"], cols, cache=cache)
    secs = time.perf_counter() - t0
    remove_dataset(store, idx, cache)
    return secs


def run_write(df, path, cols, files):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    df.select(*cols, "label").coalesce(files).write.parquet(path)
    secs = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return secs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--partitions", type=int, default=8, help="partitions of the source data")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="scalar,array,vector")
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench_prepare"))
    p.add_argument("--quick", action="store_true", help="100k rows, 2 repeats")
    p.add_argument("--json", metavar="FILE", help="also save the samples to FILE")
    args = p.parse_args()
    if args.quick:
        args.rows, args.repeats = 100_000, 2

    from spark_dl.spark.common.store import Store

    load0 = os.getloadavg()
    shutil.rmtree(args.workdir, ignore_errors=True)
    store = Store.create(os.path.join(args.workdir, "store"))
    spark = local_spark("spark_dl-bench-prepare", args.cores,
                        {"spark.python.worker.reuse": "true"})
    df = make_data(spark, args.rows, args.width, args.partitions)
    files = min(args.partitions, args.cores * 10)  # prepare_data's partitions_per_process
    results = {}
    for kind in args.kinds.split(","):
        cols = KINDS[kind]
        samples = {"prepare_data": [], "write.parquet": []}
        for rep in range(args.repeats + 1):  # the first pair warms up
            pair = {"prepare_data": run_prepare(df, store, cols, args.cores),
                    "write.parquet": run_write(df, os.path.join(args.workdir, "plain"), cols,
                                               files)}
            if rep:
                for name, secs in pair.items():
                    samples[name].append(secs)
        results[kind] = samples
    spark.stop()

    print(f"\n{args.rows} rows, {args.partitions} cached partitions -> {files} files, "
          f"local[{args.cores}], {args.repeats} alternated repeats; load average "
          f"{load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    for kind, samples in results.items():
        med = {n: statistics.median(v) for n, v in samples.items()}
        ratio = med["prepare_data"] / med["write.parquet"]
        line = " | ".join(f"{n} {med[n]:.2f} s ({min(v):.2f}-{max(v):.2f})"
                          for n, v in samples.items())
        print(f"{kind:>7} ({', '.join(KINDS[kind])[:30]}): {line} | {ratio:.2f}x "
              f"(target <= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": results}, f, indent=1)


if __name__ == "__main__":
    main()
