"""Host parsing, local-host detection and rank assignment of the sdlrun launcher."""

import socket

import pytest

from spark_dl.runner.hosts import (HostSlots, assign_ranks, is_local_host, merge_hosts,
                                   parse_hostfile, parse_hosts)
from spark_dl.runner.launch import _to_hosts
from spark_dl.runner.options import LaunchOptions

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("spec, expected", [
    ("a:2,b:2", [HostSlots("a", 2), HostSlots("b", 2)]),
    ("a", [HostSlots("a", 1)]),
    (" a:3 , b ,", [HostSlots("a", 3), HostSlots("b", 1)]),
    ("10.0.0.1:4", [HostSlots("10.0.0.1", 4)]),
    ("[::1]:2,[fe80::1]", [HostSlots("::1", 2), HostSlots("fe80::1", 1)]),
    ("node-1.example.com:8", [HostSlots("node-1.example.com", 8)]),
])
def test_parse_hosts(spec, expected):
    assert parse_hosts(spec) == expected


@pytest.mark.parametrize("spec", ["", ",", "a:x", "a:0", "a:-1", "a:1:2", "::1:2", "[::1",
                                  "[::1]2", "a b:2", ":2"])
def test_parse_hosts_rejects(spec):
    with pytest.raises(ValueError):
        parse_hosts(spec)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n"
                    "a slots=2\n"
                    "\n"
                    "b:3   # trailing comment\n"
                    "c\n"
                    "::1 slots=4\n")
    assert parse_hostfile(str(path)) == [HostSlots("a", 2), HostSlots("b", 3),
                                         HostSlots("c", 1), HostSlots("::1", 4)]


@pytest.mark.parametrize("text", ["a slots=x\n", "a b c\n", "a slots=0\n", "# only\n"])
def test_parse_hostfile_rejects(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match="hosts"):
        parse_hostfile(str(path))


def test_is_local_host():
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert is_local_host("127.0.1.1")
    assert is_local_host("::1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.1")  # TEST-NET-1, never assigned
    assert not is_local_host("no-such-host.invalid")


def test_merge_hosts_adds_duplicates_and_local_aliases():
    hosts = [HostSlots("a", 1), HostSlots("localhost", 1), HostSlots("A", 2),
             HostSlots("127.0.0.1", 2)]
    assert merge_hosts(hosts) == [HostSlots("a", 3), HostSlots("localhost", 1),
                                  HostSlots("127.0.0.1", 2)]
    assert merge_hosts(hosts, is_local=is_local_host) == [HostSlots("a", 3),
                                                          HostSlots("localhost", 3)]


def _table(slots):
    return [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots]


def test_assign_ranks_even():
    slots = assign_ranks(parse_hosts("a:2,b:2"), 4)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 2, 1, 2), ("b", 3, 1, 2, 1, 2)]
    assert all(s.size == 4 for s in slots)


def test_assign_ranks_uneven_cross_ranks():
    # local_rank 0 exists on a, b, c; local_rank 1 only on a and c; local_rank 2 on c.
    slots = assign_ranks(parse_hosts("a:2,b:1,c:3"), 6)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 1, 1, 3),
        ("c", 3, 0, 3, 2, 3), ("c", 4, 1, 3, 1, 2), ("c", 5, 2, 3, 0, 1)]


def test_assign_ranks_fills_hosts_in_order():
    slots = assign_ranks(parse_hosts("a:4,b:4"), 5)
    assert [s.hostname for s in slots] == ["a"] * 4 + ["b"]
    assert slots[4].local_size == 1 and slots[0].local_size == 4
    # Unused hosts are not part of the job.
    assert {s.hostname for s in assign_ranks(parse_hosts("a:4,b:4"), 3)} == {"a"}


def test_assign_ranks_errors():
    with pytest.raises(ValueError, match="exceeds the 3 slots"):
        assign_ranks(parse_hosts("a:2,b:1"), 4)
    with pytest.raises(ValueError, match="at least 1"):
        assign_ranks(parse_hosts("a:2"), 0)
    with pytest.raises(ValueError, match="more than once"):
        assign_ranks([HostSlots("a", 1), HostSlots("a", 1)], 2)


def test_hosts_argument_forms(tmp_path):
    assert _to_hosts(None, None, 3) == [HostSlots("localhost", 3)]
    assert _to_hosts("a:2", None, 1) == [HostSlots("a", 2)]
    assert _to_hosts([("a", 2), "b:1", HostSlots("c", 3)], None, 1) == [
        HostSlots("a", 2), HostSlots("b", 1), HostSlots("c", 3)]
    path = tmp_path / "hosts"
    path.write_text("x slots=2\n")
    assert _to_hosts(None, str(path), 1) == [HostSlots("x", 2)]
    with pytest.raises(ValueError, match="not both"):
        _to_hosts("a", str(path), 1)


def test_launch_options_validate():
    LaunchOptions().validate()
    for bad in (dict(controller="nccl"), dict(start_timeout=0), dict(kill_grace=-1),
                dict(ssh_port=70000)):
        with pytest.raises(ValueError):
            LaunchOptions(**bad).validate()
