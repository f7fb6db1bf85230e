"""The Gloo launcher: a rendezvous server on the launcher, one process per rank.

Workers find each other through the rendezvous server (the core's Gloo context reads and
writes it with :class:`~spark_dl.rendezvous.client.KVStoreClient`), so the launcher only has
to start each rank with its environment:

========================  ===================================================
``SDL_RANK`` ...          rank, size, local and cross rank/size (and the same
                          values as ``HOROVOD_*`` for scripts written for Horovod)
``SDL_HOSTNAME``          the address peers use to reach this worker: its host's
                          address on the job's network (remote hosts pick theirs,
                          see :mod:`~spark_dl.runner.network`)
``SDL_RENDEZVOUS_ADDR``   the rendezvous server, as reachable from the worker
``SDL_RENDEZVOUS_PORT``
``SDL_SECRET_KEY``        the per-job secret, hex; only ever in environments
``SDL_JOB_ID``            random per job
``SDL_CONTROLLER``        ``gloo``
``SDL_START_TIMEOUT``     seconds the rendezvous may take
========================  ===================================================
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Dict, List, Mapping, Optional, Sequence

from spark_dl.rendezvous.secret import make_secret, secret_to_hex
from spark_dl.runner import network, remote
from spark_dl.runner.hosts import LOCALHOST, SlotInfo
from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.runner.options import LaunchOptions
from spark_dl.runner.output import forwarder_for
from spark_dl.runner.workers import Stopper, WorkerGroup, WorkerSpec


def worker_environment(slot: SlotInfo, peer_address: str, rendezvous_addr: str,
                       rendezvous_port: int, secret: bytes, job_id: str,
                       start_timeout: float) -> Dict[str, str]:
    """The variables that tell one worker who it is and how to meet its peers."""
    topology = {"RANK": slot.rank, "SIZE": slot.size, "LOCAL_RANK": slot.local_rank,
                "LOCAL_SIZE": slot.local_size, "CROSS_RANK": slot.cross_rank,
                "CROSS_SIZE": slot.cross_size}
    env = {}
    for name, value in topology.items():
        env[f"SDL_{name}"] = str(value)
        env[f"HOROVOD_{name}"] = str(value)
    env.update({
        "SDL_HOSTNAME": peer_address,
        "SDL_RENDEZVOUS_ADDR": rendezvous_addr,
        "SDL_RENDEZVOUS_PORT": str(rendezvous_port),
        "SDL_SECRET_KEY": secret_to_hex(secret),
        "SDL_JOB_ID": job_id,
        "SDL_CONTROLLER": "gloo",
        "SDL_START_TIMEOUT": f"{start_timeout:g}",
    })
    return env


def route_address(remote_host: str) -> str:
    """This machine's address on the route to ``remote_host`` (no packet is sent).

    Falls back to this machine's host name when the route cannot be determined.
    """
    return network.route_address(remote_host) or socket.gethostname()


def run_gloo(command: Sequence[str], slots: Sequence[SlotInfo], options: LaunchOptions,
             env: Optional[Mapping[str, str]] = None,
             stopper: Optional[Stopper] = None) -> int:
    """Runs ``command`` once per slot and returns the job's exit code.

    Args:
        command: the program and arguments every rank runs.
        slots: from :func:`~spark_dl.runner.hosts.assign_ranks`; ``hostname`` is
            ``"localhost"`` for this machine (after :func:`merge_hosts` with is_local).
        options: launch options.
        env: extra variables for every worker, on top of the launcher's environment.
        stopper: receives the launcher's SIGINT/SIGTERM.
    """
    remote_hosts = list(dict.fromkeys(s.hostname for s in slots if s.hostname != LOCALHOST))
    net = network.choose_network(remote_hosts, options.network_interface,
                                 options.rendezvous_addr)
    rendezvous_addr = net.rendezvous_addr
    forwarder = forwarder_for(options)
    secret = make_secret()
    job_id = secrets.token_hex(8)
    cwd = options.cwd or os.getcwd()
    # Bound to the job's address only: hosts reach it there, and nothing else does.
    server = KVStoreServer(secret, host=net.address, verbose=options.verbose)
    port = server.start()
    try:
        specs = _worker_specs(command, slots, options, env or {}, net, port, secret,
                              job_id, cwd)
        group = WorkerGroup(specs, forwarder, kill_grace=options.kill_grace,
                            stopper=stopper, verbose=options.verbose)
        if options.verbose:
            group.log(f"job {job_id}: {len(slots)} ranks, rendezvous at "
                      f"{rendezvous_addr}:{port}, bound to {net.address}; job network: "
                      + " ".join(filter(None, (net.interface, net.subnet)))
                      + f" ({net.reason})")
            for spec in specs:
                group.log(f"rank {spec.rank} on {spec.hostname}: "
                          + " ".join(spec.argv))
        remote_ranks = [s.rank for s in slots if s.hostname != LOCALHOST]
        check = (_registration_check(server, remote_ranks, slots, options.start_timeout,
                                     rendezvous_addr, port) if remote_ranks else None)
        return group.run(start_check=check)
    finally:
        server.stop()


def _worker_specs(command, slots, options, extra_env, net, port, secret, job_id,
                  cwd) -> List[WorkerSpec]:
    specs = []
    for slot in slots:
        # A remote bootstrap replaces its host name by its address on the job's network
        # (remote.main) where the launcher chose one (net.payload()).
        peer_address = net.address if slot.hostname == LOCALHOST else slot.hostname
        job_env = worker_environment(slot, peer_address, net.rendezvous_addr, port, secret,
                                     job_id, options.start_timeout)
        specs.append(worker_spec(command, slot.rank, slot.hostname, job_env, options,
                                 extra_env, net, cwd))
    return specs


def worker_spec(command, key: int, hostname: str, job_env: Mapping[str, str],
                options: LaunchOptions, extra_env: Mapping[str, str], net, cwd: str,
                label: Optional[str] = None) -> WorkerSpec:
    """How to start one worker: directly on this machine, else through ssh and the remote
    bootstrap (which reads the command and environment from its stdin).

    Args:
        key: the worker's rank (its output prefix and messages).
        job_env: the variables that place it in the job (they win over the others).
        net: the job's network (:func:`~spark_dl.runner.network.choose_network`).
    """
    if hostname == LOCALHOST:
        full_env = {**os.environ, **extra_env, **job_env}
        return WorkerSpec(key, hostname, list(command), full_env, cwd=cwd, label=label)
    remote_env = {**remote.forwarded_environment(os.environ), **extra_env, **job_env}
    argv = remote.build_ssh_command(
        hostname, options.ssh_command, port=options.ssh_port,
        identity_file=options.ssh_identity_file, connect_timeout=options.start_timeout,
        cwd=cwd, pythonpath=os.environ.get("PYTHONPATH"))
    # The ssh client itself runs with the launcher's environment minus the secret.
    ssh_env = {k: v for k, v in os.environ.items() if k != "SDL_SECRET_KEY"}
    return WorkerSpec(key, hostname, argv, ssh_env, label=label,
                      stdin_data=remote.encode_payload(command, remote_env, cwd,
                                                       net.payload()))


def _registration_check(server: KVStoreServer, ranks: Sequence[int],
                        slots: Sequence[SlotInfo], start_timeout: float,
                        rendezvous_addr: str, port: int):
    """A start check: every remote rank registers within the start timeout."""
    deadline = time.monotonic() + start_timeout
    waiting = set(ranks)
    hosts = {s.rank: s.hostname for s in slots}

    def check() -> Optional[str]:
        for rank in list(waiting):
            if server.get(remote.REGISTER_SCOPE, remote.register_key(rank)) is not None:
                waiting.discard(rank)
        if not waiting or time.monotonic() < deadline:
            return None
        missing = ", ".join(f"{r} ({hosts[r]})" for r in sorted(waiting))
        return (f"ranks {missing} did not start within {start_timeout:g} s: check that ssh "
                f"reaches those hosts and that they reach the rendezvous server at "
                f"{rendezvous_addr}:{port} (see --start-timeout, --network-interface, "
                f"--rendezvous-addr)")

    return check
