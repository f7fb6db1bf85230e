"""Allreduce across simulated hosts: spark_dl flat and hierarchical against torch.distributed
(gloo) and Open MPI, on network-namespace hosts joined by shaped links (issue 31).

    sudo PYTHONPATH=. .venv/bin/python benchmarks/multihost.py                  # 10gbit, 1gbit
    sudo PYTHONPATH=. .venv/bin/python benchmarks/multihost.py --quick          # seconds
    sudo PYTHONPATH=. .venv/bin/python benchmarks/multihost.py --rates 1gbit --iters 20

Root only: the hosts are Linux network namespaces made by tests/cluster/netns.py (each with
its own host name, IPC, /dev/shm and /etc/hosts, a veth on a private bridge; the filesystem
is shared). Every host's egress is shaped with tbf to each --rates value in turn. This
kernel has no netem, so links add no latency or loss: they are bandwidth-limited only, with
the sub-millisecond latency of veth pairs on one machine.

Layouts: 2 hosts x 2 ranks and 4 hosts x 1 rank (and, with --layouts 2x1, 2 hosts x 1 rank:
the exchange between two hosts alone). Per layout, two measures, every peer on
the same hosts in the same run, the peer order rotated each round:

  allreduce   a --size (64 MiB) float32 in-place sum-allreduce, timed per call on rank 0;
              busbw = bytes * 2(n-1)/n / time (n ranks, the nccl-tests definition).
  step        --tensors (200) float32 tensors of --elements (4096: 16 KiB) each, Horovod's
              pattern: an in-place async allreduce of each, then wait for all.

Peers (each rank started on its host with nsenter; ranks of one host share its memory):

  spark_dl flat          spark_dl.torch over Gloo TCP between all ranks (SDL_HIERARCHICAL=0);
                         the step: hvd.allreduce_async_ per tensor, then hvd.synchronize.
  spark_dl hierarchical  the same with SDL_HIERARCHICAL=1: shared memory within a host, Gloo
                         between one leader per host (2 x 2 only: with one rank per host it
                         is the flat path); allreduces over SDL_HIERARCHICAL_CHUNK_BYTES
                         (4 MiB) pipelined in chunks.
  spark_dl hierarchical, serial (--peers ...,hier_serial; not by default): the same with
                         SDL_HIERARCHICAL_CHUNK_BYTES=0, the three phases one after the other.
  torch gloo             torch.distributed, gloo backend, GLOO_SOCKET_IFNAME=eth0; the step:
                         dist.all_reduce(t, async_op=True) per tensor, then wait on each.
  Open MPI               mpi4py Allreduce (IN_PLACE) on NumPy buffers; the step: Iallreduce
                         per tensor, then Waitall. mpirun runs on the first host and starts
                         the others' daemons through an agent that enters a host by name with
                         nsenter (plm_rsh_agent) instead of ssh; TCP and out-of-band traffic
                         are restricted to eth0 (btl_tcp_if_include, oob_tcp_if_include).

The link bound: a ring allreduce sends 2(n-1)/n x bytes out of every rank, so on links of
B bytes/s busbw cannot exceed B; "share of link" is busbw / B. Hierarchical allreduce
crosses the hosts' links with 2(H-1)/H x bytes per host (H hosts), so its bound is
B x (2(n-1)/n) / (2(H-1)/H): 1.5 B at 2 x 2 (also printed, as "share of host bound"). tbf
counts Ethernet and IP/TCP headers too (about 4.4% at MTU 1500).

Printed per rate and layout: each peer's median, p10 and p90 over every call of every
round, the per-round medians, spark_dl's best (the faster of flat and hierarchical) as a
speed ratio against every peer (peer time / spark_dl time: >= 1 means spark_dl is at least
as fast), for spark_dl how long the step's ``allreduce_async_`` calls alone take and the
core's counters per step (cycles, collectives, response-cache hits), and issue 31's
targets: spark_dl's best >= every peer, busbw >= 85% of the link bound, hierarchical >= 1.3x
flat at 2 x 2.
"""

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import _harness as H

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NETNS_PATH = os.path.join(ROOT, "tests", "cluster", "netns.py")

PEERS = ("flat", "hier", "hier_serial", "torch", "mpi")
LABELS = {"flat": "spark_dl flat", "hier": "spark_dl hierarchical",
          "hier_serial": "spark_dl hierarchical, serial", "torch": "torch gloo",
          "mpi": "Open MPI"}
SPARK_DL = ("flat", "hier", "hier_serial")
HIER = ("hier", "hier_serial")
# name: (hosts, ranks per host); 2x1 (not in the default) is the cross-host exchange alone
LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1), "2x1": (2, 1)}
STEP_COUNTERS = ("cycles", "collectives", "cache_hits")
SDL_ENV = {}   # --env: settings for every spark_dl rank
TARGET_BUS_SHARE = 0.85
TARGET_HIER = 1.3


def load_netns():
    """tests/cluster/netns.py, imported by path (it is a test helper, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("netns", NETNS_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- worker side

class _Peer:
    """One rank of a peer: in-place sum-allreduce of ``buf``, a step over ``grads``, a
    barrier; the subclasses hold each framework's calls."""

    def __init__(self, peer, size_bytes, tensors, elements):
        self.peer, self.info = peer, {}
        self.names = [f"grad.{i}" for i in range(tensors)]
        self.buf = self.empty(size_bytes // 4)
        self.grads = [self.empty(elements) for _ in range(tensors)]

    def fill(self, buf, value):
        buf.fill(value)

    def counters(self):
        return {}

    def equal(self, buf, value):
        return bool((buf == value).all())


class _MpiPeer(_Peer):
    def __init__(self, *args):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        super().__init__(*args)
        self.info["version"] = MPI.Get_library_version().split(",")[0].strip()

    def empty(self, n):
        import numpy as np

        return np.empty(n, dtype=np.float32)

    def allreduce(self):
        self.comm.Allreduce(self.MPI.IN_PLACE, self.buf, op=self.MPI.SUM)

    def step(self):
        MPI = self.MPI
        MPI.Request.Waitall([self.comm.Iallreduce(MPI.IN_PLACE, g, op=MPI.SUM)
                             for g in self.grads])

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        self.MPI.Finalize()


class _TorchTensors(_Peer):
    def empty(self, n):
        import torch

        return torch.empty(n, dtype=torch.float32)

    def fill(self, buf, value):
        buf.fill_(value)


class _SparkDlPeer(_TorchTensors):
    """spark_dl.torch, Horovod's API; SDL_HIERARCHICAL in the environment picks the path."""

    def __init__(self, *args):
        import spark_dl.numpy as sdl_np
        import spark_dl.torch as hvd

        hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()
        self.enqueue = []
        super().__init__(*args)
        self.info["transport"] = sdl_np.transport()

    def counters(self):
        import spark_dl.numpy as sdl_np

        return sdl_np.counters()

    def allreduce(self):
        self.hvd.allreduce_(self.buf, op=self.hvd.Sum, name="big")

    def step(self):
        """Horovod's pattern: start every tensor's allreduce, then wait for all of them."""
        hvd = self.hvd
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(g, name=n, op=hvd.Sum)
                   for g, n in zip(self.grads, self.names)]
        self.enqueue.append(time.perf_counter() - t0)
        for h in handles:
            hvd.synchronize(h)

    def barrier(self):
        self.hvd.barrier()

    def close(self):
        self.hvd.shutdown()


class _TorchPeer(_TorchTensors):
    def __init__(self, *args):
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()
        super().__init__(*args)
        self.info["version"] = "torch " + torch.__version__

    def allreduce(self):
        self.dist.all_reduce(self.buf, op=self.dist.ReduceOp.SUM)

    def step(self):
        dist = self.dist
        works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True) for g in self.grads]
        for w in works:
            w.wait()

    def barrier(self):
        self.dist.barrier()

    def close(self):
        self.dist.destroy_process_group()


def make_peer(peer, size_bytes, tensors, elements):
    cls = {"mpi": _MpiPeer, "torch": _TorchPeer}.get(peer, _SparkDlPeer)
    return cls(peer, size_bytes, tensors, elements)


def _timed(peer, call, bufs, iters, warmup, what):
    """A first call on ones checks the sum; warm-up and timed calls then reduce zeros. The
    core's counters over the timed calls (spark_dl; empty for the others) go to
    ``peer.last_counters``, per call."""
    for b in bufs:
        peer.fill(b, 1)
    call()
    if not all(peer.equal(b, peer.size) for b in bufs):
        raise AssertionError(f"{peer.peer} {what}: allreduce of ones did not give {peer.size}")
    for b in bufs:
        peer.fill(b, 0)
    for _ in range(warmup):
        call()
    peer.barrier()
    samples, clock = [], time.perf_counter
    before = peer.counters()
    for _ in range(iters):
        t0 = clock()
        call()
        samples.append(clock() - t0)
    peer.last_counters = H.counter_delta(before, peer.counters(), STEP_COUNTERS, iters)
    return samples


def worker(args):
    peer = make_peer(args.worker, args.size, args.tensors, args.elements)
    # Start-up: from the driver's launch (MULTIHOST_LAUNCHED, wall clock) to this rank's init done.
    out = dict(peer.info, size=peer.size,
               startup_s=time.time() - float(os.environ.get("MULTIHOST_LAUNCHED", time.time())))
    out["allreduce"] = _timed(peer, peer.allreduce, [peer.buf], args.iters, args.warmup,
                              "allreduce")
    out["step"] = _timed(peer, peer.step, peer.grads, args.steps, args.warmup, "step")
    if peer.last_counters:  # spark_dl: the calls alone within each timed step, the counters
        out["step_enqueue"] = peer.enqueue[-args.steps:]
        out["step_counters"] = peer.last_counters
    if peer.rank == 0:
        H.print_result(out)
    peer.close()
    # Done: skip the interpreter's teardown, which takes torch seconds on a busy machine
    # (the collectives are shut down and MPI finalized above).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- launching

class JobFailed(RuntimeError):
    pass


def _env(extra):
    env = H._base_env()
    env["MULTIHOST_LAUNCHED"] = repr(time.time())
    # A parent's rank variables must not leak into a job of another shape.
    for key in [k for k in env if k.startswith(("SDL_", "HOROVOD_", "OMPI_", "PMIX_"))]:
        del env[key]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _wait_all(procs, hosts, deadline, what):
    """Waits (bounded) for every process; the first failure or the deadline kills the rest."""
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            failed = f"{what}: a process exited {[c for c in codes if c]}"
            break
        if all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            failed = f"{what}: did not finish in time (timeout; killed)"
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    # Whatever a launcher left on the hosts (orted, a forked rank) goes with the job.
    for host in hosts:
        if host.processes():
            host.kill_all()
    return failed


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


def _result(logs, failed):
    text = "".join(_read(p) for p in logs[:1])
    result = None if failed else H.parse_result(text)
    if result is None:
        tail = "\n".join(f"--- {os.path.basename(p)}\n{_read(p)[-2500:]}" for p in logs)
        raise JobFailed(f"{failed or 'rank 0 printed no result'}\n{tail}")
    return result


def run_store_job(cluster, hosts, per_host, peer, wargs, timeout, workdir, hier_chunk=None):
    """spark_dl or torch: one process per rank, started on its host with Host.popen."""
    n = len(hosts) * per_host
    env_common = {"PYTHONUNBUFFERED": "1"}
    server = None
    if peer in SPARK_DL:
        env_common.update(SDL_ENV)
        from spark_dl.runner.kvstore import KVStoreServer

        secret = secrets.token_bytes(32)
        server = KVStoreServer(secret, host=cluster.gateway())
        port = server.start()
        env_common.update(SDL_RENDEZVOUS_ADDR=cluster.gateway(), SDL_RENDEZVOUS_PORT=port,
                          SDL_SECRET_KEY=secret.hex(), SDL_JOB_ID=secrets.token_hex(8),
                          SDL_CONTROLLER="gloo", SDL_SIZE=n, SDL_LOCAL_SIZE=per_host,
                          SDL_CROSS_SIZE=len(hosts), SDL_START_TIMEOUT=60,
                          SDL_HIERARCHICAL=1 if peer in HIER else 0)
        if peer == "hier_serial":  # the three phases one after the other (no pipeline)
            env_common["SDL_HIERARCHICAL_CHUNK_BYTES"] = 0
        elif peer == "hier" and hier_chunk is not None:
            env_common["SDL_HIERARCHICAL_CHUNK_BYTES"] = hier_chunk
    else:
        env_common.update(MASTER_ADDR=hosts[0].address,
                          MASTER_PORT=20000 + secrets.randbelow(30000),
                          WORLD_SIZE=n, GLOO_SOCKET_IFNAME="eth0")
    procs, logs = [], []
    try:
        for h, host in enumerate(hosts):
            for local in range(per_host):
                rank = h * per_host + local
                extra = dict(env_common)
                if peer in SPARK_DL:
                    extra.update(SDL_RANK=rank, SDL_LOCAL_RANK=local, SDL_CROSS_RANK=h,
                                 SDL_HOSTNAME=host.address)
                else:
                    extra.update(RANK=rank)
                log = os.path.join(workdir, f"{peer}.rank{rank}.log")
                logs.append(log)
                with open(log, "w") as f:
                    procs.append(host.popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", peer] + wargs,
                        env=_env(extra), stdout=f, stderr=subprocess.STDOUT))
        failed = _wait_all(procs, hosts, time.monotonic() + timeout, LABELS[peer])
    finally:
        _wait_all(procs, hosts, 0, "cleanup")
        if server is not None:
            server.stop()
    return _result(logs, failed)


def write_agent(hosts, workdir):
    """An rsh agent for mpirun: "agent [options] HOST command..." runs the command on HOST
    (its namespaces, entered with nsenter) through a shell, as ssh would."""
    path = os.path.join(workdir, "nsenter-agent")
    cases = "\n".join(f"    {h.name}|{h.address}) set -- {shlex.join(h.nsenter())} ;;"
                      for h in hosts)
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
# Written by benchmarks/multihost.py: mpirun's plm_rsh_agent for namespace hosts.
while [ $# -gt 0 ] && [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
command="$*"
case "$host" in
{cases}
    *) echo "nsenter-agent: unknown host '$host'" >&2; exit 255 ;;
esac
exec "$@" /bin/sh -c "$command"
""")
    os.chmod(path, 0o755)
    return path


def run_mpi_job(cluster, hosts, per_host, wargs, timeout, workdir, mpi_args):
    """Open MPI: mpirun on the first host; the other hosts' daemons through the agent."""
    n = len(hosts) * per_host
    agent = write_agent(cluster.hosts, workdir)
    env = _env({"OMPI_ALLOW_RUN_AS_ROOT": 1, "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": 1,
                "PYTHONUNBUFFERED": 1})
    argv = (["mpirun", "-np", n, "--host", ",".join(f"{h.name}:{per_host}" for h in hosts),
             "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
             "--mca", "plm_rsh_agent", agent,
             "--mca", "plm_rsh_no_tree_spawn", "1",
             "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
             "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED"] + list(mpi_args)
            + [sys.executable, os.path.abspath(__file__), "--worker", "mpi"] + wargs)
    log = os.path.join(workdir, "mpi.log")
    with open(log, "w") as f:
        proc = hosts[0].popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
    failed = _wait_all([proc], hosts, time.monotonic() + timeout, LABELS["mpi"])
    return _result([log], failed)


# ----------------------------------------------------------------------------- driver side

def link_bytes_per_s(rate):
    return load_netns()._rate_bits(rate) / 8


def job_timeout(args, rate, n):
    """Seconds a job may take: 2 minutes of start-up, 10x its transfers at the shaped rate
    and 50 ms per small allreduce (a latency-bound step is slow on a busy machine)."""
    if args.job_timeout:
        return args.job_timeout
    wire = 2 * (n - 1) / n
    calls = args.iters + args.warmup + 1
    steps = args.steps + args.warmup + 1
    moved = (calls * args.size + steps * args.tensors * args.elements * 4) * wire
    return 120 + 10 * moved / link_bytes_per_s(rate) + 0.05 * steps * args.tensors


def peers_for(layout, peers):
    """The peers of a layout: hierarchical only where a host has several ranks."""
    return [p for p in peers if not (p in HIER and LAYOUTS[layout][1] == 1)]


def run_job(cluster, layout, peer, wargs, timeout, workdir, mpi_args, hier_chunk=None):
    hosts_n, per_host = LAYOUTS[layout]
    hosts = cluster.hosts[:hosts_n]
    if peer == "mpi":
        return run_mpi_job(cluster, hosts, per_host, wargs, timeout, workdir, mpi_args)
    return run_store_job(cluster, hosts, per_host, peer, wargs, timeout, workdir, hier_chunk)


def measure(args, netns):
    """Runs every (rate, round, layout, peer) job, the peer order rotated each round; returns
    one entry per (rate, layout) with every job's result (or error)."""
    wargs = [str(a) for a in ("--size", args.size, "--tensors", args.tensors, "--elements",
                              args.elements, "--iters", args.iters, "--steps", args.steps,
                              "--warmup", args.warmup)]
    configs = {(r, lay): {"rate": r, "layout": lay, "errors": {},
                          "results": {p: [] for p in peers_for(lay, args.peers)}}
               for r in args.rates for lay in args.layouts}
    most = max(LAYOUTS[lay][0] for lay in args.layouts)
    with tempfile.TemporaryDirectory(prefix="sdl-multihost-") as workdir, \
            netns.Cluster(most) as cluster:
        for rate in args.rates:
            cluster.shape(rate=rate)
            for rnd in range(args.rounds):
                for layout in args.layouts:
                    cfg = configs[(rate, layout)]
                    order = list(cfg["results"])
                    order = order[rnd % len(order):] + order[:rnd % len(order)]
                    timeout = job_timeout(args, rate, LAYOUTS[layout][0] * LAYOUTS[layout][1])
                    for peer in order:
                        t0 = time.perf_counter()
                        try:
                            cfg["results"][peer].append(
                                run_job(cluster, layout, peer, wargs, timeout, workdir,
                                        args.mpi_args, args.hier_chunk_bytes))
                            status = "done"
                        except JobFailed as e:
                            cfg["errors"].setdefault(peer, []).append(str(e))
                            status = f"FAILED:\n{e}"
                        print(f"  {rate} {layout} round {rnd + 1}/{args.rounds}: "
                              f"{LABELS[peer]} {status} ({time.perf_counter() - t0:.1f} s)",
                              file=sys.stderr, flush=True)
    return list(configs.values())


def _stats(samples):
    return {"median": H.median(samples), "p10": H.percentile(samples, 10),
            "p90": H.percentile(samples, 90)}


def report(args, configs):
    """Prints the tables and target lines; returns the summary (also saved with --json)."""
    summary = []
    print(f"## Multi-host allreduce (issue 31): {args.rounds} round(s), "
          f"{H.fmt_size(args.size)} allreduce x {args.iters} per job, step of {args.tensors} x "
          f"{H.fmt_size(args.elements * 4)} x {args.steps} per job\n")
    print(f"machine: {args.machine}; load average (1/5/15 min) at the start: "
          f"{args.load_before}, at the end: {args.load_after}")
    print(f"spark_dl: {args.revision}")
    print("hosts: network namespaces on this one machine (tests/cluster/netns.py), each "
          "host's egress shaped with tbf; this kernel has no netem, so no added latency or "
          "loss (veth latency only)\n")
    for cfg in configs:
        rate, layout = cfg["rate"], cfg["layout"]
        hosts_n, per_host = LAYOUTS[layout]
        n = hosts_n * per_host
        link = link_bytes_per_s(rate)
        host_factor = (2 * (n - 1) / n) / (2 * (hosts_n - 1) / hosts_n)
        res = {p: r for p, r in cfg["results"].items() if r}
        print(f"### {rate}, {hosts_n} hosts x {per_host} rank{'s' if per_host > 1 else ''} "
              f"(n = {n})\n")
        print(f"link bound: busbw <= {link / 1e9:.3f} GB/s (the shaped rate); hierarchical "
              f"crosses the links with 2(H-1)/H x bytes per host, bound "
              f"{link * host_factor / 1e9:.3f} GB/s busbw\n")
        out = {"rate": rate, "layout": layout, "n": n, "link_GBps": link / 1e9, "peers": {}}
        rows = []
        for peer, rounds in res.items():
            ar = _stats(H.pooled(r["allreduce"] for r in rounds))
            st = _stats(H.pooled(r["step"] for r in rounds))
            busbw = args.size * 2 * (n - 1) / n / ar["median"]
            bound = link * (host_factor if rounds[0].get("transport") == "hierarchical" else 1)
            out["peers"][peer] = {"allreduce_s": ar, "step_s": st, "busbw_GBps": busbw / 1e9,
                                  "link_share": busbw / link, "own_bound_share": busbw / bound,
                                  "transport": rounds[0].get("transport",
                                                             rounds[0].get("version", "")),
                                  "round_medians_allreduce_s":
                                      [H.median(r["allreduce"]) for r in rounds],
                                  "round_medians_step_s": [H.median(r["step"]) for r in rounds]}
            rows.append([LABELS[peer] + f" ({out['peers'][peer]['transport']})",
                         H.fmt_time(ar["median"]),
                         f"{H.fmt_time(ar['p10'])} / {H.fmt_time(ar['p90'])}",
                         f"{busbw / 1e9:.3f}", f"{busbw / link:.0%}", f"{busbw / bound:.0%}",
                         " / ".join(H.fmt_time(x) for x in
                                    out["peers"][peer]["round_medians_allreduce_s"]),
                         H.fmt_time(st["median"]),
                         f"{H.fmt_time(st['p10'])} / {H.fmt_time(st['p90'])}",
                         " / ".join(H.fmt_time(x) for x in
                                    out["peers"][peer]["round_medians_step_s"]),
                         " / ".join(f"{r['startup_s']:.1f} s" for r in rounds)])
        for peer, errors in cfg["errors"].items():
            rows.append([LABELS[peer], f"FAILED ({len(errors)} job(s))"] + [""] * 9)
        print(H.markdown_table(
            ["peer", f"{H.fmt_size(args.size)} median", "p10 / p90", "busbw GB/s",
             "share of link", "share of own bound", "per-round medians", "step median",
             "step p10 / p90", "step per-round medians", "start-up"], rows) + "\n")
        for peer, rounds in res.items():
            if rounds[0].get("step_enqueue"):
                calls = H.median(H.pooled(r["step_enqueue"] for r in rounds))
                per = {k: H.median([r["step_counters"][k] for r in rounds])
                       for k in STEP_COUNTERS}
                out["peers"][peer].update(step_enqueue_s=calls, step_counters=per)
                print(f"- {LABELS[peer]}: the step's {args.tensors} `allreduce_async_` calls "
                      f"take {H.fmt_time(calls)} of it (median, rank 0); per step "
                      + ", ".join(f"{v:.1f} {k}" for k, v in per.items()))
        out["targets"] = targets(args, out, layout)
        summary.append(out)
        print()
    return summary


def targets(args, out, layout):
    """Prints spark_dl's ratios against the peers and issue 31's targets; returns them."""
    peers = out["peers"]
    met = {}
    mine = [p for p in SPARK_DL if p in peers]
    if not mine:
        print("spark_dl: no result, no ratios")
        return met
    for metric, key in (("allreduce", "allreduce_s"), ("step", "step_s")):
        best = min(mine, key=lambda p: peers[p][key]["median"])
        t = peers[best][key]["median"]
        ratios = {p: peers[p][key]["median"] / t for p in peers if p not in SPARK_DL}
        line = ", ".join(f"{r:.2f}x {LABELS[p]}" for p, r in ratios.items()) or "no other peer"
        ok = bool(ratios) and all(r >= 1.0 for r in ratios.values())
        missing = [LABELS[p] for p in ("torch", "mpi") if p not in peers]
        met[f"best_{metric}_vs_peers"] = ok
        print(f"- {metric}: spark_dl's best ({LABELS[best]}, {H.fmt_time(t)}) is {line} "
              f"(peer time / spark_dl time); target spark_dl's best >= every peer: "
              f"{'met' if ok else 'NOT met'}"
              + (f" (no result from {', '.join(missing)})" if missing else ""))
    best = min(mine, key=lambda p: peers[p]["allreduce_s"]["median"])
    share = peers[best]["link_share"]
    met["busbw_85pct"] = share >= TARGET_BUS_SHARE
    own = peers[best]["own_bound_share"]
    print(f"- busbw: spark_dl's best {peers[best]['busbw_GBps']:.3f} GB/s = {share:.0%} of the "
          f"link bound ({out['link_GBps']:.3f} GB/s); target >= {TARGET_BUS_SHARE:.0%}: "
          f"{'met' if met['busbw_85pct'] else 'NOT met'}"
          + (f" ({own:.0%} of the hierarchical path's own bound)" if own != share else ""))
    if layout == "2x2" and "flat" in peers and "hier" in peers:
        gain = peers["flat"]["allreduce_s"]["median"] / peers["hier"]["allreduce_s"]["median"]
        step_gain = peers["flat"]["step_s"]["median"] / peers["hier"]["step_s"]["median"]
        met["hier_1_3x_flat"] = gain >= TARGET_HIER
        print(f"- hierarchical / flat: {gain:.2f}x on the allreduce (ideal 1.5x: 2(n-1)/n = 1.5 "
              f"against 2(H-1)/H = 1 x bytes per host link), {step_gain:.2f}x on the step; "
              f"target >= {TARGET_HIER}x: {'met' if met['hier_1_3x_flat'] else 'NOT met'}")
    if "hier" in peers and "hier_serial" in peers:
        ratio = (peers["hier_serial"]["allreduce_s"]["median"]
                 / peers["hier"]["allreduce_s"]["median"])
        print(f"- pipelined / serial hierarchical: {ratio:.2f}x on the allreduce")
    return met


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="10gbit,1gbit",
                        help="tbf rates of the hosts' links, in tc's units (default "
                             "10gbit,1gbit; --quick: the first only)")
    parser.add_argument("--layouts", default="2x2,4x1",
                        help="hosts x ranks per host: 2x2, 4x1, 2x1 (default 2x2,4x1)")
    parser.add_argument("--peers", default=",".join(p for p in PEERS if p != "hier_serial"),
                        help=f"subset of {','.join(PEERS)} (default: all but hier_serial)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="jobs of every peer per rate and layout, interleaved (default 3)")
    parser.add_argument("--iters", type=int, default=10,
                        help="timed allreduces per job (default 10)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per job (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each (default 1)")
    parser.add_argument("--size", type=H.parse_size, default=64 << 20,
                        help="allreduce bytes (default 64M)")
    parser.add_argument("--tensors", type=int, default=200, help="tensors per step (default 200)")
    parser.add_argument("--elements", type=int, default=4096,
                        help="float32 elements per step tensor (default 4096: 16 KiB)")
    parser.add_argument("--hier-chunk-bytes", type=int, default=None,
                        help="SDL_HIERARCHICAL_CHUNK_BYTES of the hier peer (default: the "
                             "core's, 4 MiB; hier_serial always runs with 0)")
    parser.add_argument("--mpi-args", type=shlex.split, default=[],
                        help="extra mpirun options (write --mpi-args='...')")
    parser.add_argument("--job-timeout", type=float, default=0,
                        help="seconds one job may take (default: 60 + 5x its transfers at "
                             "the shaped rate)")
    parser.add_argument("--env", action="append", default=[], metavar="SDL_KNOB=VALUE",
                        help="a setting for every spark_dl rank (repeatable), e.g. "
                             "--env SDL_CYCLE_TIME=0.5")
    parser.add_argument("--json", metavar="FILE", help="save the options, raw times and summary")
    parser.add_argument("--quick", action="store_true",
                        help="a short run for tests: the first rate and layout, 1 round, "
                             "8 MiB x 3, 3 steps, no warm-up")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    for item in args.env:
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("SDL_"):
            parser.error(f"--env {item!r}: expected SDL_NAME=VALUE")
        SDL_ENV[key] = value
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [x for x in args.layouts if x not in LAYOUTS] + [p for p in args.peers if p not in PEERS]
    if bad:
        parser.error(f"unknown layouts or peers: {bad}")
    if args.quick:
        args.rates, args.rounds = args.rates[:1], 1
        args.layouts = args.layouts[:1]
        args.size = min(args.size, 8 << 20)
        args.iters, args.steps, args.warmup = min(args.iters, 3), min(args.steps, 3), 0
    netns = load_netns()
    for rate in args.rates:
        try:
            netns._rate_bits(rate)  # a bad unit fails here, before any host is made
        except ValueError as e:
            parser.error(str(e))
    reason = netns.unavailable()
    if reason:
        print(f"multihost.py: cannot make namespace hosts: {reason}", file=sys.stderr)
        return 2
    args.machine, args.load_before = H.describe_machine(), H.load_average()
    args.revision = H.git_revision()
    print(f"multi-host benchmark: rates {', '.join(args.rates)}, layouts "
          f"{', '.join(args.layouts)}, {args.rounds} round(s) of {', '.join(args.peers)}",
          file=sys.stderr, flush=True)
    configs = measure(args, netns)
    args.load_after = H.load_average()
    summary = report(args, configs)
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        with open(args.json, "w") as f:
            json.dump({"args": keep, "configs": configs, "summary": summary}, f, indent=1)
    return 1 if any(cfg["errors"] for cfg in configs) else 0


if __name__ == "__main__":
    sys.exit(main())
