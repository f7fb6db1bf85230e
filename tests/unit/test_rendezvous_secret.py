"""Per-job secret, MACs, replay protection and sealed messages (spark_dl.rendezvous.secret)."""

import io

import pytest

from spark_dl.rendezvous.secret import (SEAL_HEADER_BYTES, AuthenticationError, ReplayError,
                                        ReplayGuard, compute_mac, make_secret, new_nonce, seal,
                                        secret_from_hex, secret_to_hex, unseal, unseal_from,
                                        verify_mac)

pytestmark = pytest.mark.timeout(30)

CTX = b"test/request"


def test_secret_generation_and_hex_round_trip():
    a, b = make_secret(), make_secret()
    assert len(a) == 32 and a != b
    assert secret_from_hex(secret_to_hex(a)) == a
    with pytest.raises(ValueError, match="hex"):
        secret_from_hex("xyz")
    with pytest.raises(ValueError, match="short"):
        secret_from_hex("abcd")


def test_mac_covers_context_every_part_and_boundaries():
    key = make_secret()
    tag = compute_mac(key, CTX, b"ab", b"c")
    assert verify_mac(key, tag, CTX, b"ab", b"c")
    assert not verify_mac(key, tag, CTX, b"a", b"bc")  # moved boundary
    assert not verify_mac(key, tag, b"test/response", b"ab", b"c")  # other context
    assert not verify_mac(make_secret(), tag, CTX, b"ab", b"c")  # other key
    assert not verify_mac(key, tag[:-1] + bytes([tag[-1] ^ 1]), CTX, b"ab", b"c")


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_replay_guard_rejects_reuse_and_stale_messages():
    clock = FakeClock()
    guard = ReplayGuard(window_s=10, clock=clock)
    nonce = new_nonce()
    guard.check(nonce, int(clock.now * 1000))
    with pytest.raises(ReplayError, match="already used") as info:
        guard.check(nonce, int(clock.now * 1000))
    assert not info.value.stale
    with pytest.raises(ReplayError, match="window") as info:
        guard.check(new_nonce(), int((clock.now - 11) * 1000))
    assert info.value.stale
    with pytest.raises(ReplayError, match="window"):
        guard.check(new_nonce(), int((clock.now + 11) * 1000))


def test_replay_guard_forgets_only_what_can_no_longer_pass():
    clock = FakeClock()
    guard = ReplayGuard(window_s=10, clock=clock)
    nonce = new_nonce()
    future_ts = int((clock.now + 10) * 1000)  # the latest timestamp still accepted
    guard.check(nonce, future_ts)
    clock.now += 19  # the timestamp is still inside the window: must still be refused
    with pytest.raises(ReplayError, match="already used"):
        guard.check(nonce, future_ts)
    clock.now += 2  # now the timestamp itself is too old, and the entry may go
    guard.check(new_nonce(), int(clock.now * 1000))
    assert len(guard) == 1
    with pytest.raises(ReplayError, match="window"):
        guard.check(nonce, future_ts)


def test_replay_guard_fails_closed_when_full():
    clock = FakeClock()
    guard = ReplayGuard(window_s=10, max_nonces=3, clock=clock)
    for _ in range(3):
        guard.check(new_nonce(), int(clock.now * 1000))
    with pytest.raises(ReplayError, match="too many"):
        guard.check(new_nonce(), int(clock.now * 1000))
    clock.now += 21
    guard.check(new_nonce(), int(clock.now * 1000))


def test_seal_round_trip_over_a_stream():
    key = make_secret()
    guard = ReplayGuard()
    stream = io.BytesIO(seal(key, b"first", CTX) + seal(key, b"", CTX))

    def read_exact(n):
        data = stream.read(n)
        if len(data) != n:
            raise EOFError
        return data

    assert unseal_from(read_exact, key, CTX, guard, max_payload=100) == b"first"
    assert unseal_from(read_exact, key, CTX, guard, max_payload=100) == b""


def test_unseal_refusals():
    key = make_secret()
    msg = seal(key, b"payload", CTX)
    with pytest.raises(AuthenticationError, match="authentication"):
        unseal(make_secret(), msg, CTX, ReplayGuard(), 100)
    with pytest.raises(AuthenticationError, match="authentication"):
        unseal(key, msg, b"other/context", ReplayGuard(), 100)
    tampered = msg[:-1] + b"X"
    with pytest.raises(AuthenticationError, match="authentication"):
        unseal(key, tampered, CTX, ReplayGuard(), 100)
    with pytest.raises(AuthenticationError, match="magic|sealed"):
        unseal(key, b"XXXX" + msg[4:], CTX, ReplayGuard(), 100)
    with pytest.raises(AuthenticationError, match="trailing"):
        unseal(key, msg + b"!", CTX, ReplayGuard(), 100)
    guard = ReplayGuard()
    assert unseal(key, msg, CTX, guard, 100) == b"payload"
    with pytest.raises(ReplayError):
        unseal(key, msg, CTX, guard, 100)


def test_oversized_payload_refused_before_it_is_read():
    key = make_secret()
    msg = seal(key, b"x" * 1000, CTX)
    reads = []

    def read_exact(n):
        reads.append(n)
        return msg[:n] if len(reads) == 1 else pytest.fail("payload was read")

    with pytest.raises(AuthenticationError, match="exceeds"):
        unseal_from(read_exact, key, CTX, ReplayGuard(), max_payload=999)
    assert reads == [SEAL_HEADER_BYTES]
