"""One Store test suite, run against every backend that can run here.

Backends: local (LocalStore), memory (fsspec memory://), S3 through s3fs and S3 through
Arrow's native client, both against a moto S3 server on 127.0.0.1 that this module starts and
stops; HDFS runs only when a Hadoop client is configured (SPARK_DL_TEST_HDFS=hdfs://...).
Where backends differ, tests branch on ``store.capabilities``.
"""

import os
import pickle
import uuid

import pytest

from spark_dl.spark.common.remote_store import RemoteStore
from spark_dl.spark.common.store import (DBFSLocalStore, FilesystemStore, HDFSStore,
                                         LocalStore, Store, VolumesLocalStore)

S3_KEY, S3_SECRET, S3_REGION = "testing", "testing", "us-east-1"


def _s3fs_store(endpoint, prefix):
    pytest.importorskip("s3fs")
    return Store.create(f"s3://spark-dl-test/{prefix}", storage_options={
        "key": S3_KEY, "secret": S3_SECRET, "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION}})


def _arrow_s3_store(endpoint, prefix):
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key=S3_KEY, secret_key=S3_SECRET, region=S3_REGION,
                           endpoint_override=endpoint)
    return Store.create(f"s3://spark-dl-test/{prefix}", filesystem=fs)


BACKENDS = ["local", "memory", "s3fs", "s3-arrow", "hdfs"]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    prefix = f"suite-{uuid.uuid4().hex[:8]}"
    kind = request.param
    if kind == "local":
        yield Store.create(str(tmp_path / prefix))
    elif kind == "memory":
        st = Store.create(f"memory://spark-dl/{prefix}")
        yield st
        st.delete(st.prefix_path)
    elif kind in ("s3fs", "s3-arrow"):
        endpoint = request.getfixturevalue("s3_endpoint")
        st = (_s3fs_store if kind == "s3fs" else _arrow_s3_store)(endpoint, prefix)
        yield st
        st.delete(st.prefix_path)
    else:
        url = os.environ.get("SPARK_DL_TEST_HDFS")
        if not url:
            pytest.skip("HDFS: no Hadoop client/cluster here; set SPARK_DL_TEST_HDFS="
                        "hdfs://namenode:port/tmp to run the suite against HDFS")
        yield Store.create(f"{url.rstrip('/')}/{prefix}")


# ----------------------------------------------------------------------------- layout

def test_layout_paths(store):
    p = store.prefix_path
    assert store.get_train_data_path() == f"{p}/intermediate_train_data"
    assert store.get_train_data_path(3) == f"{p}/intermediate_train_data.3"
    assert store.get_val_data_path("ab") == f"{p}/intermediate_val_data.ab"
    assert store.get_test_data_path(0) == f"{p}/intermediate_test_data.0"
    assert store.get_data_metadata_path(7) == f"{p}/intermediate_metadata.7.json"
    assert store.get_run_path("r1") == f"{p}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{p}/runs/r1/checkpoint"
    assert store.get_logs_path("r1") == f"{p}/runs/r1/logs"
    for bad in ["", "a/b", "..", ".", "x y"]:
        with pytest.raises(ValueError, match="run_id"):
            store.get_run_path(bad)


def test_save_runs_false_gives_no_run_paths(tmp_path):
    st = LocalStore(str(tmp_path), save_runs=False)
    assert not st.saving_runs()
    assert st.get_checkpoint_path("r") is None and st.get_logs_path("r") is None


# ----------------------------------------------------------------------------- I/O

def test_write_read_exists_overwrite(store):
    path = store.get_checkpoint_path("run1")
    assert not store.exists(path)
    store.write(path, b"v1")  # parents are created as needed
    assert store.exists(path) and store.read(path) == b"v1"
    store.write(path, b"version two")
    assert store.read(path) == b"version two"
    store.write_text(path, "t\u00e9xt")
    assert store.read_text(path) == "t\u00e9xt"


def test_paths_in_every_accepted_form(store):
    store.write("rel/a.bin", b"1")  # relative to the prefix
    full = store.prefix_path + "/rel/a.bin"
    assert store.read(full) == b"1"
    assert store.read(store.get_fs_path(full)) == b"1"  # filesystem path
    with pytest.raises(ValueError):
        store.get_fs_path("gs://elsewhere/x" if not store.prefix_path.startswith("gs")
                          else "s3://elsewhere/x")


def test_read_errors(store):
    with pytest.raises(FileNotFoundError):
        store.read(store.prefix_path + "/missing")
    store.write("d/f", b"x")
    with pytest.raises(IsADirectoryError):
        store.read(store.prefix_path + "/d")
    with pytest.raises(IsADirectoryError):
        store.write(store.prefix_path + "/d", b"y")


def test_listdir(store):
    store.write("dir/b", b"2")
    store.write("dir/a", b"1")
    store.write("dir/sub/c", b"3")
    base = store.prefix_path + "/dir"
    assert store.listdir(base) == [f"{base}/a", f"{base}/b", f"{base}/sub"]
    with pytest.raises(FileNotFoundError):
        store.listdir(store.prefix_path + "/nodir")
    with pytest.raises(NotADirectoryError):
        store.listdir(base + "/a")


def test_delete_file_dir_and_missing(store):
    store.write("x/1", b"1")
    store.write("x/y/2", b"2")
    store.delete(store.prefix_path + "/x/1")
    assert not store.exists(store.prefix_path + "/x/1")
    store.delete(store.prefix_path + "/x")
    assert not store.exists(store.prefix_path + "/x/y/2")
    assert not store.exists(store.prefix_path + "/x")
    store.delete(store.prefix_path + "/never-was")  # succeeds


def test_makedirs(store):
    d = store.prefix_path + "/made/deep"
    store.makedirs(d)
    store.makedirs(d)  # succeeds if it exists
    if store.capabilities.real_directories:
        assert store.exists(d) and store.listdir(d) == []
    store.write("made/file", b"f")
    with pytest.raises(FileExistsError):
        store.makedirs(store.prefix_path + "/made/file")


def test_checkpoints_listing(store):
    assert store.get_checkpoints("r") == []
    store.write(store.get_run_path("r") + "/checkpoint.2.pt", b"2")
    store.write(store.get_run_path("r") + "/checkpoint.1.pt", b"1")
    store.write(store.get_run_path("r") + "/other.pt", b"o")
    run = store.get_run_path("r")
    assert store.get_checkpoints("r", ".pt") == [f"{run}/checkpoint.1.pt",
                                                 f"{run}/checkpoint.2.pt"]


def test_is_parquet_dataset(store):
    assert not store.is_parquet_dataset(store.get_train_data_path(1))
    store.write(store.get_train_data_path(1) + "/part-00000.parquet", b"PAR1")
    assert store.is_parquet_dataset(store.get_train_data_path(1))


def test_check_writable(store):
    store.check_writable()
    assert [p for p in (store.listdir(store.prefix_path) if store.exists(store.prefix_path)
                        else []) if "probe" in p] == []


# ----------------------------------------------------------------------------- atomicity

class _Crash(Exception):
    pass


def test_failed_write_keeps_previous_version(store):
    path = store.get_checkpoint_path("atomic")
    store.write(path, b"good")
    with pytest.raises(_Crash):
        with store.open_atomic(path) as f:
            f.write(b"partial-")
            raise _Crash()
    assert store.read(path) == b"good"
    # No temporary file is left where readers or listings would see it.
    assert store.listdir(store.get_run_path("atomic")) == [path]


def test_crash_before_publish_keeps_previous_version(store, monkeypatch):
    """Kill the writer after the data is complete but before the rename (rename-capable
    filesystems) or the upload (object stores): nothing visible changes."""
    path = store.get_checkpoint_path("crash")
    store.write(path, b"old")

    def die(self, src, dst):
        raise _Crash("killed before publish")
    monkeypatch.setattr(type(store), "_publish", die)
    with pytest.raises(_Crash):
        store.write(path, b"new content")
    monkeypatch.undo()
    assert store.read(path) == b"old"
    assert store.listdir(store.get_run_path("crash")) == [path]
    store.write(path, b"new content")
    assert store.read(path) == b"new content"


# ----------------------------------------------------------------------------- workers

def test_to_remote_pickles_and_reads(store):
    store.write(store.get_checkpoint_path("r2"), b"ckpt")
    remote = store.to_remote("r2", dataset_idx=5)
    assert isinstance(remote, RemoteStore)
    clone = pickle.loads(pickle.dumps(remote))
    assert clone.checkpoint_path == store.get_checkpoint_path("r2")
    assert clone.train_data_path == store.get_train_data_path(5)
    assert clone.data_metadata_path == store.get_data_metadata_path(5)
    assert clone.logs_path == store.get_logs_path("r2")
    if store.capabilities.shared_across_processes:
        assert clone.read(clone.checkpoint_path) == b"ckpt"


def test_local_output_dir_and_sync(store, tmp_path):
    remote = pickle.loads(pickle.dumps(store.to_remote("r3")))
    with remote.get_local_output_dir() as local:
        os.makedirs(os.path.join(local, "logs"), exist_ok=True)
        with open(os.path.join(local, "logs", "events.txt"), "w") as f:
            f.write("e1")
        with open(os.path.join(local, "checkpoint"), "wb") as f:
            f.write(b"c1")
        remote.sync(local)
        assert store.read(store.get_checkpoint_path("r3")) == b"c1"
        assert store.read(store.get_logs_path("r3") + "/events.txt") == b"e1"
        with open(os.path.join(local, "checkpoint"), "wb") as f:
            f.write(b"c2-longer")
        remote.sync(local)
        assert store.read(store.get_checkpoint_path("r3")) == b"c2-longer"
    if store.capabilities.local_paths:
        assert os.path.exists(store.get_fs_path(store.get_checkpoint_path("r3")))
    else:
        assert not os.path.exists(local)  # the temporary directory is removed


# ----------------------------------------------------------------------------- factory

def test_create_picks_the_implementation(tmp_path):
    assert type(Store.create(str(tmp_path))) is LocalStore
    assert type(Store.create("file://" + str(tmp_path))) is LocalStore
    assert Store.create("file://" + str(tmp_path)).prefix_path == str(tmp_path)
    assert type(Store.create("memory://x/y")) is FilesystemStore
    assert type(Store.create("dbfs:/ml/run")) is DBFSLocalStore
    assert type(Store.create("/dbfs/ml/run")) is DBFSLocalStore
    assert type(Store.create("/Volumes/main/default/vol/run")) is VolumesLocalStore
    assert type(Store.create("dbfs:/Volumes/main/default/vol/run")) is VolumesLocalStore
    rel = Store.create("relative/dir")
    assert rel.prefix_path == os.path.abspath("relative/dir")


def test_dbfs_paths():
    st = Store.create("dbfs:/ml/exp")
    assert st.prefix_path == "/dbfs/ml/exp"
    assert st.get_train_data_path(2) == "/dbfs/ml/exp/intermediate_train_data.2"
    assert DBFSLocalStore.to_dbfs_uri(st.get_train_data_path(2)) == \
        "dbfs:/ml/exp/intermediate_train_data.2"
    assert st.capabilities.local_paths


def test_hdfs_without_hadoop_client_is_a_clear_error():
    if os.environ.get("SPARK_DL_TEST_HDFS"):
        pytest.skip("a Hadoop client is configured here")
    with pytest.raises(RuntimeError, match="HDFSStore needs a Hadoop client") as e:
        Store.create("hdfs://127.0.0.1:1/tmp/x")
    assert "pyarrow said" in str(e.value)
    assert HDFSStore.matches("viewfs://ns/x") and not HDFSStore.matches("/tmp")


def test_memory_store_is_process_local():
    st = Store.create("memory://caps/x")
    assert not st.capabilities.shared_across_processes
    assert not Store.create("memory://caps/x").capabilities.atomic_rename


def test_empty_prefix_and_bad_filesystem():
    with pytest.raises(ValueError, match="empty"):
        Store.create("")
    with pytest.raises(TypeError, match="filesystem"):
        FilesystemStore("s3://b/x", filesystem=object())


# ----------------------------------------------------------------------------- cleanup


def _fake_dataset(store, idx, created, rows_bytes):
    """A prepared dataset's layout: data files, then its metadata (the commit mark)."""
    import json

    store.write(store.get_train_data_path(idx) + "/part-00000.parquet", b"t" * rows_bytes)
    store.write(store.get_val_data_path(idx) + "/part-00000.parquet", b"v" * 10)
    store.write_text(store.get_data_metadata_path(idx),
                     json.dumps({"dataset_idx": idx, "created": created}))
    return store.dataset_size(idx)


def test_cleanup_keeps_the_newest_datasets_and_reports_sizes(store):
    assert store.cleanup(keep_last=1).removed == []  # nothing prepared yet
    sizes = {idx: _fake_dataset(store, idx, created, n)
             for idx, created, n in [("aaa", 100.0, 1000), ("bbb", 300.0, 2000),
                                     ("ccc", 200.0, 3000), ("ddd", 50.0, 4000)]}
    assert sizes["bbb"] > 2000  # data, validation data and metadata
    store.write(store.get_checkpoint_path("run1"), b"ckpt")
    assert [i for i, _ in store.prepared_datasets()] == ["bbb", "ccc", "aaa", "ddd"]

    dry = store.cleanup(keep_last=2, dry_run=True)
    assert dry.removed == [("aaa", sizes["aaa"]), ("ddd", sizes["ddd"])]
    assert store.exists(store.get_train_data_path("aaa"))  # a dry run deletes nothing
    assert str(dry).startswith("would remove 2 prepared dataset(s)")

    report = store.cleanup(keep_last=1, keep=["ddd"])
    assert report.kept == [("bbb", sizes["bbb"]), ("ddd", sizes["ddd"])]
    assert [i for i, _ in report.removed] == ["ccc", "aaa"]
    assert report.freed_bytes == sizes["ccc"] + sizes["aaa"]
    assert "removed 2 prepared dataset(s)" in str(report) and "bbb (" in str(report)
    for idx in ("ccc", "aaa"):
        assert not store.exists(store.get_data_metadata_path(idx))
        assert not store.exists(store.get_train_data_path(idx))
        assert not store.exists(store.get_val_data_path(idx))
    assert [i for i, _ in store.prepared_datasets()] == ["bbb", "ddd"]
    assert store.read(store.get_checkpoint_path("run1")) == b"ckpt"  # runs untouched
    assert [i for i, _ in store.cleanup(keep_last=0).removed] == ["bbb", "ddd"]
    assert store.prepared_datasets() == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_cleanup_refuses_a_bad_keep_last(tmp_path, bad):
    with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
        Store.create(str(tmp_path)).cleanup(keep_last=bad)


def test_prepare_data_mentions_cleanup_once_copies_pile_up(tmp_path, capsys):
    from spark_dl.spark.common.util import OLD_DATASETS_NOTE, _note_old_datasets

    store = Store.create(str(tmp_path / "store"))
    for n in range(OLD_DATASETS_NOTE):
        _fake_dataset(store, f"d{n}", float(n), 2 << 20)
        _note_old_datasets(store, f"d{n}")
        printed = capsys.readouterr().out
        if n + 1 < OLD_DATASETS_NOTE:
            assert printed == ""
    assert f"the store holds {OLD_DATASETS_NOTE} prepared datasets" in printed
    assert "training data: 2.0 MiB" in printed and "store.cleanup(keep_last=1)" in printed
