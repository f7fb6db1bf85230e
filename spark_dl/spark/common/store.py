"""Where a run's artifacts live: prepared Parquet data, metadata, checkpoints and logs.

A :class:`Store` is a prefix on some filesystem plus a fixed layout under it::

    <prefix>/intermediate_train_data.<idx>/part-00000.parquet ...   prepared training data
    <prefix>/intermediate_val_data.<idx>/...                        prepared validation data
    <prefix>/intermediate_metadata.<idx>.json                       dataset metadata (commit mark)
    <prefix>/runs/<run_id>/checkpoint                               latest checkpoint of a run
    <prefix>/runs/<run_id>/logs/                                    logs of a run

``Store.create(prefix)`` picks the implementation from the prefix:

=========================================  ===================================================
prefix                                     store
=========================================  ===================================================
``/path``, ``relative/path``, ``file://``  :class:`LocalStore` (``pyarrow.fs.LocalFileSystem``)
``hdfs://``, ``viewfs://``                 :class:`HDFSStore` (``pyarrow.fs.HadoopFileSystem``)
``dbfs:/``, ``/dbfs/``                     :class:`DBFSLocalStore` (Databricks FUSE mount)
anything else (``s3://``, ``gs://``,       :class:`FilesystemStore` over the fsspec filesystem
``abfs://``, ``memory://`` ...)            of the URL, or over a filesystem you pass
=========================================  ===================================================

Every method that takes a path accepts a path this store returned (a URL under the prefix), a
filesystem path under the prefix, or a path relative to the prefix. Every implementation reads
and writes through one ``pyarrow.fs.FileSystem`` (fsspec filesystems are wrapped with
``pyarrow.fs.FSSpecHandler``), so the Parquet reader and writer use the same object.

Writes made with :meth:`Store.write` are atomic: on filesystems with an atomic rename the data
goes to a hidden temporary file in the same directory and is renamed over the target (on local
paths the file is fsync'ed before the rename and its directory after it, so a power loss cannot
leave a renamed but empty file); on object
stores (S3, GCS, ABFS, memory) the data is first spooled to a local temporary file and then
uploaded in one operation (``put_file``/``copy_files``), which the object store publishes only
when complete. A writer that crashes before the rename/upload leaves the previous version
intact; the temporary files that killed writers leave behind are removed by
:meth:`Store.remove_temporaries` (training does so for its run directory when a run starts).
(An upload that fails half way is aborted by s3fs; Arrow's native S3 stream may
complete it on close, so prefer s3fs where that matters.)
"""

import abc
import contextlib
import dataclasses
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from typing import Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

import pyarrow.fs as pafs

from spark_dl.spark.common import constants, store_cleanup
from spark_dl.spark.common.store_cleanup import CleanupReport
from spark_dl.spark.common.remote_store import (RemoteStore, _LocalRunDir, _noop_sync, _Syncer,
                                                _TempRunDir)

PathLike = Union[str, "os.PathLike[str]"]

# Temporary files of atomic writes: ".<target name>.<32 hex digits>.tmp".
_TEMPORARY_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")


def _temporary_name(fs_path: str) -> str:
    """The hidden temporary file next to ``fs_path`` that an atomic write fills first."""
    parent, name = posixpath.split(fs_path)
    return posixpath.join(parent, f".{name}.{uuid.uuid4().hex}.tmp")


def _fsync_directory(path: str) -> None:
    """Makes a rename inside ``path`` durable, where the filesystem supports it."""
    try:
        fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. a FUSE mount without directory fsync (DBFS)
    finally:
        os.close(fd)


# fsspec protocols whose rename is an atomic replace of the target.
_RENAME_PROTOCOLS = {"file", "local", "hdfs", "viewfs"}
# fsspec protocols that live inside one process: other processes (Spark executors) cannot see them.
_PROCESS_LOCAL_PROTOCOLS = {"memory"}
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-=+@]+$")


@dataclasses.dataclass(frozen=True)
class StoreCapabilities:
    """What a store's filesystem guarantees; the generic test suite branches on these flags.

    Attributes:
        atomic_rename: ``rename`` atomically replaces an existing target (local, HDFS). When
            False, atomic writes upload a complete local spool file as one object instead.
        shared_across_processes: other processes (Spark executors, training workers) see the
            same files. False for ``memory://``, which lives in one Python process; such a
            store cannot receive data written by Spark executors.
        local_paths: paths are ordinary paths of this machine's filesystem (LocalStore,
            DBFSLocalStore): training code may open them with plain ``open``.
        real_directories: directories exist on their own (local, HDFS, memory). On object
            stores a directory exists only while some object lies under it.
    """

    atomic_rename: bool
    shared_across_processes: bool
    local_paths: bool
    real_directories: bool


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or run_id in (".", ".."):
        raise ValueError(
            f"run_id {run_id!r} is not a valid run name: use letters, digits and '_.-=+@' only "
            "(no '/', not '.' or '..'), e.g. 'run_2024_01_01'")
    return run_id


def _split_scheme(url: str):
    """('s3', 'bucket/key') for 's3://bucket/key'; (None, url) when there is no scheme."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*):/", url)
    if not m or len(m.group(1)) == 1:  # a Windows drive letter is not a scheme
        return None, url
    scheme = m.group(1).lower()
    rest = url[len(m.group(1)) + 1:]
    return scheme, rest[2:] if rest.startswith("//") else rest


class Store(abc.ABC):
    """Interface of every store. Layout methods are implemented here; I/O by subclasses.

    Args:
        prefix_path: root of the store, as given by the user (URL or path). Trailing slashes
            are dropped. Nothing is created until something is written.
        train_path, val_path, test_path: override where prepared data goes (used as the stem;
            the dataset index is appended as ``.<idx>``). Default: under the prefix.
        runs_path: override where per-run directories go. Default: ``<prefix>/runs``.
        save_runs: when False, :meth:`get_checkpoint_path` and :meth:`get_logs_path` return
            None and estimators keep no checkpoints or logs in the store.
        checkpoint_filename: file name of a run's checkpoint inside its run directory.
    """

    def __init__(self, prefix_path: str, train_path: Optional[str] = None,
                 val_path: Optional[str] = None, test_path: Optional[str] = None,
                 runs_path: Optional[str] = None, save_runs: bool = True,
                 checkpoint_filename: str = constants.DEFAULT_CHECKPOINT_FILENAME):
        prefix_path = os.fspath(prefix_path)
        if not prefix_path:
            raise ValueError("store prefix_path is empty: pass a directory or URL, "
                             "e.g. '/tmp/spark_dl' or 's3://bucket/spark_dl'")
        self.prefix_path = prefix_path.rstrip("/") or "/"
        self._train_path = train_path or self._join(constants.TRAIN_DATA_DIR)
        self._val_path = val_path or self._join(constants.VAL_DATA_DIR)
        self._test_path = test_path or self._join(constants.TEST_DATA_DIR)
        self._runs_path = runs_path or self._join(constants.RUNS_DIR)
        self._save_runs = save_runs
        self._checkpoint_filename = checkpoint_filename

    def __repr__(self):
        return f"{type(self).__name__}({self.prefix_path!r})"

    # ---------------------------------------------------------------- factory

    @staticmethod
    def create(prefix_path: PathLike, *args, **kwargs) -> "Store":
        """Return the store implementation that fits ``prefix_path`` (see the module table).

        Extra arguments go to the chosen class's constructor (e.g. ``storage_options`` for
        :class:`FilesystemStore`, ``user`` for :class:`HDFSStore`).
        """
        prefix_path = os.fspath(prefix_path)
        if not prefix_path:
            raise ValueError("store prefix_path is empty: pass a directory or URL, "
                             "e.g. '/tmp/spark_dl' or 's3://bucket/spark_dl'")
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if LocalStore.matches(prefix_path):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # ---------------------------------------------------------------- layout

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.prefix_path, *parts)

    @staticmethod
    def _indexed(path: str, idx) -> str:
        return path if idx is None else f"{path}.{idx}"

    def get_train_data_path(self, idx=None) -> str:
        """Directory of the training Parquet files of dataset ``idx`` (the stem when None)."""
        return self._indexed(self._train_path, idx)

    def get_val_data_path(self, idx=None) -> str:
        """Directory of the validation Parquet files of dataset ``idx``."""
        return self._indexed(self._val_path, idx)

    def get_test_data_path(self, idx=None) -> str:
        """Directory of the test Parquet files of dataset ``idx``."""
        return self._indexed(self._test_path, idx)

    def get_data_metadata_path(self, idx) -> str:
        """JSON metadata of dataset ``idx``; ``prepare_data`` writes it last, so its existence
        means the dataset is complete."""
        return self._join(f"{constants.METADATA_FILE}.{idx}.json")

    def saving_runs(self) -> bool:
        """Whether checkpoints and logs of runs are kept in this store."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """Directory holding one sub-directory per run."""
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        """Directory of run ``run_id``. Raises ValueError for names with '/' or '..'."""
        return posixpath.join(self._runs_path, _check_run_id(run_id))

    def get_checkpoint_filename(self) -> str:
        """File name of a run's checkpoint inside its run directory."""
        return self._checkpoint_filename

    def get_logs_subdir(self) -> str:
        """Name of the logs directory inside a run directory."""
        return constants.LOGS_SUBDIR

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        """Path of run ``run_id``'s checkpoint, or None when the store does not save runs."""
        if not self._save_runs:
            return None
        return posixpath.join(self.get_run_path(run_id), self.get_checkpoint_filename())

    def get_logs_path(self, run_id: str) -> Optional[str]:
        """Logs directory of run ``run_id``, or None when the store does not save runs."""
        if not self._save_runs:
            return None
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir())

    def get_checkpoints(self, run_id: str, suffix: str = "") -> List[str]:
        """Sorted paths of the files in run ``run_id``'s directory whose names start with the
        checkpoint file name and end with ``suffix``. Empty when the run has none (or the run
        directory does not exist)."""
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        stem = self.get_checkpoint_filename()
        return sorted(p for p in self.listdir(run_path)
                      if posixpath.basename(p).startswith(stem) and p.endswith(suffix))

    # ---------------------------------------------------------------- prepared datasets

    def prepared_datasets(self) -> List[Tuple[str, float]]:
        """``(dataset index, creation time)`` of every complete prepared dataset in this
        store, newest first (the time is 0 when its metadata cannot be read)."""
        return store_cleanup.prepared_datasets(self)

    def disk_usage(self, path: PathLike) -> int:
        """Bytes of the files at or under ``path`` (0 when nothing is there)."""
        fs, fs_path = self.get_filesystem(), self.get_fs_path(path)
        info = fs.get_file_info(fs_path)
        if info.type == pafs.FileType.File:
            return int(info.size or 0)
        if info.type != pafs.FileType.Directory:
            return 0
        infos = fs.get_file_info(pafs.FileSelector(fs_path, recursive=True))
        return sum(int(i.size or 0) for i in infos if i.type == pafs.FileType.File)

    def dataset_size(self, idx) -> int:
        """Bytes of prepared dataset ``idx``: its data directories and metadata."""
        return sum(self.disk_usage(p) for p in store_cleanup.dataset_paths(self, idx))

    def cleanup(self, keep_last: int = 1, keep: Sequence[str] = (),
                dry_run: bool = False) -> CleanupReport:
        """Deletes all but the newest ``keep_last`` prepared datasets of this store.

        Every fit on a DataFrame built anew (new local data, a changed query) prepares a new
        copy of the data in the store, and nothing deletes old copies on its own; this does.
        Run checkpoints and logs (``runs/``) are not touched.

        Args:
            keep_last: how many of the newest datasets to keep (by creation time; 0 deletes
                every one).
            keep: dataset indices to keep as well (e.g. one a later ``fit_on_parquet`` uses).
            dry_run: report what would be removed, delete nothing.

        Returns:
            a :class:`CleanupReport` (``print`` it for a summary with sizes).

        Do not call it while a fit or ``prepare_data`` uses this store: a dataset being
        trained on may be among those deleted. Each dataset's metadata goes first, so a
        dataset interrupted half way through deletion is never taken as complete.
        """
        return store_cleanup.cleanup(self, keep_last, keep, dry_run)

    # ---------------------------------------------------------------- I/O primitives

    @property
    @abc.abstractmethod
    def capabilities(self) -> StoreCapabilities:
        """The :class:`StoreCapabilities` of this store's filesystem."""

    @abc.abstractmethod
    def get_filesystem(self) -> pafs.FileSystem:
        """The ``pyarrow.fs.FileSystem`` every read and write goes through (picklable)."""

    @abc.abstractmethod
    def get_fs_path(self, path: PathLike) -> str:
        """The path of ``path`` inside :meth:`get_filesystem` (no scheme).

        Raises ValueError for a URL of another scheme or another root than this store.
        """

    @abc.abstractmethod
    def exists(self, path: PathLike) -> bool:
        """True if a file or directory exists at ``path``. Never raises for a missing path."""

    @abc.abstractmethod
    def read(self, path: PathLike) -> bytes:
        """Whole content of the file at ``path``.

        Raises FileNotFoundError if it does not exist, IsADirectoryError if it is a directory.
        """

    @abc.abstractmethod
    def write(self, path: PathLike, data: Union[bytes, str]) -> None:
        """Atomically create or replace the file at ``path`` with ``data`` (str is UTF-8).

        Parent directories are created as needed. Readers see the old content or the new one,
        never a mix; a writer that dies part way leaves the old content in place. Raises
        IsADirectoryError if ``path`` is a directory.
        """

    @abc.abstractmethod
    def open_atomic(self, path: PathLike) -> ContextManager:
        """Context manager yielding a binary file object; on a clean exit its content
        atomically replaces ``path`` (as :meth:`write`); on an exception nothing changes."""

    @abc.abstractmethod
    def remove_temporaries(self, path: PathLike) -> List[str]:
        """Deletes the temporary files that interrupted atomic writes left in the
        directory ``path`` (not recursively); returns their paths. Call it only while
        nothing writes into that directory (e.g. at the start of a run, for its run
        directory): a temporary being written is indistinguishable from a stale one.
        Succeeds (returns ``[]``) if the directory does not exist."""

    @abc.abstractmethod
    def delete(self, path: PathLike) -> None:
        """Remove the file, or the directory with everything under it, at ``path``.

        Succeeds (does nothing) if nothing exists there.
        """

    @abc.abstractmethod
    def makedirs(self, path: PathLike) -> None:
        """Create directory ``path`` and its parents. Succeeds if it already exists; raises
        FileExistsError if a file is there. On object stores this may create nothing visible.
        """

    @abc.abstractmethod
    def listdir(self, path: PathLike) -> List[str]:
        """Sorted full paths (as this store returns them) of the direct children of directory
        ``path``. Raises FileNotFoundError if it does not exist, NotADirectoryError if it is a
        file."""

    @abc.abstractmethod
    def upload(self, local_path: str, path: PathLike) -> None:
        """Atomically copy the local file ``local_path`` to ``path`` (as :meth:`write`)."""

    @abc.abstractmethod
    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], ContextManager[str]]:
        """A picklable function returning a context manager that yields a local directory
        where a worker writes run ``run_id``'s outputs before :meth:`sync_fn` publishes them.
        For local stores it is the run directory itself; otherwise a temporary directory that
        is removed on exit."""

    @abc.abstractmethod
    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A picklable function ``fn(local_dir)`` that copies files of ``local_dir`` that are
        new or changed since its last call into run ``run_id``'s directory (no-op for local
        stores, where the local directory is the run directory)."""

    # ---------------------------------------------------------------- helpers

    def read_text(self, path: PathLike) -> str:
        """:meth:`read` decoded as UTF-8."""
        return self.read(path).decode("utf-8")

    def write_text(self, path: PathLike, text: str) -> None:
        """:meth:`write` of ``text`` encoded as UTF-8 (atomic)."""
        self.write(path, text.encode("utf-8"))

    def is_parquet_dataset(self, path: PathLike) -> bool:
        """True if ``path`` is a directory holding at least one ``.parquet`` file."""
        try:
            return any(p.endswith(".parquet") for p in self.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return False

    def check_writable(self) -> None:
        """Write and delete a small probe file under the prefix.

        Raises PermissionError naming the prefix and the underlying error when that fails.
        """
        probe = self._join(f".spark_dl_write_probe-{uuid.uuid4().hex}")
        try:
            self.write(probe, b"probe")
            self.delete(probe)
        except Exception as e:  # any backend error means the same thing to the caller
            raise PermissionError(
                f"store {self.prefix_path!r} is not writable ({type(e).__name__}: {e}); "
                "choose a prefix this process (and the Spark executors) can write to, or fix "
                "its permissions/credentials") from e

    def to_remote(self, run_id: Optional[str] = None, dataset_idx=None) -> "RemoteStore":
        """A picklable view of this store for workers, with the paths of one run and one
        prepared dataset resolved (see :class:`RemoteStore`)."""
        return RemoteStore(self, run_id, dataset_idx)


class FilesystemStore(Store):
    """A store on any ``pyarrow.fs`` or fsspec filesystem.

    Args:
        prefix_path: URL or path of the store root (``s3://bucket/dir``, ``memory://x`` ...).
        filesystem: a ``pyarrow.fs.FileSystem`` or ``fsspec.AbstractFileSystem`` to use instead
            of resolving ``prefix_path`` with fsspec (e.g. ``pyarrow.fs.S3FileSystem(...)`` for
            Arrow's native S3 client). It must be picklable to reach workers.
        storage_options: keyword arguments for the fsspec filesystem of the URL (credentials,
            ``client_kwargs={"endpoint_url": ...}`` ...). Ignored when ``filesystem`` is given.
        **kwargs: layout options of :class:`Store`.
    """

    def __init__(self, prefix_path: PathLike, filesystem=None, storage_options=None, **kwargs):
        super().__init__(os.fspath(prefix_path), **kwargs)
        self._scheme, _ = _split_scheme(self.prefix_path)
        self._fs, self._root, protocol = self._resolve_filesystem(filesystem, storage_options)
        self._protocol = protocol
        self._caps = self._make_capabilities(protocol)

    # -- filesystem resolution

    def _resolve_filesystem(self, filesystem, storage_options):
        if filesystem is None:
            import fsspec  # deferred: a LocalStore never needs it

            fs, root = fsspec.core.url_to_fs(self.prefix_path, **(storage_options or {}))
            return self._wrap_fsspec(fs), root.rstrip("/") or "/", self._fsspec_protocol(fs)
        if isinstance(filesystem, pafs.FileSystem):
            _, rest = _split_scheme(self.prefix_path)
            root = rest if self._scheme else self.prefix_path
            return filesystem, root.rstrip("/") or "/", filesystem.type_name
        if hasattr(filesystem, "_strip_protocol"):  # fsspec.AbstractFileSystem
            root = filesystem._strip_protocol(self.prefix_path)
            return (self._wrap_fsspec(filesystem), root.rstrip("/") or "/",
                    self._fsspec_protocol(filesystem))
        raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, "
                        f"not {type(filesystem).__name__}")

    @staticmethod
    def _wrap_fsspec(fs) -> pafs.FileSystem:
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs))

    @staticmethod
    def _fsspec_protocol(fs) -> str:
        proto = fs.protocol
        return proto[0] if isinstance(proto, (tuple, list)) else proto

    @staticmethod
    def _make_capabilities(protocol: str) -> StoreCapabilities:
        local = protocol in ("local", "file")
        return StoreCapabilities(
            atomic_rename=protocol in _RENAME_PROTOCOLS,
            shared_across_processes=protocol not in _PROCESS_LOCAL_PROTOCOLS,
            local_paths=local,
            real_directories=local or protocol in ("hdfs", "viewfs", "memory"))

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._caps

    def get_filesystem(self) -> pafs.FileSystem:
        return self._fs

    # -- paths

    def get_fs_path(self, path: PathLike) -> str:
        path = os.fspath(path)
        prefix = self.prefix_path.rstrip("/")
        if path in (self.prefix_path, prefix):
            return self._root
        if path.startswith(prefix + "/"):
            return posixpath.join(self._root, path[len(prefix) + 1:])
        scheme, rest = _split_scheme(path)
        if scheme == "file" and self._caps.local_paths:
            path = rest
        elif scheme is not None:
            raise ValueError(f"path {path!r} is not under this store's prefix "
                             f"{self.prefix_path!r}")
        root = self._root.rstrip("/")
        if path == self._root or path.startswith(root + "/") or (root == "" and
                                                                 path.startswith("/")):
            return path
        if posixpath.isabs(path):
            raise ValueError(f"path {path!r} is outside the store root {self.prefix_path!r}")
        return posixpath.join(self._root, path)

    def _to_store_path(self, fs_path: str) -> str:
        """Inverse of :meth:`get_fs_path` for paths under the root."""
        root = self._root.rstrip("/")
        if fs_path == self._root:
            return self.prefix_path
        if fs_path.startswith(root + "/"):
            return posixpath.join(self.prefix_path, fs_path[len(root) + 1:])
        return fs_path

    def _info(self, fs_path: str) -> pafs.FileInfo:
        self._invalidate(fs_path)
        return self._fs.get_file_info(fs_path)

    def _invalidate(self, fs_path: str) -> None:
        # fsspec filesystems (s3fs, gcsfs ...) cache listings and object versions per
        # process; other processes write to the same store, so every metadata call looks
        # at the store itself.
        fs = self._fsspec()
        if fs is not None:
            fs.invalidate_cache(fs_path)

    # -- I/O

    def exists(self, path: PathLike) -> bool:
        return self._info(self.get_fs_path(path)).type != pafs.FileType.NotFound

    def read(self, path: PathLike) -> bytes:
        fs_path = self.get_fs_path(path)
        info = self._info(fs_path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no file at {os.fspath(path)!r}")
        if info.type == pafs.FileType.Directory:
            raise IsADirectoryError(f"{os.fspath(path)!r} is a directory, not a file")
        with self._fs.open_input_stream(fs_path) as f:
            return f.read()

    def write(self, path: PathLike, data: Union[bytes, str]) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8")
        with self.open_atomic(path) as f:
            f.write(data)

    @contextlib.contextmanager
    def open_atomic(self, path: PathLike) -> Iterator:
        fs_path = self.get_fs_path(path)
        if self._info(fs_path).type == pafs.FileType.Directory:
            raise IsADirectoryError(f"{os.fspath(path)!r} is a directory, not a file")
        parent = posixpath.dirname(fs_path)
        if self._caps.real_directories and parent:
            self._fs.create_dir(parent, recursive=True)
        if self._caps.local_paths:
            # Same directory as the target so that the rename never crosses filesystems; the
            # leading dot hides the partial file from Parquet readers listing the directory.
            tmp = _temporary_name(fs_path)
            try:
                with open(tmp, "wb") as out:
                    yield out
                    out.flush()
                    # The data is on disk before the rename: after a power loss the target
                    # holds either the previous version or the whole new one, never an
                    # empty file under the new name.
                    os.fsync(out.fileno())
                self._publish(tmp, fs_path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        elif self._caps.atomic_rename:
            # As above, on a filesystem reached through Arrow (HDFS): closing the stream
            # is as durable as that filesystem makes it (Arrow offers no fsync).
            tmp = _temporary_name(fs_path)
            try:
                with self._fs.open_output_stream(tmp) as out:
                    yield out
                self._publish(tmp, fs_path)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._fs.delete_file(tmp)
                raise
        else:
            # Object stores publish an object when its upload completes, so the content is
            # completed in a local spool file first and then uploaded in one operation.
            fd, spool_path = tempfile.mkstemp(prefix="spark_dl_spool_")
            try:
                with os.fdopen(fd, "wb") as spool:
                    yield spool
                self._publish(spool_path, fs_path)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(spool_path)

    def remove_temporaries(self, path: PathLike) -> List[str]:
        fs_path = self.get_fs_path(path)
        if not self._caps.atomic_rename or self._info(fs_path).type != pafs.FileType.Directory:
            return []  # object stores spool locally: nothing is left under the prefix
        self._invalidate(fs_path)
        removed = []
        for info in self._fs.get_file_info(pafs.FileSelector(fs_path, recursive=False)):
            if info.type == pafs.FileType.File and _TEMPORARY_RE.match(info.base_name):
                with contextlib.suppress(FileNotFoundError):
                    self._fs.delete_file(info.path)
                    removed.append(self._to_store_path(info.path))
        return sorted(removed)

    def _fsspec(self):
        """The fsspec filesystem behind this store, or None for a native pyarrow one."""
        return getattr(getattr(self._fs, "handler", None), "fs", None)

    def _publish(self, src: str, dst: str) -> None:
        """Make the complete content at ``src`` visible at ``dst`` in one step: a rename of
        the temporary file on rename-capable filesystems, else one upload of the local spool
        file (``put_file`` of fsspec, ``copy_files`` of Arrow)."""
        if self._caps.local_paths:
            os.replace(src, dst)
            _fsync_directory(posixpath.dirname(dst))  # the rename itself is durable
            return
        if self._caps.atomic_rename:
            self._fs.move(src, dst)
            return
        fs = self._fsspec()
        if fs is not None:
            fs.put_file(src, dst)
            fs.invalidate_cache(dst)
        else:
            pafs.copy_files(src, dst, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self._fs)

    def delete(self, path: PathLike) -> None:
        fs_path = self.get_fs_path(path)
        info = self._info(fs_path)
        if info.type == pafs.FileType.Directory:
            self._fs.delete_dir(fs_path)
        elif info.type != pafs.FileType.NotFound:
            self._fs.delete_file(fs_path)

    def makedirs(self, path: PathLike) -> None:
        fs_path = self.get_fs_path(path)
        info = self._info(fs_path)
        if info.type == pafs.FileType.File:
            raise FileExistsError(f"{os.fspath(path)!r} exists and is a file")
        if info.type == pafs.FileType.NotFound:
            self._fs.create_dir(fs_path, recursive=True)

    def listdir(self, path: PathLike) -> List[str]:
        fs_path = self.get_fs_path(path)
        info = self._info(fs_path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no directory at {os.fspath(path)!r}")
        if info.type == pafs.FileType.File:
            raise NotADirectoryError(f"{os.fspath(path)!r} is a file, not a directory")
        self._invalidate(fs_path)
        infos = self._fs.get_file_info(pafs.FileSelector(fs_path, recursive=False))
        return sorted(self._to_store_path(i.path) for i in infos)

    def upload(self, local_path: str, path: PathLike) -> None:
        with open(local_path, "rb") as src, self.open_atomic(path) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    def get_local_output_dir_fn(self, run_id: str):
        run_path = self.get_run_path(run_id)
        if self._caps.local_paths:
            return _LocalRunDir(self.get_fs_path(run_path))
        return _TempRunDir()

    def sync_fn(self, run_id: str):
        if self._caps.local_paths:
            return _noop_sync
        return _Syncer(self, self.get_run_path(run_id))


class LocalStore(FilesystemStore):
    """A store on this machine's filesystem (a shared mount when Spark runs on several hosts).

    Relative paths are made absolute against the current directory at construction.
    """

    FS_PREFIX = "file://"

    def __init__(self, prefix_path: PathLike, **kwargs):
        path = os.fspath(prefix_path)
        if path.startswith(self.FS_PREFIX):
            path = path[len(self.FS_PREFIX):]
        kwargs.pop("filesystem", None)
        kwargs.pop("storage_options", None)
        super().__init__(os.path.abspath(path), filesystem=pafs.LocalFileSystem(), **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for plain paths and ``file://`` URLs."""
        scheme, _ = _split_scheme(path)
        return scheme is None or scheme == "file"

    def _make_capabilities(self, protocol):
        return StoreCapabilities(atomic_rename=True, shared_across_processes=True,
                                 local_paths=True, real_directories=True)


class DBFSLocalStore(LocalStore):
    """A store on the Databricks File System through its local FUSE mount ``/dbfs``.

    ``dbfs:/dir`` and ``/dbfs/dir`` name the same store; paths are returned in the ``/dbfs/``
    form, which every process on a Databricks cluster can open. Use :meth:`to_dbfs_uri` for
    Spark readers that want ``dbfs:/``.
    """

    DBFS_PREFIX = "dbfs:/"
    FUSE_ROOT = "/dbfs"

    def __init__(self, prefix_path: PathLike, **kwargs):
        super().__init__(self.to_fuse_path(os.fspath(prefix_path)), **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for ``dbfs:/...`` URLs and ``/dbfs/...`` paths."""
        return path.startswith(cls.DBFS_PREFIX) or path == cls.FUSE_ROOT or \
            path.startswith(cls.FUSE_ROOT + "/")

    @classmethod
    def to_fuse_path(cls, path: str) -> str:
        """``dbfs:/a/b`` -> ``/dbfs/a/b``; ``/dbfs/...`` is returned unchanged."""
        if path.startswith(cls.DBFS_PREFIX):
            return posixpath.join(cls.FUSE_ROOT, path[len(cls.DBFS_PREFIX):].lstrip("/"))
        return path

    @classmethod
    def to_dbfs_uri(cls, path: str) -> str:
        """``/dbfs/a/b`` -> ``dbfs:/a/b``."""
        if path.startswith(cls.FUSE_ROOT + "/"):
            return cls.DBFS_PREFIX + path[len(cls.FUSE_ROOT) + 1:]
        return path


class HDFSStore(FilesystemStore):
    """A store on HDFS through ``pyarrow.fs.HadoopFileSystem`` (libhdfs + a Hadoop client).

    Args:
        prefix_path: ``hdfs://[host[:port]]/path`` (``hdfs:///path`` uses the default namenode
            of the Hadoop configuration).
        host, port: override the namenode from the URL ("default" and 0 read fs.defaultFS).
        user, kerb_ticket, extra_conf: passed to ``HadoopFileSystem``.

    Raises:
        RuntimeError: when no Hadoop client is available on this machine, naming what is
            missing (libhdfs, JAVA_HOME, CLASSPATH from ``hadoop classpath --glob``).
    """

    FS_PREFIXES = ("hdfs://", "viewfs://")

    def __init__(self, prefix_path: PathLike, host: Optional[str] = None,
                 port: Optional[int] = None, user: Optional[str] = None,
                 kerb_ticket: Optional[str] = None, extra_conf: Optional[dict] = None, **kwargs):
        prefix_path = os.fspath(prefix_path)
        parsed = urlparse(prefix_path)
        host = host or parsed.hostname or "default"
        port = port if port is not None else (parsed.port or 0)
        kwargs.pop("filesystem", None)
        kwargs.pop("storage_options", None)
        fs = self.connect(host, port, user=user, kerb_ticket=kerb_ticket, extra_conf=extra_conf)
        self._hdfs_path = parsed.path or "/"
        super().__init__(prefix_path, filesystem=fs, **kwargs)

    @staticmethod
    def connect(host="default", port=0, **kwargs) -> pafs.FileSystem:
        """Connect to HDFS, turning a missing Hadoop client into one clear error."""
        try:
            options = {k: v for k, v in kwargs.items() if v is not None}
            return pafs.HadoopFileSystem(host, port, **options)
        except (OSError, RuntimeError, ImportError) as e:
            missing = [name for name, ok in [
                ("JAVA_HOME", bool(os.environ.get("JAVA_HOME"))),
                ("HADOOP_HOME", bool(os.environ.get("HADOOP_HOME"))),
                ("CLASSPATH (set it with `export CLASSPATH=$(hadoop classpath --glob)`)",
                 bool(os.environ.get("CLASSPATH")))] if not ok]
            hint = f"; not set here: {', '.join(missing)}" if missing else ""
            raise RuntimeError(
                f"HDFSStore needs a Hadoop client on this machine (libhdfs from "
                f"$HADOOP_HOME/lib/native or $ARROW_LIBHDFS_DIR, a JVM, and the Hadoop jars on "
                f"the CLASSPATH){hint}. pyarrow said: {e}") from e

    def _resolve_filesystem(self, filesystem, storage_options):
        return filesystem, self._hdfs_path.rstrip("/") or "/", "hdfs"

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for ``hdfs://`` and ``viewfs://`` URLs."""
        return path.startswith(cls.FS_PREFIXES)

    def _publish(self, src, dst):
        # HDFS rename refuses to overwrite: remove the old version first. The window between
        # the two calls is the one non-atomic moment; readers retry on FileNotFoundError.
        if self._info(dst).type != pafs.FileType.NotFound:
            self._fs.delete_file(dst)
        self._fs.move(src, dst)
