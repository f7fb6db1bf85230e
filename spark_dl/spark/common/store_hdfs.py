"""A store on HDFS (and ``viewfs://``) through ``pyarrow.fs.HadoopFileSystem``."""

import os
from typing import Optional
from urllib.parse import urlparse

import pyarrow.fs as pafs

from spark_dl.spark.common.store_base import PathLike
from spark_dl.spark.common.store_filesystem import FilesystemStore


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
