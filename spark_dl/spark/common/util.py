"""``prepare_data``: a Spark DataFrame -> train/validation Parquet and metadata in a Store.

Steps, in order (nothing is written before step 4):

1. check the arguments and the DataFrame's schema (missing columns, unsupported types);
2. look the request up in the training-data cache (:mod:`.cache`); a hit returns at once
   (a plan the cache cannot key, e.g. SQL text on Spark Connect, is written afresh);
3. check that the store is writable (and, with ``compress_sparse``, find each vector
   column's layout with one Arrow pass);
4. write: one ``mapInArrow`` job converts the columns with Spark's own functions
   (``vector_to_array`` for vectors), counts the data checks (empty DataFrame, nulls, NaN
   and infinities, arrays or vectors of differing lengths, validation column), splits
   train/validation rows, and writes one Parquet file per partition and split with row
   groups sized for streaming. The data is read once: checks and write share the pass;
5. check the counts: data that fails is deleted before the error is raised; then write the
   metadata document (:mod:`.metadata`) last, atomically: a dataset without it is
   incomplete and is never read.
"""

import json
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple, Union

from spark_dl.spark.common import constants, raw_columns
from spark_dl.spark.common.cache import (TrainingDataCache, UncacheablePlan, cache_key,
                                         delete_dataset)
from spark_dl.spark.common.metadata import load_metadata
from spark_dl.spark.common.parquet_writer import (SPLIT_COLUMN, PartitionWriter,
                                                  sparse_columns, summary_schema)
from spark_dl.spark.common.schema import (DataStats, _col, check_stats, check_vector_stats,
                                          classify, column_positions, vector_stats_fn,
                                          vector_stats_schema)
from spark_dl.spark.common.store import Store

#: The cache prepare_data uses unless given another (one per driver process).
training_cache = TrainingDataCache()


def clear_training_cache(delete: bool = True) -> None:
    """Forget every dataset prepared in this process, deleting its files when ``delete``."""
    training_cache.clear(delete=delete)


def _as_list(cols, what: str) -> List[str]:
    if cols is None:
        return []
    if isinstance(cols, str):
        cols = [cols]
    cols = list(cols)
    if not all(isinstance(c, str) for c in cols):
        raise TypeError(f"{what} must be column names (str), got {cols!r}")
    return cols


def _log(verbose: int, msg: str) -> None:
    if verbose:
        print(f"[spark_dl.prepare_data] {msg}", flush=True)


def _holds_numbers(name: str, dt, vector_dtype: str) -> bool:
    """Whether column ``name`` of type ``dt`` holds one number per row."""
    try:
        return classify(name, dt, vector_dtype).kind == constants.KIND_SCALAR
    except TypeError:
        return False


def prepare_data(num_processes: int, store: Store, df,
                 label_columns: Union[str, Sequence[str]] = ("label",),
                 feature_columns: Union[str, Sequence[str]] = ("features",),
                 validation: Union[None, float, str] = None,
                 sample_weight_col: Optional[str] = None,
                 partitions_per_process: int = 10, compress_sparse: bool = False,
                 verbose: int = 0, *, vector_dtype: str = "float64",
                 row_group_size_mb: float = 8.0, seed: int = 0,
                 cache: Optional[TrainingDataCache] = None,
                 allow_nonfinite: bool = False) -> str:
    """Write ``df``'s feature, label and weight columns to ``store`` for training.

    Args:
        num_processes: training processes that will read the data; with
            ``partitions_per_process`` it caps the number of Parquet files per split
            (``num_processes * partitions_per_process``; a DataFrame with more partitions is
            coalesced, one with fewer is written as it is, without a shuffle). The loader
            assigns rows, not files, so any count of files serves any count of ranks.
        store: where to write (:class:`~spark_dl.spark.common.store.Store`); it must be
            visible to the Spark executors (not ``memory://``).
        df: the Spark DataFrame.
        label_columns, feature_columns: column names (a str is one column). Labels may be
            empty; features may not.
        validation: None (all rows train); a fraction in (0, 1) of rows drawn at random (with
            ``seed``) for validation; or the name of a boolean/numeric column whose true/
            non-zero rows are validation rows.
        sample_weight_col: optional numeric column of per-row weights.
        partitions_per_process: see ``num_processes``.
        compress_sparse: store vector columns that hold only SparseVectors as (indices,
            values) instead of dense arrays; the loader densifies them per batch.
        verbose: print progress when > 0.
        vector_dtype: ``"float64"`` (exact) or ``"float32"`` for Spark ML vector columns.
        row_group_size_mb: target decoded size of a Parquet row group; smaller groups shard
            and shuffle more finely, larger ones read faster.
        seed: seed of the random validation split.
        cache: the :class:`~spark_dl.spark.common.cache.TrainingDataCache` to use (default:
            this module's ``training_cache``).
        allow_nonfinite: keep NaN and infinite values in float columns (by default they
            are an error naming the column, counted in the same pass as nulls).

    Returns:
        The dataset index (a :class:`DatasetIndex`, a ``str``): pass it to
        ``estimator.fit_on_parquet(dataset_idx=idx)``, ``store.get_train_data_path(idx)``,
        :func:`get_dataset_properties` or ``DataSource.from_store(store, idx)``. It is also
        a context manager, as in Horovod: ``with prepare_data(...) as idx:``.

    Raises:
        KeyError: a named column is not in ``df``.
        TypeError: a column has an unsupported type (the message names the fix).
        ValueError: bad arguments, a named column in ``df`` twice, an empty DataFrame,
            nulls, NaN or infinite values (unless ``allow_nonfinite``), arrays or vectors of
            differing lengths, a validation split that leaves either side empty.
        PermissionError: the store cannot be written.
    """
    t0 = time.time()
    cache = training_cache if cache is None else cache
    labels = _as_list(label_columns, "label_columns")
    features = _as_list(feature_columns, "feature_columns")
    from spark_dl.spark.launch.executor_python import use_driver_python_for_session

    use_driver_python_for_session(df.sparkSession)  # local masters: this interpreter
    _check_args(num_processes, store, labels, features, validation, sample_weight_col,
                partitions_per_process, vector_dtype, row_group_size_mb)
    columns = features + labels + ([sample_weight_col] if sample_weight_col else [])
    val_col = validation if isinstance(validation, str) else None
    fraction = float(validation) if validation is not None and val_col is None else None

    # 1. schema
    schema = df.schema.fields
    fields = {f.name: f.dataType for f in schema}
    names = [f.name for f in schema]
    # Each requested name once, the error naming the argument it came from.
    for what, wanted in (("feature columns", features), ("label columns", labels),
                         ("sample weight columns", [sample_weight_col] if sample_weight_col
                          else []),
                         ("validation columns", [val_col] if val_col else [])):
        column_positions(names, wanted, what)
    # The weight and validation columns are checked as what they are first: classify's
    # advice for a string column (index it as a feature) does not fit them.
    for col, what in ((sample_weight_col, f"sample_weight_col {sample_weight_col!r} must be "
                                          "a numeric column"),
                      (val_col, f"validation column {val_col!r} must be boolean or numeric "
                                "(true/non-zero = validation row)")):
        if col and not _holds_numbers(col, fields[col], vector_dtype):
            raise TypeError(f"{what}, not {fields[col].simpleString()}")
    infos = {name: classify(name, fields[name], vector_dtype) for name in columns}

    # 2. cache
    params = {"labels": labels, "features": features, "validation": validation,
              "sample_weight_col": sample_weight_col, "compress_sparse": compress_sparse,
              "vector_dtype": vector_dtype, "row_group_size_mb": row_group_size_mb,
              "seed": seed, "format": constants.METADATA_FORMAT_VERSION}
    if allow_nonfinite:  # only then: the keys of datasets checked as before stay the same
        params["allow_nonfinite"] = True
    try:
        key = cache_key(df, store, params)
    except UncacheablePlan as e:
        _log(verbose, f"not caching this dataset: {e}")
        key = None
    idx = cache.get(key) if key else None
    if idx is not None:
        _log(verbose, f"reusing prepared dataset {idx} (same plan and parameters)")
        return DatasetIndex(idx, store)
    idx = (key or uuid.uuid4().hex)[:16]  # uncached: a fresh index no request shares

    # 3. the store (and, for compress_sparse, the vector layout)
    vector_cols = [n for n, i in infos.items() if i.kind == constants.KIND_VECTOR]
    sparse_rows = 0
    if compress_sparse and vector_cols:
        rows = df.select(*[_col(n).alias(f"_{i}") for i, n in enumerate(vector_cols)]) \
            .mapInArrow(vector_stats_fn(vector_cols), vector_stats_schema()).collect()
        sparse_rows = check_vector_stats(rows, infos)
    if not store.capabilities.shared_across_processes:
        raise ValueError(f"store {store.prefix_path!r} lives in this process only, so Spark "
                         "executors cannot write to it; use a local directory or a shared "
                         "filesystem URL")
    store.check_writable()

    # 4. write, counting the checks on the way (one pass over the data)
    dirs = {"train": store.get_train_data_path(idx), "val": store.get_val_data_path(idx)}
    delete_dataset(store, idx)  # leftovers of an interrupted earlier run
    selected = _select(df, infos, vector_dtype, val_col, fraction, seed)
    target = max(1, int(num_processes * partitions_per_process))
    # coalesce never adds partitions (nor shuffles), so a DataFrame with fewer keeps its
    # own; asking df.rdd for the count would plan the query on the driver first (and
    # Spark Connect has no df.rdd).
    selected = selected.coalesce(target)
    stats = DataStats([(n, i.kind, i.dtype, i.sparse) for n, i in infos.items()],
                      check_finite=not allow_nonfinite)
    writer = PartitionWriter(store, dirs, stats, row_group_size_mb * (1 << 20),
                             sparse_columns(infos.values(),
                                            lambda i: _stored_row_bytes(i, sparse_rows)),
                             split=validation is not None, raw=_raw_columns(infos),
                             names=_written_names(infos, validation))
    t1 = time.time()
    summaries = selected.mapInArrow(writer, summary_schema()).collect()
    files = [r for r in summaries if r["split"] is not None]
    partitions = [json.loads(r["stats"]) for r in summaries if r["split"] is None]
    _log(verbose, f"wrote {len(files)} files in {time.time() - t1:.1f}s")

    # 5. the checks, then the metadata; data that fails a check is deleted
    try:
        total = _check_counts(DataStats.merge(p["counts"] for p in partitions), infos,
                              compress_sparse, val_col)
        splits = {}
        for split in ("train", "val"):
            parts = sorted((r for r in files if r["split"] == split), key=lambda r: r["name"])
            splits[split] = {
                "path": dirs[split], "rows": sum(r["rows"] for r in parts),
                "file_bytes": sum(r["file_bytes"] for r in parts),
                "files": [{"name": r["name"], "rows": r["rows"],
                           "row_groups": list(r["row_groups"]), "file_bytes": r["file_bytes"]}
                          for r in parts]}
        if splits["train"]["rows"] == 0 or (validation is not None and
                                            splits["val"]["rows"] == 0):
            empty = "training" if splits["train"]["rows"] == 0 else "validation"
            raise ValueError(f"validation fraction {fraction} left the {empty} split empty "
                             f"({total} rows); use a fraction nearer 0.5 or more rows")
    except BaseException:
        delete_dataset(store, idx)
        raise
    rows_per_group = max(p["rows_per_group"] or 0 for p in partitions)
    _log(verbose, f"checked {total} rows")
    meta = {
        "format_version": constants.METADATA_FORMAT_VERSION,
        "dataset_idx": idx, "cache_key": key, "created": time.time(),
        "label_columns": labels, "feature_columns": features,
        "sample_weight_col": sample_weight_col, "validation": validation,
        "columns": {n: _column_meta(i, total) for n, i in infos.items()},
        "train": splits["train"], "val": splits["val"] if validation is not None else None,
        "avg_row_size": sum(_decoded_row_bytes(i) for i in infos.values()),
        "rows_per_row_group": rows_per_group,
    }
    store.write_text(store.get_data_metadata_path(idx), json.dumps(meta, indent=1))
    if key:
        cache.put(key, store, idx)
    _log(verbose, f"prepared dataset {idx}: {splits['train']['rows']} train / "
                  f"{splits['val']['rows']} val rows in {time.time() - t0:.1f}s")
    if verbose:
        _note_old_datasets(store, idx)
    return DatasetIndex(idx, store)


#: prepare_data mentions Store.cleanup once a store holds this many prepared datasets.
OLD_DATASETS_NOTE = 3


def _note_old_datasets(store: Store, idx: str) -> None:
    """A hint when prepared copies pile up: nothing deletes old ones on its own."""
    try:
        count = len(store.prepared_datasets())
        if count < OLD_DATASETS_NOTE:
            return
        size = store.disk_usage(store.get_train_data_path(idx))
    except OSError:
        return
    _log(1, f"the store holds {count} prepared datasets (this one's training data: "
            f"{size / 2 ** 20:.1f} MiB); store.cleanup(keep_last=1) deletes all but the "
            f"newest (docs/data.md)")


def _check_counts(counts: dict, infos, compress_sparse: bool, val_col: Optional[str]) -> int:
    """The data checks on the write job's merged counts (see :class:`DataStats`); returns
    the row count."""
    total = check_stats(counts, infos, compress_sparse)
    if val_col:
        if counts.get("val_nulls"):
            raise ValueError(f"validation column {val_col!r} has {counts['val_nulls']} nulls; "
                             "fill them with False/0 first")
        if counts.get("val_rows", 0) in (0, total):
            side = "no" if counts.get("val_rows", 0) == 0 else "every"
            raise ValueError(f"validation column {val_col!r} marks {side} row as validation; "
                             "it must leave rows on both sides")
    return total


def _check_args(num_processes, store, labels, features, validation, sample_weight_col,
                partitions_per_process, vector_dtype, row_group_size_mb) -> None:
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if not isinstance(store, Store):
        raise TypeError(f"store must be a spark_dl Store (Store.create(path)), "
                        f"not {type(store).__name__}")
    if not features:
        raise ValueError("feature_columns is empty: name at least one feature column")
    cols = features + labels + ([sample_weight_col] if sample_weight_col else [])
    dupes = sorted({c for c in cols if cols.count(c) > 1})
    if dupes:
        raise ValueError(f"columns {dupes} are listed more than once among features, labels "
                         "and sample weight; list each column once")
    if isinstance(validation, bool) or not (validation is None or
                                            isinstance(validation, (int, float, str))):
        raise TypeError(f"validation must be None, a fraction or a column name, "
                        f"got {validation!r}")
    if isinstance(validation, (int, float)) and not 0 < validation < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {validation}; e.g. 0.1 "
                         "for 10% validation rows")
    if isinstance(validation, str) and validation in cols:
        raise ValueError(f"validation column {validation!r} is also a feature/label/weight "
                         "column; use a separate column")
    if not isinstance(partitions_per_process, int) or partitions_per_process < 1:
        raise ValueError(f"partitions_per_process must be a positive int, "
                         f"got {partitions_per_process!r}")
    if vector_dtype not in ("float32", "float64"):
        raise ValueError(f"vector_dtype must be 'float32' or 'float64', got {vector_dtype!r}")
    if not row_group_size_mb > 0:
        raise ValueError(f"row_group_size_mb must be > 0, got {row_group_size_mb!r}")


def _select(df, infos, vector_dtype, val_col, fraction, seed):
    """The columns to write, converted by Spark, plus the validation flag when splitting."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    cols = []
    for name, info in infos.items():
        c = _col(name)
        if info.kind == constants.KIND_VECTOR and not info.sparse:
            c = vector_to_array(c, dtype=vector_dtype)
        # Positional names: pyspark's mapInArrow looks every column up by name, and
        # reads a name holding a dot as a struct's field; the writer gives the names back.
        cols.append(c.alias(f"_{len(cols)}"))
    if val_col:
        # Nulls stay null: the writer counts them (an error) and writes them as training.
        cols.append(_col(val_col).cast("boolean").alias(SPLIT_COLUMN))
    elif fraction is not None:
        cols.append((F.rand(seed) < F.lit(fraction)).alias(SPLIT_COLUMN))
    return df.select(*cols)


def _written_names(infos, validation) -> List[str]:
    """The names of :func:`_select`'s columns, which it selects under positional ones."""
    return list(infos) + ([SPLIT_COLUMN] if validation is not None else [])


def _decoded_row_bytes(info) -> int:
    import numpy as np

    n = 1
    for d in info.shape:
        n *= d
    return n * np.dtype(info.dtype).itemsize


def _stored_row_bytes(info, total: int) -> float:
    import numpy as np

    if info.sparse:
        return (info.nnz / max(total, 1)) * (4 + np.dtype(info.dtype).itemsize) + 8
    return _decoded_row_bytes(info)


def _raw_columns(infos) -> Dict[str, str]:
    """{name: element dtype} of the columns written raw (dense arrays and vectors)."""
    return {n: i.dtype for n, i in infos.items()
            if i.kind in (constants.KIND_ARRAY, constants.KIND_VECTOR) and not i.sparse}


def _column_meta(info, total: int) -> dict:
    entry = {"kind": info.kind, "dtype": info.dtype, "shape": list(info.shape),
             "sparse": info.sparse, "spark_type": info.spark_type, "rows": total,
             "bytes": total * _decoded_row_bytes(info)}
    if info.sparse:
        entry["nnz"] = info.nnz
    elif info.kind != constants.KIND_SCALAR and _decoded_row_bytes(info):
        entry["encoding"] = raw_columns.ENCODING_RAW
    return entry


class DatasetIndex(str):
    """What :func:`prepare_data` returns: the dataset's index (a ``str``), knowing its
    store, and a context manager as Horovod's ``prepare_data`` is
    (``with prepare_data(...) as idx:``; the dataset stays in the store afterwards, cached
    for later fits)."""

    def __new__(cls, idx: str, store: Store):
        obj = super().__new__(cls, idx)
        obj.store = store
        return obj

    def __reduce__(self):
        return DatasetIndex, (str(self), self.store)

    def __enter__(self) -> "DatasetIndex":
        return self

    def __exit__(self, *exc) -> None:
        return None


def _store_and_idx(store_or_idx, dataset_idx):
    """(store, idx) from ``(store, idx)`` or from a :class:`DatasetIndex` alone."""
    if dataset_idx is not None:
        return store_or_idx, dataset_idx
    store = getattr(store_or_idx, "store", None)
    if store is None:
        raise ValueError(f"dataset index {store_or_idx!r} alone does not say which store "
                         "holds it: pass (store, dataset_idx), or the value prepare_data "
                         "returned")
    return store, store_or_idx


def get_dataset_metadata(store, dataset_idx=None) -> dict:
    """The metadata document of a prepared dataset (see :mod:`.metadata`): takes
    ``(store, dataset_idx)`` or, as Horovod, the index :func:`prepare_data` returned."""
    return load_metadata(*_store_and_idx(store, dataset_idx))


def get_dataset_properties(store, dataset_idx=None) -> Tuple[int, int, dict, float]:
    """Horovod-style ``(train_rows, val_rows, metadata, avg_row_size)`` of a dataset: takes
    ``(store, dataset_idx)`` or, as Horovod, the index :func:`prepare_data` returned."""
    meta = get_dataset_metadata(store, dataset_idx)
    val = meta["val"]["rows"] if meta.get("val") else 0
    return meta["train"]["rows"], val, meta, meta["avg_row_size"]


def remove_dataset(store, dataset_idx, cache: Optional[TrainingDataCache] = None) -> None:
    """Delete a prepared dataset from ``store`` and forget it in the cache."""
    cache = training_cache if cache is None else cache
    cache.forget_dataset(store, dataset_idx)
    delete_dataset(store, dataset_idx)


__all__ = ["prepare_data", "DatasetIndex", "clear_training_cache", "get_dataset_metadata",
           "get_dataset_properties", "remove_dataset", "training_cache"]
