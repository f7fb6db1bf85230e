"""Tabular regression in the style of Horovod's Rossmann example: daily sales of stores,
with a Keras model that embeds the categorical columns, trained by ``KerasEstimator``.

    .venv/bin/python examples/spark/keras_estimator_tabular.py           # starts local[2]
    .venv/bin/spark-submit --master 'local[2]' examples/spark/keras_estimator_tabular.py

The script generates sales-like data (store id, day of week, month, promotion, distance to
the nearest competitor; sales depend on all of them, multiplicatively), trains on the log of
sales with one model input per column (embeddings for the categories), reports the root
mean squared percentage error (RMSPE, the Kaggle competition's metric) on held-out days,
saves the ``KerasModel`` and checks that the loaded one predicts the same. On a cluster
pass ``--store`` (a prefix every executor can reach) and ``--output``.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.keras import KerasEstimator, KerasModel  # noqa: E402

STORES = 50


def make_sales(spark, rows: int, seed: int = 0):
    """One row per store and day: log(sales) from store, weekday, month, promo, distance."""
    rng = np.random.default_rng(seed)
    store_level = rng.lognormal(8.5, 0.4, STORES)
    weekday = np.array([1.0, 0.95, 0.95, 1.0, 1.1, 1.25, 0.6])
    season = 1 + 0.15 * np.sin(np.arange(12) / 12 * 2 * np.pi)
    store = rng.integers(0, STORES, rows)
    dow = rng.integers(0, 7, rows)
    month = rng.integers(0, 12, rows)
    promo = rng.integers(0, 2, rows)
    dist = rng.lognormal(7, 1, rows)
    sales = (store_level[store] * weekday[dow] * season[month] * (1 + 0.3 * promo)
             * (1 - 0.1 / (1 + dist / 1000)) * rng.lognormal(0, 0.05, rows))
    data = [(int(s), int(d), int(m), float(p), float(np.log1p(x) / 10), float(np.log(y)))
            for s, d, m, p, x, y in zip(store, dow, month, promo, dist, sales)]
    return spark.createDataFrame(
        data, ["store", "dow", "month", "promo", "log_distance", "log_sales"])


def build_model():
    """One input per column: embeddings for store, weekday and month, numbers as they are."""
    cats = {"store": (STORES, 8), "dow": (7, 3), "month": (12, 3)}
    inputs, parts = [], []
    for name, (n, dim) in cats.items():
        inp = keras.Input((1,), dtype="int32", name=name)
        inputs.append(inp)
        parts.append(keras.layers.Flatten()(keras.layers.Embedding(n, dim)(inp)))
    for name in ("promo", "log_distance"):
        inp = keras.Input((1,), name=name)
        inputs.append(inp)
        parts.append(inp)
    x = keras.layers.Concatenate()(parts)
    x = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    # Sales are around e^8.5: start the output there so training refines, not climbs.
    out = keras.layers.Dense(1, bias_initializer=keras.initializers.Constant(8.5))(x)
    return keras.Model(inputs, out)


def exp_rmspe(y_true, y_pred):
    """RMSPE of sales from log-sales predictions (a custom metric, via custom_objects)."""
    pct = (keras.ops.exp(y_pred) - keras.ops.exp(y_true)) / keras.ops.exp(y_true)
    return keras.ops.sqrt(keras.ops.mean(keras.ops.square(pct)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--store", help="store prefix (default: a temporary directory)")
    parser.add_argument("--output", help="where to save the model (default: temporary)")
    args = parser.parse_args()

    spark = SparkSession.builder.master(os.environ.get("MASTER", "local[2]")) \
        .appName("keras_estimator_tabular").getOrCreate()
    tmp = tempfile.mkdtemp(prefix="keras_tabular_")
    store = Store.create(args.store or os.path.join(tmp, "store"))
    df = make_sales(spark, args.rows)
    train, test = df.randomSplit([0.9, 0.1], seed=1)
    features = ["store", "dow", "month", "promo", "log_distance"]

    keras.utils.set_random_seed(0)
    estimator = KerasEstimator(
        num_proc=args.num_proc, store=store, model=build_model(),
        optimizer=keras.optimizers.Adam(2e-3), loss="mae", metrics=[exp_rmspe],
        custom_objects={"exp_rmspe": exp_rmspe}, feature_cols=features,
        label_cols=["log_sales"], validation=0.1, batch_size=128, epochs=args.epochs)
    model = estimator.fit(train)
    print("history val_exp_rmspe:",
          [round(v, 4) for v in model.getHistory()["val_exp_rmspe"]])

    pred = model.transform(test).select("log_sales", "log_sales__output").toPandas()
    actual, guess = np.exp(pred["log_sales"]), np.exp(pred["log_sales__output"])
    rmspe = float(np.sqrt(np.mean(((guess - actual) / actual) ** 2)))
    print(f"test RMSPE: {rmspe:.4f} on {len(pred)} held-out rows")

    path = args.output or os.path.join(tmp, "model")
    model.write().overwrite().save(path)
    loaded = KerasModel.load(path)
    again = loaded.transform(test).select("log_sales__output").toPandas()
    np.testing.assert_allclose(again["log_sales__output"], pred["log_sales__output"], rtol=1e-5)
    print(f"saved to {path}; the loaded model predicts the same")
    spark.stop()
    if rmspe > 0.25:
        raise SystemExit(f"RMSPE {rmspe:.3f} is worse than expected (0.25)")


if __name__ == "__main__":
    main()
