"""The authenticated rendezvous store: round trips, blocking gets, and every refusal."""

import http.client
import http.server
import threading
import time

import pytest

from spark_dl.rendezvous import client as kv_client
from spark_dl.rendezvous.client import KVStoreClient, KVStoreError, client_from_env
from spark_dl.rendezvous.protocol import sign_request
from spark_dl.rendezvous.secret import AuthenticationError, make_secret, now_ms
from spark_dl.runner.kvstore import KVStoreServer

pytestmark = pytest.mark.timeout(30)

MAX_BODY = 4096


# One server for the module (tests use distinct keys); tests that stop a server make their own.
@pytest.fixture(scope="module")
def secret():
    return make_secret()


@pytest.fixture(scope="module")
def server(secret):
    srv = KVStoreServer(secret, host="127.0.0.1", max_body=MAX_BODY)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server, secret):
    c = KVStoreClient("127.0.0.1", server.port, secret, timeout=5.0)
    yield c
    c.close()


def raw_request(port, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("X-SDL-Error"), resp.read()
    finally:
        conn.close()


def signed(secret, method, path, body=b"", **kw):
    return sign_request(secret, method, path, body, **kw)


def assert_still_serving(client):
    client.set("health", "k", b"ok")
    assert client.get("health", "k", timeout=2) == b"ok"


def test_set_get_round_trip(client):
    client.set("scope", "key", b"value")
    assert client.get("scope", "key") == b"value"
    client.set("scope", "key", b"replaced")
    assert client.get("scope", "key") == b"replaced"
    client.set("scope", "empty", b"")
    assert client.get("scope", "empty") == b""
    blob = bytes(range(256)) * 8
    client.set("scope", "binary", blob)
    assert client.get("scope", "binary") == blob


@pytest.mark.parametrize("scope, key", [
    ("gloo/global", "rank/0:addr"),
    ("a b", "c?d=e&f#g%20h"),
    ("..", "../../etc/passwd"),
    ("ünïcødé", "ключ"),
])
def test_keys_with_any_characters(client, server, scope, key):
    client.set(scope, key, key.encode())
    assert client.get(scope, key) == key.encode()
    assert server.get(scope, key) == key.encode()


def test_scopes_are_separate(client):
    client.set("s1", "k", b"one")
    client.set("s2", "k", b"two")
    assert client.get("s1", "k") == b"one"
    assert client.get("s2", "k") == b"two"


def test_launcher_side_helpers(server, client):
    server.put("launcher", "k", b"direct")
    assert client.get("launcher", "k") == b"direct"
    client.set("worker", "k", b"from worker")
    assert server.get("worker", "k") == b"from worker"
    assert server.get("worker", "missing") is None
    assert client.delete("worker", "k")
    assert not client.delete("worker", "k")
    assert server.get("worker", "k") is None


def test_get_blocks_until_set(client, server):
    timer = threading.Timer(0.3, server.put, args=("get_blocks_until_set", "late", b"here"))
    timer.start()
    start = time.monotonic()
    try:
        assert client.get("get_blocks_until_set", "late", timeout=10) == b"here"
    finally:
        timer.cancel()
    assert 0.2 < time.monotonic() - start < 5


def test_get_waits_across_long_polls(client, server, monkeypatch):
    monkeypatch.setattr(kv_client, "MAX_WAIT_S", 0.1)  # client-side poll length
    threading.Timer(0.5, server.put, args=("get_waits_across_long_polls", "later", b"v")).start()
    assert client.get("get_waits_across_long_polls", "later", timeout=10) == b"v"


def test_get_timeout_names_scope_and_key(client):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"'never'.*'my-scope'"):
        client.get("my-scope", "never", timeout=0.5)
    assert 0.4 < time.monotonic() - start < 5


def test_default_timeout_is_the_clients(server, secret):
    with KVStoreClient("127.0.0.1", server.port, secret, timeout=0.3) as c:
        with pytest.raises(TimeoutError):
            c.get("s", "missing")


def test_one_keep_alive_connection(client):
    client.set("one_keep_alive_connection", "k", b"v")
    [conn] = client._idle
    for i in range(20):
        client.set("one_keep_alive_connection", f"k{i}", b"v")
        client.get("one_keep_alive_connection", f"k{i}")
    assert client._idle == [conn]


def test_set_does_not_wait_behind_another_threads_get(client):
    reader = threading.Thread(target=client.get, args=("no_wait_behind_get", "late"),
                              kwargs={"timeout": 10})
    reader.start()
    time.sleep(0.2)  # the reader is now inside a long-poll
    start = time.monotonic()
    client.set("no_wait_behind_get", "other", b"v")
    assert time.monotonic() - start < 3.0  # not the reader's 5 s long-poll
    client.set("no_wait_behind_get", "late", b"v")
    reader.join(10)
    assert not reader.is_alive()


def test_concurrent_clients(server, secret):
    errors = []

    def worker(rank):
        try:
            with KVStoreClient("127.0.0.1", server.port, secret, timeout=10) as c:
                c.set("barrier", str(rank), b"x")
                for peer in range(8):
                    c.get("barrier", str(peer))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors


def test_wrong_secret_rejected(server, client):
    with KVStoreClient("127.0.0.1", server.port, make_secret(), timeout=2) as bad:
        with pytest.raises(AuthenticationError, match="refused"):
            bad.set("wrong_secret_rejected", "k", b"forged")
        with pytest.raises(AuthenticationError):
            bad.get("wrong_secret_rejected", "k")
    assert server.get("wrong_secret_rejected", "k") is None
    assert_still_serving(client)


@pytest.mark.parametrize("headers", [
    {},
    {"X-SDL-Nonce": "00" * 16, "X-SDL-Time": "1"},
    {"X-SDL-Nonce": "zz", "X-SDL-Time": "1", "X-SDL-MAC": "00" * 32},
    {"X-SDL-Nonce": "00" * 16, "X-SDL-Time": "soon", "X-SDL-MAC": "00" * 32},
])
def test_mac401(server, client, headers):
    status, error, _ = raw_request(server.port, "PUT", "/v1/kv/mac401/k", b"v", headers)
    assert (status, error) == (401, "unauthenticated")
    assert server.get("mac401", "k") is None
    assert_still_serving(client)


def test_tamper(server, client, secret):
    path = "/v1/kv/tamper/k"
    headers = signed(secret, "PUT", path, b"good")
    assert raw_request(server.port, "PUT", path, b"evil", headers)[:2] == (403, "bad-mac")
    headers = signed(secret, "PUT", path, b"good")
    assert raw_request(server.port, "PUT", "/v1/kv/tamper/other", b"good",
                       headers)[:2] == (403, "bad-mac")
    headers = signed(secret, "GET", path)
    assert raw_request(server.port, "DELETE", path, b"", headers)[:2] == (403, "bad-mac")
    assert server.get("tamper", "k") is None and server.get("tamper", "other") is None
    assert_still_serving(client)


def test_replayed_request_is_403(server, client, secret):
    path = "/v1/kv/replayed_request_is_403/k"
    headers = signed(secret, "PUT", path, b"once")
    assert raw_request(server.port, "PUT", path, b"once", headers)[0] == 200
    server.delete("replayed_request_is_403", "k")
    assert raw_request(server.port, "PUT", path, b"once", headers)[:2] == (403, "replay")
    assert server.get("replayed_request_is_403", "k") is None
    assert_still_serving(client)


def test_stale_request_is_403(server, client, secret):
    path = "/v1/kv/stale_request_is_403/k"
    headers = signed(secret, "PUT", path, b"old", timestamp_ms=now_ms() - 3600_000)
    assert raw_request(server.port, "PUT", path, b"old", headers)[:2] == (403, "stale")
    assert server.get("stale_request_is_403", "k") is None
    assert_still_serving(client)


def test_client_corrects_clock_skew_from_signed_answers(client):
    client._clock_offset_ms = -3600_000  # as if this host's clock were an hour behind
    client.set("s", "skewed", b"v")
    assert client.get("s", "skewed") == b"v"
    assert abs(client._clock_offset_ms) < 60_000


def test_oversized_body_is_413(server, client, secret):
    body = b"x" * (MAX_BODY + 1)
    with pytest.raises(KVStoreError, match="too large"):
        client.set("oversized_body_is_413", "big", body)
    assert server.get("oversized_body_is_413", "big") is None
    # The same connection is still usable after a drained over-limit body.
    assert_still_serving(client)
    # A huge announced length is refused before any of it is read.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        path = "/v1/kv/oversized_body_is_413/huge"
        headers = dict(signed(secret, "PUT", path, b""), **{"Content-Length": str(1 << 40)})
        conn.putrequest("PUT", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413
        assert resp.getheader("Connection") == "close"
    finally:
        conn.close()
    assert_still_serving(client)


def test_bad_paths_are_refused_after_auth(server, client, secret):
    for path in ("/v1/kv/onlyscope", "/v1/kv/a/b/c", "/other/s/k", "/v1/kv//k"):
        headers = signed(secret, "GET", path)
        assert raw_request(server.port, "GET", path, b"", headers)[0] == 400
    assert_still_serving(client)


def test_client_rejects_unauthenticated_answers(secret):
    """A server without the secret cannot feed values to a worker."""

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"injected"
            self.send_response(200)
            self.send_header("X-SDL-Time", str(now_ms()))
            self.send_header("X-SDL-MAC", "00" * 32)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Impostor)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with KVStoreClient("127.0.0.1", httpd.server_address[1], secret, timeout=2) as c:
            with pytest.raises(AuthenticationError, match="failed authentication"):
                c.get("s", "k")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_unreachable_server_fails_in_bounded_time(secret):
    srv = KVStoreServer(secret, host="127.0.0.1")
    port = srv.start()
    srv.stop()
    start = time.monotonic()
    with KVStoreClient("127.0.0.1", port, secret, timeout=0.5) as c:
        with pytest.raises(KVStoreError, match="cannot reach"):
            c.set("s", "k", b"v")
    assert time.monotonic() - start < 5


def test_stop_wakes_long_polls_and_is_idempotent(secret):
    srv = KVStoreServer(secret, host="127.0.0.1")
    srv.start()
    client = KVStoreClient("127.0.0.1", srv.port, secret, timeout=1.0)
    errors = []

    def reader():
        try:
            client.get("s", "never")
        except (TimeoutError, KVStoreError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.2)
    srv.stop()
    srv.stop()
    thread.join(5)
    assert not thread.is_alive() and errors
    client.close()


def test_value_must_be_bytes(client):
    with pytest.raises(TypeError):
        client.set("s", "k", "text")


def test_client_from_env(server, secret):
    assert client_from_env({}) is None
    env = {"SDL_RENDEZVOUS_ADDR": "127.0.0.1", "SDL_RENDEZVOUS_PORT": str(server.port),
           "SDL_SECRET_KEY": secret.hex(), "SDL_START_TIMEOUT": "7"}
    with client_from_env(env) as c:
        assert c.timeout == 7.0
        c.set("env", "k", b"v")
        assert c.get("env", "k") == b"v"
    with pytest.raises(ValueError, match="SDL_SECRET_KEY"):
        client_from_env({k: v for k, v in env.items() if k != "SDL_SECRET_KEY"})
    with pytest.raises(ValueError, match="hex"):
        client_from_env(dict(env, SDL_SECRET_KEY="not-hex"))
    with pytest.raises(ValueError, match="port"):
        client_from_env(dict(env, SDL_RENDEZVOUS_PORT="http"))
