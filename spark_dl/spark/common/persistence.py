"""ML persistence for estimators and models whose params include Python objects.

``instance.write().save(path)`` writes, through Spark (so any path Spark can write works:
local, HDFS, S3A, DBFS):

    <path>/metadata/   pyspark's params metadata (class, uid, JSON-valued params, defaults)
    <path>/data/       the pickled params (model, optimizer, loss, ...) as one cloudpickle
                       blob, base64 text in numbered lines

``Cls.load(path)`` reads both back; :func:`load_local` reads a copy in a local directory
without Spark. Classes that include :class:`PersistableParams` and were
built with :func:`~spark_dl.spark.common.params.define_params` get this behaviour; they load
inside ``Pipeline``/``PipelineModel`` too, since pyspark's pipeline reader calls
``Cls.load`` for Python stages.

Both parts go through the DataFrame API only, so the same code saves and loads on classic
and Spark Connect sessions, and either reads what the other wrote. The one classic-only
step is ``overwrite()``: pyspark deletes the old path through py4j. On Connect the server's
ML helper deletes it (Spark 4 servers, as pyspark's own Connect writers do); a server
without one gets both parts written in overwrite mode instead.

The blob goes through the driver (base64 in memory, read back with ``collect``), which suits
models up to a few hundred MB; ``spark.driver.maxResultSize`` bounds what can be loaded.
"""

import base64
import json
import os

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, \
    MLWritable, MLWriter

__all__ = ["PersistableParams", "ParamsWriter", "ParamsReader", "load_local"]

_LINE_BYTES = 3 << 20  # raw bytes per text line (4 MiB of base64)
FORMAT_VERSION = 1


def _split(instance):
    """(JSON params, pickled params) that are set on ``instance``."""
    specs = type(instance)._param_specs
    plain, pickled = {}, {}
    for name, spec in specs.items():
        param = instance.getParam(name)
        if not instance.isSet(param):
            continue
        value = instance.getOrDefault(param)
        if spec.pickled:
            pickled[name] = value
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"param {name!r} of {type(instance).__name__} holds "
                                f"{value!r}, which cannot be saved as JSON: {e}") from None
            plain[name] = value
    return plain, pickled


def _write_lines(spark, path: str, lines, replace: bool = False) -> None:
    """``lines`` as one text file under the directory ``path`` (replacing it when
    ``replace``, else failing if it exists)."""
    spark.createDataFrame([(line,) for line in lines], "value string").coalesce(1) \
        .write.mode("overwrite" if replace else "error").text(path)


def _write_blob(spark, path: str, data: bytes, replace: bool = False) -> None:
    text = base64.b64encode(data).decode("ascii")
    step = _LINE_BYTES * 4 // 3
    lines = [f"{i:09d} {text[start:start + step]}"
             for i, start in enumerate(range(0, max(len(text), 1), step))]
    _write_lines(spark, path, lines, replace)


def _blob_of(lines, path: str) -> bytes:
    """The blob :func:`_write_blob` wrote as ``lines`` (in any order)."""
    parts = sorted((int(line[:9]), line[10:]) for line in lines)
    if [i for i, _ in parts] != list(range(len(parts))):
        raise ValueError(f"{path} is incomplete: lines {[i for i, _ in parts]}")
    return base64.b64decode("".join(p for _, p in parts))


def _read_blob(spark, path: str) -> bytes:
    return _blob_of([r[0] for r in spark.read.text(path).collect()], path)


def _local_lines(path: str):
    """The lines of the text files Spark wrote into the local directory ``path``."""
    names = sorted(n for n in os.listdir(path) if not n.startswith((".", "_")))
    if not names:
        raise FileNotFoundError(f"{path} holds no data files")
    lines = []
    for name in names:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            lines.extend(line.rstrip("\n") for line in f if line.strip())
    return lines


def _instance(cls, path: str, metadata_text: str, blob: bytes):
    """A new ``cls`` from its saved metadata and blob."""
    from spark_dl.spark.launch.pickling import pickler

    expected = f"{cls.__module__}.{cls.__name__}"
    metadata = DefaultParamsReader._parseMetaData(metadata_text, expected)
    fmt = metadata.get("spark_dl", {}).get("format")
    if fmt != FORMAT_VERSION:
        raise ValueError(f"{path} was saved in format {fmt!r}; this spark_dl reads "
                         f"format {FORMAT_VERSION}")
    instance = cls()
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    pickled = pickler().loads(blob)
    instance._set(**instance._params_from_pickle(pickled))
    return instance


def load_local(path: str):
    """The spark_dl model, estimator or ``PipelineModel``/``Pipeline`` saved at the local
    directory ``path`` (``write().save`` from a classic or Connect session, then copied
    here), read without Spark: no session, no JVM. A pipeline comes back as the list of
    its stages. Used where no Spark runs, e.g. MLflow's pyfunc serving a model."""
    import importlib

    metadata_text = _local_lines(os.path.join(path, "metadata"))[0]
    metadata = json.loads(metadata_text)
    module, _, name = metadata["class"].rpartition(".")
    if name in ("PipelineModel", "Pipeline") and module.startswith("pyspark.ml"):
        stages_dir = os.path.join(path, "stages")
        order = {uid: i for i, uid in enumerate(metadata["paramMap"]["stageUids"])}
        stages = sorted(os.listdir(stages_dir), key=lambda d: order[d.split("_", 1)[1]])
        return [load_local(os.path.join(stages_dir, d)) for d in stages]
    cls = getattr(importlib.import_module(module), name)
    if not issubclass(cls, PersistableParams):
        raise TypeError(f"{path} holds a {metadata['class']}, which needs Spark to load; "
                        "load it with its class's load(path) in a Spark session")
    return _instance(cls, path, metadata_text,
                     _blob_of(_local_lines(os.path.join(path, "data")), path))


class ParamsWriter(MLWriter):
    """Writes an instance's JSON params as pyspark metadata and the others as a blob."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance
        self._replace = False  # write the parts in overwrite mode (Connect, see save)

    def save(self, path: str) -> None:
        """Saves to ``path``; after ``overwrite()`` an existing ``path`` is replaced."""
        from spark_dl.spark.common.session import is_connect

        if not (self.shouldOverwrite and is_connect(self.sparkSession)):
            super().save(path)  # classic: pyspark's overwrite through py4j
            return
        self._replace = not _delete_on_connect(path)
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:
        from spark_dl.spark.launch.pickling import pickler

        plain, pickled = _split(self.instance)
        pickled = self.instance._params_to_pickle(pickled)
        try:
            blob = pickler().dumps(pickled)
        except Exception as e:
            raise TypeError(f"cannot save {type(self.instance).__name__}: one of the params "
                            f"{sorted(pickled)} cannot be pickled ({type(e).__name__}: {e})"
                            ) from e
        extra = {"spark_dl": {"format": FORMAT_VERSION, "pickled_params": sorted(pickled)}}
        # What DefaultParamsWriter.saveMetadata writes, in a mode this writer chooses.
        metadata = DefaultParamsWriter._get_metadata_to_save(
            self.instance, self.sparkSession, extraMetadata=extra, paramMap=plain)
        _write_lines(self.sparkSession, os.path.join(path, "metadata"), [metadata],
                     self._replace)
        _write_blob(self.sparkSession, os.path.join(path, "data"), blob, self._replace)


def _delete_on_connect(path: str) -> bool:
    """Deletes ``path`` through the Spark Connect server's ML helper, as pyspark's Connect
    writers do for pipelines; False where the client or server has no such helper."""
    try:
        from pyspark.ml.connect.readwrite import RemoteMLWriter

        RemoteMLWriter.handleOverwrite(path, True)
    except Exception:
        return False
    return True


class ParamsReader(MLReader):
    """Reads what :class:`ParamsWriter` wrote into a new instance of ``cls``."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        # What DefaultParamsReader.loadMetadata reads, through the DataFrame API: Spark 3.5's
        # loadMetadata takes a SparkContext (an RDD read), which Connect sessions lack.
        text = self.sparkSession.read.text(os.path.join(path, "metadata")).first()[0]
        return _instance(self.cls, path, text,
                         _read_blob(self.sparkSession, os.path.join(path, "data")))


class PersistableParams(MLReadable, MLWritable):
    """Mixin: ``write()`` / ``read()`` / ``load()`` through the two classes above."""

    def _params_to_pickle(self, params: dict) -> dict:
        """Hook: the pickled params as saved (e.g. a model as its framework's file bytes)."""
        return params

    def _params_from_pickle(self, params: dict) -> dict:
        """Hook: the inverse of :meth:`_params_to_pickle`, on load."""
        return params

    def write(self) -> MLWriter:
        """An MLWriter saving this instance (``.overwrite()`` replaces an existing path)."""
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """An MLReader loading instances of this class."""
        return ParamsReader(cls)
