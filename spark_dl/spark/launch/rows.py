"""What the barrier job returns to the caller: its outcome as rows of one small table.

Task 0 (the coordinator) ends the job by yielding these rows; the caller collects them
(``DataFrame.collect()``, through Spark Connect or py4j) and rebuilds the outcome. A row
is ``(kind, rank, seq, data)``:

=============  =========================================================================
``result``     a piece of rank ``rank``'s pickled return value; pieces in ``seq`` order
``error``      the job's failure: one JSON document (error class, message, rank,
               traceback, per-rank lines), plus pieces of the root cause's pickled
               exception as kind ``cause``
``stdout``     workers' output kept for the caller when it could not be sent while the
``stderr``     job ran (no connection to the caller and no Store to write it to)
``phases``     JSON: wall-clock times of the coordinator's phases
``task``       JSON from a task other than 0: its own failure it could not report
=============  =========================================================================

Values are cut into pieces of :data:`PIECE_BYTES` so that no row nears the limits of
Arrow's binary column or of Spark Connect's result batches (4 MiB by default).

Only the job's own tasks write these rows, and Spark carries them (authenticated and
encrypted as Spark's own traffic is configured); the caller unpickles results and causes
as it did when they arrived over the job's authenticated driver service.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

__all__ = ["SCHEMA", "PIECE_BYTES", "Outcome", "batch", "pieces", "decode"]

#: The DDL schema of the job's rows.
SCHEMA = "kind string, rank int, seq int, data binary"
PIECE_BYTES = 1 << 20

Row = Tuple[str, int, int, bytes]


def pieces(kind: str, rank: int, data: bytes) -> Iterator[Row]:
    """``data`` as rows of at most :data:`PIECE_BYTES` (one empty row for empty data)."""
    view = memoryview(data)
    if not len(view):
        yield (kind, rank, 0, b"")
        return
    for seq, start in enumerate(range(0, len(view), PIECE_BYTES)):
        yield (kind, rank, seq, bytes(view[start:start + PIECE_BYTES]))


def batch(rows: Iterable[Row]):
    """The rows as one ``pyarrow.RecordBatch`` of :data:`SCHEMA`."""
    import pyarrow as pa

    rows = list(rows)
    return pa.RecordBatch.from_arrays(
        [pa.array([r[0] for r in rows], pa.string()),
         pa.array([r[1] for r in rows], pa.int32()),
         pa.array([r[2] for r in rows], pa.int32()),
         pa.array([r[3] for r in rows], pa.binary())],
        names=["kind", "rank", "seq", "data"])


class Outcome:
    """The collected rows, put back together."""

    def __init__(self):
        self.results: Dict[int, bytes] = {}
        self.error: Optional[dict] = None
        self.cause: Optional[bytes] = None
        self.output: List[Tuple[str, bytes]] = []
        self.phases: Dict[str, float] = {}
        self.task_reports: List[dict] = []


def decode(rows: Iterable) -> Outcome:
    """Rebuilds the outcome from collected rows (``Row`` objects or tuples)."""
    parts: Dict[Tuple[str, int], List[Tuple[int, bytes]]] = defaultdict(list)
    for row in rows:
        kind, rank, seq, data = tuple(row)
        parts[(kind, rank if rank is not None else -1)].append((seq, bytes(data or b"")))
    out = Outcome()
    for (kind, rank), chunks in sorted(parts.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        data = b"".join(d for _, d in sorted(chunks, key=lambda c: c[0]))
        if kind == "result":
            out.results[rank] = data
        elif kind == "error":
            out.error = json.loads(data)
        elif kind == "cause":
            out.cause = data
        elif kind == "phases":
            out.phases = json.loads(data)
        elif kind == "task":
            out.task_reports.append(json.loads(data))
    # Output rows keep their order across the two streams (seq counts both).
    streams = [(seq, kind, data) for (kind, _), chunks in parts.items()
               if kind in ("stdout", "stderr") for seq, data in chunks]
    out.output = [(kind, data) for _, kind, data in sorted(streams, key=lambda s: s[0])]
    return out
