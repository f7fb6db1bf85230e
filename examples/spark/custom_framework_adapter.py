"""A whole "framework" on spark_dl's shared estimator layer: a linear model in plain NumPy.

This is the smallest complete example of the adapter contract
(:mod:`spark_dl.spark.common.adapter`, docs/estimators.md "Adding a framework"): an estimator,
a worker adapter and a model, about 150 lines, get data preparation, launching, resume by
``run_id``, checkpoints, progress, averaged metrics, TensorBoard scalars, ``transform`` in
Arrow batches and ML persistence from the shared layer. Gradients are averaged across
workers with :mod:`spark_dl.numpy`.

Run it (trains y = x . w + b on 2 workers of local[2], then predicts):

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/python examples/spark/custom_framework_adapter.py
"""

import io
import sys

import numpy as np
from pyspark import keyword_only

from spark_dl.spark.common.adapter import Predictor, WorkerAdapter
from spark_dl.spark.common.estimator import EstimatorBase
from spark_dl.spark.common.model import ModelBase
from spark_dl.spark.common.params import ParamSpec, define_params


def _float(name):
    def convert(value):
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
        return float(value)
    return convert


class Linear:
    """The "model": ``outputs = x @ w + b`` for one feature column of n values."""

    def __init__(self, n_inputs: int, n_outputs: int = 1, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.w = rng.normal(scale=0.01, size=(n_inputs, n_outputs))
        self.b = np.zeros(n_outputs)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), -1) @ self.w + self.b


# ----------------------------------------------------------------------------- workers


class LinearWorker(WorkerAdapter):
    """One rank: SGD on the mean squared error, gradients averaged over all ranks."""

    def __init__(self, spec, rank, size, local_rank):
        import spark_dl.numpy as sdl

        self.spec, self.sdl = spec, sdl
        self.model, self.lr = spec.framework["model"], spec.framework["learning_rate"]
        self.step = 0

    def load_checkpoint(self, payload):
        data = np.load(io.BytesIO(payload), allow_pickle=False)
        if data["w"].shape != self.model.w.shape:
            raise ValueError(f"weights of shape {data['w'].shape}, the model has "
                             f"{self.model.w.shape}")
        self.model.w, self.model.b = data["w"], data["b"]
        history = {k[2:]: list(data[k]) for k in data.files if k.startswith("h_")}
        return int(data["epoch"]), history

    def save_checkpoint(self, epoch, history):
        buf = io.BytesIO()
        np.savez(buf, w=self.model.w, b=self.model.b, epoch=epoch,
                 **{f"h_{k}": np.asarray(v, dtype=np.float64) for k, v in history.items()})
        return buf.getvalue()

    def broadcast_state(self, root_rank):
        self.model.w = self.sdl.broadcast(self.model.w, root_rank, name="linear.w")
        self.model.b = self.sdl.broadcast(self.model.b, root_rank, name="linear.b")

    def result(self):
        return {"w": self.model.w, "b": self.model.b}

    def callback_objects(self):
        return self.model, None

    def to_tensors(self, arrays):
        return arrays  # NumPy is this framework's tensor type

    def metric_names(self):
        return ["mae"]

    def _errors(self, batch):
        x = batch[self.spec.feature_cols[0]].astype(np.float64)
        y = batch[self.spec.label_cols[0]].astype(np.float64).reshape(len(x), -1)
        return x.reshape(len(x), -1), self.model(x) - y

    def train_step(self, batch):
        x, err = self._errors(batch)
        grads = np.concatenate([(2 / len(x) * x.T @ err).ravel(), 2 * err.mean(axis=0)])
        self.step += 1
        grads = self.sdl.allreduce(grads, op=self.sdl.Average, name=f"linear.grad.{self.step}")
        n = self.model.w.size
        self.model.w -= self.lr * grads[:n].reshape(self.model.w.shape)
        self.model.b -= self.lr * grads[n:]
        return len(x), float((err ** 2).mean()), [float(np.abs(err).mean())]

    def eval_step(self, batch):
        x, err = self._errors(batch)
        return len(x), float((err ** 2).mean()), [float(np.abs(err).mean())]


class LinearPredictor(Predictor):
    def __init__(self, model: Linear, feature_cols):
        self.model, self.feature_cols = model, list(feature_cols)

    def predict(self, arrays):
        return [self.model(arrays[self.feature_cols[0]].astype(np.float64))]


# ----------------------------------------------------------------------------- driver

#: The estimator's own params (the shared ones come with EstimatorBase).
LINEAR_PARAMS = (
    ParamSpec("learning_rate", "SGD step size", 0.1, _float("learning_rate")),
)


class LinearModel(ModelBase):
    """The trained Linear as a Spark ML Model."""

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    def _default_vector_dtype(self):
        return "float64"

    def _predictor(self, specs):
        if not isinstance(self.getModel(), Linear):
            raise ValueError("this LinearModel has no model")
        return LinearPredictor(self.getModel(), self.getFeatureColumns())


@define_params(LINEAR_PARAMS)
class LinearEstimator(EstimatorBase):
    """Fits a Linear with data-parallel SGD: ``LinearEstimator(model=Linear(4), ...)``."""

    _run_prefix = "linear"
    _worker_adapter = LinearWorker

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    def _check_params_more(self):
        if not isinstance(self.getModel(), Linear):
            raise TypeError(f"model must be a Linear, got {type(self.getModel()).__name__}")
        if len(self.getFeatureCols()) != 1 or len(self.getLabelCols()) != 1:
            raise ValueError("Linear takes one feature column and one label column")

    def _framework_spec(self, store, dataset):
        batch = self._sample_batch(store, dataset)  # a dry run on two rows
        x = batch[self.getFeatureCols()[0]]
        if x.reshape(len(x), -1).shape[1] != self.getModel().w.shape[0]:
            raise ValueError(f"feature column {self.getFeatureCols()[0]!r} has "
                             f"{x.reshape(len(x), -1).shape[1]} values per row; the model "
                             f"takes {self.getModel().w.shape[0]}")
        return {"model": self.getModel(), "learning_rate": self.getLearningRate()}

    def _trained_model(self, result, run_id, dataset, framework):
        model = Linear(*framework["model"].w.shape)
        model.w, model.b = result["state"]["w"], result["state"]["b"]
        cols = self.getFeatureCols() + self.getLabelCols()
        return LinearModel(model=model, feature_columns=self.getFeatureCols(),
                           label_columns=self.getLabelCols(), history=result["history"],
                           run_id=run_id, metadata={
                               "columns": {c: dataset.columns[c] for c in cols},
                               "vector_dtype": "float64"})


def main() -> None:
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("custom-adapter")
             .config("spark.ui.enabled", "false").getOrCreate())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.5, -2.0, 0.5, 1.0]) + 0.3
    df = spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                               ["features", "y"])
    est = LinearEstimator(num_proc=2, model=Linear(4), feature_cols=["features"],
                          label_cols=["y"], batch_size=32, epochs=4, validation=0.1)
    model = est.fit(df)
    print("learned w:", np.round(model.getModel().w.ravel(), 3), "b:",
          np.round(model.getModel().b, 3))
    model.transform(df).show(3)
    spark.stop()


if __name__ == "__main__":
    sys.exit(main())
