"""Tabular regression: a Spark ML feature pipeline and a PyTorch MLP in one PipelineModel.

    python examples/spark/torch_tabular_regression.py            # starts local[2] itself
    spark-submit --master 'local[2]' examples/spark/torch_tabular_regression.py --num-proc 2

The script generates house-price-like data (numeric, integer and categorical columns),
encodes the category (StringIndexer + OneHotEncoder), assembles and scales the features
(VectorAssembler + StandardScaler), and trains an MLP with ``TorchEstimator`` as the last
stage of one ``Pipeline``. It evaluates the RMSE on held-out rows with Spark's
``RegressionEvaluator``, saves the fitted ``PipelineModel``, loads it back and checks that
the loaded pipeline predicts the same. On a cluster pass ``--store`` (a prefix every
executor can reach, e.g. ``hdfs:///tmp/spark_dl`` or ``s3://bucket/spark_dl``) and
``--output`` (where the model is saved).
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.feature import OneHotEncoder, StandardScaler, StringIndexer, VectorAssembler
from pyspark.sql import SparkSession

from spark_dl.spark.common.store import Store
from spark_dl.spark.torch import TorchEstimator

CITIES = ["north", "south", "east", "west", "center"]


def make_houses(spark, rows: int, seed: int = 0):
    """Price (in thousands) from size, rooms, age and city, with noise."""
    rng = np.random.default_rng(seed)
    sqm = rng.uniform(30, 250, rows)
    rooms = np.clip(np.round(sqm / 30 + rng.normal(0, 1, rows)), 1, 10).astype(int)
    age = rng.integers(0, 80, rows)
    city = rng.integers(0, len(CITIES), rows)
    premium = np.array([1.0, 0.8, 0.9, 1.1, 1.6])[city]
    price = (2.5 * sqm * premium + 15 * rooms - 0.8 * age + 40 * np.sqrt(sqm)
             + rng.normal(0, 20, rows))
    data = [(float(s), int(r), int(a), CITIES[c], float(p))
            for s, r, a, c, p in zip(sqm, rooms, age, city, price)]
    return spark.createDataFrame(data, ["sqm", "rooms", "age", "city", "price"])


class MLP(torch.nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(inputs, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None,
                        help="Spark master when not run by spark-submit (default local[2])")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--store", default=None, help="store prefix (default: a temp dir)")
    parser.add_argument("--output", default=None, help="where to save the PipelineModel")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_dl tabular regression") \
        .config("spark.ui.showConsoleProgress", "false")
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or "local[2]") \
            .config("spark.sql.shuffle.partitions", "4")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    workdir = tempfile.mkdtemp(prefix="spark_dl_tabular_")
    try:
        houses = make_houses(spark, args.rows)
        train, test = houses.randomSplit([0.85, 0.15], seed=1)
        # Price in thousands has a large scale: the model learns price / 100.
        train = train.withColumn("target", train.price / 100.0)

        features = StandardScaler(inputCol="raw", outputCol="features", withMean=True)
        n_inputs = 3 + len(CITIES) - 1  # sqm, rooms, age + one-hot city (last dropped)
        torch.manual_seed(0)
        model = MLP(n_inputs)
        estimator = TorchEstimator(
            num_proc=args.num_proc, model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
            loss=torch.nn.functional.mse_loss, feature_cols=["features"],
            label_cols=["target"], batch_size=args.batch_size, epochs=args.epochs,
            validation=0.1, random_seed=42,
            store=Store.create(args.store or os.path.join(workdir, "store")))
        pipeline = Pipeline(stages=[
            StringIndexer(inputCol="city", outputCol="city_idx"),
            OneHotEncoder(inputCols=["city_idx"], outputCols=["city_vec"]),
            VectorAssembler(inputCols=["sqm", "rooms", "age", "city_vec"], outputCol="raw"),
            features, estimator])
        fitted = pipeline.fit(train)

        scored = fitted.transform(test)
        scored = scored.withColumn("prediction", scored.target__output * 100.0)
        rmse = RegressionEvaluator(labelCol="price", predictionCol="prediction",
                                   metricName="rmse").evaluate(scored)
        baseline = test.selectExpr("stddev_pop(price)").first()[0]
        print(f"test RMSE {rmse:.1f} (std of price {baseline:.1f})")

        output = args.output or os.path.join(workdir, "model")
        fitted.write().overwrite().save(output)
        loaded = PipelineModel.load(output)
        again = loaded.transform(test).select("target__output").toPandas()
        first = fitted.transform(test).select("target__output").toPandas()
        assert np.allclose(again.to_numpy(), first.to_numpy()), "loaded model differs"
        assert rmse < 0.5 * baseline, (rmse, baseline)
        print(f"torch_tabular_regression: OK, model saved to {output} and reloaded")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
