"""Batches of planned sizes from a stream of decoded pieces (dicts of NumPy arrays, one
array per column, rows along axis 0): cut in order, or drawn through a shuffle buffer. No
threads and no I/O: the Arrow loader (:mod:`spark_dl.spark.common.data_loader`) feeds these
with the pieces its readers decode, in plan order."""

from typing import Dict, Iterator, List, Optional

import numpy as np


def _rows(piece: Dict[str, np.ndarray]) -> int:
    return len(next(iter(piece.values())))


def _take_rows(pending: List[Dict[str, np.ndarray]], k: int):
    """First ``k`` rows of the pieces in ``pending`` as one fresh batch; returns the batch and
    what is left of ``pending``."""
    parts, got, i = [], 0, 0
    while got < k:
        n = _rows(pending[i])
        parts.append((i, min(n, k - got)))
        got += parts[-1][1]
        i += 1
    names = pending[0].keys()
    batch = {name: np.concatenate([pending[j][name][:m] for j, m in parts]) for name in names}
    last_i, last_m = parts[-1]
    rest = pending[last_i + 1:]
    if last_m < _rows(pending[last_i]):
        rest.insert(0, {name: a[last_m:] for name, a in pending[last_i].items()})
    return batch, rest


def _check_done(si: int, sizes: List[int], leftover: int) -> None:
    if si != len(sizes) or leftover:
        raise RuntimeError(f"internal error: planned {len(sizes)} batches / {sum(sizes)} rows, "
                           f"produced {si} batches with {leftover} rows left over")


def cut(pieces: Iterator[Dict[str, np.ndarray]], sizes: List[int], group: int = 1,
         views: bool = False):
    """Batches of the planned sizes, in order (no shuffle pool).

    With ``views``, a batch that lies inside one piece is a view of it (no copy; the piece
    stays alive while the batch does) and only batches across piece boundaries are copied.
    Otherwise ``group`` batches at a time are copied out of the pieces as one block and
    handed out as consecutive views of it (one copy per column for the group instead of one
    per batch), so no batch shares memory with a piece (the in-memory cache keeps pieces)."""
    pending: List[Dict[str, np.ndarray]] = []
    have = si = 0

    def emit(k):
        nonlocal pending, have, si
        want = sizes[si:si + k]
        block, pending = _take_rows(pending, sum(want))
        have -= sum(want)
        si += len(want)
        at = 0
        for rows in want:
            yield {name: a[at:at + rows] for name, a in block.items()}
            at += rows

    def emit_view():
        nonlocal have, si
        rows, head = sizes[si], pending[0]
        if _rows(head) == rows:
            pending.pop(0)
        else:
            pending[0] = {name: a[rows:] for name, a in head.items()}
        have -= rows
        si += 1
        return {name: a[:rows] for name, a in head.items()}

    for piece in pieces:
        pending.append(piece)
        have += _rows(piece)
        if views:
            while si < len(sizes) and have >= sizes[si]:
                if _rows(pending[0]) >= sizes[si]:
                    yield emit_view()
                else:
                    yield from emit(1)
            continue
        while si < len(sizes) and have >= sum(sizes[si:si + group]):
            yield from emit(group)
    while si < len(sizes) and have >= sizes[si]:  # the last group may be short
        yield from emit(1)
    _check_done(si, sizes, have)


class _RowStream:
    """Rows of a piece iterator, taken ``k`` at a time regardless of piece boundaries."""

    def __init__(self, pieces: Iterator[Dict[str, np.ndarray]]):
        self._pieces = pieces
        self._head: Optional[Dict[str, np.ndarray]] = None

    def take(self, k: int) -> List[Dict[str, np.ndarray]]:
        """Up to ``k`` next rows as a list of views; fewer only when the stream ends."""
        parts, got = [], 0
        while got < k:
            if self._head is None:
                self._head = next(self._pieces, None)
                if self._head is None:
                    break
            n = _rows(self._head)
            m = min(n, k - got)
            if m == n:
                parts.append(self._head)
                self._head = None
            else:
                parts.append({name: a[:m] for name, a in self._head.items()})
                self._head = {name: a[m:] for name, a in self._head.items()}
            got += m
        return parts


def _scatter_rows(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """``dst[slots] = rows``, each row moved whole: NumPy's row-by-element fancy assignment
    of multi-dimensional rows is about 1.7x slower (as is ``a[idx]`` against ``np.take``)."""
    if rows.ndim >= 2 and len(rows) and rows.strides[0] > 0 and rows.flags.c_contiguous \
            and dst.flags.c_contiguous:
        whole = np.dtype((np.void, rows.strides[0]))
        dst.reshape(len(dst), -1).view(whole)[slots, 0] = \
            rows.reshape(len(rows), -1).view(whole)[:, 0]
    else:
        dst[slots] = rows


#: Most batches one draw of the shuffle buffer yields (see :func:`pool_shuffle`).
_DRAW_BATCHES = 16


def pool_shuffle(pieces: Iterator[Dict[str, np.ndarray]], sizes: List[int], pool_rows: int,
                  rng: np.random.Generator):
    """Batches of the planned sizes drawn at random from a buffer of ``pool_rows`` rows.

    Batches are drawn in draws of up to :data:`_DRAW_BATCHES` batches and at most a quarter
    of the buffer: each draw is a random subset of the full buffer, cut into consecutive
    batches, and the rows that follow in the stream take the freed slots. (One draw per
    batch cost 3x more per row for small batches: the draw's fixed cost and one gather per
    column each time.) Every row is copied twice (into the buffer, out into a batch), and
    the random draws depend only on row counts, never on where pieces end, so the batches do
    not depend on the piece size or the number of threads. When the stream ends the rest of
    the buffer is permuted and cut.
    """
    stream = _RowStream(pieces)
    buf: Optional[Dict[str, np.ndarray]] = None
    n = si = 0

    def put(parts, slots):
        nonlocal buf
        at = 0
        for part in parts:
            k = _rows(part)
            if buf is None:
                buf = {name: np.empty((pool_rows,) + a.shape[1:], a.dtype)
                       for name, a in part.items()}
            for name, a in part.items():
                _scatter_rows(buf[name], slots[at:at + k], a)
            at += k
        return at

    n = put(stream.take(pool_rows), np.arange(pool_rows))
    valid = np.arange(n)  # slots holding rows not yet emitted
    while n == pool_rows and si < len(sizes):
        group, size = [], 0  # the batches of this draw
        for want in sizes[si:si + _DRAW_BATCHES]:
            if group and size + want > pool_rows // 4:
                break
            group.append(want)
            size += want
        idx = rng.choice(n, size, replace=False)
        drawn = {name: np.take(a, idx, axis=0) for name, a in buf.items()}
        at = 0
        for want in group:
            yield {name: a[at:at + want] for name, a in drawn.items()}
            at += want
        si += len(group)
        filled = put(stream.take(size), idx)
        if filled < size:  # the stream ended: the rest of this draw's slots stay empty
            keep = np.ones(n, dtype=bool)
            keep[idx[filled:]] = False
            valid = np.flatnonzero(keep)
            break
    if len(valid) and si < len(sizes):
        order = valid[rng.permutation(len(valid))]
        pos = 0
        while si < len(sizes) and pos < len(order):
            idx = order[pos:pos + sizes[si]]
            pos += sizes[si]
            si += 1
            yield {name: a[idx] for name, a in buf.items()}
        valid = valid[:len(valid) - pos]
    _check_done(si, sizes, len(valid))
