"""The rendezvous store's wire protocol, shared by the server and the client.

Protocol (``/v1/kv/<scope>/<key>``, both segments percent-encoded, so keys may hold any
character including ``/``):

- ``PUT``     stores the request body as the value;
- ``GET``     returns the value, or 404; ``?wait_ms=N`` long-polls up to N ms (capped);
- ``DELETE``  removes the key (404 if absent).

Every request carries ``X-SDL-Nonce`` (hex), ``X-SDL-Time`` (ms) and ``X-SDL-MAC``: the
HMAC-SHA256 (see :mod:`spark_dl.rendezvous.secret`) over method, raw path, nonce,
timestamp and body (:func:`sign_request`). Responses to authenticated requests carry the
server time and a tag bound to the request nonce (:func:`response_tag`), so a client
also knows that the answer came from a holder of the secret and is not a replayed answer.
The server is :class:`spark_dl.runner.kvstore.KVStoreServer`, the client
:class:`spark_dl.rendezvous.client.KVStoreClient`.
"""

from __future__ import annotations

import urllib.parse
from typing import Dict, Optional

from spark_dl.rendezvous.secret import compute_mac, new_nonce, now_ms

__all__ = ["MAX_WAIT_S", "PREFIX", "REQUEST_CONTEXT", "RESPONSE_CONTEXT", "H_NONCE",
           "H_TIME", "H_MAC", "H_ERROR", "ts_bytes", "sign_request", "response_tag",
           "kv_path"]

# Longest a single long-poll GET holds its server thread; clients poll again after it.
MAX_WAIT_S = 5.0
PREFIX = "/v1/kv/"
REQUEST_CONTEXT = b"sdl-kv-request-v1"
RESPONSE_CONTEXT = b"sdl-kv-response-v1"
H_NONCE, H_TIME, H_MAC, H_ERROR = "X-SDL-Nonce", "X-SDL-Time", "X-SDL-MAC", "X-SDL-Error"


def ts_bytes(ts: int) -> bytes:
    return str(ts).encode()


def sign_request(secret: bytes, method: str, path: str, body: bytes = b"",
                 nonce: Optional[bytes] = None,
                 timestamp_ms: Optional[int] = None) -> Dict[str, str]:
    """Returns the authentication headers for one request.

    Args:
        secret: the job secret.
        method: HTTP method, upper case.
        path: the request target exactly as sent (already percent-encoded, with query).
        body: the request body.
        nonce, timestamp_ms: fresh values by default (tests pass their own).
    """
    nonce = new_nonce() if nonce is None else nonce
    ts = now_ms() if timestamp_ms is None else timestamp_ms
    tag = compute_mac(secret, REQUEST_CONTEXT, method.encode(), path.encode("latin-1"),
                      nonce, ts_bytes(ts), body)
    return {H_NONCE: nonce.hex(), H_TIME: str(ts), H_MAC: tag.hex()}


def response_tag(secret: bytes, nonce: bytes, status: int, ts: int, body: bytes) -> bytes:
    """The tag of a response to the request with ``nonce``."""
    return compute_mac(secret, RESPONSE_CONTEXT, nonce, str(status).encode(),
                       ts_bytes(ts), body)


def kv_path(scope: str, key: str) -> str:
    """The request target of ``scope``/``key``, both percent-encoded."""
    return (PREFIX + urllib.parse.quote(scope, safe="") + "/"
            + urllib.parse.quote(key, safe=""))
