"""The timeline (docs/observability.md): rank 0's Chrome trace of every tensor's phases.

Ranks are spawned under plain pytest (harness.py); every wait is bounded.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import HERE, REPO, collect, run_ranks, spawn_ranks
from timeline_workers import NAMES, read_trace

pytestmark = pytest.mark.timeout(120)

# The order of one tensor's top-level phases; inner phases nest in the operation's span.
ORDER = {"NEGOTIATE_ALLREDUCE": 0, "QUEUE": 1, "ALLREDUCE": 2}


def rows(events):
    """tid -> row name, and row name -> its events (metadata excluded), in time order."""
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    by_row = {}
    for e in events:
        if e.get("ph") in ("X", "i") and e.get("tid", 0) in names and e.get("tid", 0) != 0:
            by_row.setdefault(names[e["tid"]], []).append(e)
    for evs in by_row.values():
        evs.sort(key=lambda e: (e["ts"], ORDER.get(e["name"], 3)))
    return names, by_row


def check_tensor_row(evs, size, steps):
    """Each occurrence: NEGOTIATE, then QUEUE from its end, then the operation with its
    transport phase inside; negotiated occurrences carry one tick per rank."""
    spans = [e for e in evs if e["ph"] == "X"]
    top = [e for e in spans if e["name"] in ORDER]
    assert [e["name"] for e in top] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"] * steps, top
    for neg, queue, op in zip(top[0::3], top[1::3], top[2::3]):
        assert neg["ts"] + neg["dur"] <= queue["ts"] + 1e-3
        assert abs(queue["ts"] - (neg["ts"] + neg["dur"])) < 1.0  # QUEUE starts at ready
        assert queue["ts"] + queue["dur"] <= op["ts"] + 1e-3
        inner = [e for e in spans if e["name"] not in ORDER and
                 op["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"] + 1e-3]
        assert any(e["name"].endswith("_ALLREDUCE") or e["name"].endswith("_IN_PLACE")
                   for e in inner), (op, spans)
        assert op["args"]["transport"] == "shm"
    ticks = [e for e in evs if e["ph"] == "i"]
    negotiated = [e for e in top[0::3] if not e.get("args", {}).get("cached")]
    assert negotiated, "the first step is negotiated through the coordinator"
    first = negotiated[0]
    in_first = [t for t in ticks if first["ts"] - 1e-3 <= t["ts"] <= first["ts"] + first["dur"] + 1e-3]
    assert sorted(t["args"]["rank"] for t in in_first) == list(range(size))
    assert all(t["name"] == f"rank {t['args']['rank']} ready" for t in ticks)


@pytest.mark.parametrize("np_", [2, 3])
def test_every_tensor_has_its_phases_in_order(tmp_path, np_):
    path = str(tmp_path / "timeline.json")
    steps = 4
    res = run_ranks("timeline_workers:steps", np_, env={"SDL_TIMELINE": path},
                    args=(str(steps),), timeout=90)
    events = read_trace(path)
    names, by_row = rows(events)
    # Read while the job ran: parseable, with more than the metadata, less than at the end.
    assert 2 < res[0]["mid_events"] < len(events)
    assert set(by_row) == set(NAMES) | {"late"} | {n for n in by_row if n.startswith("barrier")}
    for name in NAMES:
        check_tensor_row(by_row[name], np_, steps)
    # Who was late: the last rank's tick comes last, well after rank 0's (it slept 0.6 s;
    # a tick is when the request reaches the coordinator, which takes a cycle every rank
    # joins, so rank 0's own tick may come up to an idle heartbeat or two after its call).
    ticks = {e["args"]["rank"]: e["ts"] for e in by_row["late"] if e["ph"] == "i"}
    assert max(ticks, key=ticks.get) == np_ - 1 and ticks[np_ - 1] - ticks[0] > 0.3e6, ticks
    assert not [e for e in events if e["name"] == "CYCLE_START"]  # not asked for
    stats = [e for e in events if e["name"] == "timeline_stats"]
    assert stats and stats[0]["args"]["dropped"] == 0
    assert res[0]["counters"]["timeline_records"] > 0
    assert "timeline_records" not in res[1]["counters"]  # only rank 0 records


def test_cycle_markers_when_asked(tmp_path):
    path = str(tmp_path / "timeline.json")
    run_ranks("timeline_workers:steps", 2, timeout=90, args=("2",),
              env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    events = read_trace(path)
    marks = [e for e in events if e["name"] == "CYCLE_START"]
    assert len(marks) >= 3 and all(e["ph"] == "i" and e["s"] == "p" for e in marks)


def test_start_stop_at_run_time_records_only_the_window(tmp_path):
    path = str(tmp_path / "window.json")
    res = run_ranks("timeline_workers:window", 3, timeout=90, env={"TIMELINE_TEST_PATH": path})
    assert [r["writes"] for r in res] == [True, False, False]
    _, by_row = rows(read_trace(path))
    assert set(by_row) == {f"in.{n}" for n in NAMES}
    for name in NAMES:
        assert len([e for e in by_row[f"in.{name}"] if e["name"] == "ALLREDUCE"]) == 3


def test_parseable_while_running_and_after_sigkill_of_rank_0(tmp_path):
    path = str(tmp_path / "killed.json")
    procs, outdir, server = spawn_ranks("timeline_workers:forever", 2, env={"SDL_TIMELINE": path})
    try:
        reads, deadline = 0, time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(path):
                events = read_trace(path)  # parseable at every read
                reads += 1
                if len([e for e in events if e["name"] == "ALLREDUCE"]) > 200:
                    break
            time.sleep(0.02)
        assert reads > 1, "the trace never grew"
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
    finally:
        collect(procs, outdir, server, timeout=30)
    events = read_trace(path, tries=1)
    assert len([e for e in events if e["name"] == "ALLREDUCE"]) > 200


def test_full_queue_drops_and_counts_never_stalls(tmp_path):
    path = str(tmp_path / "drops.json")
    res = run_ranks("timeline_workers:many", 2, timeout=90, args=("5",),
                    env={"SDL_TIMELINE": path, "SDL_TIMELINE_QUEUE_CAPACITY": "2"})
    dropped = res[0]["counters"]["timeline_dropped"]
    assert dropped > 0
    events = read_trace(path, tries=1)
    stats = [e for e in events if e["name"] == "timeline_stats"]
    assert stats[0]["args"]["dropped"] >= dropped
    assert any(e["name"] == "timeline dropped records" and e["ph"] == "C" for e in events)


def test_sdlrun_flags_reach_the_workers(tmp_path):
    path = str(tmp_path / "sdlrun.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    for k in ("SDL_TIMELINE", "HOROVOD_TIMELINE"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, "-m", "spark_dl.runner", "-np", "2", "--timeline-filename", path,
         "--timeline-mark-cycles", sys.executable, os.path.join(HERE, "timeline_workers.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90)
    assert p.returncode == 0, p.stdout.decode(errors="replace")
    events = read_trace(path, tries=1)
    _, by_row = rows(events)
    assert set(NAMES) <= set(by_row)
    assert any(e["name"] == "CYCLE_START" for e in events)
    json.dumps(events)
