"""Elastic training, the framework-neutral half: membership, states and the retry loop.

An elastic job (``sdlrun --min-np/--max-np``, docs/elastic.md) has a launcher that is the
membership authority: it decides which workers form each *generation* of the job and
publishes that on its authenticated rendezvous server. A worker never learns its rank
from its environment; :func:`spark_dl.common.basics.init` asks the authority (through
:class:`Membership`) for the next generation that includes it and starts the core with
that topology, in the generation's own namespace of the store.

The training function runs inside :func:`run_fn`'s loop:

1. every member of a generation calls ``state.sync()`` first (the root is rank 0 of the
   generation, which the authority always picks among the workers that already trained
   when there are any): a newcomer gets the state, a survivor re-aligns. Every member
   syncs after every reset, so no rank can skip a broadcast that another one waits on
   (Horovod's #3494 deadlock);
2. a peer's death makes a collective raise :class:`~spark_dl.common.exceptions.PeerFailureError`
   (or ``ShutdownError``) on the survivors, wherever they are, object broadcasts and
   ``sync()`` included: each rolls back to its last ``commit()``, shuts its core down and
   joins the next generation;
3. new workers wait in ``init()``; the authority raises a flag that ``state.commit()``
   reads on rank 0 and broadcasts, so every rank raises :class:`HostsUpdatedInterrupt` at
   the same commit, keeps its state (it was just committed) and re-forms with them.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional

from spark_dl.common.exceptions import PeerFailureError, ShutdownError

__all__ = ["State", "ObjectState", "HostsUpdatedInterrupt", "run_fn", "Membership",
           "is_elastic", "hosts_updated", "SCOPE"]

SCOPE = "elastic"  # the rendezvous server's scope of the membership records
WORKER_VAR = "SDL_ELASTIC_WORKER_ID"
# Failures a survivor recovers from; anything else is the program's own error and ends it.
RECOVERABLE = (PeerFailureError, ShutdownError)
_NAMED = re.compile(r"^(%s): (.*)$" % "|".join(c.__name__ for c in RECOVERABLE), re.MULTILINE)


def named_recoverable(error: BaseException):
    """The :data:`RECOVERABLE` error that ``error`` is, or that its message names: a
    framework reports a collective's failure inside compiled code under its own type
    (TensorFlow: ``tf.errors.UnknownError`` whose message holds ``PeerFailureError: ...``).
    None for any other error."""
    if isinstance(error, RECOVERABLE):
        return error
    found = _NAMED.search(str(getattr(error, "message", None) or error))
    if found is None:
        return None
    cls = next(c for c in RECOVERABLE if c.__name__ == found.group(1))
    return cls(found.group(2))


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``state.commit()`` on every rank when the job's membership is about to
    change (workers joined or are leaving). The state was committed just before, so the
    retry loop keeps it (no rollback) and every rank re-forms the job.

    Attributes:
        skip_sync: kept for Horovod's signature; spark_dl always syncs after a reset (so
            that no rank skips a broadcast another one waits on).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts changed: re-forming the workers")
        self.skip_sync = skip_sync


def is_elastic(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a worker started by an elastic launcher."""
    return bool(environ.get(WORKER_VAR))


def generation_key(generation: int) -> str:
    return f"gen/{generation}"


def update_key(generation: int) -> str:
    return f"update/{generation}"


def want_key(worker: str) -> str:
    return f"want/{worker}"


class Membership:
    """A worker's link to the membership authority (one per process).

    Args:
        client: the authenticated rendezvous client (:class:`KVStoreClient`).
        worker: this worker's id, as the launcher named it (``SDL_ELASTIC_WORKER_ID``).
        timeout: seconds :meth:`join` waits for a generation that includes this worker.
    """

    def __init__(self, client, worker: str, timeout: float):
        self._client = client
        self.worker = worker
        self.timeout = timeout
        self.generation = -1  # the last generation this worker belonged to

    def join(self) -> Dict[str, int]:
        """Waits for the next generation that includes this worker and returns its
        topology (rank, size, local_rank, local_size, cross_rank, cross_size and
        ``generation``).

        Raises:
            PeerFailureError: no generation took this worker within the timeout (the
                launcher ended the job, or could not gather enough workers).
        """
        self._client.set(SCOPE, want_key(self.worker), str(self.generation).encode())
        deadline = time.monotonic() + self.timeout
        candidate = self.generation + 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerFailureError(
                    f"elastic worker {self.worker}: no generation of the job took it within "
                    f"{self.timeout:g} s (SDL_ELASTIC_TIMEOUT); the launcher could not gather "
                    "enough workers, or ended the job")
            try:
                record = json.loads(self._client.get(SCOPE, generation_key(candidate),
                                                     timeout=min(left, 5.0)))
            except TimeoutError:
                continue
            if record.get("finished"):
                # The job ended well before a generation took this worker: nothing to do.
                print(f"spark_dl: elastic worker {self.worker}: {record['end']}; it was not "
                      "needed", file=sys.stderr, flush=True)
                raise SystemExit(0)
            if record.get("end"):
                raise PeerFailureError(f"elastic worker {self.worker}: the launcher ended the "
                                       f"job: {record['end']}")
            topo = record["workers"].get(self.worker)
            if topo is None:  # left out of this one (e.g. above max-np): wait for the next
                candidate += 1
                continue
            self.generation = candidate
            return dict(topo, generation=candidate)

    def update_pending(self) -> bool:
        """True when the authority asked the current generation to re-form (rank 0 asks;
        one request to the rendezvous server, which answers at once)."""
        try:
            self._client.get(SCOPE, update_key(self.generation), timeout=0)
            return True
        except TimeoutError:
            return False


_membership: Optional[Membership] = None


def membership(environ: Mapping[str, str] = os.environ) -> Membership:
    """This process's :class:`Membership`, built on first use from the launcher's
    variables (the rendezvous client keeps the secret after ``init()`` removed it)."""
    global _membership
    if _membership is None:
        from spark_dl.config import knobs
        from spark_dl.rendezvous.client import client_from_env

        client = client_from_env(environ)
        if client is None:
            raise PeerFailureError(f"{WORKER_VAR} is set but no rendezvous server is "
                                   "(SDL_RENDEZVOUS_ADDR/PORT, SDL_SECRET_KEY)")
        timeout = knobs.value("elastic_timeout_s", environ) + knobs.value("start_timeout_s",
                                                                           environ)
        _membership = Membership(client, environ[WORKER_VAR], timeout)
    return _membership


def hosts_updated(broadcast_object: Callable, rank: int) -> bool:
    """True on every rank when workers wait to join the job or leave it: rank 0 asks the
    launcher and broadcasts the answer, so that all ranks agree. A collective."""
    pending = False
    if is_elastic() and rank == 0:
        pending = membership().update_pending()
    return bool(broadcast_object(pending, 0, name="elastic.hosts_updated"))


class State:
    """What an elastic job rolls back to and re-aligns after a membership change.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`. ``commit()``
    saves and then checks, agreed by every rank, whether workers are waiting to join.

    Args:
        broadcast_object: the front end's ``broadcast_object(obj, root_rank, name=)``.
        rank: the front end's ``rank()``.
    """

    def __init__(self, broadcast_object: Callable, rank: Callable[[], int]):
        self._bcast_object = broadcast_object
        self._rank = rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called with no argument after every reset, once the new membership
        is known, before the state is synced (e.g. to scale the learning rate to
        ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state (what a failure rolls back to), then raises
        :class:`HostsUpdatedInterrupt` on every rank if the membership is about to
        change. A collective: every rank commits at the same point of its loop."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank when workers wait to join
        or leave (see :func:`hosts_updated`)."""
        if hosts_updated(self._bcast_object, self._rank()):
            raise HostsUpdatedInterrupt()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Hook called after the job re-formed, before :meth:`sync`."""


class ObjectState(State):
    """A state of plain attributes (anything picklable), e.g.
    ``ObjectState(bcast_object, rank, epoch=0, batch=0)``: ``state.epoch`` reads it,
    assignment changes it; ``commit()`` copies them, ``restore()`` puts the copies back,
    ``sync()`` gives every rank rank 0's values."""

    def __init__(self, broadcast_object: Callable, rank: Callable[[], int], **kwargs):
        super().__init__(broadcast_object, rank)
        self._saved_state = kwargs
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0,
                                                   name="elastic.object_state")
            self._set_attrs()


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """Wraps a training function ``func(state, *args, **kwargs)`` in the elastic loop.

    Args:
        func: runs the training from the state's values (an epoch/batch counter in the
            state lets it resume where the last commit was).
        reset: the front end's reset: shuts its core down and joins the next generation
            (``init()`` again).
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except RECOVERABLE:
                state.restore()  # back to the last commit
            except HostsUpdatedInterrupt:
                pass  # committed just before: nothing to roll back
            reset()
            state.reset()
            state.on_reset()

    return wrapper
