"""The pieces of the task-0 launch path that need no Spark: the job's rows, the caller
link and its fallbacks (spool, result), and how the caller rebuilds a failure."""

import json
import socket
import threading
import time

import pytest

from spark_dl.rendezvous.secret import make_secret
from spark_dl.spark.launch import link, rows
from spark_dl.spark.launch.coordinator import error_document
from spark_dl.spark.launch.errors import (ExecutorPythonError, NotEnoughSlotsError, RunError,
                                          StartTimeoutError, WorkerFailedError)
from spark_dl.spark.launch.spark_run import _job_failure, _rebuild_error


class MemorySpool(link.Spool):
    def __init__(self):
        self.blobs = {}

    def put(self, name, data):
        self.blobs[name] = bytes(data)

    def get(self, name):
        return self.blobs[name]

    def names(self):
        return list(self.blobs)


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_rows_round_trip_in_pieces(monkeypatch):
    monkeypatch.setattr(rows, "PIECE_BYTES", 7)
    big = bytes(range(200)) * 3
    out = list(rows.pieces("result", 1, big)) + list(rows.pieces("result", 0, b""))
    assert max(len(r[3]) for r in out) == 7
    out += [("error", -1, 0, json.dumps({"class": "RunError"}).encode()),
            ("stderr", -1, 1, b"b"), ("stdout", -1, 0, b"a"), ("stdout", -1, 2, b"c"),
            ("phases", -1, 0, b'{"services": 1.5}')]
    table = rows.batch(reversed(out))
    assert table.num_rows == len(out) and table.schema.names == ["kind", "rank", "seq", "data"]
    decoded = rows.decode(reversed(out))
    assert decoded.results == {0: b"", 1: big}
    assert decoded.error == {"class": "RunError"}
    assert decoded.output == [("stdout", b"a"), ("stderr", b"b"), ("stdout", b"c")]
    assert decoded.phases == {"services": 1.5}


def test_output_is_kept_for_the_result_without_link_or_spool(monkeypatch):
    monkeypatch.setattr(link, "KEEP_BYTES", 10)
    route = link.OutputRoute(make_secret(), None, None)
    assert not route.live
    for i in range(5):
        route.write("stdout", f"line{i}\n".encode())
    route.close()
    assert [d for _, _, d in route.kept] == [b"line4\n"]
    assert route.dropped_bytes == 24


def test_an_unreachable_caller_falls_back_to_the_spool_in_order():
    spool = MemorySpool()
    start = time.monotonic()
    route = link.OutputRoute(make_secret(), [("127.0.0.1", _closed_port())], spool)
    assert time.monotonic() - start < link.HELLO_TIMEOUT_S + 1 and not route.live
    route.write("stdout", b"one\n")
    route.write("stdout", b"two\n")
    route.write("stderr", b"err\n")
    route.report("plan", {0: [0, "h"], 1: [1, "h"]})
    route.write("stdout", b"three\n")
    route.close()
    got = []
    follower = link.SpoolFollower(spool, lambda s, d: got.append((s, d)))
    follower.poll()
    assert follower.started
    # Pieces gather what came within a flush interval; the order is kept.
    text = b"".join(d if s == "stdout" else b"<" + d + b">" for s, d in got)
    assert text == b"one\ntwo\n<err\n>three\n"
    assert follower.reports.plan == {0: [0, "h"], 1: [1, "h"]}


def test_the_spool_follower_stops_at_a_gap():
    spool = MemorySpool()
    spool.put(link.Spool.piece_name(0, "stdout"), b"a")
    spool.put(link.Spool.piece_name(2, "stdout"), b"c")
    spool.put("00000001.stdout.tmp-123", b"partial")  # a write in progress
    got = []
    follower = link.SpoolFollower(spool, lambda s, d: got.append(d))
    follower.poll()
    assert got == [b"a"]
    spool.put(link.Spool.piece_name(1, "stdout"), b"b")
    follower.poll()
    follower.poll()
    assert got == [b"a", b"b", b"c"]


def test_the_live_link_carries_output_addresses_and_reports():
    secret = make_secret()
    got = []
    caller = link.CallerLink(secret, ["127.0.0.1"], lambda s, d: got.append((s, d)))
    endpoints = caller.start()
    try:
        route = link.OutputRoute(secret, endpoints, MemorySpool())
        assert route.live and caller.contacted.is_set()
        answers = []
        other = threading.Thread(target=lambda: answers.append(
            link.coordinator_from_caller(secret, endpoints, timeout=10)))
        other.start()
        time.sleep(0.2)
        route.announce([("127.0.0.1", 1234)])
        other.join(10)
        assert answers == [{"endpoints": [("127.0.0.1", 1234)]}]
        route.write("stdout", b"live\n")
        route.report("outcome", {"class": "RunError", "message": "m"}, b"cause")
        route.close()
        assert got == [("stdout", b"live\n")]
        assert caller.reports.outcome == {"class": "RunError", "message": "m"}
        assert caller.reports.cause == b"cause"
    finally:
        caller.stop()


def test_a_link_with_another_secret_is_not_live():
    caller = link.CallerLink(make_secret(), ["127.0.0.1"], lambda s, d: None)
    endpoints = caller.start()
    try:
        route = link.OutputRoute(make_secret(), endpoints, None)
        assert not route.live and not caller.contacted.is_set()
        route.close()
    finally:
        caller.stop()


def test_asking_a_caller_that_never_answers_times_out():
    caller = link.CallerLink(make_secret(), ["127.0.0.1"], lambda s, d: None)
    endpoints = caller.start()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            link.coordinator_from_caller(caller.server._secret, endpoints, timeout=0.5)
        assert time.monotonic() - start < 5
    finally:
        caller.stop()


def test_failures_are_rebuilt_as_their_class():
    wfe = WorkerFailedError("rank 1 raised ValueError: x", 1, "Traceback ...", None,
                            ["rank 1: ValueError"], "job")
    doc = json.loads(json.dumps(error_document(wfe, "job")))
    back = _rebuild_error(doc, None, "job")
    assert isinstance(back, WorkerFailedError) and back.rank == 1
    assert back.remote_traceback == "Traceback ..." and back.failures == ["rank 1: ValueError"]
    for cls in (RunError, StartTimeoutError, NotEnoughSlotsError):
        back = _rebuild_error(error_document(cls("why", "job"), "job"), None, "job")
        assert type(back) is cls and str(back) == "why"
    back = _rebuild_error(error_document(ExecutorPythonError("py", python="/x"), "j"), None, "j")
    assert isinstance(back, ExecutorPythonError) and back.python == "/x"
    try:
        raise OSError("cannot listen")
    except OSError as exc:
        doc = error_document(exc, "job")
    back = _rebuild_error(doc, None, "job")
    assert type(back) is RunError and "task 0" in str(back) and "cannot listen" in str(back)


def test_a_failed_spark_job_names_the_rank_of_the_lost_task():
    reports = link.Reports()
    reports.add("plan", {"0": [0, "a"], "1": [1, "b"]})
    error = RuntimeError("Job aborted due to stage failure: Could not recover from a failed "
                         "barrier ResultStage. Most recent failure reason: Stage failed "
                         "because barrier task ResultTask(2, 1) finished unsuccessfully.\n"
                         "ExecutorLostFailure (executor 1 exited caused by one of the running "
                         "tasks) Reason: Command exited with code 137")
    e = _job_failure(error, [reports], "job")
    assert isinstance(e, WorkerFailedError) and e.rank == 1
    assert "rank 1 was lost: its Spark task 1 on b" in str(e) and "ExecutorLostFailure" in str(e)
    # Task 0's own verdict wins; without plan or verdict, Spark's error.
    reports.add("outcome", error_document(RunError("the verdict", "job"), "job"))
    assert str(_job_failure(error, [reports], "job")) == "the verdict"
    plain = _job_failure(RuntimeError("boom"), [], "job")
    assert type(plain) is RunError and "boom" in str(plain)
