"""Failure reports name the root cause and label its consequences (issue 17).

A rank that loses a peer (PeerFailureError) or finds spark_dl shut down (ShutdownError)
fails because another rank failed or finished first: the reports of spark.run and sdlrun
say so instead of listing it as one more failure.
"""

import io
import sys
import textwrap
import time

import pytest

from spark_dl.rendezvous.secret import make_secret
from spark_dl.runner.launch import run_command
from spark_dl.spark.launch.driver.report import failure_report
from spark_dl.spark.launch.driver.service import DriverService, Failure
from spark_dl.spark.launch.service import ServiceClient

pytestmark = pytest.mark.timeout(60)

SECRET = make_secret()
SHUTDOWN = "spark_dl.common.exceptions.ShutdownError"


def _error(client, rank, exc_type, text):
    name = exc_type.rsplit(".", 1)[-1]
    client.call("error", rank=rank, exc_type=exc_type, summary=f"rank {rank} raised {name}: "
                f"{text}", traceback=f"Traceback ...\n{name}: {text}\n", exception=None)


def _outcome(num_proc, post):
    """Runs ``post(client)`` (or ``post(client, driver)``) against a driver service;
    returns (failures, finished ranks, seconds waited for the outcome)."""
    driver = DriverService(SECRET, num_proc, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        driver.set_ranks({i: i for i in range(num_proc)})
        with ServiceClient("driver", SECRET, driver.server.endpoints) as client:
            post(client) if post.__code__.co_argcount == 1 else post(client, driver)
        start = time.monotonic()
        failures = driver.wait_for_outcome(lambda: None, settle_s=0.3,
                                           consequence_settle_s=20.0)
        return failures, driver.finished_ranks(), time.monotonic() - start
    finally:
        driver.stop()


def test_shutdown_errors_after_a_root_cause_are_labelled_consequences():
    def post(client):
        _error(client, 1, SHUTDOWN, "spark_dl has been shut down")
        _error(client, 0, "builtins.ValueError", "boom")
        _error(client, 2, "spark_dl.common.exceptions.PeerFailureError", "lost rank 0")

    failures, finished, _ = _outcome(3, post)
    assert [f.rank for f in failures] == [0, 1, 2]
    message, lines = failure_report(failures, finished)
    assert message.startswith("rank 0 raised ValueError: boom")
    assert "Also failed" not in message
    assert ("Consequences of rank 0's failure, not causes:\n"
            "  rank 1: stopped because rank 0 failed first (ShutdownError: spark_dl has been "
            "shut down)\n"
            "  rank 2: stopped because rank 0 failed first (PeerFailureError: lost rank 0)"
            ) in message
    assert lines[0] == "rank 0 raised ValueError: boom"
    assert all("stopped because rank 0 failed first" in line for line in lines[1:])


def test_other_root_causes_stay_under_also_failed():
    failures = [Failure(0, "rank 0 raised ValueError: boom", rank=0, detail="ValueError: boom"),
                Failure(1, "rank 3 ended with exit code 137", rank=3),
                Failure(3, "rank 1 raised ShutdownError: gone", rank=1,
                        detail="ShutdownError: gone")]
    message, lines = failure_report(failures)
    assert "Also failed:\n  rank 3 ended with exit code 137" in message
    assert "rank 1: stopped because rank 0 failed first (ShutdownError: gone)" in message
    assert "ShutdownError" not in message.split("Also failed:")[1].split("Consequences")[0]
    assert len(lines) == 3


def test_collective_after_peers_finished_names_the_finished_ranks():
    def post(client):
        client.call("result", rank=0, value=b"r0")
        client.call("result", rank=2, value=b"r2")
        _error(client, 1, SHUTDOWN, "spark_dl has been shut down")

    failures, finished, waited = _outcome(3, post)
    # Every rank reported (results or the error): no cause can still come, so the
    # outcome does not wait out the consequence settle time.
    assert waited < 10.0
    assert finished == [0, 2]
    message, _ = failure_report(failures, finished)
    assert message.startswith("rank 1 raised ShutdownError")
    assert ("Ranks 0 and 2 had already returned their results and shut spark_dl down when "
            "rank 1 called a collective: the ranks did not call the same collectives") in message


def test_only_consequences_and_nobody_finished_says_the_cause_is_unknown():
    failures = [Failure(3, "rank 0 raised PeerFailureError: x", rank=0,
                        detail="PeerFailureError: x"),
                Failure(3, "rank 1 raised PeerFailureError: y", rank=1,
                        detail="PeerFailureError: y")]
    message, lines = failure_report(failures)
    assert "no other cause was reported" in message
    assert "rank 1: PeerFailureError: y (also a consequence, not a cause)" in message
    assert lines[1] == "rank 1: PeerFailureError: y (also a consequence, not a cause)"


_EXTRA_CALL = textwrap.dedent("""
    import os, sys, time
    if os.environ["SDL_RANK"] == "1":
        time.sleep(3.0)  # ranks 0 and 2 exit 0 meanwhile (a loaded machine included)
        print("ShutdownError: spark_dl has been shut down", file=sys.stderr)
        sys.exit(1)
""")


def test_sdlrun_names_the_ranks_that_had_finished():
    out, err = io.BytesIO(), io.BytesIO()
    rc = run_command([sys.executable, "-c", _EXTRA_CALL], 3, kill_grace=1.0,
                     stdout=out, stderr=err)
    text = err.getvalue().decode()
    assert rc == 1, text
    assert ("rank 1 on localhost failed with exit code 1 after ranks 0, 2 had finished with "
            "exit code 0 (if it raised ShutdownError, it called a collective") in text


def test_a_lost_ranks_own_consequence_does_not_blame_itself():
    """A rank lost with its task may have reported a consequence first (its peer died in a
    collective): that line is its last word, not 'rank 0 stopped because rank 0 failed'."""
    failures = [Failure(2, "rank 0 was lost: its Spark task 0 disappeared", rank=0),
                Failure(3, "rank 0 raised PeerFailureError: rank 1 exited", rank=0,
                        detail="PeerFailureError: rank 1 exited")]
    message, lines = failure_report(failures)
    assert "rank 0 failed first" not in message
    assert "rank 0 had also reported: PeerFailureError: rank 1 exited" in message
    assert lines == ["rank 0 was lost: its Spark task 0 disappeared",
                     "rank 0 had also reported: PeerFailureError: rank 1 exited"]


def test_a_lost_task_waits_for_the_exit_that_explains_it():
    # MPI: mpirun's task can vanish before the killed rank's exit is reported (seconds
    # later on a loaded machine); the exit, reported after the normal settle time, is the
    # root cause, and the lost rank comes after it.
    def post(client, driver):
        import threading

        with driver._cond:
            driver._exits[0] = -1
            driver._fail(Failure(1, "rank 0 was lost: its Spark task 0 disappeared", rank=0,
                                 lost=True))
        threading.Timer(1.0, lambda: driver._worker_exit(1, 1, 137)).start()

    failures, _, waited = _outcome(2, post)
    assert [(f.rank, f.lost) for f in failures] == [(1, False), (0, True)], failures
    assert "rank 1 ended with exit code 137 (signal 9, SIGKILL)" in failures[0].summary
    assert 0.9 < waited < 10, waited


def test_a_workers_terminal_colour_codes_do_not_reach_the_error():
    # Keras bolds the message inside "Exception encountered when calling ..."; relayed as
    # is, a notebook shows "[1m" around it.
    def post(client):
        _error(client, 0, "builtins.ValueError", "\x1b[1mInput 0 is incompatible\x1b[0m")

    failures, finished, _ = _outcome(2, post)
    message, lines = failure_report(failures, finished)
    assert "\x1b" not in message and "\x1b" not in failures[0].traceback
    assert lines[0] == "rank 0 raised ValueError: Input 0 is incompatible"
    assert failures[0].detail in (None, "ValueError: Input 0 is incompatible")
