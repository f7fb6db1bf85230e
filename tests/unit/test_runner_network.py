"""The job's network (spark_dl.runner.network): the launcher's choice, each remote host's
address, and what ``sdlrun --mpi`` passes to Open MPI. Interfaces are faked; the real
thing runs across namespace hosts in tests/cluster/test_sdlrun_hosts.py."""

import ipaddress

import pytest

from spark_dl.runner import network
from spark_dl.runner.hosts import assign_ranks, HostSlots
from spark_dl.runner.mpi_run import mpi_interfaces, mpirun_command
from spark_dl.runner.options import LaunchOptions


def iface(name, cidr):
    address = cidr.split("/")[0]
    return network.Interface(name, address, ipaddress.ip_network(cidr, strict=False))


LAUNCHER = [iface("lo", "127.0.0.1/8"), iface("eth0", "10.1.0.10/24"),
            iface("eth1", "10.2.0.10/24")]


@pytest.fixture
def here(monkeypatch):
    found = list(LAUNCHER)
    monkeypatch.setattr(network, "interfaces", lambda: found)
    return found


def test_local_job_uses_loopback(here):
    net = network.choose_network([])
    assert (net.address, net.rendezvous_addr, net.payload()) == ("127.0.0.1", "127.0.0.1",
                                                                  None)


def test_named_interface(here):
    net = network.choose_network(["b"], nic="eth1")
    assert (net.address, net.interface, net.subnet, net.explicit) == (
        "10.2.0.10", "eth1", "10.2.0.0/24", True)
    assert net.payload() == {"interface": "eth1", "subnet": "10.2.0.0/24", "explicit": True}


def test_named_interface_missing_here(here):
    with pytest.raises(ValueError, match=r"has no IPv4 address on eth7 \(its interfaces: "
                                         r"lo 127.0.0.1/8, eth0 10.1.0.10/24"):
        network.choose_network(["b"], nic="eth7")
    with pytest.raises(ValueError, match="name one interface"):
        network.choose_network(["b"], nic="eth0,eth1")


def test_automatic_choice_follows_the_route(here, monkeypatch):
    monkeypatch.setattr(network, "route_address", lambda host: "10.2.0.10")
    net = network.choose_network(["b", "c"])
    assert (net.address, net.interface, net.subnet, net.explicit) == (
        "10.2.0.10", "eth1", "10.2.0.0/24", False)
    assert "on the route to b" in net.reason


def test_no_route_is_an_error(here, monkeypatch):
    monkeypatch.setattr(network, "route_address", lambda host: None)
    with pytest.raises(ValueError, match="no route from this machine to b"):
        network.choose_network(["b"])


def test_rendezvous_addr_keeps_host_names(here, monkeypatch):
    monkeypatch.setattr(network, "is_own_address", lambda a: a == "127.0.0.1")
    monkeypatch.setattr(network, "route_address", lambda host: "10.1.0.10")
    net = network.choose_network(["b"], rendezvous_addr="127.0.0.1")
    assert (net.address, net.rendezvous_addr, net.payload()) == ("127.0.0.1", "127.0.0.1",
                                                                  None)
    # An address of another machine (NAT): bind this machine's address on the route.
    net = network.choose_network(["b"], rendezvous_addr="192.0.2.7")
    assert (net.address, net.rendezvous_addr) == ("10.1.0.10", "192.0.2.7")


REMOTE = [iface("lo", "127.0.0.1/8"), iface("eth0", "10.1.0.11/24"),
          iface("eth1", "10.9.0.11/24")]


@pytest.fixture
def remote(monkeypatch):
    found = list(REMOTE)
    monkeypatch.setattr(network, "interfaces", lambda: found)
    return found


def test_remote_picks_its_address_in_the_subnet(remote):
    address, how = network.pick_address({"interface": "eth0", "subnet": "10.1.0.0/24",
                                         "explicit": False}, "10.1.0.10", "b")
    assert address == "10.1.0.11" and "eth0" in how


def test_remote_named_interface_on_another_subnet(remote):
    with pytest.raises(ValueError, match=r"b's eth1 \(10.9.0.11/24\) is not in the "
                                         r"launcher's eth1 subnet 10.2.0.0/24: the hosts "
                                         "share no subnet"):
        network.pick_address({"interface": "eth1", "subnet": "10.2.0.0/24",
                              "explicit": True}, "10.2.0.10", "b")
    with pytest.raises(ValueError, match="b has no IPv4 address on eth5"):
        network.pick_address({"interface": "eth5", "subnet": "10.2.0.0/24",
                              "explicit": True}, "10.2.0.10", "b")


def test_remote_routed_fallback_and_no_shared_subnet(remote, monkeypatch):
    job = {"interface": "eth3", "subnet": "10.3.0.0/24", "explicit": False}
    monkeypatch.setattr(network, "route_address", lambda host: "10.1.0.11")
    assert network.pick_address(job, "10.3.0.10", "b")[0] == "10.1.0.11"
    monkeypatch.setattr(network, "route_address", lambda host: None)
    with pytest.raises(ValueError, match="b shares no subnet with the launcher"):
        network.pick_address(job, "10.3.0.10", "b")


def test_mpi_gets_the_interfaces(here, monkeypatch):
    slots = assign_ranks([HostSlots("localhost", 1), HostSlots("b", 1)], 2)
    assert mpi_interfaces(slots, LaunchOptions(network_interface="eth0,eth1")) == "eth0,eth1"
    monkeypatch.setattr(network, "route_address", lambda host: "10.1.0.10")
    assert mpi_interfaces(slots, LaunchOptions()) == "10.1.0.0/24"
    assert mpi_interfaces(slots[:1], LaunchOptions()) is None
    assert mpi_interfaces(slots[:1], LaunchOptions(network_interface="eth1")) is None
    argv = mpirun_command("mpirun", ["x"], slots, {}, LaunchOptions(), "10.1.0.0/24")
    assert " ".join(argv).count("_if_include 10.1.0.0/24") == 2
    # --mpi-args' own value wins.
    options = LaunchOptions(mpi_args="--mca btl_tcp_if_include eth9")
    argv = mpirun_command("mpirun", ["x"], slots, {}, options, "10.1.0.0/24")
    assert "oob_tcp_if_include" in argv and argv.count("btl_tcp_if_include") == 1
    assert argv[argv.index("btl_tcp_if_include") + 1] == "eth9"


def test_interfaces_lists_loopback():
    assert any(i.name == "lo" and i.address == "127.0.0.1" for i in network.interfaces())
