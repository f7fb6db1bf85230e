"""Atomic writes are durable (fsync before the rename) and the temporaries of killed
writes are removed when the run starts again."""

import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from spark_dl.spark.common.store import LocalStore

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WRITER = textwrap.dedent("""
    import sys, time
    from spark_dl.spark.common.store import LocalStore
    store = LocalStore(sys.argv[1])
    with store.open_atomic(sys.argv[2]) as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
""")


def _killed_write(store, path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, store.prefix_path, path],
                            stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_killed_checkpoint_writes_are_cleaned_at_the_next_start(tmp_path):
    from spark_dl.spark.common.worker import _Worker

    store = LocalStore(str(tmp_path / "store"))
    remote = store.to_remote("run1")
    store.write(remote.checkpoint_path, b"epoch 3")
    run_dir = store.get_fs_path(store.get_run_path("run1"))
    for _ in range(3):
        _killed_write(store, remote.checkpoint_path)
    leftovers = [n for n in os.listdir(run_dir) if n.endswith(".tmp")]
    assert len(leftovers) == 3
    store.write(store.get_run_path("run1") + "/other.txt", b"kept")

    # Rank 0 of the next start of the run, as far as the checkpoint is concerned.
    notes = []
    worker = object.__new__(_Worker)
    worker.spec = types.SimpleNamespace(remote_store=remote, run_id="run1")
    worker.reporter = types.SimpleNamespace(note=notes.append)
    worker.adapter = types.SimpleNamespace(load_checkpoint=lambda data: (3, {"loss": [data]}))
    start, history = worker._load_checkpoint()
    assert (start, history) == (3, {"loss": [b"epoch 3"]})  # the checkpoint survived whole
    assert sorted(os.listdir(run_dir)) == [os.path.basename(remote.checkpoint_path),
                                           "other.txt"]
    assert sum("interrupted write" in n for n in notes) == 3
    assert store.remove_temporaries(store.get_run_path("missing")) == []


def test_atomic_write_fsyncs_file_then_directory(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path))
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")) else "file"
        events.append(("fsync", kind))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.write("a/checkpoint", b"data")
    assert events == [("fsync", "file"), ("rename", "checkpoint"), ("fsync", "dir")]
    assert store.read("a/checkpoint") == b"data"
    # A failed write leaves neither the target nor a temporary.
    with pytest.raises(RuntimeError):
        with store.open_atomic("a/other") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path / "a") == ["checkpoint"]


def test_estimator_workers_dump_the_flight_recorder_into_a_local_run(tmp_path, monkeypatch):
    """A LocalStore's run gets the dumps (docs/observability.md); a user's folder wins."""
    from spark_dl.spark.common.worker import _flight_recorder_in_run

    monkeypatch.delenv("SDL_FLIGHT_RECORDER_DIR", raising=False)
    remote = LocalStore(str(tmp_path)).to_remote(run_id="run1")
    _flight_recorder_in_run(remote)
    folder = os.environ["SDL_FLIGHT_RECORDER_DIR"]
    assert folder == os.path.join(str(tmp_path), "runs", "run1", "flight_recorder")
    assert os.path.isdir(folder)
    monkeypatch.setenv("SDL_FLIGHT_RECORDER_DIR", "/mine")
    _flight_recorder_in_run(remote)
    assert os.environ["SDL_FLIGHT_RECORDER_DIR"] == "/mine"
    monkeypatch.delenv("SDL_FLIGHT_RECORDER_DIR")
    _flight_recorder_in_run(None)  # spark.run has no run
    assert "SDL_FLIGHT_RECORDER_DIR" not in os.environ


def test_flight_recorder_dumps_of_a_remote_store_are_staged_and_copied(tmp_path, monkeypatch):
    """A Store whose paths are not local files: the core dumps into a local staging folder,
    copied into the run's flight_recorder/ when training ends, the staging folder removed."""
    import types

    from spark_dl.spark.common.worker import _flight_recorder_in_run, _upload_flight_dumps

    monkeypatch.delenv("SDL_FLIGHT_RECORDER_DIR", raising=False)
    written = {}
    store = types.SimpleNamespace(capabilities=types.SimpleNamespace(local_paths=False))
    remote = types.SimpleNamespace(run_path="s3://bucket/runs/run1", store=store,
                                   write=lambda path, data: written.__setitem__(path, data))
    staging = _flight_recorder_in_run(remote)
    assert staging and os.environ["SDL_FLIGHT_RECORDER_DIR"] == staging
    with open(os.path.join(staging, "flight_recorder.rank1.json"), "w") as f:
        f.write('{"rank": 1}')  # as the core writes it when the runtime fails
    _upload_flight_dumps(remote, staging)
    assert written == {"s3://bucket/runs/run1/flight_recorder/flight_recorder.rank1.json":
                       b'{"rank": 1}'}
    assert not os.path.exists(staging)
    _upload_flight_dumps(remote, None)  # a local Store's run: nothing to copy

