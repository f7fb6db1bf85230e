"""What ``prepare_data`` accepts, and the checks it runs before writing anything.

Supported column types (feature, label and sample-weight columns):

================================  ========  ============================================
Spark type                        kind      stored as
================================  ========  ============================================
boolean, byte, short, int, long,  scalar    the same Parquet type
float, double
array<number or boolean>          array     list of the element type, one length per column
Spark ML DenseVector/SparseVector vector    list<double> (``vector_dtype``) via Spark's own
                                            ``vector_to_array``; with ``compress_sparse``, a
                                            column of only SparseVectors is stored as
                                            struct<indices: list<int32>, values: list<T>>
================================  ========  ============================================

Everything else is rejected with the column name and a fix, and so are nulls, NaN and infinite
values in float columns, arrays and vectors (unless ``allow_nonfinite``) and arrays or vectors
of differing lengths. The checks on the data are counted by :class:`DataStats` inside the
write job itself, so the data is read once (plus one vectorised Arrow pass over vector
columns before it when ``compress_sparse`` is asked for, which decides their layout); a
dataset that fails them is deleted before ``prepare_data`` raises.
"""

import dataclasses
from typing import Dict, List, Optional

from spark_dl.spark.common import constants

_SCALAR_DTYPES = {
    "boolean": "bool", "tinyint": "int8", "smallint": "int16", "int": "int32",
    "bigint": "int64", "float": "float32", "double": "float64",
}

_FIXES = {
    "string": "encode it as numbers first (e.g. pyspark.ml.feature.StringIndexer, "
              "then OneHotEncoder if needed)",
    "binary": "decode it into a numeric array column first",
    "date": "cast it to a number first (e.g. F.unix_date(col) or col.cast('long'))",
    "timestamp": "cast it to a number first (e.g. F.unix_timestamp(col))",
    "decimal": "cast it to double first (col.cast('double'))",
    "map": "turn it into numeric columns or a vector first (e.g. VectorAssembler)",
    "struct": "select its numeric fields as separate columns, or assemble them with "
              "VectorAssembler",
    "array": "flatten it to one level first (pyspark.sql.functions.flatten) and reshape it in "
             "the model",
    "void": "cast it to a numeric type",
}
# The same for an array's elements: an array column is cast whole.
_ARRAY_FIXES = {
    "decimal": "cast it to array<double> first (col.cast('array<double>'))",
    "array": _FIXES["array"],
}


@dataclasses.dataclass
class ColumnInfo:
    """A checked column: its kind, element dtype and (after the data pass) shape."""

    name: str
    kind: str
    dtype: str
    spark_type: str
    shape: Optional[List[int]] = None
    sparse: bool = False
    nnz: Optional[int] = None  # total stored non-zeros of a sparse column


def _col(name: str):
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def column_positions(names: List[str], wanted: List[str], what: str = "columns") -> List[int]:
    """The position in ``names`` (a DataFrame's columns) of each name in ``wanted``.

    Raises:
        ValueError: ``names`` holds a wanted name more than once (a join keeps both sides'
            ``id``), which Spark cannot resolve.
        KeyError: a wanted name is not in ``names``.
    """
    names = list(names)
    twice = sorted({n for n in wanted if names.count(n) > 1})
    if twice:
        raise ValueError(f"{what} {twice} are each in the DataFrame more than once (columns: "
                         f"{names}); rename or drop the copies that are not meant first (a "
                         "join on a.id == b.id keeps both id columns)")
    missing = [n for n in dict.fromkeys(wanted) if n not in names]
    if missing:
        folded = {str(n).lower(): n for n in names}
        close = [f"{folded[str(n).lower()]!r} for {n!r}" for n in missing
                 if str(n).lower() in folded]
        hint = f" (names match exactly, case too: did you mean {', '.join(close)}?)" \
            if close else ""
        raise KeyError(f"{what} {missing} are not in the DataFrame (columns: {names}); fix "
                       f"the names or add the columns{hint}")
    return [names.index(n) for n in wanted]


def _type_name(dt) -> str:
    return dt.simpleString()


def classify(name: str, dt, vector_dtype: str) -> ColumnInfo:
    """ColumnInfo for Spark type ``dt`` of column ``name``; TypeError naming a fix otherwise."""
    from pyspark.sql import types as T

    try:
        from pyspark.ml.linalg import VectorUDT
    except ImportError:  # pragma: no cover - pyspark always ships ml
        VectorUDT = ()
    simple = _type_name(dt)
    if isinstance(dt, VectorUDT):
        return ColumnInfo(name, constants.KIND_VECTOR, vector_dtype, "vector")
    if type(dt).__name__ == "VectorUDT":  # pyspark.mllib's old vector type
        raise TypeError(f"column {name!r} holds pyspark.mllib vectors; convert them to "
                        "pyspark.ml vectors first (MLUtils.convertVectorColumnsToML)")
    if simple in _SCALAR_DTYPES:
        return ColumnInfo(name, constants.KIND_SCALAR, _SCALAR_DTYPES[simple], simple)
    if isinstance(dt, T.ArrayType):
        elem = _type_name(dt.elementType)
        if elem in _SCALAR_DTYPES:
            return ColumnInfo(name, constants.KIND_ARRAY, _SCALAR_DTYPES[elem], simple)
        key = "array" if isinstance(dt.elementType, T.ArrayType) else \
            elem.split("(")[0].split("<")[0]
        fix = _ARRAY_FIXES.get(key, "convert its elements to numbers first (e.g. "
                               "pyspark.sql.functions.transform)")
        raise TypeError(f"column {name!r} has unsupported type {simple}: arrays must hold "
                        f"numbers or booleans; {fix}")
    key = simple.split("(")[0].split("<")[0]
    raise TypeError(f"column {name!r} has unsupported type {simple}; "
                    f"{_FIXES.get(key, 'convert it to numbers, arrays of numbers or vectors')}")


# Element dtypes that can hold NaN or an infinity (vectors hold doubles).
_FLOAT_DTYPES = ("float32", "float64")


class DataStats:
    """The data checks, counted per Arrow batch inside the write job (one pass over the
    data; see :mod:`.parquet_writer`) and merged on the driver for :func:`check_stats`.

    Counts, keyed as :func:`check_stats` reads them: ``n`` rows; per column ``i`` (in
    ``columns`` order) ``nulls_i``; ``min_i``/``max_i`` lengths of arrays and dense vectors;
    ``elemnulls_i`` rows of an array column with a null element; with ``check_finite``,
    ``nonfinite_i`` rows holding NaN or an infinity in a float column (a value, or any
    element of an array or vector); ``val_nulls``/``val_rows`` of a validation column.

    Args:
        columns: ``(name, kind, dtype, sparse)`` per column, as the batches carry them
            (dense vectors already turned into lists by ``vector_to_array``; sparse ones
            as Spark's vector struct).
        check_finite: count NaN and infinities in float columns.
    """

    def __init__(self, columns, check_finite: bool):
        self.columns = [tuple(c) for c in columns]
        self.check_finite = check_finite
        self.counts: Dict[str, int] = {"n": 0}

    def _add(self, key: str, value, combine=lambda a, b: a + b) -> None:
        if value is None:
            return
        value = int(value)
        old = self.counts.get(key)
        self.counts[key] = value if old is None else combine(old, value)

    def add_batch(self, rb) -> None:
        """Counts one Arrow record batch."""
        import pyarrow.compute as pc

        self._add("n", rb.num_rows)
        for i, (name, kind, dtype, sparse) in enumerate(self.columns):
            arr = rb.column(name)
            self._add(f"nulls_{i}", arr.null_count)
            if arr.null_count:
                arr = arr.filter(arr.is_valid())
            check = self.check_finite and dtype in _FLOAT_DTYPES
            if kind == constants.KIND_SCALAR:
                if check:
                    self._add(f"nonfinite_{i}", pc.sum(pc.invert(pc.is_finite(arr))).as_py()
                              or 0)
                continue
            lists = pc.struct_field(arr, "values") if sparse else arr
            if not sparse:
                lengths = pc.min_max(pc.list_value_length(lists)).as_py()
                self._add(f"min_{i}", lengths["min"], min)
                self._add(f"max_{i}", lengths["max"], max)
            if kind == constants.KIND_ARRAY:
                self._add(f"elemnulls_{i}", _rows_where(lists, lambda v: v.is_null()))
            if check:
                self._add(f"nonfinite_{i}",
                          _rows_where(lists, lambda v: pc.invert(pc.is_finite(v))))

    def add_validation_flags(self, flags) -> None:
        """Counts a validation column (boolean, before its nulls are filled)."""
        import pyarrow.compute as pc

        self._add("val_nulls", flags.null_count)
        self._add("val_rows", pc.sum(flags.fill_null(False)).as_py() or 0)

    @staticmethod
    def merge(parts) -> Dict[str, int]:
        """One dict of counts from the per-partition dicts (sums; min and max lengths)."""
        total: Dict[str, int] = {"n": 0}
        for part in parts:
            for key, value in part.items():
                if value is None:
                    continue
                if key not in total:
                    total[key] = value
                elif key.startswith("min_"):
                    total[key] = min(total[key], value)
                elif key.startswith("max_"):
                    total[key] = max(total[key], value)
                else:
                    total[key] += value
        return total


def _rows_where(lists, predicate) -> int:
    """How many rows of a list array (no null rows) hold an element for which
    ``predicate`` (elements -> boolean array) is true."""
    import numpy as np
    import pyarrow.compute as pc

    values = lists.flatten()
    if len(values) == 0:
        return 0
    hit = np.asarray(predicate(values).fill_null(False))
    if not hit.any():
        return 0
    parents = np.asarray(pc.list_parent_indices(lists))
    return int(np.unique(parents[hit]).size)


def check_stats(row: Dict[str, int], infos: Dict[str, ColumnInfo],
                compress_sparse: bool) -> int:
    """Raise ValueError for nulls, NaN or infinite values (when counted, see
    :class:`DataStats`) or differing lengths; set shapes. Returns the row count."""
    n = row["n"]
    if n == 0:
        raise ValueError("the DataFrame is empty: there is nothing to train on (check the "
                         "filters that produced it)")
    for i, (name, info) in enumerate(infos.items()):
        nulls = row.get(f"nulls_{i}", 0)
        if nulls:
            raise ValueError(f"column {name!r} has {nulls} null values out of {n} rows; drop "
                             f"them (df.dropna(subset=[{name!r}])) or fill them "
                             f"(df.fillna(...)) first")
        nonfinite = row.get(f"nonfinite_{i}", 0)
        if nonfinite:
            what = "values" if info.kind == constants.KIND_SCALAR else "elements"
            raise ValueError(
                f"column {name!r} has {nonfinite} rows out of {n} with NaN or infinite "
                f"{what}, which train to a loss of nan; drop those rows or replace the values "
                f"first (e.g. df.replace(float('nan'), 0.0, subset=[{name!r}])), or pass "
                "allow_nonfinite=True to keep them")
        if info.kind == constants.KIND_SCALAR:
            info.shape = []
        elif info.kind == constants.KIND_ARRAY or not compress_sparse:
            lo, hi = row[f"min_{i}"], row[f"max_{i}"]
            what = "arrays" if info.kind == constants.KIND_ARRAY else "vectors"
            if lo != hi:
                raise ValueError(f"column {name!r} holds {what} of different lengths ({lo} to "
                                 f"{hi}); every row must have the same length: pad or truncate "
                                 f"them first (e.g. F.slice / F.concat with zeros)")
            if info.kind == constants.KIND_ARRAY and row.get(f"elemnulls_{i}"):
                raise ValueError(f"column {name!r} has {row[f'elemnulls_{i}']} arrays with null "
                                 "elements; replace them first (e.g. F.transform(col, lambda x: "
                                 "F.coalesce(x, F.lit(0))))")
            info.shape = [int(lo)]
    return int(n)


def vector_stats_fn(names: List[str]):
    """An Arrow batch function returning, per partition and vector column: rows, dense rows,
    min/max size and stored non-zeros. Spark hands ML vectors to Arrow as
    struct<type: int8, size: int32, indices: list<int32>, values: list<double>> (type 0 =
    sparse, 1 = dense)."""
    return _VectorStats(list(names))


def vector_stats_schema():
    """The schema of :func:`vector_stats_fn`'s rows as a StructType (not a DDL string,
    which the JVM's SQL parser would parse: seconds of class loading on first use)."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    return StructType([StructField("col", StringType())] + [
        StructField(name, LongType())
        for name in ("rows", "dense_rows", "min_size", "max_size", "nnz")])


class _VectorStats:
    def __init__(self, names):
        self.names = names

    def __call__(self, batches):
        import numpy as np
        import pyarrow as pa

        acc = {n: [0, 0, None, None, 0] for n in self.names}
        for rb in batches:
            for i, name in enumerate(self.names):
                arr = rb.column(i)  # Spark's names are positional (see prepare_data)
                if arr.null_count:  # nulls are counted by the write pass (DataStats)
                    arr = arr.filter(arr.is_valid())
                kind = np.asarray(arr.field("type"))
                values = arr.field("values")
                lengths = np.diff(np.asarray(values.offsets))
                sizes = np.where(kind == 1, lengths,
                                 np.asarray(arr.field("size").fill_null(0)))
                a = acc[name]
                a[0] += len(kind)
                a[1] += int((kind == 1).sum())
                if len(sizes):
                    a[2] = int(sizes.min()) if a[2] is None else min(a[2], int(sizes.min()))
                    a[3] = int(sizes.max()) if a[3] is None else max(a[3], int(sizes.max()))
                a[4] += int(lengths.sum())
        cols = list(zip(*[[n] + acc[n] for n in self.names]))
        yield pa.RecordBatch.from_arrays(
            [pa.array(cols[0], pa.string())] + [pa.array(c, pa.int64()) for c in cols[1:]],
            names=["col", "rows", "dense_rows", "min_size", "max_size", "nnz"])


def check_vector_stats(rows, infos: Dict[str, ColumnInfo]) -> int:
    """Fold per-partition vector stats into ``infos``; sparse-only columns become sparse.
    Returns the most non-null rows counted in a column (for sizing row groups)."""
    total: Dict[str, list] = {}
    for r in rows:
        t = total.setdefault(r["col"], [0, 0, None, None, 0])
        t[0] += r["rows"]
        t[1] += r["dense_rows"]
        for k, (f, v) in enumerate([(min, r["min_size"]), (max, r["max_size"])], start=2):
            if v is not None and r["rows"]:
                t[k] = v if t[k] is None else f(t[k], v)
        t[4] += r["nnz"]
    for name, (n, dense, lo, hi, nnz) in total.items():
        if lo != hi:
            raise ValueError(f"column {name!r} holds vectors of different sizes ({lo} to {hi}); "
                             "every row must have the same size")
        info = infos[name]
        info.shape = [int(lo)]
        info.sparse = dense == 0
        info.nnz = int(nnz) if info.sparse else None
    return max((t[0] for t in total.values()), default=0)
