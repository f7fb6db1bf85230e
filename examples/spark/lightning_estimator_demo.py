"""A PyTorch Lightning module trained on a Spark DataFrame with LightningEstimator.

    .venv/bin/python examples/spark/lightning_estimator_demo.py          # starts local[2]
    spark-submit --master 'local[2]' examples/spark/lightning_estimator_demo.py

The LightningModule configures its own optimizer and learning-rate schedule and logs its
metrics with ``self.log``; an EarlyStopping callback watches ``val_loss`` and a CSVLogger
writes Lightning's own log. ``fit`` prepares the DataFrame as Parquet in the store, trains
on two Spark-hosted workers (``Trainer.fit`` with spark_dl's SparkDLStrategy: gradients
averaged by spark_dl's core), writes a Lightning checkpoint into the store after every
epoch, and returns a ``LightningModel`` whose ``transform`` adds a prediction column. The
script checks those predictions against the trained module applied locally, then fits
again with the same ``run_id`` and two more epochs: training resumes from the checkpoint.
"""

import argparse
import os
import sys
import tempfile
import time

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession

from spark_dl.spark.common.store import Store
from spark_dl.spark.lightning import LightningEstimator


class Regressor(pl.LightningModule):
    """A small MLP; batches arrive as dicts column -> tensor."""

    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def _loss(self, batch):
        out = self(batch["features"]).squeeze(-1)
        return F.mse_loss(out, batch["label"]), (out - batch["label"]).abs().mean()

    def training_step(self, batch, batch_idx):
        loss, mae = self._loss(batch)
        self.log("train_mae", mae)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, mae = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_mae", mae, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return {"optimizer": opt, "lr_scheduler": sched}


def make_data(spark, rows: int, seed: int = 0):
    """label = sin(x0) + x1 * x2 - 0.5 * x3 + noise, with x in a Spark ML vector column."""
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
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--store", default=None, help="store path (default: a temporary one)")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_dl LightningEstimator demo") \
        .config("spark.ui.showConsoleProgress", "false")
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or "local[2]") \
            .config("spark.sql.shuffle.partitions", "4")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    store = Store.create(args.store or tempfile.mkdtemp(prefix="spark_dl_lightning_demo_"))
    try:
        df = make_data(spark, args.rows)
        common = dict(num_proc=args.num_proc, model=Regressor(), feature_cols=["features"],
                      label_cols=["label"], batch_size=64, validation=0.2, store=store,
                      run_id="demo",
                      callbacks=[EarlyStopping(monitor="val_loss", patience=3)],
                      logger=CSVLogger("logs", name="demo"))
        start = time.time()
        model = LightningEstimator(epochs=args.epochs, **common).fit(df)
        history = model.getHistory()
        print(f"fit: {time.time() - start:.1f}s, val_loss {history['val_loss'][0]:.3f} -> "
              f"{history['val_loss'][-1]:.3f}; history keys {sorted(history)}")

        rows = model.transform(df).toPandas()          # adds "label__output"
        print(rows.head(5).to_string(max_colwidth=40))
        with torch.no_grad():
            local = model.getModel()(torch.tensor(np.stack([v.toArray() for v in
                                                            rows["features"]]),
                                                  dtype=torch.float32))
        assert np.allclose(rows["label__output"], local.numpy().ravel(), atol=1e-5)
        assert history["val_loss"][-1] < history["val_loss"][0], history

        # The same run_id with more epochs resumes after the last checkpointed epoch
        # (weights, optimizer, scheduler and EarlyStopping state restored).
        more = LightningEstimator(epochs=args.epochs + 2, **common).fit(df)
        epochs = more.getHistory()["epoch"]
        print(f"resumed: epochs {epochs}; checkpoint {store.get_checkpoint_path('demo')}")
        assert epochs[:len(history["epoch"])] == history["epoch"], epochs
        print(f"lightning_estimator_demo: OK, {len(epochs)} epochs on {args.num_proc} "
              "workers; transform() matches the trained module")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
