"""Image classification: a small CNN trained on synthetic images held in a DataFrame.

    python examples/spark/torch_image_classifier.py               # starts local[2] itself
    spark-submit --master 'local[2]' examples/spark/torch_image_classifier.py --num-proc 2

Each row holds a 16x16 grayscale image as an array of 256 floats and a class label (a
double, as StringIndexer produces): 0 horizontal bar, 1 vertical bar, 2 diagonal, 3 square,
drawn at random positions with noise. ``input_shapes=[[-1, 1, 16, 16]]`` reshapes each batch
for the convolutions; the double class index becomes an int64 target for ``cross_entropy``.
The model's output column holds the 4 logits; the script takes their argmax in Spark SQL
and reports the accuracy on held-out images.
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_dl.spark.common.store import Store
from spark_dl.spark.torch import TorchEstimator

SIZE = 16
CLASSES = ["horizontal", "vertical", "diagonal", "square"]


def draw(kind: int, rng) -> np.ndarray:
    img = np.zeros((SIZE, SIZE), np.float32)
    a, b = rng.integers(2, SIZE - 6, size=2)
    length = rng.integers(5, 9)
    if kind == 0:
        img[a, b:b + length] = 1.0
    elif kind == 1:
        img[a:a + length, b] = 1.0
    elif kind == 2:
        for i in range(length - 1):
            img[a + i, b + i] = 1.0
    else:
        img[a:a + 4, b] = img[a:a + 4, b + 3] = img[a, b:b + 4] = img[a + 3, b:b + 4] = 1.0
    return np.clip(img + rng.normal(0, 0.2, img.shape), 0, 1).astype(np.float32)


def make_images(spark, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), rows)
    data = [([float(v) for v in draw(int(k), rng).ravel()], float(k)) for k in labels]
    return spark.createDataFrame(data, ["image", "label"])


class SmallCNN(torch.nn.Module):
    def __init__(self, classes: int = len(CLASSES)):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.head = torch.nn.Linear(16 * (SIZE // 4) ** 2, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None,
                        help="Spark master when not run by spark-submit (default local[2])")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--store", default=None, help="store prefix (default: a temp dir)")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_dl image classifier") \
        .config("spark.ui.showConsoleProgress", "false")
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or "local[2]") \
            .config("spark.sql.shuffle.partitions", "4")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        images = make_images(spark, args.rows)
        train, test = images.randomSplit([0.85, 0.15], seed=2)
        torch.manual_seed(0)
        model = SmallCNN()
        store = Store.create(args.store or tempfile.mkdtemp(prefix="spark_dl_images_"))
        estimator = TorchEstimator(
            num_proc=args.num_proc, model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=2e-3),
            loss=torch.nn.functional.cross_entropy, metrics=[accuracy],
            feature_cols=["image"], label_cols=["label"], input_shapes=[[-1, 1, SIZE, SIZE]],
            batch_size=args.batch_size, epochs=args.epochs, validation=0.1, store=store)
        classifier = estimator.fit(train).setOutputCols(["logits"])
        print(f"validation accuracy by epoch: "
              f"{[round(a, 3) for a in classifier.getHistory()['val_accuracy']]}")

        scored = classifier.transform(test).withColumn(
            "predicted", F.expr("array_position(logits, array_max(logits)) - 1"))
        acc = scored.select(F.avg((F.col("predicted") == F.col("label")).cast("double"))) \
            .first()[0]
        print(f"test accuracy {acc:.3f} on {scored.count()} images "
              f"({len(CLASSES)} classes, chance {1 / len(CLASSES):.2f})")
        assert acc > 0.8, acc
        print("torch_image_classifier: OK")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
