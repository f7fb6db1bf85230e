"""The MPI launcher: one Open MPI ``mpirun`` starts every rank.

``mpirun`` starts the ranks (here, and through ssh on other hosts), MPI gives each its
rank, and the core negotiates and exchanges over MPI (``SDL_CONTROLLER=mpi``). There is
no rendezvous server and no secret: MPI's own wire-up connects the ranks. What sdlrun
adds around ``mpirun``:

- placement: ``-H`` lists exactly the slots sdlrun assigned (host by host, as on the Gloo
  path) and ``--map-by slot`` fills them in that order; ``--bind-to none`` leaves each
  rank's threads (the core's background thread, the framework's pools) free to use every
  core, where Open MPI would bind a rank to one core when ``np <= 2``, as horovodrun does.
  Either default gives way when ``--mpi-args`` sets its own;
- environment: ``mpirun`` runs with the launcher's environment minus what describes
  another job (Gloo ranks, rendezvous, secret), plus ``env`` and ``SDL_CONTROLLER=mpi``;
  ``-x NAME`` exports each variable that Gloo's remote workers would inherit, by name, so
  values never appear on a command line;
- network: ``oob_tcp_if_include`` and ``btl_tcp_if_include`` name the job's network
  (:func:`mpi_interfaces`: ``--network-interface``, else the subnet on the route to the
  first remote host), so daemons and ranks connect only over it;
- output: ``--tag-output`` marks each piece with its rank, and a
  :class:`~spark_dl.runner.output.TagDemux` turns that back into sdlrun's
  ``[<rank>]<stdout>:`` lines and ``--output-filename`` files;
- failures: ``mpirun`` stops the job when a rank fails and exits with that rank's code
  (128+N for signal N); sdlrun names the rank, and says what to set when ``mpirun``
  refuses to start (running as root, too few slots, binding). Signals to sdlrun go to
  ``mpirun``, which stops its ranks; SIGKILL after the grace period reaches them all.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import subprocess
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.runner import remote
from spark_dl.runner.hosts import LOCALHOST, SlotInfo
from spark_dl.runner.network import choose_network, mpi_interface_args
from spark_dl.runner.options import LaunchError, LaunchOptions
from spark_dl.runner.output import TagDemux, forwarder_for
from spark_dl.runner.workers import Stopper, WorkerGroup, WorkerSpec

# Open MPI's --tag-output tag: "[<job>,<rank>]<stdout>:" (Open MPI 4.x).
OPEN_MPI_TAG = re.compile(rb"\[\d+,(?P<rank>\d+)\]<(?P<stream>stdout|stderr|stddiag)>:")

_TOPOLOGY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
# What describes one Gloo job's ranks and rendezvous: an MPI job inherits none of it.
NOT_INHERITED = frozenset(
    [f"{prefix}_{name}" for prefix in ("SDL", "HOROVOD") for name in _TOPOLOGY]
    + ["SDL_HOSTNAME", "SDL_RENDEZVOUS_ADDR", "SDL_RENDEZVOUS_PORT", "SDL_SECRET_KEY",
       "SDL_JOB_ID"])
# Set by MPI itself in each rank, or read by mpirun itself: never exported with -x.
_MPI_OWN_PREFIXES = ("OMPI_", "OPAL_", "ORTE_", "PMIX_", "PRTE_", "PMI_")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# mpirun flags that sdlrun's own options own: refused in --mpi-args, with the option to use.
_OWNED_FLAGS = {
    "-np": "-np", "-n": "-np", "--np": "-np", "-c": "-np",
    "-H": "-H", "-host": "-H", "--host": "-H",
    "-hostfile": "--hostfile", "--hostfile": "--hostfile", "-machinefile": "--hostfile",
    "--machinefile": "--hostfile",
    "-tag-output": "(always on)", "--tag-output": "(always on)",
    "-timestamp-output": "--prefix-output-with-timestamp",
    "--timestamp-output": "--prefix-output-with-timestamp",
    "-output-filename": "--output-filename", "--output-filename": "--output-filename",
    "-xml": "(not supported)", "--xml": "(not supported)",
}
# Defaults sdlrun adds unless --mpi-args gives one of these flags.
_DEFAULTS = ((("--map-by", "-map-by", "--rankfile", "-rankfile", "-rf"), ("--map-by", "slot")),
             (("--bind-to", "-bind-to"), ("--bind-to", "none")))

_ROOT_HINT = ("mpirun refuses to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1 and "
              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, or pass --mpi-args=--allow-run-as-root")
_HINTS = (
    ("attempt to run as root", _ROOT_HINT),
    ("not enough slots available",
     "mpirun found too few slots: give more with -H host:slots, or let Open MPI "
     "oversubscribe: --mpi-args=--oversubscribe (or OMPI_MCA_rmaps_base_oversubscribe=1)"),
    ("binding more processes than cpus",
     "mpirun cannot bind that many ranks: drop --bind-to from --mpi-args, or add "
     "--mpi-args='--bind-to none' (or --oversubscribe)"),
    ("unable to reliably start one or more daemons",
     "mpirun could not start its daemons on the remote hosts: check passwordless ssh "
     "(ssh -o BatchMode=yes HOST true) and that Open MPI is installed on every host"),
)
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_EXITED = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*(?:Exit code:\s*(\d+))?"
                     r"(?:\s*Node:\s*(\S+))?")


def find_mpirun(program: str = "mpirun") -> Tuple[str, str]:
    """Returns (path, version) of Open MPI's ``mpirun``.

    Raises:
        LaunchError: not found, or not Open MPI.
    """
    path = shutil.which(program)
    if path is None:
        raise LaunchError(
            f"the MPI launcher needs Open MPI's {program}, which is not on PATH: install "
            "Open MPI (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev) or use --gloo")
    try:
        probe = subprocess.run([path, "--version"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {path} --version: {exc}") from None
    text = probe.stdout.decode(errors="replace")
    match = re.search(r"\(Open MPI\)\s*(\S+)", text)
    if match is None:
        first = text.strip().splitlines()[0] if text.strip() else f"exit code {probe.returncode}"
        raise LaunchError(f"--mpi supports Open MPI's mpirun only; {path} says: {first}")
    return path, match.group(1)


def mpi_environment(environ: Mapping[str, str], extra: Mapping[str, str],
                    job_id: str) -> Dict[str, str]:
    """mpirun's environment: ``environ`` and ``extra``, minus :data:`NOT_INHERITED`,
    plus ``SDL_CONTROLLER=mpi`` and ``SDL_JOB_ID``."""
    env = {k: v for k, v in {**environ, **extra}.items() if k not in NOT_INHERITED}
    env.update(SDL_CONTROLLER="mpi", SDL_JOB_ID=job_id)
    return env


def exported_names(env: Mapping[str, str]) -> List[str]:
    """The variables passed with ``-x``: what a Gloo remote worker would inherit, minus
    MPI's own."""
    return sorted(name for name in remote.forwarded_environment(env)
                  if _NAME.match(name) and not name.startswith(_MPI_OWN_PREFIXES))


def owner_of(arg: str) -> Optional[str]:
    """The sdlrun option that owns the ``mpirun`` flag ``arg`` (``-np`` -> ``-np``), or
    ``(always on)``/``(not supported)``; None for a flag that ``--mpi-args`` may pass."""
    return _OWNED_FLAGS.get(arg.split("=", 1)[0])


def split_args(value, what: str) -> List[str]:
    """Extra command-line arguments given as one string (split like a shell) or as a list;
    ``what`` names the option in the error.

    Raises:
        ValueError: a string a shell could not split (e.g. an unclosed quote).
    """
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"{what} {value!r}: {exc}") from None
    return [str(a) for a in value or ()]


def split_mpi_args(mpi_args) -> List[str]:
    """``--mpi-args``: a string (split like a shell) or a list; refuses flags that
    sdlrun's own options own.

    Raises:
        ValueError: such a flag.
    """
    args = split_args(mpi_args, "--mpi-args")
    for arg in args:
        owner = owner_of(arg)
        if owner is not None:
            raise ValueError(f"--mpi-args: {arg} is sdlrun's to set; use sdlrun {owner}"
                             if owner.startswith("-") else
                             f"--mpi-args: {arg} conflicts with sdlrun's output handling "
                             f"{owner}")
    return args


def mpirun_command(mpirun: str, command: Sequence[str], slots: Sequence[SlotInfo],
                   env: Mapping[str, str], options: LaunchOptions,
                   interfaces: Optional[str] = None) -> List[str]:
    """The full ``mpirun`` command line for ``command`` on ``slots``.

    ``interfaces`` (names or CIDR subnets, see :func:`mpi_interfaces`) restricts Open MPI's
    out-of-band and TCP transports, unless ``mpi_args`` sets those parameters itself.

    Raises:
        ValueError: bad ``mpi_args``, or an IPv6 address (Open MPI's ``-H`` takes none).
    """
    per_host: "OrderedDict[str, int]" = OrderedDict()
    for slot in slots:
        per_host[slot.hostname] = per_host.get(slot.hostname, 0) + 1
    for host in per_host:
        if ":" in host:
            raise ValueError(f"host {host}: Open MPI's -H takes no IPv6 address; use a "
                             "host name")
    extra = split_mpi_args(options.mpi_args)
    argv = [mpirun, "--tag-output", "-np", str(len(slots)),
            "-H", ",".join(f"{host}:{n}" for host, n in per_host.items())]
    given = {arg.split("=", 1)[0] for arg in extra}
    for flags, default in _DEFAULTS:
        if not given.intersection(flags):
            argv += default
    if interfaces:
        argv += mpi_interface_args(interfaces, given=extra)
    rsh_args = []
    if options.ssh_port is not None:
        rsh_args += ["-p", str(options.ssh_port)]
    if options.ssh_identity_file:
        rsh_args += ["-i", options.ssh_identity_file]
    if rsh_args:
        argv += ["--mca", "plm_rsh_args", " ".join(rsh_args)]
    if tuple(options.ssh_command) != ("ssh",):
        argv += ["--mca", "plm_rsh_agent", " ".join(options.ssh_command)]
    for name in exported_names(env):
        argv += ["-x", name]
    return argv + extra + list(command)


def mpi_interfaces(slots: Sequence[SlotInfo], options: LaunchOptions) -> Optional[str]:
    """What Open MPI's ``*_if_include`` get for an ``sdlrun --mpi`` job with ranks on
    other hosts: the ``network_interface`` as given (one name or a comma list), else the
    subnet of the interface on the route to the first remote host (a subnet matches each
    host's own interface in it, whatever its name).

    None for a job on this machine only (its ranks meet through shared memory), and when
    this machine has no route to the first remote host (a name only ssh knows, e.g. an
    alias in ``~/.ssh/config``): Open MPI then chooses, as without sdlrun.
    """
    remote_hosts = list(dict.fromkeys(s.hostname for s in slots if s.hostname != LOCALHOST))
    if not remote_hosts:
        return None
    if options.network_interface:
        return options.network_interface
    try:
        return choose_network(remote_hosts).subnet
    except ValueError:
        return None


def failed_rank(mpirun_text: str) -> Optional[Tuple[int, Optional[str], Optional[int]]]:
    """The rank that ``mpirun``'s messages name as the job's failure.

    Returns:
        ``(rank, node or None, exit code or None)``, the exit code being 128+N for a
        rank killed by signal N; None when the messages name no rank.
    """
    match = _SIGNALLED.search(mpirun_text)
    if match:
        rank, node, signum = match.groups()
        return int(rank), node, 128 + int(signum)
    match = _EXITED.search(mpirun_text)
    if match:
        rank, rc, node = match.groups()
        return int(rank), node, int(rc) if rc else None
    return None


def explain_failure(code: int, mpirun_text: str) -> str:
    """One line saying why mpirun failed, from its exit code and its own messages."""
    for needle, hint in _HINTS:
        if needle in mpirun_text:
            return hint
    failed = failed_rank(mpirun_text)
    if failed is not None:
        rank, node, rc = failed
        where = f" on {node}" if node else ""
        if _SIGNALLED.search(mpirun_text):
            return (f"rank {rank}{where} failed with signal {rc - 128}; mpirun stopped "
                    "the job")
        return (f"rank {rank}{where} failed with exit code {code if rc is None else rc}; "
                "mpirun stopped the job")
    return f"mpirun failed with exit code {code} (see its messages above)"


def run_mpi(command: Sequence[str], slots: Sequence[SlotInfo], options: LaunchOptions,
            env: Optional[Mapping[str, str]] = None,
            stopper: Optional[Stopper] = None) -> int:
    """Runs ``command`` on ``slots`` through ``mpirun`` and returns the job's exit code.

    Args: as :func:`~spark_dl.runner.gloo_run.run_gloo`.

    Raises:
        LaunchError: no usable ``mpirun``.
        ValueError: bad ``mpi_args`` or hosts.
    """
    stopper = stopper or Stopper()
    job_id = secrets.token_hex(8)
    job_env = mpi_environment(os.environ, env or {}, job_id)
    argv = mpirun_command(options.mpirun, command, slots, job_env, options)  # checks args
    interfaces = mpi_interfaces(slots, options)
    if interfaces:
        argv = mpirun_command(options.mpirun, command, slots, job_env, options, interfaces)
    argv[0], version = find_mpirun(options.mpirun)
    mpirun = argv[0]
    demux = {"stdout": TagDemux(OPEN_MPI_TAG), "stderr": TagDemux(OPEN_MPI_TAG)}
    spec = WorkerSpec(0, LOCALHOST, argv, job_env, cwd=options.cwd or os.getcwd(),
                      label="mpirun", demux=demux, ranks=[s.rank for s in slots],
                      report_failure=False)
    group = WorkerGroup([spec], forwarder_for(options), kill_grace=options.kill_grace,
                        stopper=stopper, verbose=options.verbose)
    if options.verbose:
        hosts = sorted({s.hostname for s in slots if s.hostname != LOCALHOST})
        group.log(f"job {job_id}: {len(slots)} ranks through {mpirun} (Open MPI {version})"
                  + (f", remote hosts {', '.join(hosts)}" if hosts else ""))
        group.log("mpirun command: " + " ".join(shlex.quote(a) for a in argv))
    code = group.run()
    if code != 0 and stopper.signum is None:
        text = b"".join(bytes(d.untagged_tail) for d in demux.values())
        group.log(explain_failure(code, text.decode(errors="replace")))
    return code
