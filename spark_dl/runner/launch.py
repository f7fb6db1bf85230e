"""The ``sdlrun`` command and its Python API, :func:`run_command`.

``sdlrun -np 4 -H a:2,b:2 python train.py`` starts four workers, two per host, each with
its rank environment, and returns when they are done; ``sdlrun --mpi ...`` does it through
Open MPI's ``mpirun`` (:func:`choose_controller` says which is used when neither
``--gloo`` nor ``--mpi`` is given). See ``docs/sdlrun.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from spark_dl.config import knobs
from spark_dl.runner.hosts import (HostSlots, assign_ranks, is_local_host, merge_hosts,
                                   parse_hostfile, parse_hosts)
from spark_dl.runner.options import LaunchError, LaunchOptions
from spark_dl.runner.workers import Stopper

HostsArg = Union[None, str, Sequence[Union[HostSlots, str, tuple]]]


def _to_hosts(hosts: HostsArg, hostfile: Optional[str], np: int) -> List[HostSlots]:
    if hosts is not None and hostfile is not None:
        raise ValueError("give hosts or a hostfile, not both")
    if hostfile is not None:
        return parse_hostfile(hostfile)
    if hosts is None:
        return [HostSlots("localhost", np)]
    if isinstance(hosts, str):
        return parse_hosts(hosts)
    result = []
    for host in hosts:
        if isinstance(host, HostSlots):
            result.append(host)
        elif isinstance(host, str):
            result.extend(parse_hosts(host))
        else:
            name, slots = host
            result.append(HostSlots(str(name), int(slots)))
    return result


@contextlib.contextmanager
def _forward_signals(stopper: Stopper) -> Iterator[None]:
    """Routes SIGINT/SIGTERM to ``stopper`` while launching (main thread only: elsewhere,
    e.g. inside a Spark driver thread, the caller keeps its own handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _frame: stopper.request(s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _core_build() -> Optional[Mapping[str, bool]]:
    """The core's ``build_info()``, or None where the core is not built (the runner works
    without it: it may launch on hosts that only launch)."""
    try:
        from spark_dl.common.native import core as _core
    except ImportError:
        return None
    return _core.build_info()


def choose_controller(requested: str = "auto", env: Optional[Mapping[str, str]] = None,
                      mpirun: str = "mpirun", mpi_args: Union[str, Sequence[str]] = ()
                      ) -> Tuple[str, str]:
    """Which launcher runs a job, ``"gloo"`` or ``"mpi"``, and why (for ``--verbose``).

    1. ``requested`` when it is ``"gloo"`` or ``"mpi"`` (``--gloo``, ``--mpi``); else
       MPI when ``mpi_args`` are given.
    2. Else ``SDL_CONTROLLER`` (from ``env``, else this process's environment) when it is
       ``gloo`` or ``mpi``: the workers' controller knob also picks their launcher.
    3. Else Gloo, which needs nothing outside spark_dl, even where MPI is available too;
       only a core built without Gloo but with MPI, with ``mpirun`` on ``PATH``, makes it
       MPI.

    Args:
        requested: ``"auto"``, ``"gloo"`` or ``"mpi"``.
        env: the job's extra environment (``run_command``'s ``env``).
        mpirun: the ``mpirun`` program to look for.
        mpi_args: ``--mpi-args``.

    Raises:
        ValueError: ``mpi_args`` with ``requested="gloo"``, or a bad ``SDL_CONTROLLER``.
    """
    if requested == "gloo" and mpi_args:
        raise ValueError("--mpi-args needs --mpi")
    if requested in ("gloo", "mpi"):
        return requested, f"--{requested}"
    if mpi_args:
        return "mpi", "--mpi-args given"
    knob = knobs.value("controller", {**os.environ, **(env or {})})
    if knob in ("gloo", "mpi"):
        return knob, f"SDL_CONTROLLER={knob}"
    build = _core_build()
    if build is not None and not build.get("gloo") and build.get("mpi"):
        if shutil.which(mpirun):
            return "mpi", "this spark_dl build has MPI but no Gloo"
    return "gloo", "the default; --mpi launches through mpirun"


def _mpi_build_warning() -> Optional[str]:
    build = _core_build()
    if build is not None and not build.get("mpi"):
        from spark_dl.common.native import mpi_missing_reason

        return ("sdlrun: warning: spark_dl.init() will fail in the workers under --mpi: "
                f"{mpi_missing_reason()}; or use --gloo\n")
    return None


def run_command(command: Sequence[str], np: Optional[int], hosts: HostsArg = None,
                env: Optional[Mapping[str, str]] = None, hostfile: Optional[str] = None,
                elastic=None, **options) -> int:
    """Runs ``command`` on ``np`` workers and returns the job's exit code.

    Args:
        command: program and arguments, run by every rank.
        np: number of workers.
        hosts: ``"a:2,b:2"``, or a list of :class:`HostSlots`, ``"host:slots"`` strings or
            ``(host, slots)`` pairs; default ``localhost:np``.
        env: extra environment variables for every worker.
        hostfile: a host file instead of ``hosts``.
        elastic: an :class:`~spark_dl.runner.elastic.ElasticOptions` to run an elastic
            job (docs/elastic.md); ``np`` may then be None (up to ``max_np`` workers start
            on the hosts' slots).
        **options: fields of :class:`~spark_dl.runner.options.LaunchOptions`
            (``controller``, ``mpi_args``, ``start_timeout``, ``output_dir``,
            ``verbose``, ``kill_grace`` ...).

    Returns:
        0 when every worker succeeded; else the exit code of the first worker that failed
        (128+N if killed by signal N), 128+N if the launcher received signal N, 1 if
        workers did not start in time, 126/127 if the command could not be started.

    Raises:
        ValueError: bad hosts, np or options.
        TypeError: an unknown option.
        LaunchError: MPI asked for, and no Open MPI ``mpirun`` found.
    """
    if not command:
        raise ValueError("no command to run")
    opts = LaunchOptions(**options)
    opts.validate()
    if not opts.network_interface:  # the workers' Gloo interface knob chooses it too
        opts.network_interface = knobs.value("gloo_iface", {**os.environ, **(env or {})}) or None
    stderr = opts.stderr or sys.stderr.buffer
    if elastic is not None:
        return _run_elastic(command, np, hosts, hostfile, env, elastic, opts, stderr)
    if np is None:
        raise ValueError("-np is required (unless the job is elastic)")
    host_list = merge_hosts(_to_hosts(hosts, hostfile, np), is_local=is_local_host)
    slots = assign_ranks(host_list, np)
    controller, reason = choose_controller(opts.controller, env, opts.mpirun, opts.mpi_args)
    if opts.verbose:
        name = {"gloo": "Gloo", "mpi": "MPI (mpirun)"}[controller]
        _say(stderr, f"sdlrun: launching with {name}: {reason}\n")
    stopper = Stopper()
    if controller == "mpi":
        from spark_dl.runner.mpi_run import run_mpi
        warning = _mpi_build_warning()
        if warning:
            _say(stderr, warning)
        with _forward_signals(stopper):
            return run_mpi(list(command), slots, opts, env=env, stopper=stopper)
    from spark_dl.runner.gloo_run import run_gloo
    with _forward_signals(stopper):
        return run_gloo(list(command), slots, opts, env=env, stopper=stopper)


def _run_elastic(command, np, hosts, hostfile, env, elastic, opts, stderr) -> int:
    from spark_dl.runner.elastic import run_elastic

    if opts.controller == "mpi" or opts.mpi_args:
        raise ValueError("an elastic job runs on Gloo: Open MPI cannot re-form a job's "
                         "communicator when a process is lost; drop --mpi")
    if elastic.max_np is None and np is not None and elastic.discovery_script is None:
        elastic.max_np = max(np, elastic.min_np)
    elastic.validate()
    host_list = []
    if elastic.discovery_script is None:
        host_list = merge_hosts(_to_hosts(hosts, hostfile, np or elastic.min_np),
                                is_local=is_local_host)
        total = sum(h.slots for h in host_list)
        if total < elastic.min_np:
            raise ValueError(f"--min-np {elastic.min_np} exceeds the {total} slots of "
                             + ",".join(str(h) for h in host_list))
    elif hosts is not None or hostfile is not None:
        raise ValueError("give hosts (-H/--hostfile) or --host-discovery-script, not both")
    if opts.verbose:
        _say(stderr, f"sdlrun: elastic job on Gloo: {elastic.min_np} to "
                     f"{elastic.max_np or 'any number of'} workers\n")
    stopper = Stopper()
    with _forward_signals(stopper):
        return run_elastic(list(command), host_list, opts, elastic, env=env, stopper=stopper)


def _say(stream, text: str) -> None:
    stream.write(text.encode())
    stream.flush()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdlrun", allow_abbrev=False,
        description="Launch a spark_dl (or Horovod-style) job: run COMMAND once per rank.",
        epilog="Example: sdlrun -np 4 -H host1:2,host2:2 python train.py")
    parser.add_argument("-np", "--num-proc", dest="np", type=int,
                        help="number of workers (ranks); an elastic job's starting and "
                             "default minimum and maximum number")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="host:slots,... (default: localhost:NP)")
    where.add_argument("--hostfile", help="file with one 'host slots=N' or 'host:N' per line")
    parser.add_argument("--start-timeout", type=float, metavar="SECONDS",
                        help="how long workers may take to start and meet (default: "
                             "SDL_START_TIMEOUT, else "
                             f"{knobs.table()['start_timeout_s'].default:g})")
    parser.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.<r>/{stdout,stderr}")
    parser.add_argument("--prefix-output-with-timestamp", action="store_true",
                        help="put a timestamp before every forwarded line")
    parser.add_argument("--disable-output-prefix", action="store_true",
                        help="forward worker output without the [rank]<stream> prefix")
    parser.add_argument("--verbose", action="store_true",
                        help="report hosts, ranks, commands and rendezvous traffic")
    controller = parser.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                            help="start one process per rank, meeting through sdlrun's "
                                 "rendezvous server, on Gloo (the default)")
    controller.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                            help="launch through Open MPI's mpirun; the workers use MPI")
    parser.add_argument("--mpi-args", default="", metavar="ARGS",
                        help="extra mpirun arguments, split like a shell line "
                             "(--mpi only; write --mpi-args=\"-x FOO\")")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port of remote hosts")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh private key for remote hosts")
    parser.add_argument("--rendezvous-addr", metavar="ADDR",
                        help="address workers use to reach this launcher (default: "
                             "127.0.0.1 for local jobs, else the address on the route to "
                             "the first remote host)")
    parser.add_argument("--network-interface", "--network-interfaces", dest="nic",
                        metavar="NIC",
                        help="the network interface every host uses for the job: the "
                             "rendezvous server, the workers' addresses and their data "
                             "(--mpi: Open MPI's oob/btl_tcp_if_include; a comma list "
                             "there). Default: SDL_GLOO_IFACE, else "
                             "the interface on the route to the first remote host")
    parser.add_argument("--timeline-filename", metavar="PATH",
                        help="rank 0 writes a Chrome-trace timeline of the core to PATH "
                             "(sets SDL_TIMELINE for the workers; docs/observability.md)")
    parser.add_argument("--timeline-mark-cycles", action="store_true",
                        help="the timeline also marks every negotiation cycle "
                             "(SDL_TIMELINE_MARK_CYCLES)")
    parser.add_argument("--autotune", action="store_true",
                        help="rank 0 tunes fusion threshold, cycle time, response cache and "
                             "(several hosts) hierarchical allreduce while training "
                             "(SDL_AUTOTUNE; docs/observability.md)")
    parser.add_argument("--autotune-log-file", metavar="PATH",
                        help="rank 0 writes autotune's samples to this CSV (SDL_AUTOTUNE_LOG)")
    for flag, knob in (("--autotune-warmup-samples", "SDL_AUTOTUNE_WARMUP_SAMPLES"),
                       ("--autotune-steps-per-sample", "SDL_AUTOTUNE_STEPS_PER_SAMPLE"),
                       ("--autotune-bayes-opt-max-samples", "SDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")):
        parser.add_argument(flag, type=int, metavar="N", help=f"sets {knob}")
    parser.add_argument("--autotune-gaussian-process-noise", type=float, metavar="X",
                        help="sets SDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE")
    elastic = parser.add_argument_group(
        "elastic jobs", "workers may come and go while the job trains (docs/elastic.md); "
        "any of --min-np, --max-np or --host-discovery-script makes a job elastic")
    elastic.add_argument("--min-np", type=int, metavar="N",
                         help="fewest workers that train (default: -np)")
    elastic.add_argument("--max-np", type=int, metavar="N",
                         help="most workers at once (default: -np with fixed hosts, else "
                              "every discovered slot)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="prints the available hosts, one host:slots per line; run "
                              "every second")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int,
                         default=1, metavar="N",
                         help="slots of a discovered host printed without :N (default 1)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="SECONDS",
                         help="how long the job may have fewer than --min-np workers "
                              "(default: SDL_ELASTIC_TIMEOUT, else 600)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="end the job after N re-formations (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                         metavar=("LOW", "HIGH"),
                         help="a host where a worker failed takes no new worker for a "
                              "random LOW..HIGH seconds (default: for the rest of the job)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="program and arguments")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sdlrun`` and ``python -m spark_dl.runner``; returns the exit code."""
    parser = make_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given")
    options = dict(controller=args.controller or "auto", mpi_args=args.mpi_args,
                   output_dir=args.output_filename, verbose=args.verbose,
                   prefix_output=not args.disable_output_prefix,
                   prefix_timestamp=args.prefix_output_with_timestamp,
                   ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
                   rendezvous_addr=args.rendezvous_addr, network_interface=args.nic)
    if args.start_timeout is not None:  # else LaunchOptions reads the knob
        options["start_timeout"] = args.start_timeout
    env = {}  # the workers' knobs these flags set (a relative path is the workers' cwd's)
    if args.timeline_filename:
        env["SDL_TIMELINE"] = args.timeline_filename
    if args.timeline_mark_cycles:
        env["SDL_TIMELINE_MARK_CYCLES"] = "1"
    if args.autotune:
        env["SDL_AUTOTUNE"] = "1"
    for value, knob in ((args.autotune_log_file, "SDL_AUTOTUNE_LOG"),
                        (args.autotune_warmup_samples, "SDL_AUTOTUNE_WARMUP_SAMPLES"),
                        (args.autotune_steps_per_sample, "SDL_AUTOTUNE_STEPS_PER_SAMPLE"),
                        (args.autotune_bayes_opt_max_samples, "SDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
                        (args.autotune_gaussian_process_noise,
                         "SDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE")):
        if value is not None:
            env[knob] = str(value)
    elastic = None
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        from spark_dl.runner.elastic import ElasticOptions

        min_np = args.min_np if args.min_np is not None else args.np
        if min_np is None:
            parser.error("an elastic job needs --min-np or -np")
        elastic = ElasticOptions(
            min_np=min_np, max_np=args.max_np, discovery_script=args.host_discovery_script,
            slots_per_host=args.slots_per_host,
            timeout=(args.elastic_timeout if args.elastic_timeout is not None
                     else knobs.value("elastic_timeout_s")),
            reset_limit=args.reset_limit,
            cooldown_range=(tuple(args.blacklist_cooldown_range)
                            if args.blacklist_cooldown_range else None))
    elif args.np is None:
        parser.error("-np is required")
    try:
        return run_command(command, args.np, hosts=args.hosts, hostfile=args.hostfile,
                           env=env or None, elastic=elastic, **options)
    except (ValueError, OSError, LaunchError) as exc:
        print(f"sdlrun: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
