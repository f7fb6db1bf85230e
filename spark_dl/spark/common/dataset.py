"""What an estimator knows of its prepared training data, and how workers read it.

:class:`Dataset` travels to the workers inside the training function's arguments, so this
module imports neither pyspark nor pyarrow at import time (a worker unpickling it stays
light).
"""

import dataclasses
import posixpath
from typing import Dict, List, Optional

from spark_dl.spark.common import constants

__all__ = ["Dataset"]


@dataclasses.dataclass
class Dataset:
    """Prepared training data as the estimator and its workers see it.

    Attributes:
        idx: the ``prepare_data`` index, or None for plain Parquet in the store's train
            (and val) directories (``fit_on_parquet()`` without an index).
        columns: column name -> ``{"kind", "dtype", "shape"}`` (shape per row, [] for
            scalars).
        train_rows, val_rows: rows of each split (val_rows 0 without validation).
        train_path, val_path: the directories (store paths).
        files: for plain Parquet, split -> its files (filesystem paths of the store's
            filesystem), listed on the driver.
    """

    idx: Optional[str]
    columns: Dict[str, dict]
    train_rows: int
    val_rows: int
    train_path: str
    val_path: Optional[str]
    files: Optional[Dict[str, List[str]]] = None

    @classmethod
    def from_store(cls, store, idx: str) -> "Dataset":
        """The dataset ``prepare_data`` wrote under index ``idx``."""
        from spark_dl.spark.common.metadata import load_metadata

        meta = load_metadata(store, idx)
        columns = {n: {"kind": c["kind"], "dtype": c["dtype"], "shape": list(c["shape"])}
                   for n, c in meta["columns"].items()}
        val = meta.get("val")
        return cls(idx, columns, meta["train"]["rows"], val["rows"] if val else 0,
                   meta["train"]["path"], val["path"] if val else None)

    @classmethod
    def from_plain_parquet(cls, store, columns: List[str]) -> "Dataset":
        """Parquet files written by the user into ``store.get_train_data_path()`` (and
        ``get_val_data_path()``, if it holds any): numeric columns and fixed-length lists of
        numbers, as ``horovod.spark``'s ``fit_on_parquet`` reads them."""
        train = store.get_train_data_path()
        if not store.is_parquet_dataset(train):
            raise FileNotFoundError(
                f"no Parquet files in {train}: write the training data there first, or pass "
                "the dataset_idx that prepare_data returned")
        val = store.get_val_data_path()
        val = val if store.is_parquet_dataset(val) else None
        train_rows, specs = _scan_parquet(store, train, columns)
        val_rows = _scan_parquet(store, val, columns)[0] if val else 0
        files = {"train": [store.get_fs_path(p) for p in _parquet_files(store, train)]}
        if val:
            files["val"] = [store.get_fs_path(p) for p in _parquet_files(store, val)]
        return cls(None, specs, train_rows, val_rows, train, val, files)

    def source(self, store, split: str):
        """The :class:`~spark_dl.spark.common.data_loader_base.DataSource` of ``split``
        ('train' or 'val'); ``store`` is a Store or its ``to_remote()`` view."""
        from spark_dl.spark.common.data_loader_base import DataSource

        if self.idx is not None:
            return DataSource.from_store(store, self.idx, split)
        if split not in (self.files or {}):
            raise ValueError(f"dataset has no {split!r} split")
        return DataSource.from_path(self.files[split], filesystem=store.get_filesystem())


def _parquet_files(store, path: str) -> List[str]:
    return [p for p in store.listdir(path) if p.endswith(".parquet")
            and not posixpath.basename(p).startswith((".", "_"))]


def _scan_parquet(store, path: str, columns: List[str]):
    """(rows, column specs) of the Parquet files in ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = store.get_filesystem()
    files = _parquet_files(store, path)
    rows = sum(pq.read_metadata(store.get_fs_path(f), filesystem=fs).num_rows for f in files)
    schema = pq.read_schema(store.get_fs_path(files[0]), filesystem=fs)
    specs = {}
    for name in columns:
        if name not in schema.names:
            raise KeyError(f"column {name!r} is not in the Parquet files of {path} "
                           f"(columns: {schema.names})")
        t = schema.field(name).type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            specs[name] = {"kind": constants.KIND_SCALAR,
                           "dtype": str(t.to_pandas_dtype().__name__), "shape": []}
            continue
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or
                pa.types.is_fixed_size_list(t)) and (
                pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
            first = pq.ParquetFile(fs.open_input_file(store.get_fs_path(files[0]))) \
                .read_row_group(0, columns=[name]).column(0)
            size = len(first[0].as_py()) if len(first) else 0
            specs[name] = {"kind": constants.KIND_ARRAY,
                           "dtype": str(t.value_type.to_pandas_dtype().__name__),
                           "shape": [size]}
            continue
        raise TypeError(f"column {name!r} of {path} has type {t}: plain Parquet training data "
                        "must hold numbers or fixed-length lists of numbers")
    return rows, specs
