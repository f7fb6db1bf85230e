"""Ends a job's workers when the launcher dies without doing it (SIGKILL, crash, OOM).

Workers run in their own sessions, so nothing else would stop them. The launcher starts one
watchdog per job, in a session of its own, and tells it through a pipe on its stdin each
worker's process group as it starts (``add PGID``) and as it is reaped (``del PGID``); a
launcher that finishes cleanly writes ``exit``. End of file without ``exit`` means the
launcher is gone: the watchdog sends SIGTERM to every group still listed, SIGKILL after a
grace period (to each group's whole session: every worker leads one), and exits.

Remote workers are covered too: their local ssh processes are the groups listed here, and
a remote worker stops when its ssh connection closes.

This file imports only the standard library and runs as a script, by path, so that it
works however ``spark_dl`` was put on the launcher's path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional


class Watchdog:
    """Launcher side: starts the watchdog process and keeps it informed.

    Every method is best effort: without a watchdog the job runs the same, only without
    this protection.
    """

    def __init__(self, grace_s: float = 3.0):
        self._proc: Optional[subprocess.Popen] = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(grace_s)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:
            self._proc = None

    def add(self, pgid: int) -> None:
        self._send(f"add {pgid}\n")

    def remove(self, pgid: int) -> None:
        self._send(f"del {pgid}\n")

    def close(self) -> None:
        """Tells the watchdog the launcher finished cleanly, and reaps it."""
        if self._proc is None:
            return
        self._send("exit\n")
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _send(self, line: str) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):
            self._proc = None


def session_processes(sid: int) -> Dict[int, str]:
    """``pid -> state letter`` (``R``, ``S``, ``T`` stopped ...) of every process of
    session ``sid`` (Linux; elsewhere empty)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                # "pid (comm) state ppid pgrp session ...": comm may hold spaces.
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:
                found[int(entry)] = fields[0].decode()
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_session(sid: int) -> None:
    """SIGKILL to every process of session ``sid`` (Linux; elsewhere nothing).

    A worker leads its own session, so this reaches what it started in process groups of
    their own (``mpirun`` puts each rank in one). Linux does not reuse a pid while a
    session still carries it, so while anything of ours is left the id is ours; only
    once all of it is gone, and the pid numbers wrapped around, could a stranger lead a
    session with that id (the same bound as ``killpg`` on a worker's group).
    """
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_groups(groups, signum) -> None:
    for pgid in list(groups):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            groups.discard(pgid)
        except PermissionError:
            groups.discard(pgid)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    grace_s = float(argv[0]) if argv else 3.0
    # Ctrl-C in the launcher's terminal is the launcher's to handle, not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups = set()
    for raw in sys.stdin.buffer:
        words = raw.decode(errors="replace").split()
        if words == ["exit"]:
            return 0
        if len(words) == 2 and words[1].isdigit():
            if words[0] == "add":
                groups.add(int(words[1]))
            elif words[0] == "del":
                groups.discard(int(words[1]))
    # The launcher died.
    sessions = set(groups)
    _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while groups and time.monotonic() < deadline:
        time.sleep(0.1)
        _signal_groups(groups, 0)  # drops the groups that are gone
    _signal_groups(groups, signal.SIGKILL)
    for sid in sessions:
        kill_session(sid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
