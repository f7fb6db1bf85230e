"""Stands in for ssh: runs the remote command locally through sh, in a new session, as if
on another host (only its stdin connects it to the launcher). Records its argv in
FAKE_SSH_LOG. FAKE_SSH_MODE=hang never runs the command; =unreachable exits 255."""

import json
import os
import subprocess
import sys
import time

args = sys.argv[1:]
if os.environ.get("FAKE_SSH_LOG"):
    with open(os.environ["FAKE_SSH_LOG"], "a") as f:
        f.write(json.dumps(sys.argv) + "\n")
i = 0
while args[i].startswith("-"):
    i += 2 if args[i] in ("-o", "-p", "-i", "-l") else 1
host, command = args[i], " ".join(args[i + 1:])
mode = os.environ.get("FAKE_SSH_MODE", "")
if mode == "hang":
    time.sleep(60)
if mode == "unreachable":
    print(f"ssh: connect to host {host} port 22: Connection refused", file=sys.stderr)
    sys.exit(255)
proc = subprocess.Popen(["sh", "-c", command], start_new_session=True)
rc = proc.wait()
sys.exit(128 - rc if rc < 0 else rc)
