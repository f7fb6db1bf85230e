"""Per-job secret and message authentication.

Every message between the pieces of one job (launcher, rendezvous server, workers, and
later the Spark driver and task services) carries an HMAC-SHA256 tag computed with a
secret that only the job knows. The receiver checks, in this order:

1. the announced length against its limit (before reading the body),
2. the tag, in constant time,
3. freshness: the timestamp lies inside a window around the receiver's clock and the
   nonce was not seen before inside that window (replay protection),

and only then parses the body. Nothing is deserialized from an unauthenticated message.

Two shapes are offered: :func:`compute_mac` / :func:`verify_mac` for protocols that carry
the tag out of band (the HTTP rendezvous puts it in a header), and :func:`seal` /
:func:`unseal_from` for a self-contained message with one tag over everything (read whole
before its tag is checked: fit for small messages; the Spark services use
:mod:`spark_dl.rendezvous.frames`, whose header is authenticated before the body is read).

Tags cover a *context* string first (domain separation: a tag made for a rendezvous
response can never pass as a rendezvous request or as a service message), then every part
prefixed by its length, so that moving bytes from one part into the next changes the tag.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from typing import Callable, Optional

SECRET_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size
DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_NONCES = 1_000_000

_LEN = struct.Struct(">Q")


class AuthenticationError(Exception):
    """A message failed authentication (missing, malformed or wrong tag)."""


class ReplayError(AuthenticationError):
    """An authentic message was seen before, or is outside the accepted time window.

    Attributes:
        stale: True when the timestamp is outside the window (possibly clock skew),
            False when the nonce was already used.
    """

    def __init__(self, message: str, stale: bool = False):
        super().__init__(message)
        self.stale = stale


def make_secret() -> bytes:
    """Returns a new random per-job secret of :data:`SECRET_BYTES` bytes."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_to_hex(secret: bytes) -> str:
    """Encodes a secret for an environment variable."""
    return secret.hex()


def secret_from_hex(text: str) -> bytes:
    """Decodes a secret written by :func:`secret_to_hex`.

    Raises:
        ValueError: the text is not hex or decodes to fewer than 16 bytes.
    """
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("the secret key is not a hex string") from None
    if len(secret) < 16:
        raise ValueError(f"the secret key is too short ({len(secret)} bytes, need at least 16)")
    return secret


def new_nonce() -> bytes:
    """Returns :data:`NONCE_BYTES` random bytes, unique per message."""
    return os.urandom(NONCE_BYTES)


def now_ms() -> int:
    """Wall-clock time in integer milliseconds, the unit of message timestamps."""
    return int(time.time() * 1000)


def compute_mac(secret: bytes, context: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``context`` and ``parts``, each prefixed by its 8-byte length."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (context,) + parts:
        mac.update(_LEN.pack(len(part)))
        mac.update(part)
    return mac.digest()


def verify_mac(secret: bytes, tag: bytes, context: bytes, *parts: bytes) -> bool:
    """True when ``tag`` is the MAC of ``context`` and ``parts``; constant-time compare."""
    return hmac.compare_digest(compute_mac(secret, context, *parts), tag)


class ReplayGuard:
    """Rejects messages whose (nonce, timestamp) was already accepted or is too old.

    A message is fresh when ``|receiver clock - timestamp| <= window_s`` and its nonce is
    not in the cache. An accepted nonce is remembered until no message with its timestamp
    could still pass the window check (at most ``2 * window_s`` after it arrived), so the
    cache is bounded by the message rate times the window. If the cache still reaches
    ``max_nonces``, new messages are refused (fail closed) until entries expire.

    Only record nonces of messages whose tag was verified; otherwise anyone could fill the
    cache. Thread-safe.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 max_nonces: int = DEFAULT_MAX_NONCES,
                 clock: Callable[[], float] = time.time):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = float(window_s)
        self.max_nonces = int(max_nonces)
        self._clock = clock
        self._seen: "collections.OrderedDict[bytes, float]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, nonce: bytes, timestamp_ms: int) -> None:
        """Accepts the message once, or raises :class:`ReplayError`."""
        now = self._clock()
        skew = timestamp_ms / 1000.0 - now
        if abs(skew) > self.window_s:
            raise ReplayError(
                f"message timestamp is {skew:+.1f} s from this host's clock, outside the "
                f"accepted window of {self.window_s:.0f} s (clocks not synchronized?)",
                stale=True)
        with self._lock:
            self._expire(now)
            if nonce in self._seen:
                raise ReplayError("message nonce was already used (replayed message)")
            if len(self._seen) >= self.max_nonces:
                raise ReplayError("too many messages inside the replay window; retry later")
            # Entries are appended in arrival order with a fixed lifetime, so expiry
            # order equals insertion order and expiring pops from the front only.
            self._seen[nonce] = now + 2 * self.window_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen:
            nonce, expiry = next(iter(seen.items()))
            if expiry > now:
                break
            seen.popitem(last=False)


# A sealed message: magic, nonce, timestamp (ms), payload length, tag, then the payload.
_SEAL_MAGIC = b"SDL1"
_SEAL_HEADER = struct.Struct(f">4s{NONCE_BYTES}sqQ{MAC_BYTES}s")
SEAL_HEADER_BYTES = _SEAL_HEADER.size


def seal(secret: bytes, payload: bytes, context: bytes,
         nonce: Optional[bytes] = None, timestamp_ms: Optional[int] = None) -> bytes:
    """Frames ``payload`` with a nonce, a timestamp, its length and a tag.

    Args:
        secret: the job secret.
        payload: opaque bytes (the caller serializes).
        context: names the protocol and direction, e.g. ``b"driver-service/request"``.
        nonce, timestamp_ms: for tests only; fresh values by default.
    """
    nonce = new_nonce() if nonce is None else nonce
    ts = now_ms() if timestamp_ms is None else timestamp_ms
    tag = compute_mac(secret, context, nonce, _LEN.pack(ts), payload)
    return _SEAL_HEADER.pack(_SEAL_MAGIC, nonce, ts, len(payload), tag) + payload


def unseal_from(read_exact: Callable[[int], bytes], secret: bytes, context: bytes,
                guard: Optional[ReplayGuard], max_payload: int) -> bytes:
    """Reads one sealed message and returns its payload once it is authentic and fresh.

    Args:
        read_exact: returns exactly n bytes from the stream or raises (e.g. EOFError).
        secret, context: as given to :func:`seal`.
        guard: replay protection; None skips it (only for a channel that is already
            protected against replay, such as responses bound to a request nonce).
        max_payload: a longer announced payload is refused before it is read.

    Raises:
        AuthenticationError: bad magic, oversized payload or wrong tag.
        ReplayError: replayed or stale message.
    """
    header = read_exact(SEAL_HEADER_BYTES)
    magic, nonce, ts, length, tag = _SEAL_HEADER.unpack(header)
    if magic != _SEAL_MAGIC:
        raise AuthenticationError("not a sealed spark_dl message")
    if length > max_payload:
        raise AuthenticationError(
            f"message payload of {length} bytes exceeds the limit of {max_payload}")
    payload = read_exact(length)
    if not verify_mac(secret, tag, context, nonce, _LEN.pack(ts), payload):
        raise AuthenticationError("message failed authentication (wrong secret key?)")
    if guard is not None:
        guard.check(nonce, ts)
    return payload


def unseal(secret: bytes, message: bytes, context: bytes,
           guard: Optional[ReplayGuard], max_payload: int) -> bytes:
    """:func:`unseal_from` for a message already held in memory."""
    view = memoryview(message)
    pos = 0

    def read_exact(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(view):
            raise AuthenticationError("truncated sealed message")
        chunk = bytes(view[pos:pos + n])
        pos += n
        return chunk

    payload = unseal_from(read_exact, secret, context, guard, max_payload)
    if pos != len(view):
        raise AuthenticationError("trailing bytes after sealed message")
    return payload
