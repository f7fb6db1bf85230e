"""Estimator and model parameters, defined once in tables and turned into pyspark.ml Params.

Every parameter is one :class:`ParamSpec` row: name, doc, default, type converter, and
whether ML persistence writes it as JSON or pickles it. :func:`define_params` turns rows
into what pyspark.ml expects: a class-level :class:`~pyspark.ml.param.Param`, a getter and a
setter (``num_proc`` -> ``getNumProc`` / ``setNumProc``, plus Horovod's spellings where they
differ, e.g. ``setShufflingBufferSize``). :func:`params_signature` gives the keyword-only
constructors an honest signature and docstring built from the same rows.

The shared rows (:data:`ESTIMATOR_PARAMS`, :data:`MODEL_PARAMS`) carry Horovod's names so a
``horovod.spark`` user switches by changing imports; each framework adds its own rows
(``spark_dl.spark.torch.params.TORCH_PARAMS``).

IDEs see explicit, typed accessors: :mod:`~spark_dl.spark.common.params_codegen` writes them
from the tables into ``params_accessors`` modules (mixins the classes inherit), and
:func:`define_params` only makes accessors at run time for tables nobody generated (e.g. a
third-party framework's).

Converters check values when they are set, so a bad value fails in the constructor with the
parameter's name (pyspark prefixes converter ``TypeError`` messages with it); ``ValueError``
messages name the parameter themselves.
"""

import dataclasses
import inspect
import numbers
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from pyspark.ml.param import Param, Params, TypeConverters

from spark_dl.spark.common.metrics import is_metric_pair, metric_pairs

__all__ = ["ParamSpec", "define_params", "set_param_defaults", "check_param_names", "TableParams",
           "params_signature", "params_doc", "accessor_stem", "ESTIMATOR_PARAMS",
           "MODEL_PARAMS", "SCALE_LEARNING_RATE", "PREDICTION_KINDS"]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter.

    Attributes:
        name: the Param name (Horovod's).
        doc: one line for ``explainParams`` and the generated docs.
        default: its default; must be JSON-serializable (None for pickled params), since
            pyspark writes defaults into the saved metadata.
        converter: checks and normalizes a value (``TypeError``/``ValueError`` when bad).
        pickled: saved with cloudpickle (objects, functions) rather than as JSON.
        accessor: stem of the getter/setter (default: ``num_proc`` -> ``NumProc``).
        aliases: more stems, for Horovod's spellings that differ from the generated one.
        annotation: the value's type in the generated accessors (default: the converter's
            ``annotation``, else ``Any``).
        ignored: for a Horovod param that means nothing here, why: it is accepted (so
            Horovod code runs unchanged) and setting it prints this one-line note.
    """

    name: str
    doc: str
    default: Any = None
    converter: Callable[[Any], Any] = TypeConverters.identity
    pickled: bool = False
    accessor: Optional[str] = None
    aliases: Tuple[str, ...] = ()
    annotation: Optional[str] = None
    ignored: Optional[str] = None

    @property
    def type_hint(self) -> str:
        """The annotation the generated getter returns and setter takes."""
        return self.annotation or getattr(self.converter, "annotation", "Any")

    @property
    def stems(self) -> Tuple[str, ...]:
        """Accessor stems: ``NumProc`` for ``getNumProc``/``setNumProc``, then aliases."""
        return (self.accessor or accessor_stem(self.name),) + tuple(self.aliases)


def accessor_stem(name: str) -> str:
    """``num_proc`` -> ``NumProc`` (the part after ``get``/``set``)."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


# ----------------------------------------------------------------------------- converters
# Each returns the normalized value or raises TypeError (wrong kind) / ValueError (bad value).
# None always passes: it means "not set / use the default behaviour". Each carries the type
# annotation its getter and setter get in the generated accessors (``annotation``).


def _typed(convert, annotation: str):
    convert.annotation = annotation
    return convert


def _int(name: str, minimum: int = 0):
    def convert(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return int(value)
    return _typed(convert, "Optional[int]")


def _bool(name: str):
    def convert(value):
        if value is None:
            return None
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    return _typed(convert, "Optional[bool]")


def _str(name: str):
    def convert(value):
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty str, got {value!r}")
        return value
    return _typed(convert, "Optional[str]")


def _columns(name: str):
    """A list of column names; one str is one column."""
    def convert(value):
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) and c
                                                           for c in value):
            raise TypeError(f"{name} must be a list of column names, got {value!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"{name} lists a column twice: {list(value)}")
        return list(value)
    return _typed(convert, "Optional[List[str]]")


def _shapes(name: str):
    """A list of shapes (lists of ints, one -1 allowed for the batch), one per column."""
    def convert(value):
        if value is None:
            return None
        example = f"e.g. {name}=[[-1, 1, 28, 28]] for one column of 784 values"
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, (list, tuple))
                                                           for s in value):
            raise TypeError(f"{name} must be a list of shapes, one per column ({example}), "
                            f"got {value!r}")
        shapes = []
        for s in value:
            if not s or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool)
                                for d in s):
                raise TypeError(f"{name}: shape {s!r} must be a non-empty list of ints "
                                f"({example})")
            if sum(1 for d in s if d == -1) > 1 or any(d == 0 or d < -1 for d in s):
                raise ValueError(f"{name}: shape {list(s)} must have positive sizes and at "
                                 f"most one -1 ({example})")
            shapes.append([int(d) for d in s])
        return shapes
    return _typed(convert, "Optional[List[List[int]]]")


def _floats(name: str):
    def convert(value):
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
            raise TypeError(f"{name} must be a list of numbers, got {value!r}")
        return [float(v) for v in value]
    return _typed(convert, "Optional[List[float]]")


def _validation(value):  # annotation set below
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            raise TypeError("validation must be a fraction in (0, 1) or a column name, got ''")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"validation must be a fraction in (0, 1) or a column name, "
                        f"got {value!r}")
    if not 0 < value < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {value}; e.g. 0.1")
    return float(value)


def _callables(name: str, allow_single: bool = True):
    """A callable or a list of callables (kept as given, for persistence)."""
    def convert(value):
        if value is None:
            return None
        items = value if isinstance(value, (list, tuple)) else [value]
        if not allow_single and not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of callables, got {value!r}")
        bad = [v for v in items if not callable(v)]
        if bad:
            raise TypeError(f"{name} must be a callable or a list of callables; "
                            f"{bad[0]!r} is not callable")
        return list(value) if isinstance(value, tuple) else value
    return _typed(convert, "Union[Callable, List[Callable], None]")


def _metrics(value):
    """The ``metrics`` param: checked by :func:`metric_pairs`; a dict or a lone pair is
    kept as a list of ``(name, fn)`` pairs, a tuple as a list, anything else as given."""
    if value is None:
        return None
    metric_pairs(value)
    if isinstance(value, dict):
        return list(value.items())
    if is_metric_pair(value):
        return [tuple(value)]
    return list(value) if isinstance(value, tuple) else value


_metrics.annotation = "Union[Callable, List[Any], Dict[str, Callable], None]"


def _callable(name: str):
    def convert(value):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {value!r}")
        return value
    return _typed(convert, "Optional[Callable]")


def _list(name: str):
    def convert(value):
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            value = [value]
        return list(value)
    return _typed(convert, "Optional[List[Any]]")


def _verbose(value):  # annotation set below
    value = _int("verbose")(value)
    if value is not None and value > 2:
        raise ValueError(f"verbose must be 0, 1 or 2, got {value}")
    return value


def _dict(name: str):
    def convert(value):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict, got {value!r}")
        return value
    return _typed(convert, "Optional[Dict[str, Any]]")


_typed(_validation, "Union[float, str, None]")
_typed(_verbose, "Optional[int]")


# ----------------------------------------------------------------------------- tables

def _choice(name: str, choices: Sequence[str]):
    def convert(value):
        if value is None:
            return None
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value
    return _typed(convert, "Optional[str]")


#: What a model's output means, for pyspark.ml's prediction columns (see MODEL_PARAMS).
PREDICTION_KINDS = ("regression", "logits", "log_probabilities", "probabilities",
                    "binary_logits", "binary_probabilities")

#: Parameters every estimator shares (Horovod's ``EstimatorParams``).
ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("num_proc", "number of training processes (default: the Spark application's "
              "default parallelism); exclusive with backend", None, _int("num_proc", 1)),
    ParamSpec("elastic", "train as an elastic job (docs/elastic.md): workers lost with their "
              "executors are replaced by Spark's task retries and join, the job goes on "
              "between min_num_proc and max_num_proc workers, resuming from the last "
              "epoch's checkpoint", False, _bool("elastic")),
    ParamSpec("min_num_proc", "elastic: the fewest workers that train (default num_proc)",
              None, _int("min_num_proc", 1)),
    ParamSpec("max_num_proc", "elastic: the most workers at once (default num_proc)", None,
              _int("max_num_proc", 1)),
    ParamSpec("model", "the model to train; fit() trains a copy and leaves it unchanged",
              None, pickled=True),
    ParamSpec("optimizer", "the optimizer, constructed over the model's parameters", None,
              pickled=True),
    ParamSpec("loss", "loss function(output, label), or one per label column", None,
              _callables("loss"), pickled=True),
    ParamSpec("loss_weights", "weight of each label column's loss in the total", None,
              _floats("loss_weights")),
    ParamSpec("metrics", "metric functions(output, label) averaged over rows and workers "
              "each epoch: a callable, a list, (name, fn) pairs or a dict name -> fn "
              "(names show in the history as name and val_name)", None, _metrics,
              pickled=True),
    ParamSpec("feature_cols", "feature column names, one model input each", None,
              _columns("feature_cols")),
    ParamSpec("label_cols", "label column names, one model output each", None,
              _columns("label_cols")),
    ParamSpec("sample_weight_col", "column of per-row loss weights", None,
              _str("sample_weight_col")),
    ParamSpec("validation", "fraction of rows for validation, or a boolean/numeric column "
              "marking validation rows", None, _validation),
    ParamSpec("batch_size", "rows per training batch on each worker", 32,
              _int("batch_size", 1)),
    ParamSpec("val_batch_size", "rows per validation batch (default: batch_size)", None,
              _int("val_batch_size", 1)),
    ParamSpec("epochs", "number of passes over the training data", 1, _int("epochs", 1)),
    ParamSpec("train_steps_per_epoch", "training batches per epoch and worker (default: one "
              "pass over the data)", None, _int("train_steps_per_epoch", 1)),
    ParamSpec("validation_steps_per_epoch", "validation batches per epoch and worker "
              "(default: one pass over the validation data)", None,
              _int("validation_steps_per_epoch", 1)),
    ParamSpec("shuffle_buffer_size", "rows in each worker's shuffle buffer (0: shuffle row "
              "groups only; default: the data loader's)", None,
              _int("shuffle_buffer_size", 0), aliases=("ShufflingBufferSize",)),
    ParamSpec("partitions_per_process", "Parquet files per training process written by "
              "the data preparation", 10, _int("partitions_per_process", 1)),
    ParamSpec("gradient_compression", "compression of gradients between workers "
              "(e.g. spark_dl.torch.Compression.fp16)", None, pickled=True),
    ParamSpec("backward_passes_per_step", "batches whose gradients accumulate locally "
              "before one averaged optimizer step", 1, _int("backward_passes_per_step", 1)),
    ParamSpec("transformation_fn", "function applied on the workers to each training and "
              "validation batch (a dict column -> tensor), returning the batch", None,
              _callable("transformation_fn"), pickled=True),
    ParamSpec("label_shapes", "shape of each label column's tensors (default: reshaped to "
              "the matching output when the sizes agree)", None, _shapes("label_shapes")),
    ParamSpec("callbacks", "callbacks run on every worker during training", None,
              _list("callbacks"), pickled=True),
    ParamSpec("store", "the Store for prepared data, checkpoints and logs (default: a "
              "temporary local one, on local masters only)", None, pickled=True,
              annotation='Optional["Store"]'),
    ParamSpec("run_id", "name of the run in the store; fitting again with the same run_id "
              "resumes after its last finished epoch (default: a new name)", None,
              _str("run_id")),
    ParamSpec("random_seed", "seed of the data shuffling and of the framework's random "
              "generators", None, _int("random_seed")),
    ParamSpec("terminate_on_nan", "stop training on every rank when a batch loss is NaN or "
              "infinite (the ranks agree at each step)", True, _bool("terminate_on_nan")),
    ParamSpec("allow_nonfinite", "keep NaN and infinite values of the data (by default "
              "preparing the data fails, naming the column that holds them)", False,
              _bool("allow_nonfinite"), accessor="AllowNonfinite"),
    ParamSpec("inmemory_cache_all", "keep each worker's decoded training and validation "
              "rows in memory after the first epoch", False, _bool("inmemory_cache_all"),
              accessor="InMemoryCacheAll"),
    ParamSpec("train_reader_num_workers", "reader threads of each worker's training data "
              "loader", 2, _int("train_reader_num_workers", 1),
              aliases=("TrainReaderNumWorker",)),
    ParamSpec("val_reader_num_workers", "reader threads of each worker's validation data "
              "loader", 2, _int("val_reader_num_workers", 1),
              aliases=("ValReaderNumWorker",)),
    ParamSpec("use_gpu", "train on the GPU Spark assigned to each worker when CUDA is "
              "available", True, _bool("use_gpu")),
    ParamSpec("verbose", "0 quiet, 1 a line per epoch and a progress bar, 2 also data "
              "preparation and launch details", 1, _verbose),
    ParamSpec("mlflow", "log the fit to MLflow from the driver: params, per-epoch metrics, "
              "the run folder (TensorBoard logs) and the model (None: on when "
              "mlflow_tracking_uri or mlflow_experiment is set; see docs/observability.md)",
              None, _bool("mlflow"), accessor="Mlflow"),
    ParamSpec("mlflow_tracking_uri", "MLflow tracking URI to log to (default: the active "
              "run, else MLflow's current URI: MLFLOW_TRACKING_URI or a local store)", None,
              _str("mlflow_tracking_uri"), accessor="MlflowTrackingUri"),
    ParamSpec("mlflow_experiment", "MLflow experiment name of the fit's new run (created "
              "when missing; default: MLflow's current experiment)", None,
              _str("mlflow_experiment"), accessor="MlflowExperiment"),
    ParamSpec("shuffle", "shuffle the training rows every epoch (seeded; validation rows "
              "are never shuffled)", True, _bool("shuffle")),
    ParamSpec("compress_sparse_cols", "store vector columns holding only SparseVectors as "
              "(indices, values) in the prepared data; the loader densifies each batch",
              False, _bool("compress_sparse_cols")),
    ParamSpec("backend_env", "environment variables for the training processes", None,
              _dict("backend_env")),
    ParamSpec("reader_pool_type", "Horovod's Petastorm reader pool ('thread'/'process')",
              None, ignored="the Arrow loader reads with threads "
              "(train_reader_num_workers, val_reader_num_workers)"),
    ParamSpec("mp_start_method", "Horovod's multiprocessing start method for its backend",
              None, ignored="spark_dl's task services start the training processes"),
    ParamSpec("data_module", "Horovod's data loader module", None, pickled=True,
              ignored="training reads the prepared data with spark_dl's Arrow loader"),
    ParamSpec("continuous_cols", "Horovod's continuous feature columns", None,
              _columns("continuous_cols"), ignored="list every feature column in "
              "feature_cols"),
    ParamSpec("categorical_cols", "Horovod's categorical feature columns", None,
              _columns("categorical_cols"), ignored="list every feature column in "
              "feature_cols"),
    ParamSpec("transformation_edit_fields", "Horovod's Petastorm TransformSpec fields",
              None, pickled=True, ignored="transformation_fn gets and returns a dict "
              "column -> tensor: add keys there"),
    ParamSpec("transformation_removed_fields", "Horovod's Petastorm TransformSpec fields",
              None, pickled=True, ignored="transformation_fn gets and returns a dict "
              "column -> tensor: drop keys there"),
    ParamSpec("prediction_kind", "what the model's output is, for the trained model's "
              "pyspark.ml prediction columns (see the model's prediction_kind; default: "
              "from the loss)", None, _choice("prediction_kind", PREDICTION_KINDS)),
    ParamSpec("backend", "runs the training function on the workers (default: "
              "SparkBackend(num_proc)); exclusive with num_proc", None, pickled=True,
              annotation='Optional["Backend"]'),
)

#: Parameters every trained model shares (Horovod's ``ModelParams``).
MODEL_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("feature_columns", "feature columns, one model input each", None,
              _columns("feature_columns")),
    ParamSpec("label_columns", "label columns the model was trained on", None,
              _columns("label_columns"), aliases=("LabelColoumns",)),  # Horovod's spelling
    ParamSpec("output_cols", "columns transform() adds, one per model output (default: "
              "'<label>__output')", None, _columns("output_cols")),
    ParamSpec("history", "per-epoch training history: metric name -> list of values", None,
              _dict("history")),
    ParamSpec("model", "the trained model", None, pickled=True),
    ParamSpec("run_id", "the run that trained the model", None, _str("run_id")),
    ParamSpec("metadata", "what training saw of each feature and label column (kind, "
              "dtype, shape)", None, _dict("metadata")),
    ParamSpec("batch_size", "rows per forward pass in transform()", 1024,
              _int("batch_size", 1)),
    ParamSpec("output_format", "type of output columns with several values per row: "
              "'vector' (Spark ML DenseVector, Horovod's) or 'array' (array of the model's "
              "float type)", "vector", _choice("output_format", ("vector", "array"))),
    ParamSpec("prediction_kind", "what the model's output is, for pyspark.ml's prediction "
              "columns: 'regression' (writes predictionCol), 'logits', 'log_probabilities', "
              "'probabilities' (multi-class: also probabilityCol and rawPredictionCol), "
              "'binary_logits', 'binary_probabilities'; None writes only output_cols "
              "(default: from the training loss)", None,
              _choice("prediction_kind", PREDICTION_KINDS)),
    ParamSpec("predictionCol", "column of the predicted value or class index (double)",
              "prediction", _str("predictionCol")),
    ParamSpec("probabilityCol", "column of the class probabilities (Spark ML vector)",
              "probability", _str("probabilityCol")),
    ParamSpec("rawPredictionCol", "column of the raw scores (Spark ML vector)",
              "rawPrediction", _str("rawPredictionCol")),
)


#: Horovod's torch and Keras estimators multiply the learning rate by the number of
#: workers; the frameworks that follow it add this row to their tables.
SCALE_LEARNING_RATE = ParamSpec(
    "scale_learning_rate", "multiply the optimizer's learning rate by the number of training "
    "processes while training, as Horovod's estimators do (the returned optimizer and the "
    "checkpoints keep the rate given here); False trains with the rate as given", True,
    _bool("scale_learning_rate"))


# ----------------------------------------------------------------------------- generation


def _getter(name: str, stem: str, doc: str):
    def get(self):
        return self.getOrDefault(name)
    get.__name__ = f"get{stem}"
    get.__doc__ = f"Gets the value of ``{name}``: {doc}."
    get._spark_dl_generated = True
    return get


def _setter(name: str, stem: str, doc: str):
    def set_(self, value):
        return self._set(**{name: value})
    set_.__name__ = f"set{stem}"
    set_.__doc__ = f"Sets ``{name}``: {doc}. Returns self."
    set_._spark_dl_generated = True
    return set_


def define_params(*tables: Iterable[ParamSpec]):
    """Class decorator adding a Param, getter and setter for every row of ``tables``.

    A row with the name of an inherited one replaces it (a framework may refine a shared
    row). Accessors written by hand (in the class or a base) are kept. The class gets
    ``_param_specs`` (name -> ParamSpec, base classes' rows included) for
    :func:`set_param_defaults` and persistence.
    """
    def apply(cls):
        specs: Dict[str, ParamSpec] = dict(getattr(cls, "_param_specs", {}))
        for spec in (s for table in tables for s in table):
            specs[spec.name] = spec
            setattr(cls, spec.name, Param(Params._dummy(), spec.name, spec.doc,
                                          spec.converter))
            for stem in (spec.accessor or accessor_stem(spec.name),) + tuple(spec.aliases):
                for prefix, make in (("get", _getter), ("set", _setter)):
                    existing = getattr(cls, prefix + stem, None)
                    if existing is None or getattr(existing, "_spark_dl_generated", False):
                        setattr(cls, prefix + stem, make(spec.name, stem, spec.doc))
        cls._param_specs = specs
        return cls
    return apply


def set_param_defaults(instance: Params) -> None:
    """Sets every table default on ``instance`` (call from ``__init__``)."""
    instance._setDefault(**{s.name: s.default for s in type(instance)._param_specs.values()})


def check_param_names(instance: Params, kwargs: Dict[str, Any]) -> None:
    """TypeError naming unknown keyword arguments and listing the known ones."""
    known = type(instance)._param_specs
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"{type(instance).__name__} got unknown parameter(s) {unknown}; "
                        f"known parameters: {sorted(known)}")


class TableParams:
    """Mixin for classes decorated with :func:`define_params`: a constructor and
    ``setParams`` taking the table's params as keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__()
        set_param_defaults(self)
        check_param_names(self, kwargs)
        self._set(**kwargs)

    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        check_param_names(self, kwargs)
        return self._set(**kwargs)


def _merged(specs: Sequence[ParamSpec]) -> Sequence[ParamSpec]:
    """``specs`` with one row per name: a later row (a framework's refinement) replaces an
    earlier one in its place."""
    rows: Dict[str, ParamSpec] = {}
    for s in specs:
        rows[s.name] = s
    return [rows[name] for name in dict.fromkeys(s.name for s in specs)]


def params_signature(specs: Sequence[ParamSpec]) -> inspect.Signature:
    """A keyword-only signature ``(self, *, name=default, ...)`` for generated constructors."""
    specs = _merged(specs)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default)
                   for s in specs]
    return inspect.Signature(parameters)


def params_doc(specs: Sequence[ParamSpec]) -> str:
    """A Google-style ``Args:`` section listing ``specs``."""
    lines = ["Args:"]
    for s in _merged(specs):
        default = "" if s.default is None else f" Default: {s.default!r}."
        lines.append(f"    {s.name}: {s.doc}.{default}")
    return "\n".join(lines)
