"""The metadata document of a prepared dataset, and the column specs the loaders decode with.

``prepare_data`` writes one JSON document per dataset index (``Store.get_data_metadata_path``)
after all Parquet files are in place, so a dataset without its metadata is incomplete. Layout::

    {
      "format_version": 2,
      "dataset_idx": "d3f1...",
      "label_columns": ["y"], "feature_columns": ["x"], "sample_weight_col": null,
      "columns": {
        "x": {"kind": "vector", "dtype": "float64", "shape": [64], "sparse": false,
              "spark_type": "vector", "bytes": 1024000, "encoding": "raw"},
        ...
      },
      "train": {"path": "<store path>", "rows": 1000, "bytes": 123456,
                "files": [{"name": "part-00000.parquet", "rows": 500, "row_groups": [250, 250]},
                          ...]},
      "val": null or the same shape as "train",
      "avg_row_size": 1033.0,
      "cache_key": "<sha256 of the DataFrame plan and the parameters>"
    }

``bytes`` are decoded (in-memory, uncompressed) sizes. ``shape`` is the per-row shape: ``[]`` for
scalars. A ``sparse`` column is stored as a Parquet struct of two lists (``indices`` int32,
``values``) and decoded to a dense array of ``shape``. ``"encoding": "raw"``: a dense array or
vector column stored as one fixed-width binary value per row (:mod:`.raw_columns`; format 2);
without it, a Parquet list (format 1, and columns of empty arrays).
"""

import dataclasses
import json
import posixpath
from typing import Dict, List, Optional, Tuple

from spark_dl.spark.common import constants


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """How one column is stored and what a loader yields for it.

    Attributes:
        name: column name.
        kind: ``"scalar"``, ``"array"`` or ``"vector"`` (see :mod:`.constants`).
        dtype: NumPy dtype name of the yielded values (e.g. ``"float32"``).
        shape: per-row shape; ``()`` for scalars, None when not known before reading.
        sparse: stored as (indices, values) and densified on read.
    """

    name: str
    kind: str
    dtype: str
    shape: Optional[Tuple[int, ...]]
    sparse: bool = False

    @property
    def row_bytes(self) -> Optional[int]:
        """Decoded bytes of one row of this column, None when the shape is not known."""
        if self.shape is None:
            return None
        import numpy as np

        n = 1
        for d in self.shape:
            n *= d
        return n * np.dtype(self.dtype).itemsize

    @classmethod
    def from_metadata(cls, name: str, entry: dict) -> "ColumnSpec":
        return cls(name=name, kind=entry["kind"], dtype=entry["dtype"],
                   shape=tuple(entry["shape"]), sparse=bool(entry.get("sparse", False)))


def column_specs(metadata: dict) -> Dict[str, ColumnSpec]:
    """The :class:`ColumnSpec` of every column of a metadata document."""
    return {name: ColumnSpec.from_metadata(name, entry)
            for name, entry in metadata["columns"].items()}


def split_files(metadata: dict, split: str) -> Tuple[List[str], List[List[int]]]:
    """(file paths, row counts per row group of each file) of ``split`` ('train' or 'val')."""
    part = metadata.get(split)
    if part is None:
        raise ValueError(f"dataset {metadata.get('dataset_idx')!r} has no {split!r} split")
    files = [posixpath.join(part["path"], f["name"]) for f in part["files"]]
    return files, [list(f["row_groups"]) for f in part["files"]]


def load_metadata(store, dataset_idx) -> dict:
    """Read and check the metadata of ``dataset_idx`` from ``store`` (a Store or RemoteStore).

    Raises:
        FileNotFoundError: the dataset was never prepared, or was removed, or its
            ``prepare_data`` did not finish.
        ValueError: the document has a format version this code does not read.
    """
    path = store.get_data_metadata_path(dataset_idx)
    try:
        meta = json.loads(store.read(path).decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no prepared dataset {dataset_idx!r} in {store.prefix_path!r} (missing {path}); "
            "run prepare_data first (it writes the metadata last, so an interrupted "
            "prepare_data leaves none)") from None
    version = meta.get("format_version")
    if version not in constants.METADATA_FORMAT_VERSIONS_READ:
        raise ValueError(f"dataset {dataset_idx!r} has metadata format {version}, this "
                         f"spark_dl reads {list(constants.METADATA_FORMAT_VERSIONS_READ)}; "
                         "prepare it again")
    return meta
