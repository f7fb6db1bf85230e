"""spark_dl's front door in one minute: a PyTorch model trained on a Spark DataFrame.

    python examples/spark/torch_estimator_demo.py                 # starts local[2] itself
    spark-submit --master 'local[2]' examples/spark/torch_estimator_demo.py

Embedded defaults: a local Spark session, a temporary LocalStore for the prepared data and
checkpoints, Gloo between the two training processes. The DataFrame holds a feature
vector per row and a numeric label; ``TorchEstimator.fit`` prepares it as Parquet, trains on
two Spark-hosted workers (gradients averaged by spark_dl's core), and returns a
``TorchModel``, whose ``transform`` adds a prediction column. The script checks that those
predictions equal the returned torch module applied locally.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession

from spark_dl.spark.torch import TorchEstimator


def make_data(spark, rows: int, seed: int = 0):
    """y = sin(x0) + x1 * x2 - 0.5 * x3 + noise, with x in a Spark ML vector column."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(rows, 4))
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3] + rng.normal(0, 0.05, rows)
    return spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                                 ["features", "label"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None,
                        help="Spark master when not run by spark-submit (default local[2])")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--timings", action="store_true",
                        help="print the fit's start-up phases as one JSON line "
                             "(benchmarks/demo.py reads it)")
    parser.add_argument("--fits", type=int, default=1,
                        help="fit this many times in the application (a later fit starts "
                             "from warm executors and workers)")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_dl TorchEstimator demo") \
        .config("spark.ui.showConsoleProgress", "false")
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or "local[2]") \
            .config("spark.sql.shuffle.partitions", "4")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        df = make_data(spark, args.rows)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1))

        def mae(output, label):
            return (output - label).abs().mean()

        estimator = TorchEstimator(
            num_proc=args.num_proc, model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
            loss=torch.nn.functional.mse_loss, metrics=[mae],
            feature_cols=["features"], label_cols=["label"],
            batch_size=64, epochs=args.epochs, validation=0.2)
        for _ in range(max(args.fits, 1)):
            start = time.time()
            torch_model = estimator.fit(df)          # store=None: a temporary LocalStore
            history = torch_model.getHistory()
            if args.timings:
                print("timings: " + json.dumps({k: v for k, v in torch_model.timings.items()
                                                if k != "epoch_s"}))
            print(f"fit: {time.time() - start:.1f}s, val_loss {history['val_loss'][0]:.3f} "
                  f"-> {history['val_loss'][-1]:.3f}")

        rows = torch_model.transform(df).toPandas()   # adds "label__output"
        print(rows.head(8).to_string(max_colwidth=40))
        with torch.no_grad():
            local = torch_model.getModel()(torch.tensor(np.stack([v.toArray() for v in
                                                                  rows["features"]]),
                                                        dtype=torch.float32))
        assert np.allclose(rows["label__output"], local.numpy().ravel(), atol=1e-5)
        assert history["val_loss"][-1] < history["val_loss"][0], history
        print(f"torch_estimator_demo: OK, {len(history['epoch'])} epochs on "
              f"{args.num_proc} workers; transform() matches the trained torch module")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
