"""The text of a failed job's error: the root cause first, its consequences labelled.

When one rank fails, its peers usually fail too, as a consequence: a collective they were
in loses its peer (``PeerFailureError``), or finds the runtime shut down
(``ShutdownError``). Listing those as "Also failed" beside the cause sends the reader after
N-1 symptoms; here they are named as what they are ("rank 1: stopped because rank 0
failed first"). A consequence is recognized by the exception's type (see
:data:`~spark_dl.spark.launch.errors.CONSEQUENCES`), never by its wording.

When every failure is a consequence and some ranks had already returned their results,
the job did not lose a rank: a rank called a collective after its peers had finished
(the ranks did not call the same collectives). The report says so, naming the finished
ranks.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from spark_dl.spark.launch.driver.service import Failure

__all__ = ["failure_report", "ranks_text"]


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0 and 1', 'ranks 0, 1 and 2'."""
    names = [str(r) for r in ranks]
    if len(names) == 1:
        return f"rank {names[0]}"
    return "ranks " + ", ".join(names[:-1]) + " and " + names[-1]


def _who(failure: Failure) -> str:
    return f"rank {failure.rank}" if failure.rank is not None else "the job"


def _what(failure: Failure) -> str:
    return failure.detail or failure.summary


def failure_report(failures: Sequence[Failure],
                   finished: Sequence[int] = ()) -> Tuple[str, List[str]]:
    """The error message of a failed job and one line per failure (root cause first).

    Args:
        failures: the failures, root cause first (as
            :meth:`~spark_dl.spark.launch.driver.service.DriverService.wait_for_outcome`
            returns them).
        finished: the ranks that had returned their results.

    Returns:
        ``(message, lines)``: the message (root cause, its remote traceback, the other
        failures, then the consequences, labelled), and the per-failure lines of
        :attr:`~spark_dl.spark.launch.errors.WorkerFailedError.failures`.
    """
    root, rest = failures[0], list(failures[1:])
    others = [f for f in rest if not f.consequence]
    consequences = [f for f in rest if f.consequence]
    message = root.summary
    if root.traceback:
        message += "\n\nRemote traceback:\n" + root.traceback.rstrip()
    if root.consequence:
        message += "\n\n" + _unmatched(root, finished)
    if others:
        message += "\n\nAlso failed:\n  " + "\n  ".join(f.summary for f in others)
    if root.consequence:
        labelled = [f"{_who(f)}: {_what(f)} (also a consequence, not a cause)"
                    for f in consequences]
    else:
        labelled = [f"{_who(f)}: stopped because {_who(root)} failed first ({_what(f)})"
                    if f.rank is None or f.rank != root.rank else
                    f"{_who(f)} had also reported: {_what(f)}"  # the lost rank's last word
                    for f in consequences]
    if labelled:
        heading = ("Consequences (these ranks lost a peer or found spark_dl shut down):"
                   if root.consequence else
                   f"Consequences of {_who(root)}'s failure, not causes:")
        message += f"\n\n{heading}\n  " + "\n  ".join(labelled)
    lines = [root.summary] + [f.summary for f in others] + labelled
    return message, lines


def _unmatched(root: Failure, finished: Sequence[int]) -> str:
    """Why a job whose only failures are consequences failed."""
    who = _who(root)
    if finished:
        their = "its result" if len(finished) == 1 else "their results"
        text = (f"{ranks_text(finished)} had already returned {their} and shut spark_dl down "
                f"when {who} called a collective: the ranks did not call the same collectives "
                "(every rank must call the same collective operations, in the same order; "
                f"the traceback above shows the call {who} made that its peers never made).")
    else:
        text = (f"{who}'s error is the kind a rank raises when another rank failed or shut "
                "down first, and no other cause was reported (a rank may have been killed or "
                "stopped outside spark_dl; see the Spark executor logs).")
    return text[0].upper() + text[1:]
