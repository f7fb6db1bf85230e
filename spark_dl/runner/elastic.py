"""Elastic jobs on sdlrun: workers come and go while training goes on (docs/elastic.md).

The launcher is the job's membership authority. It starts one worker per free slot (up to
``max_np``) on the hosts it knows (``-H``, or a host discovery script run every second),
and decides which of them form each *generation* of the job. A generation is a record on
the launcher's authenticated rendezvous server, ``elastic/gen/<g>``: every member's rank,
size, local and cross rank/size. Workers take part through
:mod:`spark_dl.common.elastic`:

- ``init()`` posts ``elastic/want/<worker>`` (the last generation it belonged to) and
  waits for the next generation that lists it;
- the launcher forms generation g+1 when the current one cannot go on (a member died, or
  its members reset after a ``PeerFailureError``) or should grow (workers wait to join,
  see ``elastic/update/<g>``, which ``state.commit()`` reads), once every live member has
  posted that it waits, or after the start timeout without the stragglers;
- members keep their order (rank 0 stays rank 0 while it lives, so the root of the state
  sync is always a worker that trained), newcomers come after, ranks are grouped by host.

A worker that fails (exits non-zero, is killed) blacklists its host for new workers: for
good, or for a random time within ``--blacklist-cooldown-range``; its other workers keep
running. With fewer than ``min_np`` workers ready for ``--elastic-timeout`` seconds, or
after more than ``--reset-limit`` re-formations, the job ends with an error. Once a worker
of the current generation exits 0, the job is finishing: no generation follows, and the
job's exit code is 0 when every member of the last generation exits 0.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.common.elastic import (SCOPE, WORKER_VAR, generation_key, update_key,
                                     want_key)
from spark_dl.rendezvous.secret import make_secret, secret_to_hex
from spark_dl.runner import network
from spark_dl.runner.gloo_run import worker_spec
from spark_dl.runner.hosts import LOCALHOST, HostSlots, parse_hosts
from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.runner.options import LaunchOptions
from spark_dl.runner.output import forwarder_for
from spark_dl.runner.workers import Stopper, WorkerGroup, exit_code

DISCOVERY_INTERVAL_S = 1.0
# Once the last generation's members are done: how long workers that never joined may take
# to see that the job finished and exit.
FINISH_GRACE_S = 30.0
_POLL_S = 0.05


@dataclass
class ElasticOptions:
    """What makes a job elastic (``sdlrun --min-np/--max-np/...``).

    Attributes:
        min_np: the fewest workers that may train; below it the job waits (up to
            ``timeout``) for more.
        max_np: the most workers at once (None: as many as the hosts have slots).
        discovery_script: prints the available hosts, one ``host:slots`` (or ``host
            slots=N``) per line; run every second. None: the fixed ``hosts``.
        slots_per_host: slots of a discovered host printed without a count.
        timeout: seconds the job may stay below ``min_np`` (``SDL_ELASTIC_TIMEOUT``).
        reset_limit: most re-formations after the first generation (None: no limit).
        cooldown_range: (low, high) seconds a failing host stays blacklisted, drawn at
            random between them; None: for good.
    """

    min_np: int
    max_np: Optional[int] = None
    discovery_script: Optional[str] = None
    slots_per_host: int = 1
    timeout: float = 600.0
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[float, float]] = None

    def validate(self) -> None:
        if self.min_np < 1:
            raise ValueError("--min-np must be at least 1")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ValueError(f"--max-np {self.max_np} is below --min-np {self.min_np}")
        if self.slots_per_host < 1:
            raise ValueError("--slots-per-host must be at least 1")
        if self.timeout <= 0:
            raise ValueError("--elastic-timeout must be positive")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError("--reset-limit must not be negative")
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if not 0 <= low <= high:
                raise ValueError("--blacklist-cooldown-range needs 0 <= LOW <= HIGH")


def discover_hosts(script: str, slots_per_host: int, timeout: float = 10.0) -> List[HostSlots]:
    """Runs the discovery script and parses its lines (``host``, ``host:N`` or ``host
    slots=N``; blank lines and ``#`` comments ignored).

    Raises:
        ValueError: the script failed, timed out or printed something unreadable.
    """
    try:
        done = subprocess.run(script, shell=True, capture_output=True, timeout=timeout,
                              text=True)
    except subprocess.TimeoutExpired:
        raise ValueError(f"host discovery script {script!r} ran longer than {timeout:g} s")
    if done.returncode != 0:
        raise ValueError(f"host discovery script {script!r} exited with code "
                         f"{done.returncode}: {done.stderr.strip()[-300:]}")
    hosts = []
    for line in done.stdout.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if ":" not in line and "slots=" not in line:
            line = f"{line}:{slots_per_host}"
        hosts.extend(parse_hosts(line.replace(" slots=", ":")))
    return hosts


class Blacklist:
    """Hosts where a worker failed: no new worker starts there until the cool-down ends
    (never without a cool-down range)."""

    def __init__(self, cooldown_range: Optional[Tuple[float, float]],
                 clock: Callable[[], float] = time.monotonic):
        self._range = cooldown_range
        self._until: Dict[str, float] = {}
        self._clock = clock

    def add(self, host: str) -> float:
        """Blacklists ``host``; returns the seconds it stays blacklisted (inf: for good)."""
        seconds = (float("inf") if self._range is None
                   else random.uniform(*self._range))
        self._until[host] = self._clock() + seconds
        return seconds

    def blocks(self, host: str) -> bool:
        until = self._until.get(host)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[host]  # cooled down: it may take workers again
            return False
        return True


@dataclass
class _Worker:
    wid: str
    host: str
    seq: int  # start order
    alive: bool = True
    leaving: bool = False  # its host left the discovery's list: stopped at the next re-form
    rc: Optional[int] = None


@dataclass
class Generation:
    number: int = -1
    members: List[str] = field(default_factory=list)  # worker ids in rank order


def assign_topology(members: Sequence[str], host_of: Mapping[str, str]) -> Dict[str, dict]:
    """Ranks for a generation: hosts in order of their first member, each host's members
    together in the given order (so the first member is rank 0)."""
    hosts: List[str] = []
    by_host: Dict[str, List[str]] = {}
    for wid in members:
        host = host_of[wid]
        if host not in by_host:
            hosts.append(host)
            by_host[host] = []
        by_host[host].append(wid)
    size = len(members)
    out, rank = {}, 0
    for cross_rank, host in enumerate(hosts):
        local = by_host[host]
        for local_rank, wid in enumerate(local):
            out[wid] = {"rank": rank, "size": size, "local_rank": local_rank,
                        "local_size": len(local), "cross_rank": cross_rank,
                        "cross_size": len(hosts)}
            rank += 1
    return out


class MembershipAuthority:
    """Forms the generations of an elastic job on the rendezvous server (see the module
    docstring). The launcher tells it which workers started and ended and calls
    :meth:`step` about every 50 ms.

    Args:
        server: the job's rendezvous server.
        options: the elastic options.
        settle_timeout: seconds a re-formation waits for live members that have not yet
            noticed it (they join a later generation).
        log: writes a launcher message.
    """

    def __init__(self, server: KVStoreServer, options: ElasticOptions, settle_timeout: float,
                 log: Callable[[str], None]):
        self._kv = server
        self._opt = options
        self._settle = settle_timeout
        self._log = log
        self.workers: Dict[str, _Worker] = {}
        self.current = Generation()
        self.resets = 0
        self.finishing = False  # a member exited 0: no generation follows
        self._reform_since: Optional[float] = None
        self._below_min_since: Optional[float] = None
        self._first_ready: Optional[float] = None

    # -- what the launcher reports ------------------------------------------------------

    def started(self, wid: str, host: str, seq: int) -> None:
        self.workers[wid] = _Worker(wid, host, seq)

    def exited(self, wid: str, rc: int) -> None:
        worker = self.workers[wid]
        worker.alive, worker.rc = False, rc
        if rc == 0 and wid in self.current.members and not worker.leaving:
            self.finishing = True

    def live(self) -> List[_Worker]:
        return [w for w in self.workers.values() if w.alive]

    # -- forming generations -----------------------------------------------------------

    def _wants(self, wid: str) -> Optional[int]:
        raw = self._kv.get(SCOPE, want_key(wid))
        return None if raw is None else int(raw)

    def _ready(self, worker: _Worker) -> bool:
        """A member is ready when it waits for a generation after the current one; any
        other live worker as soon as it waits at all."""
        wants = self._wants(worker.wid)
        if wants is None:
            return False
        return wants == self.current.number if worker.wid in self.current.members else True

    def step(self) -> Tuple[Optional[str], List[str]]:
        """One look at the workers: may publish a generation or ask the current one to
        re-form. Returns (an error that ends the job or None, workers to stop now)."""
        if self.finishing:
            return None, []
        now = time.monotonic()
        live = self.live()
        members = set(self.current.members)
        waiting = {w.wid for w in live if self._ready(w)}  # one read per worker and step
        ready = [w for w in live if w.wid in waiting and not w.leaving]
        if self.current.number < 0:
            return self._first(live, ready, now), []
        broken = any(not self.workers[m].alive or self.workers[m].leaving or m in waiting
                     for m in members)
        newcomers = [w for w in ready if w.wid not in members]
        room = self._opt.max_np is None or len(members) < self._opt.max_np
        if not broken and not (newcomers and room):
            self._reform_since = None
            return None, []
        if self._reform_since is None:
            self._reform_since = now
            self._kv.put(SCOPE, update_key(self.current.number), b"1")
        # Leaving workers go once they stopped training (they wait for a generation).
        leaving = [w.wid for w in live if w.leaving and w.wid in waiting]
        waiting_for = [m for m in members if self.workers[m].alive
                       and not self.workers[m].leaving and m not in waiting]
        if waiting_for and now - self._reform_since < self._settle:
            return None, leaving
        error = self._form(ready, now)
        return error, leaving

    def _first(self, live, ready, now) -> Optional[str]:
        if ready and self._first_ready is None:
            self._first_ready = now
        everyone = live and len(ready) == len(live)
        settled = (self._first_ready is not None and now - self._first_ready >= self._settle
                   and len(ready) >= self._opt.min_np)
        if not (everyone or settled):
            return self._check_below_min(len(ready), now)
        return self._form(ready, now)

    def _form(self, ready: List[_Worker], now: float) -> Optional[str]:
        old_rank = {wid: r for r, wid in enumerate(self.current.members)}
        order = sorted(ready, key=lambda w: (old_rank.get(w.wid, len(old_rank)), w.seq))
        if self._opt.max_np is not None:
            order = order[:self._opt.max_np]
        if len(order) < self._opt.min_np:
            return self._check_below_min(len(order), now)
        self._below_min_since = None
        if self.current.number >= 0:
            self.resets += 1
            if self._opt.reset_limit is not None and self.resets > self._opt.reset_limit:
                return (f"the job re-formed more than --reset-limit={self._opt.reset_limit} "
                        "times; ending it")
        number = self.current.number + 1
        host_of = {w.wid: w.host for w in order}
        topology = assign_topology([w.wid for w in order], host_of)
        self._kv.put(SCOPE, generation_key(number),
                     json.dumps({"workers": topology}).encode())
        self.current = Generation(number, [w.wid for w in order])
        self._reform_since = None
        self._log(f"generation {number}: {len(order)} workers ("
                  + ", ".join(f"rank {topology[w.wid]['rank']}: worker {w.wid} on {w.host}"
                              for w in order) + ")")
        return None

    def _check_below_min(self, count: int, now: float) -> Optional[str]:
        if self._below_min_since is None:
            self._below_min_since = now
        if now - self._below_min_since < self._opt.timeout:
            return None
        return (f"only {count} worker(s) ready, fewer than --min-np={self._opt.min_np}, for "
                f"{self._opt.timeout:g} s (--elastic-timeout / SDL_ELASTIC_TIMEOUT): ending "
                "the job")

    def end(self, reason: str, finished: bool = False) -> None:
        """Tells workers waiting for a generation that none will come: the job failed
        (they raise), or it ``finished`` (they exit 0)."""
        self._kv.put(SCOPE, generation_key(self.current.number + 1),
                     json.dumps({"end": reason, "finished": finished}).encode())

    def members_done(self) -> bool:
        """True once the job is finishing and no member of its last generation runs."""
        return self.finishing and not any(self.workers[m].alive for m in self.current.members)


def run_elastic(command: Sequence[str], hosts: Sequence[HostSlots], options: LaunchOptions,
                elastic: ElasticOptions, env: Optional[Mapping[str, str]] = None,
                stopper: Optional[Stopper] = None) -> int:
    """Runs ``command`` as an elastic job (Gloo) and returns its exit code.

    Args:
        hosts: the fixed hosts (``-H``); ignored when a discovery script is given.
        options: launch options.
        elastic: the elastic options.
        env: extra variables for every worker.
        stopper: receives the launcher's SIGINT/SIGTERM.
    """
    return _ElasticJob(command, hosts, options, elastic, env or {}, stopper or Stopper()).run()


class _ElasticJob:
    def __init__(self, command, hosts, options, elastic, env, stopper):
        self.command = list(command)
        self.fixed_hosts = list(hosts)
        self.opt = options
        self.el = elastic
        self.env = env
        self.stopper = stopper
        self.blacklist = Blacklist(elastic.cooldown_range)
        self.seq = 0
        self.stopped_by_us: set = set()
        self.first_error: Optional[Tuple[str, int]] = None

    def hosts_now(self) -> List[HostSlots]:
        if self.el.discovery_script is None:
            return self.fixed_hosts
        return discover_hosts(self.el.discovery_script, self.el.slots_per_host)

    def run(self) -> int:
        from spark_dl.runner.hosts import is_local_host, merge_hosts

        hosts = merge_hosts(self.hosts_now(), is_local=is_local_host)
        remote_hosts = [h.hostname for h in hosts if h.hostname != LOCALHOST]
        self.net = network.choose_network(remote_hosts, self.opt.network_interface,
                                          self.opt.rendezvous_addr)
        self.secret = make_secret()
        self.job_id = secrets.token_hex(8)
        server = KVStoreServer(self.secret, host=self.net.address, verbose=self.opt.verbose)
        self.port = server.start()
        forwarder = forwarder_for(self.opt)
        forwarder.hold(True)
        self.group = WorkerGroup([], forwarder, kill_grace=self.opt.kill_grace,
                                 stopper=self.stopper, verbose=self.opt.verbose)
        self.authority = MembershipAuthority(server, self.el, self.opt.start_timeout,
                                             self.group.log)
        try:
            return self.group.run_custom(lambda: self._supervise(hosts))
        finally:
            forwarder.hold(False)
            server.stop()

    def _supervise(self, hosts: List[HostSlots]) -> int:
        from spark_dl.runner.hosts import is_local_host, merge_hosts

        group, auth = self.group, self.authority
        self._top_up(hosts)
        next_discovery = time.monotonic() + DISCOVERY_INTERVAL_S
        signals_seen = 0
        finished_at = None
        while True:
            ended = group.next_exit(_POLL_S)
            if ended is not None:
                self._exited(*ended)
            if self.stopper.count > signals_seen:
                signals_seen = self.stopper.count
                name = signal.Signals(self.stopper.signum).name
                group.log(f"received {name}; stopping the workers")
                auth.end(f"the launcher received {name}")
                return group.stop_all(128 + self.stopper.signum)
            if self.first_error is not None:
                message, code = self.first_error
                group.log(message)
                auth.end(message)
                return group.stop_all(code)
            if not auth.live():
                return self._result()
            if auth.members_done():
                if finished_at is None:
                    # Workers still waiting to join (a late replacement) exit 0 on this.
                    finished_at = time.monotonic()
                    auth.end("the job finished", finished=True)
                elif time.monotonic() - finished_at > FINISH_GRACE_S:
                    return group.stop_all(self._result())
            error, leaving = auth.step()
            if error is not None:
                self.first_error = (error, 1)
                continue
            for wid in leaving:
                self.stopped_by_us.add(wid)
                group.stop_one(int(wid))
            if time.monotonic() >= next_discovery and not auth.finishing:
                next_discovery = time.monotonic() + DISCOVERY_INTERVAL_S
                try:
                    hosts = merge_hosts(self.hosts_now(), is_local=is_local_host)
                except ValueError as exc:
                    group.log(f"warning: {exc}; keeping the hosts known so far")
                self._top_up(hosts)

    def _exited(self, key: int, rc: int) -> None:
        wid = str(key)
        auth = self.authority
        worker = auth.workers[wid]
        auth.exited(wid, rc)
        what = f"exit code {exit_code(rc)}" if rc >= 0 else f"signal {-rc}"
        if rc == 0 or wid in self.stopped_by_us:
            if self.opt.verbose or wid in self.stopped_by_us:
                self.group.log(f"worker {wid} on {worker.host} ended ({what})")
            return
        if auth.finishing and wid in auth.current.members:
            if self.first_error is None:
                self.first_error = (f"worker {wid} on {worker.host} failed with {what} while "
                                    "the job was finishing", exit_code(rc))
            return
        seconds = self.blacklist.add(worker.host)
        until = "for good" if seconds == float("inf") else f"for {seconds:.0f} s"
        self.group.log(f"worker {wid} on {worker.host} failed with {what}; the others go on "
                       f"(no new worker on {worker.host} {until})")

    def _result(self) -> int:
        auth = self.authority
        codes = [auth.workers[m].rc for m in auth.current.members]
        failed = [c for c in codes if c]
        if auth.finishing and not failed:
            return 0
        if failed:
            return exit_code(failed[0])
        message = "every worker ended before the job finished"
        self.group.log(message)
        return 1

    def _top_up(self, hosts: List[HostSlots]) -> None:
        """Starts workers on free slots of hosts that are not blacklisted (up to max_np);
        marks workers on hosts that left the list as leaving."""
        auth = self.authority
        if auth.finishing:
            return
        slots = {h.hostname: h.slots for h in hosts}
        live = auth.live()
        if self.el.discovery_script:
            # A host that left the list, or has fewer slots now: its newest workers leave.
            for host in {w.host for w in live}:
                staying = [w for w in live if w.host == host and not w.leaving]
                for w in sorted(staying, key=lambda w: w.seq)[slots.get(host, 0):]:
                    w.leaving = True
                    self.group.log(f"host {host} now has {slots.get(host, 0)} slot(s): worker "
                                   f"{w.wid} leaves at the next re-formation")
        count = sum(1 for w in live if not w.leaving)
        for host in hosts:
            if self.blacklist.blocks(host.hostname):
                continue
            running = sum(1 for w in live if w.host == host.hostname and not w.leaving)
            for _ in range(host.slots - running):
                if self.el.max_np is not None and count >= self.el.max_np:
                    return
                self._start(host.hostname)
                count += 1

    def _start(self, host: str) -> None:
        wid = str(self.seq)
        self.seq += 1
        peer_address = self.net.address if host == LOCALHOST else host
        job_env = {
            WORKER_VAR: wid,
            "SDL_HOSTNAME": peer_address,
            "SDL_RENDEZVOUS_ADDR": self.net.rendezvous_addr,
            "SDL_RENDEZVOUS_PORT": str(self.port),
            "SDL_SECRET_KEY": secret_to_hex(self.secret),
            "SDL_JOB_ID": self.job_id,
            "SDL_CONTROLLER": "gloo",
            "SDL_START_TIMEOUT": f"{self.opt.start_timeout:g}",
            "SDL_ELASTIC_TIMEOUT": f"{self.el.timeout:g}",
        }
        spec = worker_spec(self.command, int(wid), host, job_env, self.opt, self.env,
                           self.net, self.opt.cwd or os.getcwd(),
                           label=f"worker {wid} on {host}")
        self.authority.started(wid, host, int(wid))
        failure = self.group.start(spec)
        if failure is not None:
            self.authority.exited(wid, 127)
            self.first_error = failure
        elif self.opt.verbose:
            self.group.log(f"started worker {wid} on {host}: " + " ".join(spec.argv))
