"""Stores over one ``pyarrow.fs.FileSystem``: :class:`FilesystemStore` (any pyarrow or fsspec
filesystem: S3, GCS, ABFS, memory ...) and :class:`LocalStore` (this machine's filesystem),
with the atomic-write machinery they share.

How writes are made atomic: on filesystems with an atomic rename the data goes to a hidden
temporary file in the same directory and is renamed over the target (on local paths the file
is fsync'ed before the rename and its directory after it, so a power loss cannot leave a
renamed but empty file); on object stores (S3, GCS, ABFS, memory) the data is first spooled to
a local temporary file and then uploaded in one operation (``put_file``/``copy_files``), which
the object store publishes only when complete. A writer that crashes before the rename/upload
leaves the previous version intact; the temporary files that killed writers leave behind are
removed by :meth:`~spark_dl.spark.common.store_base.Store.remove_temporaries` (training does
so for its run directory when a run starts). (An upload that fails half way is aborted by
s3fs; Arrow's native S3 stream may complete it on close, so prefer s3fs where that matters.)
"""

import contextlib
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from typing import Iterator, List, Union

import pyarrow.fs as pafs

from spark_dl.spark.common.remote_store import _LocalRunDir, _noop_sync, _Syncer, _TempRunDir
from spark_dl.spark.common.store_base import PathLike, Store, StoreCapabilities

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


def _split_scheme(url: str):
    """('s3', 'bucket/key') for 's3://bucket/key'; (None, url) when there is no scheme."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*):/", url)
    if not m or len(m.group(1)) == 1:  # a Windows drive letter is not a scheme
        return None, url
    scheme = m.group(1).lower()
    rest = url[len(m.group(1)) + 1:]
    return scheme, rest[2:] if rest.startswith("//") else rest


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

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for every prefix: :meth:`Store.create` tries this class last, for the URLs
        that no more specific store claims (fsspec resolves the scheme)."""
        return bool(path)

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

