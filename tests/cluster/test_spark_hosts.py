"""spark_dl on a Spark standalone cluster of two hosts (issue 31).

Hosts (netns.py): ``client`` runs the standalone master and the application's driver;
``host0`` and ``host1`` run one Worker each (2 cores: 2 task slots). ``spark_dl.spark.run``
with Gloo and with MPI across 2 hosts x 2 slots must give ranks grouped by host (the ranks
of one host share its host hash and local ranks 0..1; cross ranks 0..1), move intra-host
traffic through shared memory (the loopback interface stays quiet while a host-local
process set allreduces megabytes) and inter-host traffic over eth0 (at least the data of
the cross-host allreduces leaves each host's eth0), and reduce right. A TorchEstimator
fit across the two hosts must equal the same fit (same ranks, data, partitioning, seed,
a Store on the shared filesystem) run on the client host alone.
"""

import sys

import cloudpickle
import pytest

import netns
from spark_standalone import client_and_two_workers

pytest.importorskip("pyspark")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the driver cannot import it

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

MIB = 1 << 20
# The allreduce moved in each phase: well above the background traffic of one phase
# (task pings every second, Spark heartbeats, negotiation: kilobytes).
PAYLOAD = 4 * MIB
ROUNDS = 3


@pytest.fixture(scope="module")
def setup():
    with client_and_two_workers(netns) as both:
        yield both


@pytest.fixture(scope="module")
def hosts(setup):
    return setup[0]


@pytest.fixture(scope="module")
def standalone(setup):
    return setup[1]


# ------------------------------------------------------------------------- the workers


def topology(payload, rounds):
    """Rank placement, transports, interface byte counts per phase, an allreduce."""
    import os
    import socket

    import numpy as np

    import spark_dl.numpy as sdl
    from spark_dl.spark.launch.network import host_hash

    def nic_bytes():
        out = {}
        for nic in ("lo", "eth0"):
            for way in ("tx", "rx"):
                with open(f"/sys/class/net/{nic}/statistics/{way}_bytes") as f:
                    out[f"{nic}_{way}"] = int(f.read())
        return out

    def delta(a, b):
        return {k: b[k] - a[k] for k in a}

    sdl.init()
    local = sdl.local_size()
    groups = [list(range(h * local, (h + 1) * local)) for h in range(sdl.cross_size())]
    sets = [sdl.add_process_set(g) for g in groups]
    mine = sets[sdl.cross_rank()]
    x = np.full(payload // 4, sdl.rank() + 1.0, dtype=np.float32)
    sdl.allreduce(x, op=sdl.Sum, process_set=mine)  # warm: connections, segments
    sdl.allreduce(x, op=sdl.Sum)
    sdl.barrier()
    c0, n0 = sdl.counters(), nic_bytes()
    for _ in range(rounds):
        in_host = sdl.allreduce(x, op=sdl.Sum, process_set=mine)
    sdl.barrier()
    c1, n1 = sdl.counters(), nic_bytes()
    for _ in range(rounds):
        total = sdl.allreduce(x, op=sdl.Sum)
    sdl.barrier()
    c2, n2 = sdl.counters(), nic_bytes()
    return {"rank": sdl.rank(), "size": sdl.size(), "local_rank": sdl.local_rank(),
            "local_size": sdl.local_size(), "cross_rank": sdl.cross_rank(),
            "cross_size": sdl.cross_size(), "hostname": socket.gethostname(),
            "host_hash": host_hash(), "host_id": os.environ.get("SDL_HOST_ID"),
            "peer_address": os.environ.get("SDL_HOSTNAME"),
            "controller": os.environ.get("SDL_CONTROLLER"),
            "transport": sdl.transport(), "host_transport": sdl.transport(mine),
            "in_host": float(in_host[0]), "total": float(total[0]),
            "in_host_nics": delta(n0, n1), "cross_nics": delta(n1, n2),
            "in_host_counters": {k: c1[k] - c0.get(k, 0) for k in ("collectives", "bytes")},
            "cross_counters": {k: c2[k] - c1.get(k, 0) for k in ("collectives", "bytes")}}


def run_topology(spark, use_mpi):
    import io

    from spark_dl.spark import run

    out = io.StringIO()
    results = run(topology, args=(PAYLOAD, ROUNDS), num_proc=4, use_mpi=use_mpi,
                  use_gloo=not use_mpi, stdout=out, stderr=out, start_timeout=120)
    return results, out.getvalue()


def _check_topology(hosts, results, controller):
    by_host = {}
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["size"] == 4 and r["controller"] == controller
        by_host.setdefault(r["hostname"], []).append(r)
    assert sorted(by_host) == ["host0", "host1"], by_host.keys()
    addresses = {h.name: h.address for h in hosts.hosts}
    cross = set()
    for name, ranks in by_host.items():
        # Ranks of one host are consecutive, local ranks 0..1, one cross rank per host.
        assert [r["local_rank"] for r in ranks] == [0, 1]
        assert [r["rank"] for r in ranks] == [ranks[0]["rank"], ranks[0]["rank"] + 1]
        assert {(r["local_size"], r["cross_size"]) for r in ranks} == {(2, 2)}
        assert len({r["cross_rank"] for r in ranks}) == 1
        cross.add(ranks[0]["cross_rank"])
        assert len({r["host_hash"] for r in ranks}) == 1
        assert {r["host_id"] for r in ranks} == {ranks[0]["host_hash"]}
        if controller == "gloo":  # Gloo's peers reach each rank at its host's address
            assert {r["peer_address"] for r in ranks} == {addresses[name]}
    assert cross == {0, 1}
    assert by_host["host0"][0]["host_hash"] != by_host["host1"][0]["host_hash"]
    for r in results:
        assert r["transport"] == "hierarchical" and r["host_transport"] == "shm", r
        first = 1 + 2 * r["cross_rank"]  # the host's ranks hold first and first + 1
        assert r["in_host"] == first + first + 1 and r["total"] == 1 + 2 + 3 + 4
    data = PAYLOAD * ROUNDS
    for name, ranks in by_host.items():
        r = ranks[0]  # both ranks of a host read the same (the host's) counters
        inside, across = r["in_host_nics"], r["cross_nics"]
        # Host-local allreduces: shared memory, no interface carries their data.
        assert inside["lo_tx"] < data / 20 and inside["eth0_tx"] < data / 20, (name, inside)
        # Cross-host allreduces: one leader per host sends over eth0 at least the
        # reduce-scatter's and the allgather's half each (= the data), lo stays quiet.
        assert across["eth0_tx"] > 0.9 * data and across["eth0_rx"] > 0.9 * data, (name, across)
        assert across["lo_tx"] < data / 20, (name, across)
        assert r["in_host_counters"]["collectives"] >= ROUNDS
    return by_host


def test_gloo_across_two_hosts(hosts, standalone):
    results, out = standalone.app.call(run_topology, False, timeout=240)
    by_host = _check_topology(hosts, results, "gloo")
    print({h: [(r["rank"], r["in_host_nics"], r["cross_nics"]) for r in rs]
           for h, rs in by_host.items()})


def test_mpi_across_two_hosts(hosts, standalone):
    results, out = standalone.app.call(run_topology, True, timeout=240)
    by_host = _check_topology(hosts, results, "mpi")
    print({h: [(r["rank"], r["in_host_nics"], r["cross_nics"]) for r in rs]
           for h, rs in by_host.items()})


# --------------------------------------------------------------------- the estimator


def fit(spark, store_path, run_id):
    """A TorchEstimator fit on 4 ranks: fixed rows in 4 partitions, seeded; returns the
    model's weights, the history and where the ranks ran."""
    import numpy as np
    import torch

    from spark_dl.spark.common.store import Store
    from spark_dl.spark.torch import TorchEstimator

    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 3))
    y = x @ np.array([2.0, -1.0, 0.5]) - 1.0
    rows = [tuple(float(v) for v in r) + (float(t),) for r, t in zip(x, y)]
    df = spark.sparkContext.parallelize(rows, 4).toDF(["a", "b", "c", "y"])
    from pyspark.ml.feature import VectorAssembler

    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    est = TorchEstimator(num_proc=4, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], batch_size=20, epochs=2, random_seed=11,
                         store=Store.create(store_path), run_id=run_id, verbose=0)
    model = est.fit(df)
    weights = {k: v.detach().numpy().copy() for k, v in model.getModel().state_dict().items()}
    return weights, model.getHistory()


def test_torch_estimator_across_hosts_equals_one_host(hosts, standalone, tmp_path):
    import numpy as np

    client = hosts.hosts[0]
    store = str(tmp_path / "store")
    across, history = standalone.app.call(fit, store, "hosts", timeout=300)
    # The same fit with the same 4 ranks on the client host alone (local[4]).
    alone = standalone.driver(client, master="local[4]", timeout=120)
    try:
        single, single_history = alone.call(fit, store, "one_host", timeout=300)
    finally:
        alone.stop()
        standalone.drivers.remove(alone)
    assert history["epoch"] == single_history["epoch"] == [1, 2]
    np.testing.assert_allclose(history["loss"], single_history["loss"], rtol=1e-5)
    assert sorted(across) == sorted(single)
    for name in across:
        np.testing.assert_allclose(across[name], single[name], rtol=1e-5, atol=1e-6)
