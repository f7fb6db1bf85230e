"""petastorm behind the :class:`~spark_dl.spark.common.data_loader_base.BaseDataLoader`
contract, for users who rely on petastorm (``loader="petastorm"``).

petastorm is optional and imported only when this loader is built. petastorm 0.13.1 does not
import with pyarrow >= 15 (it imports ``pyarrow.filesystem``, which was removed) and pins
``setuptools<70`` (torch 2.13 needs >= 77), so it only runs in an environment built for it
(pyarrow 10, numpy < 2). The default Arrow loader does not depend on it.

Semantics differ from :class:`~spark_dl.spark.common.data_loader.ArrowDataLoader` where
petastorm's own do:

- sharding is by whole row groups (``cur_shard=rank, shard_count=size``): every row group goes
  to exactly one rank, but ranks may get different row counts (and none at all when there are
  fewer row groups than ranks), so step counts may differ between ranks; ``len()`` raises
  TypeError because petastorm does not expose the count up front;
- shuffling is petastorm's row-group order (seeded with ``seed + epoch``); batches are NumPy
  (as every loader's), so petastorm's torch-only ``BatchedDataLoader`` and its row buffer
  are not used;
- sparse (``compress_sparse``) columns are not decoded; scalar and fixed-length array columns
  are.
"""

from typing import Dict, Iterator, Optional, Sequence

import numpy as np

from spark_dl.spark.common import raw_columns
from spark_dl.spark.common.data_loader_base import BaseDataLoader, DataSource


def import_petastorm():
    """Import petastorm, or raise ImportError saying why and what to do instead."""
    try:
        import petastorm  # noqa: F401
        from petastorm import make_batch_reader
    except Exception as e:  # ImportError, or AttributeError from an incompatible pyarrow
        raise ImportError(
            f"petastorm is not importable here ({type(e).__name__}: {e}). petastorm 0.13.1 "
            "needs pyarrow<15 and numpy<2 (and setuptools<70, which conflicts with torch "
            ">= 2.13); run it in an environment built for it, or use the default "
            "loader='arrow'") from e
    return make_batch_reader


class PetastormDataLoader(BaseDataLoader):
    """Reads with ``petastorm.make_batch_reader`` and cuts its row groups into batches.

    Args:
        source, batch_size, rank, size, columns, shuffle, seed: see
            :class:`BaseDataLoader`. ``source.dataset_url`` must be set.
        reader_pool_type, workers_count: petastorm reader pool ("thread", "process",
            "dummy") and its size.
        **reader_kwargs: passed to ``make_batch_reader``.
    """

    def __init__(self, source: DataSource, *, batch_size: int, rank: int = 0, size: int = 1,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0,
                 reader_pool_type: str = "thread", workers_count: int = 2, **reader_kwargs):
        super().__init__(source, batch_size=batch_size, rank=rank, size=size, columns=columns,
                         shuffle=shuffle, seed=seed)
        self._make_batch_reader = import_petastorm()
        if not source.dataset_url:
            raise ValueError("PetastormDataLoader needs source.dataset_url (a directory URL)")
        sparse = [n for n, s in (source.columns or {}).items() if s.sparse and
                  (columns is None or n in columns)]
        if sparse:
            raise TypeError(f"petastorm cannot decode the sparse columns {sparse}; prepare the "
                            "data with compress_sparse=False or use loader='arrow'")
        self._reader_kwargs = dict(reader_pool_type=reader_pool_type,
                                   workers_count=workers_count, **reader_kwargs)

    def __len__(self) -> int:
        raise TypeError("petastorm does not tell how many batches a shard yields; iterate "
                        "to the end of the epoch instead")

    def _reader(self, epoch: int):
        return self._make_batch_reader(
            self.source.dataset_url, schema_fields=self.columns, cur_shard=self.rank,
            shard_count=self.size, shuffle_row_groups=self.shuffle,
            seed=self.seed + epoch, num_epochs=1, **self._reader_kwargs)

    def _iterate(self, epoch: int) -> Iterator[Dict[str, object]]:
        with self._reader(epoch) as reader:
            yield from self._rebatch(reader)

    def _column(self, name: str, values) -> np.ndarray:
        """petastorm's values of one column as NumPy; raw array columns (format 2,
        :mod:`.raw_columns`) arrive as ``bytes`` per row and are decoded here."""
        arr = np.asarray(values)
        spec = (self.source.columns or {}).get(name)
        if arr.dtype == object and len(arr) and isinstance(arr[0], (bytes, bytearray)) \
                and spec is not None and spec.shape:
            length = int(np.prod(spec.shape))
            return raw_columns.decode_values(arr, spec.dtype, length).reshape(
                (len(arr),) + tuple(spec.shape))
        return arr

    def _rebatch(self, reader) -> Iterator[Dict[str, np.ndarray]]:
        """petastorm yields one namedtuple per row group; cut them into batch_size batches."""
        pending: Dict[str, list] = {}
        have = 0
        for chunk in reader:
            cols = chunk._asdict()
            if self.columns is not None:
                cols = {k: cols[k] for k in self.columns}
            for k, v in cols.items():
                pending.setdefault(k, []).append(self._column(k, v))
            have += len(next(iter(cols.values())))
            while have >= self.batch_size:
                merged = {k: np.concatenate(v) for k, v in pending.items()}
                yield {k: v[:self.batch_size] for k, v in merged.items()}
                pending = {k: [v[self.batch_size:]] for k, v in merged.items()}
                have -= self.batch_size
        if have:
            yield {k: np.concatenate(v) for k, v in pending.items()}
