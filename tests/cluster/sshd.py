"""One OpenSSH server per namespace host, with test-only keys: ``ssh host1`` as users do.

:class:`SshServers` generates, into a temporary directory, a host key and a client key
(``ssh-keygen``), writes an ``sshd_config`` per host (root login by key only, no password,
no PAM, listening on the host's own addresses and a test port), and starts
``/usr/sbin/sshd -D -e -f <config>`` on each host (:meth:`netns.Host.popen`), waiting
until each answers with its SSH banner. :meth:`SshServers.close` (also on ``with`` exit)
stops them, kills any session process they left, checks that no ``sshd`` remains on any
host (raising if one does) and removes the keys.

The client side: :meth:`SshServers.client_args` are the ``ssh`` options that reach these
servers non-interactively (identity, port, no known-hosts file, ``BatchMode``);
:meth:`SshServers.install_client_config` puts the options that a user's own ssh
configuration would hold (host keys accepted, ``BatchMode``) into a host's
``/etc/ssh/ssh_config``, by a bind mount visible only in that host's mount namespace, so
that programs started there (``sdlrun``, ``mpirun``) need only ``-p``/``-i``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

SSHD = "/usr/sbin/sshd"
PORT = 2222  # not 22: the tests check that sdlrun passes -p through

_SERVER_CONFIG = """\
Port {port}
{listen}
HostKey {tmp}/host_key
PidFile {tmp}/sshd.{name}.pid
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
X11Forwarding no
AllowAgentForwarding no
AllowTcpForwarding no
MaxStartups 100:30:200
LogLevel ERROR
"""

_CLIENT_CONFIG = """\
Host *
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    BatchMode yes
    LogLevel ERROR
    ConnectTimeout 20
"""


def unavailable() -> Optional[str]:
    """Why the servers cannot run here (None: they can)."""
    for tool in (SSHD, shutil.which("ssh"), shutil.which("ssh-keygen")):
        if not tool or not os.path.exists(tool):
            return "OpenSSH server and client are needed (scripts/setup.sh installs them)"
    return None


def is_sshd(pid: int) -> bool:
    """Whether process ``pid`` is an sshd (a listener or a session)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "sshd"
    except OSError:
        return False


class SshServers:
    """An sshd on every host of ``cluster`` (a :class:`netns.Cluster`)."""

    def __init__(self, cluster, port: int = PORT, timeout: float = 20.0):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.cluster = cluster
        self.port = port
        self.tmp = tempfile.mkdtemp(prefix="sdl-sshd-")
        os.chmod(self.tmp, 0o700)
        self.identity = os.path.join(self.tmp, "client_key")
        self.client_config = os.path.join(self.tmp, "ssh_config")
        self.servers: Dict[str, subprocess.Popen] = {}
        self._closed = False
        try:
            self._keys()
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privsep directory
            for host in cluster.hosts:
                self._start(host)
            for host in cluster.hosts:
                self._wait_ready(host, timeout)
        except BaseException:
            self.close()
            raise

    def _keys(self) -> None:
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                            f"sdl-test-{name}", "-f", os.path.join(self.tmp, name)],
                           check=True, capture_output=True, timeout=30)
        shutil.copyfile(self.identity + ".pub", os.path.join(self.tmp, "authorized_keys"))
        with open(self.client_config, "w") as f:
            f.write(_CLIENT_CONFIG)

    def _start(self, host) -> None:
        config = os.path.join(self.tmp, f"sshd_config.{host.name}")
        listen = "\n".join(f"ListenAddress {a}" for a in host.addresses)
        with open(config, "w") as f:
            f.write(_SERVER_CONFIG.format(port=self.port, listen=listen, tmp=self.tmp,
                                          name=host.name))
        log = open(os.path.join(self.tmp, f"sshd.{host.name}.log"), "wb")
        with log:
            self.servers[host.name] = host.popen([SSHD, "-D", "-e", "-f", config],
                                                 stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=log)

    def _wait_ready(self, host, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        proc = self.servers[host.name]
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd on {host.name} exited {proc.returncode}: "
                                   f"{self.log(host.name)}")
            try:
                # The root namespace reaches every host's address through the bridge.
                with socket.create_connection((host.address, self.port), timeout=2) as s:
                    if s.recv(64).startswith(b"SSH-2.0"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} did not answer within {timeout:g} s: "
                                   f"{self.log(host.name)}")
            time.sleep(0.05)

    def log(self, host_name: str) -> str:
        try:
            with open(os.path.join(self.tmp, f"sshd.{host_name}.log"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    # -- the client side ----------------------------------------------------------------
    def client_args(self) -> List[str]:
        """``ssh`` options that reach these servers without a prompt or a known_hosts."""
        return ["-p", str(self.port), "-i", self.identity, "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]

    def install_client_config(self, host) -> None:
        """Makes ``host``'s ``/etc/ssh/ssh_config`` accept these servers' host key without
        a known_hosts file (a bind mount in that host's mount namespace only)."""
        host.run(["mount", "--bind", self.client_config, "/etc/ssh/ssh_config"], timeout=30)

    def ssh(self, from_host, to: str, command: str, timeout: float = 30):
        """Runs ``command`` on ``to`` through ssh, from ``from_host``."""
        return from_host.run(["ssh"] + self.client_args() + [to, command], timeout=timeout,
                             check=False)

    # -- stopping -----------------------------------------------------------------------
    def sshd_pids(self) -> List[int]:
        """Every sshd process on the cluster's hosts (listeners and sessions)."""
        return [pid for host in self.cluster.hosts for pid in host.processes()
                if is_sshd(pid)]

    def close(self) -> None:
        """Stops every server and its sessions; raises if an sshd is still running."""
        if self._closed:
            return
        self._closed = True
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.servers.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # Sessions outlive their listener until their connection closes: end them too.
        deadline = time.monotonic() + 10
        left = self.sshd_pids()
        while left and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
            left = self.sshd_pids()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if left:
            raise RuntimeError(f"sshd processes left running: {left}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
