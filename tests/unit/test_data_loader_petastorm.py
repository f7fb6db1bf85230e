"""The petastorm adapter. Runs only where petastorm imports (pyarrow < 15, numpy < 2); elsewhere
every test is skipped with the import error as the reason."""

import os

import numpy as np
import pytest

from spark_dl.spark.common.data_loader_base import DataSource, get_data_loader_class

try:
    from spark_dl.spark.common.petastorm_loader import PetastormDataLoader, import_petastorm

    import_petastorm()
    REASON = None
except ImportError as e:
    REASON = str(e)

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"petastorm unavailable: {REASON}")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path_factory.mktemp("pst"))
    start = 0
    for f, sizes in enumerate([[10, 5], [17], [8]]):
        tables = []
        for n in sizes:
            ids = np.arange(start, start + n, dtype=np.int64)
            start += n
            x = np.stack([ids, 2 * ids], axis=1).astype(np.float32)
            tables.append(pa.table({"id": ids, "x": pa.array(list(x), pa.list_(pa.float32()))}))
        writer = pq.ParquetWriter(os.path.join(path, f"part-{f:05d}.parquet"), tables[0].schema)
        for t in tables:
            writer.write_table(t)
        writer.close()
    return DataSource.from_path(path), start


def test_selectable_by_name():
    assert get_data_loader_class("petastorm") is PetastormDataLoader


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_row_once_across_shards(dataset, size):
    source, total = dataset
    seen = []
    for rank in range(size):
        loader = PetastormDataLoader(source, batch_size=4, rank=rank, size=size, seed=1,
                                     reader_pool_type="dummy")
        for batch in loader:
            np.testing.assert_array_equal(batch["x"][:, 1], 2 * batch["id"])
            assert len(batch["id"]) <= 4
            seen.extend(batch["id"].tolist())
    assert sorted(seen) == list(range(total))


def test_numpy_batches_unshuffled(dataset):
    source, total = dataset
    loader = PetastormDataLoader(source, batch_size=8, shuffle=False,
                                 reader_pool_type="dummy")
    batches = list(loader)
    assert all(isinstance(b["id"], np.ndarray) for b in batches)
    assert sorted(np.concatenate([b["id"] for b in batches]).tolist()) == list(range(total))
    with pytest.raises(TypeError):
        len(loader)
