# Databricks notebook source
# MAGIC %md
# MAGIC # TorchEstimator on Databricks
# MAGIC
# MAGIC `torch_estimator.ipynb` (next to this file) on Databricks: a PyTorch model trained on a
# MAGIC Spark DataFrame with spark_dl, through the `spark` session the notebook is given. On
# MAGIC **standard** (formerly shared) and **serverless** compute that session is a Spark
# MAGIC Connect client; on **dedicated** (single user) compute it is a classic session.
# MAGIC spark_dl's fit launches its workers the same way from both: one barrier job whose first
# MAGIC task coordinates the others, so nothing has to connect back to the notebook.
# MAGIC
# MAGIC Import this file into the workspace (Workspace > Import, or a Git folder): Databricks
# MAGIC reads it as a notebook of the cells below.

# COMMAND ----------

# MAGIC %md
# MAGIC ## 1. Install spark_dl
# MAGIC
# MAGIC Install it where the notebook and the executors both see it:
# MAGIC
# MAGIC - notebook-scoped, with `%pip` (the next cell): from your package index
# MAGIC   (`%pip install spark_dl`), or from a wheel in a volume
# MAGIC   (`%pip install /Volumes/<catalog>/<schema>/<volume>/wheels/spark_dl-....whl`);
# MAGIC - or as a cluster library (Compute > your cluster > Libraries > Install new), so that
# MAGIC   every notebook attached to the cluster has it.
# MAGIC
# MAGIC spark_dl has a compiled core (`spark_dl._core`), so the wheel must be built for the
# MAGIC cluster's platform and Python version (Linux x86_64 or aarch64, the runtime's
# MAGIC Python). The shared libraries its build linked against (`ldd` on `spark_dl/_core*.so`
# MAGIC lists them; a default build links Gloo and Open MPI) must be on every node: install
# MAGIC them with a cluster init script, or use a wheel that bundles them. torch comes with
# MAGIC the Databricks Runtime for Machine Learning; elsewhere add it to the `%pip` line.
# MAGIC
# MAGIC `%pip` restarts nothing by itself: the cell after it restarts Python so that the
# MAGIC notebook imports what was installed.

# COMMAND ----------

# MAGIC %pip install spark_dl

# COMMAND ----------

dbutils.library.restartPython()  # noqa: F821 (Databricks defines dbutils)

# COMMAND ----------

# MAGIC %md
# MAGIC ## 2. Settings: the store, the workers, GPUs
# MAGIC
# MAGIC **Store.** Spark writes the prepared training data (Parquet) into the store, the
# MAGIC workers read it and write checkpoints there, and the fit's progress comes back through
# MAGIC it when the cluster cannot reach the notebook (the fitted model returns with the
# MAGIC training job's result), so it must be a path that the notebook and every executor
# MAGIC reach. On Databricks
# MAGIC that is a Unity Catalog volume, `/Volumes/<catalog>/<schema>/<volume>/spark_dl`
# MAGIC (`Store.create` picks `VolumesLocalStore`, through the volume's FUSE path; create the
# MAGIC volume first, and you need WRITE VOLUME on it), or, on compute with DBFS access, a
# MAGIC `/dbfs/...` or `dbfs:/...` path (`DBFSLocalStore`). Without a store, spark_dl uses a
# MAGIC temporary directory on the driver, which only a local master can share: here the fit
# MAGIC refuses to start.
# MAGIC
# MAGIC **Workers.** `num_proc` workers each take one task slot (one executor core, or one GPU
# MAGIC with GPU scheduling), all at the same time: the cluster must have that many free.
# MAGIC
# MAGIC **GPUs.** Standard and serverless compute have no GPUs. To train on GPUs, use
# MAGIC dedicated compute with GPU instance types and a GPU Machine Learning runtime, where
# MAGIC Spark gives each task one GPU (`spark.task.resource.gpu.amount` 1): set `num_proc` to
# MAGIC the number of GPUs and `use_gpu` to true. With `use_gpu` false the workers train on the
# MAGIC CPU (with `use_gpu` true and no GPU they also do, and warn).

# COMMAND ----------

dbutils.widgets.text("store_path", "/Volumes/main/default/spark_dl/spark_dl",  # noqa: F821
                     "Store (a /Volumes or /dbfs path)")
dbutils.widgets.text("num_proc", "2", "Workers")  # noqa: F821
dbutils.widgets.dropdown("use_gpu", "false", ["false", "true"], "Train on GPUs")  # noqa: F821

from spark_dl.spark.common.store import Store

store = Store.create(dbutils.widgets.get("store_path"))  # noqa: F821
num_proc = int(dbutils.widgets.get("num_proc"))  # noqa: F821
use_gpu = dbutils.widgets.get("use_gpu") == "true"  # noqa: F821
print(f"{type(store).__name__} at {store.prefix_path}; {num_proc} workers, use_gpu={use_gpu}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## 3. Data
# MAGIC
# MAGIC `y = sin(x0) + x1 * x2 - 0.5 * x3 + noise`, with the four inputs in one Spark ML
# MAGIC vector column, split into training and test rows. Your own DataFrame (a table read
# MAGIC with `spark.read.table(...)`) takes its place: feature columns of numbers, arrays or
# MAGIC vectors, and a label column.

# COMMAND ----------

import numpy as np
from pyspark.ml.linalg import Vectors

rng = np.random.default_rng(0)
x = rng.uniform(-2, 2, size=(2000, 4))
y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3] + rng.normal(0, 0.05, len(x))
df = spark.createDataFrame(  # noqa: F821 (Databricks defines spark)
    [(Vectors.dense(row), float(label)) for row, label in zip(x, y)], ["features", "label"])
train_df, test_df = df.randomSplit([0.8, 0.2], seed=0)

# COMMAND ----------

# MAGIC %md
# MAGIC ## 4. Fit
# MAGIC
# MAGIC The fit prints one line per epoch with a live bar above them. Where the executors
# MAGIC cannot connect back to the notebook (a Spark Connect client they cannot reach), the
# MAGIC workers' lines may arrive late, in bursts or when the fit ends.

# COMMAND ----------

import torch

from spark_dl.spark.torch import TorchEstimator

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def mae(output, label):
    return (output - label).abs().mean()


estimator = TorchEstimator(
    num_proc=num_proc, store=store, model=net,
    optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
    loss=torch.nn.functional.mse_loss, metrics=[mae],
    feature_cols=["features"], label_cols=["label"],
    batch_size=64, epochs=4, validation=0.2, use_gpu=use_gpu)
model = estimator.fit(train_df)

# COMMAND ----------

# MAGIC %md
# MAGIC ## 5. Training curves
# MAGIC
# MAGIC `model.history_df()` is the history as a pandas DataFrame (one row per epoch);
# MAGIC `model.plot_history()` draws it with matplotlib and returns the figure.

# COMMAND ----------

model.history_df()

# COMMAND ----------

model.plot_history()

# COMMAND ----------

# MAGIC %md
# MAGIC ## 6. Predictions and evaluation
# MAGIC
# MAGIC `transform` runs the model on the executors and adds `label__output` and, for a
# MAGIC regression loss, pyspark.ml's `prediction` column, so `RegressionEvaluator` works with
# MAGIC its default column names.

# COMMAND ----------

from pyspark.ml.evaluation import RegressionEvaluator

scored = model.transform(test_df)
predictions = scored.select("label", "prediction").limit(500).toPandas()
rmse = RegressionEvaluator(metricName="rmse").evaluate(scored)
r2 = RegressionEvaluator(metricName="r2").evaluate(scored)
print(f"test RMSE {rmse:.4f}, R2 {r2:.4f}")
predictions.head(10)

# COMMAND ----------

# MAGIC %md
# MAGIC ## 7. What stays in the store
# MAGIC
# MAGIC Each fit keeps its run under `<store>/runs/<run_id>` (`model.getRunId()`): the
# MAGIC checkpoint after the last epoch, from which a fit with the same `run_id` resumes, and
# MAGIC TensorBoard logs. Remove the directory when you no longer need it.
