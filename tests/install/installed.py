"""Running a program of the wheel's venv, away from this checkout."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_in(venv_bin, args, prefix=(), timeout=300, cwd=None, env=None):
    """Runs args (args[0] resolved in venv_bin) outside the checkout, with a clean
    environment; returns the CompletedProcess (text)."""
    exe = args[0] if os.path.isabs(args[0]) else str(venv_bin / args[0])
    clean = {"PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
             "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1"}
    for name in ("JAVA_HOME", "TMPDIR"):
        if name in os.environ:
            clean[name] = os.environ[name]
    clean.update(env or {})
    return subprocess.run([*prefix, exe, *args[1:]], cwd=cwd or "/tmp", env=clean,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
