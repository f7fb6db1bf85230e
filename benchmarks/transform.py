"""Batch inference: a fitted model's ``transform`` against pyspark's ``predict_batch_udf``.

    PYTHONPATH=. .venv/bin/python benchmarks/transform.py                  # torch, 400k x 64
    PYTHONPATH=. .venv/bin/python benchmarks/transform.py --frameworks torch,lightning,keras
    PYTHONPATH=. .venv/bin/python benchmarks/transform.py --quick

One ``local[2]`` application; the data (``--rows`` rows of ``--width`` float32 features, as
an array<float> column and as a Spark ML vector column) is cached and counted first. For
each framework, model size (small: MLP width-32-1, where the data path dominates; large:
width-1024-1024-1, where the model does) and column kind, the two peers run alternately
``--repeats`` times on ``id`` and that one feature column, each timed to the end of a
``noop`` write of every column:

* ``spark_dl``: ``TorchModel`` / ``LightningModel`` / ``KerasModel`` ``.transform(df)``;
* ``predict_batch_udf``: ``pyspark.ml.functions.predict_batch_udf`` with the same model,
  batch size and input shape, added with ``withColumn`` (vector columns go through
  ``vector_to_array`` first, as its docs ask).

Both predict ``--batch-size`` rows per model call on CPU and keep every column. The first
run of each pair is a warm-up (Python workers start, the model is unpickled) and not
counted. Prints the median, min-max and the ratio of medians (predict_batch_udf / spark_dl:
above 1 means spark_dl is faster) per case, and the load average before and after.
"""

import argparse
import json
import os
import statistics
import time

from _spark import local_spark


def make_data(spark, rows, width, cores):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    x = F.transform(F.sequence(F.lit(1), F.lit(width)),
                    lambda i: (F.rand(0) * i).cast("float"))
    df = spark.range(rows, numPartitions=cores).select("id", x.alias("arr"))
    df = df.withColumn("vec", array_to_vector("arr")).cache()
    df.count()
    return df


def torch_net(width, size):
    import torch

    torch.manual_seed(0)
    hidden = [32] if size == "small" else [1024, 1024]
    layers, prev = [], width
    for h in hidden:
        layers += [torch.nn.Linear(prev, h), torch.nn.ReLU()]
        prev = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(prev, 1))


def keras_net(width, size):
    import keras

    keras.utils.set_random_seed(0)
    hidden = [32] if size == "small" else [1024, 1024]
    inp = keras.Input((width,))
    h = inp
    for n in hidden:
        h = keras.layers.Dense(n, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(1)(h))


def spark_dl_model(framework, net, col, width, batch_size):
    meta = {"columns": {col: {"kind": "vector" if col == "vec" else "array",
                              "dtype": "float32", "shape": [width]},
                        "y": {"kind": "scalar", "dtype": "float32", "shape": []}},
            "vector_dtype": "float32"}
    kwargs = dict(model=net, feature_columns=[col], label_columns=["y"], use_gpu=False,
                  batch_size=batch_size, metadata=meta)
    if framework == "torch":
        from spark_dl.spark.torch import TorchModel

        return TorchModel(**kwargs)
    if framework == "lightning":
        from spark_dl.spark.lightning import LightningModel

        return LightningModel(input_shapes=[[-1, width]], **kwargs)
    from spark_dl.spark.keras import KerasModel

    return KerasModel(**kwargs)


def make_predict_fn_factory(framework, blob):
    """A ``make_predict_fn`` for predict_batch_udf (the model travels pickled in it)."""
    def make_predict_fn():
        import numpy as np

        if framework == "keras":
            import keras

            path = f"/tmp/spark_dl_bench_{os.getpid()}.keras"
            with open(path, "wb") as f:
                f.write(blob)
            model = keras.saving.load_model(path)

            def predict(x):
                return np.asarray(model.predict_on_batch(x)).reshape(-1)
            return predict
        import pickle

        import torch

        model = pickle.loads(blob).eval()

        def predict(x):
            with torch.inference_mode():
                return model(torch.from_numpy(x)).numpy().reshape(-1)
        return predict
    return make_predict_fn


def model_blob(framework, net):
    if framework == "keras":
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "m.keras")
        net.save(path)
        with open(path, "rb") as f:
            return f.read()
    import cloudpickle

    return cloudpickle.dumps(net)


def timed(df):
    t = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t


def load():
    return os.getloadavg()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frameworks", default="torch")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--cols", default="arr,vec")
    parser.add_argument("--quick", action="store_true", help="100k rows, 2 repeats")
    parser.add_argument("--json", metavar="FILE", help="also save the samples to FILE")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 100_000, 2
    import pyspark
    from pyspark.ml.functions import predict_batch_udf, vector_to_array
    from pyspark.sql import types as T

    spark = local_spark("spark_dl-bench-transform", args.cores,
                        {"spark.python.worker.reuse": "true"})
    df = make_data(spark, args.rows, args.width, args.cores)
    print(f"pyspark {pyspark.__version__}, {args.rows:,} rows x {args.width} float32, "
          f"local[{args.cores}], batch {args.batch_size}, {args.repeats} timed runs each "
          f"(alternated); load average {load():.1f} at start", flush=True)
    results = []
    for framework in args.frameworks.split(","):
        for size in args.sizes.split(","):
            net = (keras_net if framework == "keras" else torch_net)(args.width, size)
            if framework == "lightning":
                import lightning.pytorch as pl

                class Module(pl.LightningModule):
                    def __init__(self, inner):
                        super().__init__()
                        self.inner = inner

                    def forward(self, x):
                        return self.inner(x)

                net = Module(net)
            udf = predict_batch_udf(make_predict_fn_factory(framework, model_blob(framework, net)),
                                    return_type=T.FloatType(), batch_size=args.batch_size,
                                    input_tensor_shapes=[[args.width]])
            for col in args.cols.split(","):
                ours = spark_dl_model(framework, net, col, args.width, args.batch_size)
                data = df.select("id", col)
                inp = vector_to_array(col, "float32") if col == "vec" else data[col]
                peers = {"spark_dl": lambda: ours.transform(data),
                         "predict_batch_udf": lambda: data.withColumn("y__output", udf(inp))}
                samples = {p: [] for p in peers}
                loads = [load()]
                for r in range(args.repeats + 1):
                    order = list(peers) if r % 2 == 0 else list(peers)[::-1]
                    for p in order:
                        t = timed(peers[p]())
                        if r:
                            samples[p].append(t)
                loads.append(load())
                med = {p: statistics.median(s) for p, s in samples.items()}
                ratio = med["predict_batch_udf"] / med["spark_dl"]
                results.append(dict(framework=framework, size=size, col=col, samples=samples,
                                    load=loads, ratio=ratio))
                print(f"{framework:9} {size:5} {col}: spark_dl {med['spark_dl']:.2f} s "
                      f"({min(samples['spark_dl']):.2f}-{max(samples['spark_dl']):.2f}), "
                      f"predict_batch_udf {med['predict_batch_udf']:.2f} s "
                      f"({min(samples['predict_batch_udf']):.2f}-"
                      f"{max(samples['predict_batch_udf']):.2f}), ratio {ratio:.2f}x; "
                      f"load {loads[0]:.1f} -> {loads[1]:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    spark.stop()


if __name__ == "__main__":
    main()
