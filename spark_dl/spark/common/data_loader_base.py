"""The interface every data loader implements, the description of what to read, and the
registry that lets estimators pick a loader by name.

A loader turns a set of Parquet files into batches for one rank. Estimators construct it as::

    loader_cls = get_data_loader_class(name_or_class)       # "arrow", "petastorm" or a class
    loader = loader_cls(source, batch_size=..., rank=..., size=..., columns=...,
                        shuffle=..., seed=..., **loader_options)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:                                  # dict: column -> NumPy array
            ...
    loader.close()

**Custom loaders** subclass :class:`BaseDataLoader`, accept the keyword arguments above (and
may take more through ``**options``), and keep its contract:

- ``batch`` is a dict from column name to a NumPy array whose first dimension is the batch
  (loaders know no framework: an estimator's adapter turns batches into its tensors, and
  ``spark_dl.spark.torch.util.torch_batch`` does it for PyTorch code of your own);
- ``len(loader)`` is the number of batches one epoch yields on this rank, or raises
  TypeError when the loader cannot know it;
- iterating twice without ``set_epoch`` moves to the next epoch;
- ``close()`` stops background work and is idempotent; the loader is a context manager.

Register it with :func:`register_data_loader` to make it selectable by name.

This module imports neither pyarrow's Parquet reader nor petastorm, so it loads in any
environment.
"""

import abc
import dataclasses
import posixpath
from typing import Dict, Iterator, List, Optional, Sequence, Type, Union

from spark_dl.spark.common.metadata import ColumnSpec, column_specs, load_metadata, split_files


@dataclasses.dataclass
class DataSource:
    """What to read: Parquet files on one filesystem, plus what is known about them.

    Attributes:
        files: file paths inside ``filesystem`` (no scheme), in a stable order.
        filesystem: a ``pyarrow.fs.FileSystem`` (None: the local filesystem).
        dataset_url: URL of the directory holding the files, for loaders that take a URL
            (petastorm); None when unknown.
        columns: column specs from the dataset metadata; None for plain Parquet, whose specs
            loaders infer from the schema and data.
        row_groups: for each file, the row count of each of its row groups (from the
            metadata); None to read it from the Parquet footers.
    """

    files: List[str]
    filesystem: object = None
    dataset_url: Optional[str] = None
    columns: Optional[Dict[str, ColumnSpec]] = None
    row_groups: Optional[List[List[int]]] = None

    @classmethod
    def from_store(cls, store, dataset_idx, split: str = "train") -> "DataSource":
        """The ``split`` ('train' or 'val') of a dataset prepared by ``prepare_data``.

        ``store`` is a :class:`~spark_dl.spark.common.store.Store` or its ``to_remote()``
        view. Raises FileNotFoundError when the dataset is not (completely) prepared.
        """
        meta = load_metadata(store, dataset_idx)
        files, row_groups = split_files(meta, split)
        part_dir = meta[split]["path"]
        local = getattr(store, "store", store).capabilities.local_paths
        fs_dir = store.get_fs_path(part_dir)
        return cls(files=[store.get_fs_path(f) for f in files],
                   filesystem=store.get_filesystem(),
                   dataset_url=("file://" + fs_dir) if local else part_dir,
                   columns=column_specs(meta), row_groups=row_groups)

    @classmethod
    def from_path(cls, path: Union[str, Sequence[str]], filesystem=None) -> "DataSource":
        """Plain Parquet: one directory (its ``*.parquet`` files, hidden ones skipped), one
        file, or a list of files, on ``filesystem`` (default: resolved from the URL, or
        local)."""
        import pyarrow.fs as pafs

        paths = [path] if isinstance(path, str) else list(path)
        if not paths:
            raise ValueError("no Parquet path given")
        if filesystem is None:
            filesystem, first = pafs.FileSystem.from_uri(paths[0]) if "://" in paths[0] \
                else (pafs.LocalFileSystem(), paths[0])
            paths = [first] + [pafs.FileSystem.from_uri(p)[1] if "://" in p else p
                               for p in paths[1:]]
        files: List[str] = []
        url = None
        for p in paths:
            info = filesystem.get_file_info(p)
            if info.type == pafs.FileType.Directory:
                sel = filesystem.get_file_info(pafs.FileSelector(p, recursive=False))
                found = sorted(i.path for i in sel if i.type == pafs.FileType.File
                               and i.base_name.endswith(".parquet")
                               and not i.base_name.startswith((".", "_")))
                if not found:
                    raise FileNotFoundError(f"no .parquet files in directory {p!r}")
                files.extend(found)
                url = url or p
            elif info.type == pafs.FileType.File:
                files.append(p)
            else:
                raise FileNotFoundError(f"no Parquet file or directory at {p!r}")
        if url is None:
            url = posixpath.dirname(files[0])
        if isinstance(filesystem, pafs.LocalFileSystem):
            url = "file://" + url
        return cls(files=files, filesystem=filesystem, dataset_url=url)


Batch = Dict[str, object]


class BaseDataLoader(abc.ABC):
    """Contract of every data loader (see the module doc for the constructor keywords).

    Subclasses implement :meth:`_iterate` (one epoch's batches) and :meth:`__len__`; this base
    keeps the epoch counter.
    """

    def __init__(self, source: DataSource, *, batch_size: int, rank: int = 0, size: int = 1,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0):
        if not isinstance(source, DataSource):
            raise TypeError(f"source must be a DataSource, not {type(source).__name__}; build "
                            "one with DataSource.from_store(...) or DataSource.from_path(...)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank={rank} size={size}")
        self.source = source
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.size = int(size)
        self.columns = list(columns) if columns is not None else None
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._next_epoch = 0
        self._closed = False

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its shuffle order depends on it)."""
        self._next_epoch = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will produce."""
        return self._next_epoch

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this data loader is closed")
        epoch = self._next_epoch
        self._next_epoch += 1
        return self._iterate(epoch)

    @abc.abstractmethod
    def _iterate(self, epoch: int) -> Iterator[Batch]:
        """Yield the batches of ``epoch`` for this rank."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Batches per epoch on this rank."""

    def close(self) -> None:
        """Stop background work. Idempotent."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_REGISTRY: Dict[str, str] = {
    # name -> "module:Class", imported on first use so that optional loaders cost nothing.
    "arrow": "spark_dl.spark.common.data_loader:ArrowDataLoader",
    "petastorm": "spark_dl.spark.common.petastorm_loader:PetastormDataLoader",
}


def register_data_loader(name: str, cls: Union[Type[BaseDataLoader], str]) -> None:
    """Make ``cls`` (a BaseDataLoader subclass or a ``"module:Class"`` string) selectable as
    ``name``. Re-registering a name replaces it."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and
                                         issubclass(cls, BaseDataLoader)):
        raise TypeError(f"{cls!r} is not a BaseDataLoader subclass")
    _REGISTRY[name] = cls


def get_data_loader_class(loader: Union[str, Type[BaseDataLoader]]) -> Type[BaseDataLoader]:
    """Resolve a registered name or a BaseDataLoader subclass to the class."""
    if isinstance(loader, type):
        if not issubclass(loader, BaseDataLoader):
            raise TypeError(f"{loader!r} is not a BaseDataLoader subclass")
        return loader
    try:
        target = _REGISTRY[loader]
    except KeyError:
        raise ValueError(f"unknown data loader {loader!r}; registered: "
                         f"{sorted(_REGISTRY)}") from None
    if isinstance(target, str):
        import importlib

        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def make_data_loader(source: DataSource, loader: Union[str, Type[BaseDataLoader]] = "arrow",
                     **kwargs) -> BaseDataLoader:
    """``get_data_loader_class(loader)(source, **kwargs)``."""
    return get_data_loader_class(loader)(source, **kwargs)
