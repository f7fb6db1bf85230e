"""The elastic membership authority and its parts, without processes (docs/elastic.md):
how generations are formed, ranks kept, joiners and leavers handled, hosts blacklisted,
and what a worker's Membership reads."""

import json
import time

import pytest

from spark_dl.common.elastic import SCOPE, Membership, generation_key, update_key, want_key
from spark_dl.rendezvous.client import KVStoreClient
from spark_dl.runner.elastic import (Blacklist, ElasticOptions, MembershipAuthority,
                                     assign_topology, discover_hosts)
from spark_dl.runner.kvstore import KVStoreServer

SECRET = b"s" * 32


@pytest.fixture
def server():
    with KVStoreServer(SECRET, host="127.0.0.1") as s:
        yield s


def authority(server, settle=5.0, **options):
    logs = []
    opts = ElasticOptions(**{"min_np": 2, "max_np": 4, "timeout": 2.0, **options})
    return MembershipAuthority(server, opts, settle, logs.append), logs


def want(server, wid, last):
    server.put(SCOPE, want_key(wid), str(last).encode())


def generation(server, g):
    raw = server.get(SCOPE, generation_key(g))
    return None if raw is None else json.loads(raw)


def test_topology_groups_ranks_by_host_in_member_order():
    topo = assign_topology(["a1", "b1", "a2"], {"a1": "A", "a2": "A", "b1": "B"})
    assert [topo[w]["rank"] for w in ("a1", "a2", "b1")] == [0, 1, 2]
    assert topo["a2"] == {"rank": 1, "size": 3, "local_rank": 1, "local_size": 2,
                          "cross_rank": 0, "cross_size": 2}
    assert topo["b1"]["cross_rank"] == 1 and topo["b1"]["local_size"] == 1


def test_first_generation_waits_for_every_started_worker(server):
    auth, logs = authority(server)
    for i in range(3):
        auth.started(str(i), "localhost", i)
    want(server, "0", -1)
    want(server, "1", -1)
    assert auth.step() == (None, []) and generation(server, 0) is None
    want(server, "2", -1)
    assert auth.step() == (None, [])
    gen = generation(server, 0)
    assert sorted(gen["workers"]) == ["0", "1", "2"]
    assert "generation 0: 3 workers" in logs[-1]


def test_a_death_reforms_with_the_survivors_once_they_wait_keeping_rank_order(server):
    auth, _ = authority(server)
    for i in range(3):
        auth.started(str(i), "localhost", i)
        want(server, str(i), -1)
    auth.step()
    ranks = {w: t["rank"] for w, t in generation(server, 0)["workers"].items()}
    auth.exited("0", -9)  # rank 0 died
    auth.step()
    assert server.get(SCOPE, update_key(0)) == b"1"  # the members are told
    want(server, "1", 0)
    assert auth.step() == (None, []) and generation(server, 1) is None  # "2" still trains
    want(server, "2", 0)
    auth.step()
    gen = generation(server, 1)["workers"]
    assert sorted(gen) == ["1", "2"] and gen["1"]["rank"] < gen["2"]["rank"]
    assert ranks["1"] < ranks["2"]
    assert auth.resets == 1


def test_newcomers_are_asked_for_and_come_after_the_members(server):
    auth, _ = authority(server)
    for i in range(2):
        auth.started(str(i), "localhost", i)
        want(server, str(i), -1)
    auth.step()
    auth.started("2", "localhost", 2)
    want(server, "2", -1)
    auth.step()
    assert server.get(SCOPE, update_key(0)) == b"1"
    want(server, "0", 0)
    want(server, "1", 0)
    auth.step()
    gen = generation(server, 1)["workers"]
    assert [w for w, _ in sorted(gen.items(), key=lambda kv: kv[1]["rank"])] == ["0", "1", "2"]


def test_leaving_workers_are_stopped_and_below_min_times_out(server):
    auth, _ = authority(server, timeout=0.3)
    for i in range(2):
        auth.started(str(i), "localhost", i)
        want(server, str(i), -1)
    auth.step()
    auth.workers["1"].leaving = True
    auth.step()
    want(server, "0", 0)
    want(server, "1", 0)
    error, stop = auth.step()
    assert error is None and stop == ["1"]
    time.sleep(0.4)
    error, _ = auth.step()
    assert "fewer than --min-np=2, for 0.3 s" in error


def test_the_reset_limit_ends_the_job(server):
    auth, _ = authority(server, reset_limit=0, min_np=1)
    for i in range(2):
        auth.started(str(i), "localhost", i)
        want(server, str(i), -1)
    auth.step()
    auth.exited("1", 1)
    want(server, "0", 0)
    error, _ = auth.step()
    assert "--reset-limit=0" in error


def test_a_member_that_returns_ends_the_forming(server):
    auth, _ = authority(server)
    for i in range(2):
        auth.started(str(i), "localhost", i)
        want(server, str(i), -1)
    auth.step()
    auth.exited("0", 0)
    assert auth.finishing and auth.step() == (None, []) and generation(server, 1) is None


def test_membership_joins_the_generation_that_lists_it_and_reads_the_flag(server):
    port = server.port
    client = KVStoreClient("127.0.0.1", port, SECRET, timeout=5)
    member = Membership(client, "7", timeout=5)
    server.put(SCOPE, generation_key(0), json.dumps({"workers": {"1": {}}}).encode())
    server.put(SCOPE, generation_key(1), json.dumps(
        {"workers": {"7": {"rank": 0, "size": 1, "local_rank": 0, "local_size": 1,
                           "cross_rank": 0, "cross_size": 1}}}).encode())
    topo = member.join()
    assert topo["generation"] == 1 and topo["rank"] == 0
    assert server.get(SCOPE, want_key("7")) == b"-1"
    assert not member.update_pending()
    server.put(SCOPE, update_key(1), b"1")
    assert member.update_pending()
    server.put(SCOPE, generation_key(2), json.dumps({"end": "the job ended"}).encode())
    with pytest.raises(Exception, match="the launcher ended the job: the job ended"):
        member.join()
    late = Membership(client, "8", timeout=5)  # the job finished before it joined: exit 0
    server.put(SCOPE, generation_key(0), json.dumps(
        {"end": "the job finished", "finished": True}).encode())
    with pytest.raises(SystemExit) as info:
        late.join()
    assert info.value.code == 0


def test_blacklist_cools_down():
    now = [0.0]
    blacklist = Blacklist((10.0, 10.0), clock=lambda: now[0])
    assert blacklist.add("h") == 10.0 and blacklist.blocks("h")
    now[0] = 10.5
    assert not blacklist.blocks("h")
    forever = Blacklist(None)
    forever.add("h")
    assert forever.blocks("h")


def test_discovery_script_lines(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'a:2'\necho 'b slots=3  # comment'\necho c\necho\n")
    script.chmod(0o755)
    hosts = discover_hosts(str(script), slots_per_host=4)
    assert [(h.hostname, h.slots) for h in hosts] == [("a", 2), ("b", 3), ("c", 4)]
    with pytest.raises(ValueError, match="exited with code 3"):
        discover_hosts("exit 3", 1)


def test_options_are_checked():
    with pytest.raises(ValueError, match="below --min-np"):
        ElasticOptions(min_np=3, max_np=2).validate()
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        ElasticOptions(min_np=1, cooldown_range=(5, 1)).validate()


def test_a_failure_named_by_a_framework_error_is_recoverable():
    from spark_dl.common.elastic import named_recoverable
    from spark_dl.common.exceptions import PeerFailureError, ShutdownError

    class UnknownError(Exception):  # how TensorFlow reports it from tf.function
        message = "Graph execution error:\n\nPeerFailureError: rank 1 exited\n [[node]]"

    lost = named_recoverable(UnknownError())
    assert isinstance(lost, PeerFailureError) and str(lost) == "rank 1 exited"
    shut = ShutdownError("down")
    assert named_recoverable(shut) is shut
    assert named_recoverable(ValueError("PeerFailureError is in the text, not named")) is None
    assert named_recoverable(ValueError("bad shape")) is None
