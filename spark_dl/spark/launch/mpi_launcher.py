"""The MPI launcher of :func:`spark_dl.spark.run`: ``mpirun`` on the driver, ``orted`` in
the executors, started through the task services (no sshd anywhere).

Once the ranks are assigned (grouped by host, see :mod:`spark_dl.spark.launch.driver.plan`):

1. **Hosts.** Each host (tasks with one host hash) gets an alias, ``sdl-<host hash>``,
   that ``mpirun`` takes as a remote host name (it resolves to nothing, so ``mpirun``
   never treats it as itself). ``-H alias:n,...`` in plan order and ``--map-by slot``
   make MPI's ranks exactly the planned ones, so local ranks are MPI's too.
2. **Roles.** On each host, the task with the lowest index hosts the host's MPI daemon
   (``host_daemon``: the daemon's environment); the host's other tasks are ``attach``-ed:
   their ranks run under that daemon, and they wait for the end of the job.
3. **mpirun** runs on the driver, supervised like ``sdlrun --mpi``'s (reusing
   :mod:`spark_dl.runner.mpi_run`: the command line, ``--tag-output`` demultiplexing into
   ``[<rank>]<stdout>:`` lines, failure explanations), with
   ``--mca plm_rsh_agent "<python> -m spark_dl.spark.launch.rsh_agent"``; ``mpirun`` runs the
   agent once per alias, and the agent asks that host's daemon task to start ``orted``
   (see :mod:`spark_dl.spark.launch.rsh_agent`). ``plm_rsh_no_tree_spawn`` keeps every daemon
   launch on the driver (only the driver holds the agent's credentials), and
   ``orte_leave_session_attached`` keeps ``orted`` a child of its task (not a daemonized
   orphan), so the task reaps it.
4. **Workers.** ``orted`` starts each rank's bootstrap (``python -m
   spark_dl.spark.launch.task.worker --mpi``, the executor's interpreter) with
   ``SDL_CONTROLLER=mpi`` and the user's ``env`` (``-x``: by name, values never on a
   command line). The bootstrap fetches the secret from its task, the function and its
   task's GPU variables from the driver, and posts its result or exception, as on Gloo.
5. **End.** ``mpirun`` ends when every rank ended, or stops the job when one fails and
   names it; this launcher reports that to the driver service
   (:meth:`~spark_dl.spark.launch.driver.service.DriverService.job_ended`), which then fails
   the job (naming the rank, e.g. a SIGKILL) or lets the tasks end.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import sys
import threading
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.rendezvous.secret import secret_to_hex
from spark_dl.runner.mpi_run import (OPEN_MPI_TAG, explain_failure, failed_rank,
                                     find_mpirun, mpi_environment, mpirun_command, owner_of,
                                     split_args)
from spark_dl.runner.network import mpi_interface_args
from spark_dl.runner.options import LaunchError, LaunchOptions
from spark_dl.runner.output import TagDemux
from spark_dl.runner.workers import Stopper, WorkerGroup, WorkerSpec
from spark_dl.spark.launch.driver.plan import Placement
from spark_dl.spark.launch.driver.service import Failure, describe_exit
from spark_dl.spark.launch.errors import MpiNotBuiltError
from spark_dl.spark.launch.handover import SecretHandover
from spark_dl.spark.launch.launcher import Launcher, LaunchContext, call_tasks
from spark_dl.spark.launch.network import address_network
from spark_dl.spark.launch.rsh_agent import AGENT_HANDOVER_VAR
from spark_dl.spark.launch.task.environment import (DRIVER_VAR, PYTHON_VAR, device_environment,
                                                    format_endpoints)
from spark_dl.spark.launch.task.output import StreamSink, TaskOutputForwarder

__all__ = ["MpiLauncher", "host_alias", "spark_mpi_args", "job_interfaces"]

# Open MPI refuses to run as root unless told. On Spark, mpirun and orted run under the
# identity of the driver and the executors, which is often root (Databricks): that is the
# user's choice of cluster, not a mistake to guard against (Horovod passes
# --allow-run-as-root there too). sdlrun on a user's own machine keeps the refusal.
RUN_AS_EXECUTOR = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# Always set: see the module docstring (3.).
_FIXED_MCA = ("--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "orte_leave_session_attached", "1")
# extra_mpi_args may not change how ranks map to hosts (ranks follow the Spark tasks) nor
# how daemons are launched.
_REFUSED_FLAGS = {"--map-by", "-map-by", "--rankfile", "-rankfile", "-rf", "--npernode",
                  "-npernode", "-N", "--ppr", "-ppr", "--bynode", "-bynode", "--byslot",
                  "-byslot", "--nolocal", "-nolocal", "--daemonize"}
_REFUSED_PARAMS = {"plm_rsh_agent", "plm_rsh_args", "plm_rsh_no_tree_spawn",
                   "orte_leave_session_attached", "plm"}
_AGENT_MARK = "spark_dl.spark.launch.rsh_agent:"
# When a rank failed, mpirun stops the job by itself: give it this long before SIGTERM
# (a SIGTERM in the middle of its own abort can crash Open MPI 4.1's mpirun).
_SELF_STOP_S = 2.0


def host_alias(host_hash: str) -> str:
    """The name ``mpirun`` knows a host by (no dots: Open MPI may cut names at one)."""
    return f"sdl-{host_hash}"


def job_interfaces(addresses: Sequence[str],
                   networks: Optional[Mapping[str, str]] = None) -> str:
    """Open MPI's ``*_if_include`` value for the addresses a job uses (the driver's and
    the task services'): ``lo`` when they are all loopback, else the network of each
    address's interface (``networks``: address -> CIDR, as the tasks registered them), so
    that mpirun, the daemons and the ranks connect only over those interfaces.

    An address whose network is unknown is given as a ``/32``: enough for ``mpirun`` and
    the daemons, but Open MPI's TCP transport then refuses connections between ranks on
    different hosts (measured with Open MPI 4.1 on namespace hosts: the job hangs in its
    first collective), hence the tasks' networks.
    """
    unique = sorted(set(addresses))
    if all(a.startswith("127.") or a == "::1" for a in unique):
        return "lo"
    networks = networks or {}
    out: List[str] = []
    for a in unique:
        net = networks.get(a) or (f"{a}/128" if ":" in a else f"{a}/32")
        if net not in out:
            out.append(net)
    return ",".join(out)


def spark_mpi_args(extra_mpi_args, nics: Optional[Sequence[str]] = None,
                   addresses: Sequence[str] = (), single_host: bool = False,
                   networks: Optional[Mapping[str, str]] = None) -> List[str]:
    """``extra_mpi_args`` (a string split like a shell, or a list), checked, after the
    fixed settings and the job's network (each unless ``extra_mpi_args`` sets its own):

    - ``oob_tcp_if_include``/``btl_tcp_if_include``: the ``nics`` interfaces, else the
      networks of the ``addresses`` the job uses (:func:`job_interfaces`);
    - ``btl ^tcp,ofi`` for a ``single_host`` job: its ranks meet through shared memory,
      so none opens the listeners of Open MPI's network transports (the TCP one binds
      every interface whatever ``btl_tcp_if_include`` says; libfabric's binds the host's
      address).

    Raises:
        ValueError: a flag that ``run`` sets itself or that would break the launch.
    """
    extra = split_args(extra_mpi_args, "extra_mpi_args")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if owner_of(arg) is not None or flag in _REFUSED_FLAGS or arg in _REFUSED_PARAMS:
            raise ValueError(
                f"extra_mpi_args: {arg} is set by spark_dl.spark.run itself (num_proc and "
                "the Spark tasks decide the ranks and their hosts, output is always tagged, "
                "and mpirun reaches the executors through the task services)")
    args = list(_FIXED_MCA)
    interfaces = ",".join(nics) if nics else (
        job_interfaces(addresses, networks) if addresses else "")
    if interfaces:
        args += mpi_interface_args(interfaces, given=extra)
    if single_host and "btl" not in extra:
        args += ["--mca", "btl", "^tcp,ofi"]
    return args + extra


def _check_mpi() -> Tuple[str, str]:
    """(path, version) of Open MPI's ``mpirun``; raises MpiNotBuiltError without MPI."""
    if shutil.which("mpirun") is None:
        raise MpiNotBuiltError(
            "spark_dl.spark.run(use_mpi=True) needs Open MPI's mpirun on the PATH of the "
            "process that runs it (task 0's executor; on local masters this machine) and "
            "orted on every executor host: install Open MPI (Debian/Ubuntu: apt-get "
            "install openmpi-bin libopenmpi-dev), or run with Gloo (use_mpi=None)")
    try:
        path, version = find_mpirun()
    except LaunchError as exc:
        raise MpiNotBuiltError(f"spark_dl.spark.run(use_mpi=True): {exc}") from None
    try:
        from spark_dl.common.native import core as _core, mpi_missing_reason
    except ImportError:  # the driver may only launch; the workers' init() checks theirs
        return path, version
    if not _core.build_info().get("mpi"):
        raise MpiNotBuiltError(
            f"spark_dl.spark.run(use_mpi=True): {mpi_missing_reason()}; or run with Gloo "
            "(use_mpi=None)")
    return path, version


def _hosts(placements: Sequence[Placement]) -> "OrderedDict[str, List[Placement]]":
    """alias -> the host's placements, hosts in plan order, placements in rank order."""
    hosts: "OrderedDict[str, List[Placement]]" = OrderedDict()
    for p in placements:
        hosts.setdefault(host_alias(p.task.host_hash), []).append(p)
    return hosts


class MpiLauncher(Launcher):
    """``mpirun`` through the task services (see the module docstring).

    Args:
        extra_mpi_args: extra ``mpirun`` arguments (checked here, before any Spark job).

    Raises:
        MpiNotBuiltError: no Open MPI ``mpirun`` here, or a spark_dl build without MPI.
        ValueError: ``extra_mpi_args`` holds a flag that ``run`` sets itself.
    """

    name = "mpi"

    def __init__(self, extra_mpi_args=None):
        spark_mpi_args(extra_mpi_args)  # refuses bad flags before anything starts
        self._extra = extra_mpi_args
        self._mpirun, self._version = _check_mpi()
        self._stopper = Stopper()
        self._thread: Optional[threading.Thread] = None

    def start(self, ctx: LaunchContext) -> None:
        if ctx.driver is None or ctx.write_output is None:
            raise ValueError("the MPI launcher needs the driver service and an output sink")
        hosts = _hosts(ctx.placements)
        daemon_env = {alias: {DRIVER_VAR: format_endpoints(ctx.driver_endpoints),
                              "SDL_HOST_ID": ps[0].task.host_hash, **RUN_AS_EXECUTOR}
                      for alias, ps in hosts.items()}
        ctx.driver.set_worker_env({
            p.rank: {k: v for k, v in device_environment(
                p.task.gpus, {**os.environ, **ctx.user_env}).items()
                     if k not in ctx.user_env}  # the user's env wins, as on Gloo
            for p in ctx.placements})
        daemons = {id(ps[0]) for ps in hosts.values()}

        def assign(p: Placement) -> None:
            client = ctx.tasks[p.task.index]
            if id(p) in daemons:
                client.call("host_daemon", env=daemon_env[host_alias(p.task.host_hash)])
            else:
                client.call("attach", rank=p.rank)

        call_tasks(ctx, ctx.placements, assign)
        handover = SecretHandover({
            "secret": secret_to_hex(ctx.secret),
            "hosts": {alias: ps[0].task.endpoints for alias, ps in hosts.items()},
        }, label="driver")
        try:
            argv, env = self._command(ctx, hosts)
            env[AGENT_HANDOVER_VAR] = handover.address
        except BaseException:
            handover.close()
            raise
        if ctx.verbose >= 2:
            ctx.write_output("stderr", (
                f"spark_dl.spark.run: {len(ctx.placements)} ranks through {self._mpirun} "
                f"(Open MPI {self._version}), hosts "
                + ", ".join(f"{a}={ps[0].task.hostname}" for a, ps in hosts.items())
                + "\nspark_dl.spark.run: mpirun command: "
                + " ".join(shlex.quote(a) for a in argv) + "\n").encode())
        self._thread = threading.Thread(target=self._supervise,
                                        args=(ctx, argv, env, hosts, handover),
                                        name=f"sdl-mpirun-{ctx.job_id}", daemon=True)
        self._thread.start()

    def _command(self, ctx: LaunchContext, hosts) -> Tuple[List[str], Dict[str, str]]:
        """mpirun's argv and environment (no secret in either)."""
        alias_of = {ps[0].task.host_hash: alias for alias, ps in hosts.items()}
        slots = [dataclasses.replace(p.slot, hostname=alias_of[p.task.host_hash])
                 for p in ctx.placements]
        env = dict(mpi_environment(os.environ, ctx.user_env, ctx.job_id), **RUN_AS_EXECUTOR)
        # -x exports these by name: the job's controller and id, and the user's env.
        exported = {**ctx.user_env, "SDL_CONTROLLER": "mpi", "SDL_JOB_ID": ctx.job_id}
        addresses = [h for h, _ in ctx.driver_endpoints] + [
            h for p in ctx.placements for h, _ in p.task.endpoints]
        # mpirun runs here, beside the driver service: its addresses' networks are ours.
        networks = {h: address_network(h) for h, _ in ctx.driver_endpoints}
        for p in ctx.placements:
            networks.update(zip((h for h, _ in p.task.endpoints), p.task.networks))
        networks = {h: n for h, n in networks.items() if n}
        options = LaunchOptions(controller="mpi", mpirun=self._mpirun,
                                mpi_args=spark_mpi_args(self._extra, ctx.nics, addresses,
                                                        single_host=len(hosts) == 1,
                                                        networks=networks),
                                ssh_command=(sys.executable, "-m",
                                             "spark_dl.spark.launch.rsh_agent"))
        # The executor's interpreter (the task's, in the daemon's environment) runs the
        # bootstrap; the job id is hex, safe inside the shell line.
        command = ["/bin/sh", "-c", f'exec "${PYTHON_VAR}" -m spark_dl.spark.launch.task.worker '
                                    f"--job {ctx.job_id} --mpi"]
        return mpirun_command(self._mpirun, command, slots, exported, options), env

    def _supervise(self, ctx: LaunchContext, argv: List[str], env: Dict[str, str],
                   hosts, handover: SecretHandover) -> None:
        demux = {"stdout": TagDemux(OPEN_MPI_TAG), "stderr": TagDemux(OPEN_MPI_TAG)}
        spec = WorkerSpec(0, "the driver", argv, env, cwd=os.getcwd(), label="mpirun",
                          demux=demux, ranks=[p.rank for p in ctx.placements],
                          report_failure=False)
        forwarder = TaskOutputForwarder(
            StreamSink(ctx.write_output, "stdout"), StreamSink(ctx.write_output, "stderr"),
            prefix=True, timestamp=ctx.prefix_timestamp, show_launcher_messages=True,
            label="spark_dl.spark.run")
        group = WorkerGroup([spec], forwarder, kill_grace=ctx.kill_grace,
                            stopper=self._stopper, verbose=ctx.verbose >= 2)
        code, failure = 1, None
        try:
            code = group.run()
            if code != 0:
                text = b"".join(bytes(d.untagged_tail) for d in demux.values())
                failure = self._explain(code, text.decode(errors="replace"), hosts)
        except Exception as exc:  # e.g. mpirun cannot be started: the job must still end
            failure = Failure(2, f"mpirun could not run: {exc}")
        finally:
            handover.close()
            ctx.driver.job_ended(code, failure)

    @staticmethod
    def _explain(code: int, text: str, hosts) -> Failure:
        """The failure ``mpirun``'s exit code and messages describe."""
        failed = failed_rank(text)
        if failed is not None:
            rank, node, rc = failed
            ps = hosts.get(node or "") or hosts.get((node or "").split(".", 1)[0])
            where = f" on {ps[0].task.hostname}" if ps else (f" on {node}" if node else "")
            rc = code if rc is None else rc
            return Failure(1, f"rank {rank}{where} ended with {describe_exit(rc)}",
                           rank=rank, exit_code=rc)
        agent = [line.strip() for line in text.splitlines() if _AGENT_MARK in line]
        if agent:
            return Failure(2, "mpirun could not start its daemons through the task "
                              "services:\n  " + "\n  ".join(agent[:10]))
        if "unable to reliably start one or more daemons" in text:
            return Failure(2, "mpirun could not start orted in the executors: Open MPI "
                              "(orted, the same version as the driver's mpirun) must be "
                              "installed on every executor host; see mpirun's messages "
                              "above")
        if "lost communication with a remote daemon" in text:
            return Failure(2, "mpirun lost the MPI daemon (orted) of a host: its Spark task "
                              "or executor ended, or the network between the executors and "
                              "the driver broke; see mpirun's messages above")
        return Failure(2, explain_failure(code, text).replace("--mpi-args=", "extra_mpi_args="))

    def stop(self, ctx: LaunchContext, timeout: float = 5.0) -> None:
        """Stops ``mpirun`` (unless it ends by itself within a moment: SIGTERM, SIGKILL
        after the grace), then every task's part (its ``orted``, or its wait)."""
        if self._thread is not None:
            self._thread.join(_SELF_STOP_S)
        self._stopper.request(signal.SIGTERM)
        super().stop(ctx, timeout)
