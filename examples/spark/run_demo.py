"""Run a function on workers hosted by Spark executors with ``spark_dl.spark.run``.

Through spark-submit (any master; spark_dl must be importable on the executors):

    spark-submit --master 'local[2]' examples/spark/run_demo.py --num-proc 2

or as a plain script, which then starts a ``local[2]`` session itself:

    python examples/spark/run_demo.py

Each worker is a fresh Python process with its rank environment: it calls
``spark_dl.numpy.init()``, averages a "gradient" with the other workers, and returns a
value; ``run`` returns the values ordered by rank. Worker output reaches this driver
prefixed with the rank (``[1]<stdout>:...``).
"""

import argparse
import os
import sys

from pyspark.sql import SparkSession

import spark_dl.spark


def train(scale):
    """What each worker runs: a stand-in for one data-parallel training step."""
    import numpy as np

    import spark_dl.numpy as sdl
    from spark_dl.spark.launch.task import get_available_devices

    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    grad = np.full(4, float(rank + 1) * scale, dtype=np.float32)
    mean = sdl.allreduce(grad, name="grad", op=sdl.Average)
    print(f"rank {rank}/{size} (local rank {sdl.local_rank()}, GPUs "
          f"{get_available_devices() or 'none'}): averaged gradient {mean.tolist()}")
    return rank, float(mean[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=None,
                        help="number of workers (default: the default parallelism)")
    parser.add_argument("--master", default=None,
                        help="Spark master when not run by spark-submit (default local[2])")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_dl run demo")
    # spark-submit hands its settings (master included) to this process through the
    # gateway it started; a plain `python` run picks its own master.
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or "local[2]")
        # Executors must run this interpreter (spark-submit users set PYSPARK_PYTHON).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = builder.getOrCreate()
    try:
        results = spark_dl.spark.run(train, args=(2.0,), num_proc=args.num_proc)
        size = len(results)
        expected = 2.0 * (size + 1) / 2  # mean of 2*(r+1) over ranks r = 0..size-1
        assert [rank for rank, _ in results] == list(range(size)), results
        assert all(abs(mean - expected) < 1e-6 for _, mean in results), results
        print(f"run_demo: OK, {size} workers returned {results}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
