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


def test_the_route_asks_whether_the_caller_still_answers():
    assert link.OutputRoute(make_secret(), None, None).caller_reachable(1.0) is None
    secret = make_secret()
    caller = link.CallerLink(secret, ["127.0.0.1"], lambda s, d: None)
    endpoints = caller.start()
    spool = MemorySpool()
    route = link.OutputRoute(secret, endpoints, spool)
    try:
        assert route.caller_reachable(2.0) is True and route.live
    finally:
        caller.stop()
    start = time.monotonic()
    assert route.caller_reachable(1.0) is False
    assert time.monotonic() - start < 3
    # The unanswered link is dropped: the outcome goes to the spool without waiting.
    assert not route.live
    start = time.monotonic()
    route.report("outcome", {"class": "RunError", "message": "m"})
    assert time.monotonic() - start < 1
    assert any(name.endswith(".outcome") for name in spool.names())
    route.close()


def _silence_case(answer):
    """Task 0 on host1 with ranks 0 and 1; ranks 2 and 3 on host0 fell silent."""
    from types import SimpleNamespace

    from spark_dl.spark.launch.coordinator import Coordinator
    from spark_dl.spark.launch.driver.service import Failure, Registration

    def placement(index, rank, host):
        reg = Registration(index, f"hash-{host}", host, [("10.0.0.1", 1)], [], 100 + index)
        return SimpleNamespace(task=reg, rank=rank)

    placements = [placement(0, 0, "host1"), placement(2, 1, "host1"),
                  placement(1, 2, "host0"), placement(3, 3, "host0")]
    failures = [Failure(1, f"rank {r} on host0 is unreachable: ...", rank=r, lost=True,
                        unreachable=True) for r in (2, 3)]
    coordinator = Coordinator.__new__(Coordinator)
    asked = []
    coordinator.route = SimpleNamespace(
        caller_reachable=lambda timeout: asked.append(timeout) or answer)
    coordinator._cut_off = False
    out = coordinator._weigh_silence(failures, placements)
    assert coordinator._cut_off == (answer is False)
    return out, failures, asked


def test_task0_cut_off_is_named_when_the_caller_cannot_be_reached_either():
    out, _, asked = _silence_case(False)
    assert asked and len(out) == 1
    assert out[0].rank == 0 and out[0].lost
    assert out[0].summary.startswith("ranks 0 and 1 on host1 were lost: host1, the host of "
                                     "task 0")
    assert "host0: ranks 2 and 3" in out[0].summary


def test_other_hosts_cut_off_when_the_caller_answers_and_both_without_a_link():
    out, failures, _ = _silence_case(True)
    assert out == failures and out[0].summary == "rank 2 on host0 is unreachable: ..."
    out, failures, _ = _silence_case(None)
    assert out[0].rank == 2
    assert "Or host1, task 0's own host, is the one cut off" in out[0].summary


def test_one_silent_host_among_others_is_not_weighed():
    from types import SimpleNamespace

    from spark_dl.spark.launch.coordinator import Coordinator
    from spark_dl.spark.launch.driver.service import Failure, Registration

    regs = [Registration(i, f"hash-{h}", h, [], [], i) for i, h in
            enumerate(["host0", "host1", "host2"])]
    placements = [SimpleNamespace(task=r, rank=r.index) for r in regs]
    failures = [Failure(1, "rank 1 on host1 is unreachable", rank=1, lost=True,
                        unreachable=True)]
    coordinator = Coordinator.__new__(Coordinator)
    coordinator.route = SimpleNamespace(caller_reachable=lambda timeout: 1 / 0)  # not asked
    assert coordinator._weigh_silence(failures, placements) == failures


class _StuckJob:
    """A Spark job that cannot end by itself (a task on a cut-off host) until cancelled."""

    rows = error = None

    def __init__(self):
        self.cancelled = threading.Event()

    def join(self, timeout):
        return self.cancelled.wait(timeout)

    def cancel(self):
        self.cancelled.set()


@pytest.mark.parametrize("cut_off", [True, False])
def test_the_caller_cancels_at_once_when_task0_says_its_host_is_cut_off(monkeypatch, cut_off):
    from spark_dl.spark.launch import spark_run

    monkeypatch.setattr(spark_run, "_VERDICT_END_WAIT_S", 1.5)
    spool = MemorySpool()
    doc = {"class": "WorkerFailedError", "message": "ranks 0 and 1 on host1 were lost",
           "job_id": "j", "rank": 0, "traceback": None, "exit_code": None, "failures": []}
    if cut_off:
        doc["task0_cut_off"] = True
    spool.put(link.Spool.piece_name(0, "started"), b"")
    spool.put(link.Spool.piece_name(1, "outcome"), json.dumps(doc).encode())
    follower = link.SpoolFollower(spool, lambda s, d: None)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="ranks 0 and 1 on host1") as info:
        spark_run._wait(_StuckJob(), None, follower, None, "j", 4)
    took = time.monotonic() - start
    assert info.value.rank == 0
    assert took < 1.0 if cut_off else 1.5 <= took < 3.0, took


def test_task0_beats_over_the_link_and_the_caller_times_its_silence(monkeypatch):
    monkeypatch.setattr(link, "BEAT_S", 0.1)
    secret = make_secret()
    caller = link.CallerLink(secret, ["127.0.0.1"], lambda s, d: None)
    endpoints = caller.start()
    try:
        assert caller.silent_s() == 0.0  # nothing heard yet: no silence to count
        route = link.OutputRoute(secret, endpoints, None)
        first = caller.last_heard
        time.sleep(0.5)
        assert caller.last_heard > first and caller.silent_s() < 0.4
        route.close()
        time.sleep(0.3)
        assert caller.silent_s() >= 0.3  # closed: no more beats
        assert caller.task0_gone.wait(2)
    finally:
        caller.stop()


@pytest.mark.parametrize("plan", [True, False])
def test_the_caller_fails_the_job_when_task0_falls_silent(monkeypatch, plan):
    from types import SimpleNamespace

    from spark_dl.spark.launch import spark_run

    monkeypatch.setattr(spark_run, "TASK0_SILENT_S", 0.5)
    reports = link.Reports()
    if plan:
        reports.add("plan", {"0": [0, "host1"], "1": [2, "host0"], "2": [1, "host1"],
                             "3": [3, "host0"]})
    contacted, gone = threading.Event(), threading.Event()
    contacted.set()
    heard = time.monotonic()
    fake = SimpleNamespace(reports=reports, contacted=contacted, task0_gone=gone,
                           silent_s=lambda: time.monotonic() - heard)
    job = _StuckJob()
    start = time.monotonic()
    expected = WorkerFailedError if plan else RunError
    with pytest.raises(expected, match="has not been heard from") as info:
        spark_run._wait(job, fake, None, None, "j", 4)
    assert job.cancelled.is_set() and time.monotonic() - start < 3
    if plan:
        assert info.value.rank == 0
        assert str(info.value).startswith("ranks 0 and 1 on host1 were lost: task 0")
    # A caller that was itself stalled (asleep) counts task 0's silence from its wake-up:
    # without that, its first pass after a 1.5 s stall would fail the job (silent 10 s,
    # waiting for 1.75 s); with it, the job ends (0.5 s after the wake-up) first.
    monkeypatch.setattr(spark_run, "TASK0_SILENT_S", 1.0)
    monkeypatch.setattr(spark_run, "_CALLER_STALL_S", 0.2)
    heard = time.monotonic() - 10
    waking = _StuckJob()
    first = [True]

    def join(timeout):
        if first[0]:
            first[0] = False
            time.sleep(1.5)  # the stall
        return waking.cancelled.wait(timeout)

    waking.join = join
    threading.Timer(2.0, waking.cancel).start()
    assert spark_run._wait(waking, fake, None, None, "j", 4) is not None
    # Task 0 gone (its connection closed: the job is ending) is not a silence.
    gone.set()
    heard = time.monotonic() - 10
    done = _StuckJob()
    threading.Timer(1.0, done.cancel).start()
    assert spark_run._wait(done, fake, None, None, "j", 4) is not None
