"""A fitted spark_dl model as an MLflow model, written from classic and Spark Connect
sessions alike, and MLflow's pyfunc loader for it.

:func:`save_mlflow_model` writes an MLflow model folder with two flavors:

- ``spark``: the model inside a one-stage ``PipelineModel`` (``data/sparkml``), as MLflow's
  own Spark flavor stores one: ``mlflow.spark.load_model(uri)`` in a classic session gives a
  ``PipelineModel`` whose ``transform`` is the model's;
- ``python_function``, loaded by this module (:func:`_load_pyfunc`): the model read back
  without Spark (:func:`~spark_dl.spark.common.persistence.load_local`) and run on pandas in
  the loading process (:meth:`~spark_dl.spark.common.model.ModelBase.predict_pandas`). So
  ``mlflow.pyfunc.load_model(uri).predict(pdf)`` needs no Spark session and no JVM: in a
  notebook on Spark Connect, in ``mlflow models serve``, in ``mlflow.pyfunc.spark_udf``.

MLflow's own ``mlflow.spark.save_model`` moves the saved model through the JVM's Hadoop
filesystem, which a Spark Connect client lacks. Here Spark writes the ``PipelineModel`` into
the run's folder in the Store (a place the executors and this process both reach), this
process copies it through the Store's filesystem and deletes the staging copy.
"""

import os
import posixpath
import shutil
import uuid
from typing import Callable, List

__all__ = ["save_mlflow_model", "SparkDLPyfunc", "copy_from_store"]

#: The Spark flavor's data folder inside the MLflow model (pyfunc copies the staged folder
#: to ``data/<its name>``).
SPARKML_DIR = "sparkml"


def copy_from_store(store, path: str, local: str,
                    keep: Callable[[str], bool] = lambda rel: True) -> int:
    """Copies the files of the Store directory ``path`` whose relative path ``keep``
    accepts into the local directory ``local``; returns how many."""
    import pyarrow.fs as pafs

    fs = store.get_filesystem()
    base = store.get_fs_path(path).rstrip("/")
    copied = 0
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        rel = info.path[len(base):].lstrip("/")
        if info.type != pafs.FileType.File or not keep(rel):
            continue
        dst = os.path.join(local, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with fs.open_input_stream(info.path) as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out)
        copied += 1
    return copied


def save_mlflow_model(model, spark, store, run_id: str, path: str,
                      pip_requirements: List[str]) -> None:
    """Writes ``model`` as an MLflow model into the new local directory ``path``.

    Args:
        model: a fitted spark_dl model (``TorchModel``, ``KerasModel``, ``LightningModel``).
        spark: the session that saves it (classic or Connect).
        store: the fit's Store; run_id: its run, whose folder holds the staging copy.
        pip_requirements: the model's pip requirements, for MLflow's environment files.
    """
    import mlflow.pyfunc
    import pyspark
    from mlflow.models import Model
    from mlflow.models.signature import ModelSignature
    from mlflow.types import ParamSchema, ParamSpec
    from pyspark.ml import PipelineModel

    staging = posixpath.join(store.get_run_path(run_id), f".mlflow_model-{uuid.uuid4().hex}")
    try:
        PipelineModel(stages=[model]).write().session(spark).save(staging)
        with _scratch(path) as local:
            if not copy_from_store(store, staging, local):
                raise FileNotFoundError(f"saving the model wrote nothing to {staging}")
            mlflow_model = Model()
            mlflow_model.add_flavor("spark", pyspark_version=pyspark.__version__,
                                    model_data=f"data/{SPARKML_DIR}",
                                    model_class="pyspark.ml.pipeline.PipelineModel")
            # pyfunc's one inference param (MLflow drops params a signature does not name).
            mlflow_model.signature = ModelSignature(params=ParamSchema(
                [ParamSpec("outputs", "string", "default")]))
            mlflow.pyfunc.save_model(path, loader_module=__name__, data_path=local,
                                     mlflow_model=mlflow_model,
                                     pip_requirements=pip_requirements)
    finally:
        store.delete(staging)  # nothing there: nothing done


class _scratch:
    """A local directory named :data:`SPARKML_DIR` beside ``path``, removed afterwards."""

    def __init__(self, path: str):
        self.dir = os.path.join(os.path.dirname(os.path.abspath(path)),
                                f".staging-{uuid.uuid4().hex}", SPARKML_DIR)

    def __enter__(self) -> str:
        os.makedirs(self.dir)
        return self.dir

    def __exit__(self, *exc) -> None:
        shutil.rmtree(os.path.dirname(self.dir), ignore_errors=True)


class SparkDLPyfunc:
    """MLflow's pyfunc model of a spark_dl model: ``predict(pdf)`` runs the model on a
    pandas DataFrame in this process (no Spark).

    It returns the pyspark.ml ``prediction`` column where the model has one (as MLflow's
    Spark flavor does), else its one output column, as a pandas Series; a DataFrame of
    every output column (model outputs, then prediction/probability/rawPrediction) for a
    model with several, or when ``params={"outputs": "all"}`` (the signature's one param,
    default ``"default"``).
    """

    def __init__(self, model):
        self.model = model

    def get_raw_model(self):
        """The spark_dl model (MLflow's name for it)."""
        return self.model

    def predict(self, model_input, params=None):
        import pandas as pd

        if not isinstance(model_input, pd.DataFrame):
            raise TypeError(f"a spark_dl model predicts on a pandas DataFrame holding its "
                            f"feature columns {self.model.getFeatureColumns()}; got "
                            f"{type(model_input).__name__}")
        outputs = (params or {}).get("outputs", "default")
        if outputs not in ("default", "all"):
            raise ValueError(f"params={{'outputs': {outputs!r}}}: the values are 'default' "
                             "(the prediction column, or the one output) and 'all'")
        out = self.model.predict_pandas(model_input)
        if outputs == "all":
            return out
        if self.model._ml_columns():
            return out[self.model.getPredictionCol()]
        return out.iloc[:, 0] if out.shape[1] == 1 else out


def _load_pyfunc(data_path: str) -> SparkDLPyfunc:
    """MLflow's pyfunc entry point: ``data_path`` is the model's ``data/sparkml``."""
    from spark_dl.spark.common.model import ModelBase
    from spark_dl.spark.common.persistence import load_local

    stages = load_local(data_path)
    models = [s for s in (stages if isinstance(stages, list) else [stages])
              if isinstance(s, ModelBase)]
    if len(models) != 1:
        raise ValueError(f"{data_path} holds {len(models)} spark_dl models; the pyfunc flavor "
                         "serves a pipeline of exactly one")
    return SparkDLPyfunc(models[0])
