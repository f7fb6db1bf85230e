"""The launch layer's services without Spark: wire protocol, refusals, supervision.

Every service (driver, task) is fed wrong or missing MACs, replays, truncated and
oversized frames, and frames made for another service; each must refuse them without
deserializing anything (the payloads are pickles that would create a marker directory
if ever loaded) and keep serving. Task services must stop their worker on request, when
the driver disappears, and when their own process is killed.
"""

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from spark_dl.rendezvous.frames import HEADER_BYTES, seal_frame
from spark_dl.rendezvous.secret import make_secret
from spark_dl.spark.launch.driver.plan import plan_ranks
from spark_dl.spark.launch.driver.service import DriverService, Registration
from spark_dl.spark.launch.driver.slots import _check_local_task_resources, configured_slots
from spark_dl.spark.launch.errors import (MpiNotBuiltError, NotEnoughSlotsError,
                                          StartTimeoutError)
from spark_dl.spark.launch.launcher import GlooLauncher
from spark_dl.spark.launch.service import (ServiceClient, ServiceError, ServiceServer,
                                           request_context, response_context)
from spark_dl.spark.launch.spark_run import select_launcher
from spark_dl.spark.launch.task import get_available_devices
from spark_dl.spark.launch.task.environment import format_endpoints, parse_endpoints
from spark_dl.spark.launch.task.main import TaskMain, TaskSettings
from spark_dl.spark.launch.task.service import TaskService
from test_run_cases import processes_with

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = make_secret()


class _Evil:
    """Unpickling this creates a directory: proof that something was deserialized."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class _Target:
    """A running service, the name its frames are sealed for, and one harmless call."""

    def __init__(self, name, server, call, kwargs, close):
        self.name = name
        self.server = server
        self.call = call
        self.kwargs = kwargs
        self.close = close

    @property
    def endpoint(self):
        return self.server.endpoints[0]

    def client(self, secret=SECRET):
        return ServiceClient(self.name, secret, [self.endpoint], timeout=5.0)

    def frame(self, payload=None, secret=SECRET, context=None):
        payload = pickle.dumps((self.call, self.kwargs)) if payload is None else payload
        return seal_frame(secret, context or request_context(self.name), self.call, payload)

    def works(self):
        with self.client() as c:
            c.call(self.call, **self.kwargs)


def _driver_target():
    driver = DriverService(SECRET, 2, b"code", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    return _Target("driver", driver.server, "ping", {"index": 0}, driver.stop)


def _task_target():
    dead_driver = ServiceClient("driver", SECRET, [("127.0.0.1", 9)], timeout=1.0)
    task = TaskService(SECRET, "job", 0, [], dead_driver, hosts=["127.0.0.1"])
    task.start()
    return _Target("task", task.server, "status", {}, lambda: task.stop(1.0))


@pytest.fixture(params=["driver", "task"])
def target(request):
    t = {"driver": _driver_target, "task": _task_target}[request.param]()
    yield t
    t.close()


def _send(endpoint, data, timeout=3.0, close_write=False):
    """Sends raw bytes; returns (everything answered until EOF, seconds to EOF)."""
    start = time.monotonic()
    with socket.create_connection(endpoint, timeout=timeout) as sock:
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # closed with our unread bytes still queued
                break
            if not chunk:
                break
            chunks.append(chunk)
            if sum(map(len, chunks)) >= HEADER_BYTES and not close_write:
                sock.shutdown(socket.SHUT_WR)  # an answer came: end the connection
    return b"".join(chunks), time.monotonic() - start


def _evil_payload(target, tmp_path):
    marker = tmp_path / "deserialized"
    return marker, pickle.dumps((target.call, {"x": _Evil(str(marker))}))


def _assert_refused(target, data, marker=None, close_write=False):
    before = target.server.rejected
    answer, _ = _send(target.endpoint, data, close_write=close_write)
    assert answer == b""
    assert target.server.rejected == before + 1
    if marker is not None:
        assert not marker.exists()
    target.works()  # the service keeps serving


def test_good_request_is_answered(target):
    target.works()
    answer, _ = _send(target.endpoint, target.frame())
    assert len(answer) > HEADER_BYTES


def test_wrong_mac_refused_without_deserializing(target, tmp_path):
    marker, payload = _evil_payload(target, tmp_path)
    _assert_refused(target, target.frame(payload, secret=make_secret()), marker)


def test_tampered_frame_refused(target, tmp_path):
    marker, payload = _evil_payload(target, tmp_path)
    frame = bytearray(target.frame(payload))
    frame[-1] ^= 1
    _assert_refused(target, bytes(frame), marker)


def test_missing_mac_refused(target, tmp_path):
    marker, payload = _evil_payload(target, tmp_path)
    _assert_refused(target, payload, marker)  # a bare pickle, no frame at all
    frame = bytearray(target.frame(payload))
    frame[HEADER_BYTES - 32:HEADER_BYTES] = bytes(32)  # an all-zero tag
    _assert_refused(target, bytes(frame), marker)


def test_frame_for_another_service_refused(target, tmp_path):
    marker, payload = _evil_payload(target, tmp_path)
    other = "task" if target.name == "driver" else "driver"
    _assert_refused(target, target.frame(payload, context=request_context(other)), marker)
    # A response frame is not a request either.
    _assert_refused(target, target.frame(payload, context=response_context(target.name,
                                                                           bytes(16))), marker)


def test_replayed_frame_refused(target):
    frame = target.frame()
    answer, _ = _send(target.endpoint, frame)
    assert answer
    _assert_refused(target, frame)


def test_truncated_frame_refused(target, tmp_path):
    marker, payload = _evil_payload(target, tmp_path)
    frame = target.frame(payload)
    _assert_refused(target, frame[:HEADER_BYTES // 2], marker, close_write=True)
    _assert_refused(target, frame[:len(frame) - 3], marker, close_write=True)


def test_stalled_frame_does_not_block_others(target):
    frame = target.frame()
    with socket.create_connection(target.endpoint, timeout=5) as stalled:
        stalled.sendall(frame[:HEADER_BYTES + 1])
        start = time.monotonic()
        target.works()
        assert time.monotonic() - start < 2.0


def test_oversized_frame_refused_before_reading(target):
    frame = bytearray(target.frame())
    frame[28:36] = struct.pack(">Q", 1 << 40)  # the announced payload length
    # Only the header is sent: the refusal must not wait for the announced body.
    answer, took = _send(target.endpoint, bytes(frame[:HEADER_BYTES]))
    assert answer == b"" and took < 2.0
    target.works()


def test_stalled_frame_is_closed_idle_connection_is_not_an_offence():
    with ServiceServer("svc", SECRET, {"one": lambda: 1}, read_timeout=0.5) as server:
        frame = seal_frame(SECRET, request_context("svc"), "one", pickle.dumps(("one", {})))
        answer, took = _send(server.endpoints[0], frame[:10])  # stalls inside the header
        assert answer == b"" and 0.4 < took < 3 and server.rejected == 1
        answer, took = _send(server.endpoints[0], b"")  # says nothing at all
        assert answer == b"" and server.rejected == 1


def test_client_rejects_unbound_or_forged_answers():
    """Answers must be sealed with the secret and bound to the request's nonce."""
    def serve(sock, make_answer):
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(make_answer())

    for make_answer in (
            lambda: seal_frame(SECRET, response_context("driver", bytes(16)), "response",
                               pickle.dumps(("ok", 1))),
            lambda: seal_frame(make_secret(), b"x", "response", pickle.dumps(("ok", 1)))):
        with socket.create_server(("127.0.0.1", 0)) as sock:
            thread = threading.Thread(target=serve, args=(sock, make_answer), daemon=True)
            thread.start()
            with pytest.raises(ServiceError):
                ServiceClient("driver", SECRET, [sock.getsockname()], timeout=3).call("ping")
            thread.join(5)


def test_stale_clock_is_corrected_once():
    with ServiceServer("svc", SECRET, {"echo": lambda v: v}) as server:
        client = ServiceClient("svc", SECRET, server.endpoints, timeout=5)
        client._clock_offset_ms = -3_600_000  # an hour behind the server
        assert client.call("echo", v=5) == 5
        assert abs(client._clock_offset_ms) < 60_000
        client.close()


def test_handler_errors_reach_the_caller_and_service_goes_on():
    from spark_dl.spark.launch.service import RemoteCallError

    def fail():
        raise KeyError("nope")

    with ServiceServer("svc", SECRET, {"fail": fail, "one": lambda: 1}) as server:
        with ServiceClient("svc", SECRET, server.endpoints, timeout=5) as client:
            with pytest.raises(RemoteCallError, match="nope"):
                client.call("fail")
            with pytest.raises(RemoteCallError, match="unknown method"):
                client.call("missing")
            assert client.call("one") == 1


# ---- driver logic -------------------------------------------------------------------


def _reg(index, host):
    return Registration(index, host, f"host-{host}", [("127.0.0.1", 1000 + index)], [], 1)


def test_ranks_are_grouped_by_host():
    plan = plan_ranks([_reg(0, "a"), _reg(1, "b"), _reg(2, "a"), _reg(3, "b"), _reg(4, "c")])
    got = [(p.task.index, p.rank, p.slot.local_rank, p.slot.local_size, p.slot.cross_rank,
            p.slot.cross_size) for p in plan]
    assert got == [(0, 0, 0, 2, 0, 3), (2, 1, 1, 2, 0, 2), (1, 2, 0, 2, 1, 3),
                   (3, 3, 1, 2, 1, 2), (4, 4, 0, 1, 2, 3)]


def test_worker_environment_has_no_secret():
    from spark_dl.spark.launch.launcher import LaunchContext

    plan = plan_ranks([_reg(0, "a"), _reg(1, "b")])
    ctx = LaunchContext("job", SECRET, plan, [("10.0.0.1", 5)], ("10.0.0.1", 6), 30.0,
                        {"MY_VAR": "1", "SDL_RANK": "99"}, {})
    env = GlooLauncher().worker_env(ctx, plan[1])
    assert "SDL_SECRET_KEY" not in env and SECRET.hex() not in repr(env)
    assert env["SDL_RANK"] == "1" and env["MY_VAR"] == "1"
    assert env["SDL_HOSTNAME"] == "127.0.0.1"  # the task's registered address
    assert env["SDL_HOST_ID"] == "b" and env["SDL_CONTROLLER"] == "gloo"
    assert parse_endpoints(env["SDL_SPARK_DRIVER"]) == [("10.0.0.1", 5)]
    assert parse_endpoints(format_endpoints([("::1", 7), ("h", 8)])) == [("::1", 7), ("h", 8)]


def test_registration_timeout_names_missing_tasks():
    driver = DriverService(SECRET, 3, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        with ServiceClient("driver", SECRET, driver.server.endpoints) as client:
            client.call("register", index=1, host_hash="h", hostname="x", endpoints=[],
                        gpus=[], pid=1)
        start = time.monotonic()
        with pytest.raises(StartTimeoutError, match=r"2 of 3 .*tasks 0, 2\. Check"):
            driver.wait_for_registrations(0.5, lambda: None, "Check this.")
        assert time.monotonic() - start < 2
    finally:
        driver.stop()


def test_task_failure_before_registration_ends_the_wait():
    driver = DriverService(SECRET, 2, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        with ServiceClient("driver", SECRET, driver.server.endpoints) as client:
            client.call("task_failed", index=1, traceback="Traceback ...\nOSError: no port")
        with pytest.raises(RuntimeError, match=r"(?s)task 1 failed\nTraceback .*no port"):
            driver.wait_for_registrations(30, lambda: None)
    finally:
        driver.stop()


def test_exit_after_result_is_only_a_warning():
    lines = []
    driver = DriverService(SECRET, 1, b"", ["127.0.0.1"], lambda s, d: lines.append(d))
    driver.start()
    try:
        driver.set_ranks({0: 0})
        with ServiceClient("driver", SECRET, driver.server.endpoints) as client:
            client.call("result", rank=0, value=b"r")
            client.call("worker_exit", index=0, rank=0, code=139)
        assert driver.wait_for_outcome(lambda: None) == []
        assert b"returned its result but then ended with exit code 139" in b"".join(lines)
    finally:
        driver.stop()


def test_root_cause_wins_over_its_consequences():
    driver = DriverService(SECRET, 2, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        driver.set_ranks({0: 0, 1: 1})
        with ServiceClient("driver", SECRET, driver.server.endpoints) as client:
            client.call("error", rank=0, exc_type="spark_dl.common.exceptions.PeerFailureError",
                        summary="rank 0 lost rank 1", traceback="tb", exception=None)
            client.call("worker_exit", index=1, rank=1, code=137)
        failures = driver.wait_for_outcome(lambda: None, settle_s=0.5)
        assert [f.rank for f in failures] == [1, 0]
        assert "SIGKILL" in failures[0].summary
    finally:
        driver.stop()


def test_silent_task_is_named_unreachable(monkeypatch):
    """A task whose connection stays open but pings no more (its host cut off) fails
    the job, naming its rank and host; a task that keeps pinging does not."""
    from spark_dl.spark.launch.driver import service as driver_service

    monkeypatch.setattr(driver_service, "TASK_SILENT_S", 0.6)
    driver = DriverService(SECRET, 2, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        with ServiceClient("driver", SECRET, driver.server.endpoints) as alive, \
                ServiceClient("driver", SECRET, driver.server.endpoints) as silent:
            for index, client in enumerate((alive, silent)):
                client.call("register", index=index, host_hash=f"h{index}",
                            hostname=f"host{index}", endpoints=[], gpus=[], pid=1)
            driver.set_ranks({0: 0, 1: 1})
            stop = threading.Event()

            def ping():
                while not stop.wait(0.1):
                    alive.call("ping", index=0)

            pinger = threading.Thread(target=ping, daemon=True)
            pinger.start()
            start = time.monotonic()
            try:
                failures = driver.wait_for_outcome(lambda: None, consequence_settle_s=0.2)
            finally:
                stop.set()
                pinger.join(5)
        assert time.monotonic() - start < 5
        assert [f.rank for f in failures] == [1]
        assert "rank 1 on host1 is unreachable" in failures[0].summary
    finally:
        driver.stop()


def test_launcher_selection(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun
    with pytest.raises(MpiNotBuiltError, match="needs Open MPI's mpirun"):
        select_launcher(True, None)
    with pytest.raises(MpiNotBuiltError):
        select_launcher(None, False)
    with pytest.raises(ValueError):
        select_launcher(True, True)
    with pytest.raises(ValueError):
        select_launcher(False, False)
    assert select_launcher(None, None).name == "gloo"
    with pytest.warns(UserWarning, match="extra_mpi_args"):
        select_launcher(None, True, "-x FOO")


def test_configured_slots():
    conf = {"spark.task.cpus": "1"}
    assert configured_slots("local[2]", conf) == 2
    assert configured_slots("local", conf) == 1
    assert configured_slots("local[3, 2]", conf) == 3
    assert configured_slots("local-cluster[2,1,1024]", conf) == 2
    assert configured_slots("local-cluster[2,4,1024]", {"spark.task.cpus": "2"}) == 4
    assert configured_slots("yarn", {}) is None
    gpus = {"spark.executor.instances": "3", "spark.executor.cores": "8",
            "spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "2"}
    assert configured_slots("yarn", gpus) == 6
    assert configured_slots("yarn", {**gpus, "spark.dynamicAllocation.enabled": "true"}) is None


def test_local_master_with_task_resources_is_refused_at_once():
    """Spark's local mode never schedules a task that asks for a custom resource (found
    when a GPU setting leaked into a local[2] session and its job waited forever)."""
    with pytest.raises(NotEnoughSlotsError,
                       match=r"spark.task.resource.gpu.amount=1 is set, but Spark's local mode"):
        _check_local_task_resources("local[2]", {"spark.task.resource.gpu.amount": "1"})
    _check_local_task_resources("local[2]", {"spark.task.resource.gpu.amount": "0"})
    _check_local_task_resources("local-cluster[2,1,1024]",
                                {"spark.task.resource.gpu.amount": "1"})


def test_addresses_services_bind():
    from spark_dl.spark.launch.network import (driver_addresses, host_hash, interface_addresses,
                                               task_bind_addresses)

    assert interface_addresses(["lo"]) == ["127.0.0.1"]
    with pytest.raises(ValueError, match="no-such-nic0"):
        interface_addresses(["no-such-nic0"])
    conf = {"spark.driver.host": "127.0.0.1"}.get
    assert driver_addresses(conf, "local[2]", None) == (["127.0.0.1"], ["127.0.0.1"])
    assert driver_addresses(conf, "spark://m:7077", None) == (["127.0.0.1"], ["127.0.0.1"])
    assert driver_addresses(conf, "yarn", ["lo"]) == (["127.0.0.1"], ["127.0.0.1"])
    assert task_bind_addresses(["127.0.0.1"], None) == ["127.0.0.1"]
    assert host_hash() == host_hash() and len(host_hash()) == 16


class _FakeContext:
    """Just enough of a SparkContext for check_slots; slots change per query."""

    def __init__(self, master, conf, slots):
        self.master = master
        self._conf = conf
        self._slots = list(slots)
        self._jsc = self

    def sc(self):
        return self

    def resourceProfileManager(self):
        return self

    def defaultResourceProfile(self):
        return "default"

    def maxNumConcurrentTasks(self, profile):
        return self._slots.pop(0) if len(self._slots) > 1 else self._slots[0]

    def getConf(self):
        return self

    def getAll(self):
        return list(self._conf.items())

    @property
    def sparkContext(self):  # the fake stands for a classic session too
        return self


class _FakeConnectConf:
    def __init__(self, conf):
        self._conf = conf

    def get(self, key, default=None):
        return self._conf.get(key, default)

    @property
    def getAll(self):
        return dict(self._conf)


_FakeConnectSession = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})


def _connect_session(master, conf):
    session = _FakeConnectSession()
    session.conf = _FakeConnectConf({"spark.master": master, **conf})
    return session


def test_slot_check_under_connect_uses_the_configuration():
    from spark_dl.spark.launch.driver.slots import check_slots
    from spark_dl.spark.launch.errors import NotEnoughSlotsError

    cluster = {"spark.executor.instances": "2", "spark.executor.cores": "2"}
    with pytest.raises(NotEnoughSlotsError, match="exceeds the 4 task slots .* configured"):
        check_slots(_connect_session("spark://m:7077", cluster), 5, wait_s=30)
    with pytest.raises(NotEnoughSlotsError, match="exceeds the 2 task slots"):
        check_slots(_connect_session("local[2]", {}), 3, wait_s=30)
    check_slots(_connect_session("spark://m:7077", cluster), 4, wait_s=30)
    check_slots(_connect_session("", {}), 64, wait_s=30)  # serverless: nothing said
    with pytest.raises(NotEnoughSlotsError, match="local mode .* no custom resources"):
        check_slots(_connect_session("local[2]", {"spark.task.resource.gpu.amount": "1"}), 1,
                    wait_s=30)


def test_slot_check_fails_fast_or_waits_for_promised_executors():
    from spark_dl.spark.launch.driver.slots import check_slots
    from spark_dl.spark.launch.errors import NotEnoughSlotsError

    cluster = {"spark.executor.instances": "2", "spark.executor.cores": "2"}
    start = time.monotonic()
    with pytest.raises(NotEnoughSlotsError, match="exceeds the 1 task slots"):
        check_slots(_FakeContext("local[4]", {}, [1]), 2, wait_s=30)
    with pytest.raises(NotEnoughSlotsError, match="exceeds the 4 task slots .* configured"):
        check_slots(_FakeContext("spark://m:7077", cluster, [4]), 5, wait_s=30)
    assert time.monotonic() - start < 1
    # Promised but still registering: wait until they are there.
    check_slots(_FakeContext("spark://m:7077", cluster, [0, 2, 4]), 4, wait_s=5, poll_s=0.01)
    with pytest.raises(NotEnoughSlotsError, match="offer only 2 task slots after"):
        check_slots(_FakeContext("spark://m:7077", cluster, [2]), 4, wait_s=0.2, poll_s=0.01)
    # Nothing promised: Spark's own check decides.
    check_slots(_FakeContext("yarn", {}, [0]), 4, wait_s=30)


def test_available_devices_from_environment():
    assert get_available_devices({"SDL_AVAILABLE_DEVICES": "1,3"}) == ["1", "3"]
    assert get_available_devices({}) == []


# ---- task service supervision -------------------------------------------------------

_CHILD = textwrap.dedent("""
    import os, sys
    secret = sys.stdin.readline().strip()
    with open("/proc/self/environ", "rb") as f:
        env = f.read()
    with open("/proc/self/cmdline", "rb") as f:
        cmd = f.read()
    print("secret", len(secret), secret.encode() in env or secret.encode() in cmd,
          os.environ["MY_VAR"], os.environ.get("CUDA_VISIBLE_DEVICES"))
    print("to stderr", file=sys.stderr)
""")


def _alive(token):
    return bool(processes_with(token))


def _wait_alive(token, timeout=10):
    deadline = time.monotonic() + timeout
    while not _alive(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_gone(token, timeout):
    deadline = time.monotonic() + timeout
    while _alive(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def driver_and_task():
    lines = []
    driver = DriverService(SECRET, 1, b"", ["127.0.0.1"], lambda s, d: lines.append((s, d)))
    driver.start()
    driver.set_ranks({0: 0})
    client = ServiceClient("driver", SECRET, driver.server.endpoints, timeout=5)
    task = TaskService(SECRET, "job", 0, ["2"], client, kill_grace=1.0, hosts=["127.0.0.1"])
    task.start()
    yield driver, task, lines
    task.stop(5)
    client.close()
    driver.stop()


def test_task_service_runs_a_command_with_the_secret_on_stdin(driver_and_task):
    driver, task, lines = driver_and_task
    with ServiceClient("task", SECRET, task.server.endpoints) as client:
        client.call("launch", rank=0, env={"MY_VAR": "v"},
                    command=[sys.executable, "-c", _CHILD])
        with pytest.raises(Exception, match="already launched"):
            client.call("launch", rank=0, env={}, command=["true"])
    assert task.done.wait(20)
    assert driver.wait_for_exits([0], 5) == []
    out = b"".join(d for s, d in lines if s == "stdout")
    err = b"".join(d for s, d in lines if s == "stderr")
    assert out == b"[0]<stdout>:secret 64 False v 2\n"
    assert err == b"[0]<stderr>:to stderr\n"


def test_task_service_terminates_its_worker(driver_and_task):
    driver, task, _ = driver_and_task
    token = f"sdl-test-sleeper-{os.getpid()}-terminate"
    with ServiceClient("task", SECRET, task.server.endpoints) as client:
        client.call("launch", rank=0, env={},
                    command=[sys.executable, "-c", "import time; time.sleep(60)", token])
        assert _wait_alive(token)
        client.call("terminate")
    assert task.done.wait(10)
    assert not _alive(token)
    assert driver.wait_for_exits([0], 5) == []


def test_task_stops_its_worker_when_the_driver_disappears(driver_and_task):
    driver, task, _ = driver_and_task
    token = f"sdl-test-sleeper-{os.getpid()}-lost"
    with ServiceClient("task", SECRET, task.server.endpoints) as client:
        client.call("launch", rank=0, env={},
                    command=[sys.executable, "-c", "import time; time.sleep(60)", token])
    assert _wait_alive(token)
    driver.stop()
    settings = TaskSettings("job", SECRET, driver.server.endpoints, 30.0, ping_s=0.2,
                            driver_lost_s=1.0)
    client = ServiceClient("driver", SECRET, driver.server.endpoints, timeout=1)
    start = time.monotonic()
    TaskMain(settings)._wait(task, client, 0)
    assert time.monotonic() - start < 5
    assert task.stop(5)
    assert not _alive(token)


_HOST = textwrap.dedent("""
    import sys, time
    from spark_dl.spark.launch.service import ServiceClient
    from spark_dl.spark.launch.task.service import TaskService
    secret = bytes.fromhex(sys.argv[1])
    driver = ServiceClient("driver", secret, [("127.0.0.1", 9)], timeout=1)
    task = TaskService(secret, "job", 0, [], driver, hosts=["127.0.0.1"])
    task.start()
    task._launch({}, 0, [sys.executable, "-c", "import time; time.sleep(60)",
                         sys.argv[2] + "-worker"])
    print("ready", flush=True)
    time.sleep(60)
""")


def test_worker_is_reaped_when_the_task_process_is_killed():
    token = f"sdl-test-sleeper-{os.getpid()}-orphan"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    host = subprocess.Popen([sys.executable, "-c", _HOST, SECRET.hex(), token], env=env,
                            stdout=subprocess.PIPE, start_new_session=True)
    token += "-worker"  # only the worker's command line holds this
    try:
        assert host.stdout.readline().strip() == b"ready"
        assert _wait_alive(token)
        time.sleep(0.5)  # the supervisor registers the worker with its watchdog
        host.send_signal(signal.SIGKILL)  # as Spark does to a cancelled task's process
        host.wait(10)
        assert _wait_gone(token, 10)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        host.stdout.close()
