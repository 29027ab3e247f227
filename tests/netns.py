"""Real test hosts: one network namespace per host, each with its own sshd.

A bridge in the root namespace joins a veth pair per host, on a private /24 used only for
this (10.77.X.0/24, X random and claimed by creating its bridge, so that concurrent runs do not collide); the control
side is 10.77.X.1. sshd runs with a throwaway host key and an authorized throwaway client
key; known_hosts is written here. The filesystem is shared, so the test venv works on every
host. ``close()`` removes processes, namespaces, veths and the bridge even after failures.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def netns_unavailable() -> str | None:
    """Why these hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not Path("/usr/sbin/sshd").exists():
        return "openssh-server not installed (scripts/setup.sh installs it)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@dataclass
class TestHost:
    name: str
    netns: str
    ip: str
    sshd: subprocess.Popen | None = None

    def pids(self) -> list[int]:
        """Every process in this host's namespace but its sshd (and sshd's session children)."""
        out = _run("ip", "netns", "pids", self.netns, check=False).stdout.split()
        pids = [int(p) for p in out]
        keep = {self.sshd.pid} if self.sshd else set()
        result = []
        for pid in pids:
            if pid in keep:
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("sshd"):
                continue
            if _zombie(pid):  # it has exited; its reaper (this container's init) may come late
                continue
            result.append(pid)
        return result

    def exec(self, *argv: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], **kw)


OWNERS = Path("/run/pdctl-test-hosts")
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts the files of /etc/netns/NS over /etc's: each test host's own
hosts and resolv.conf (_names)."""
"""One file per claimed test host set (pdX), holding the pid of the suite that made it."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone meanwhile
    return stat[stat.rindex(")") + 2 :].startswith("Z")  # the state field follows "(comm) "


class TestHosts:
    def __init__(self, count: int, tmp: Path):
        self.tmp = tmp
        self.count = count
        self.subnet = 0
        self.prefix = self.bridge = self.gateway = ""
        self.hosts: list[TestHost] = []
        self.client_key = tmp / "client_key"
        self.known_hosts = tmp / "known_hosts"

    # -- build ---------------------------------------------------------------------------
    def start(self) -> TestHosts:
        self.sweep_orphans()
        try:
            self._claim()
            self._network()
            self._keys()
            for i, host in enumerate(self.hosts):
                self._sshd(i, host)
            for host in self.hosts:
                self._wait_sshd(host)
        except BaseException:  # (Ctrl-C too) nothing half built stays
            self.close()
            raise
        return self

    @staticmethod
    def sweep_orphans() -> None:
        """Remove the test host sets whose owning process is gone (a suite killed with SIGKILL could
        not run its teardown): each set's owner pid is kept in OWNERS/pdX."""
        if not OWNERS.is_dir():
            return
        for owner in OWNERS.iterdir():
            try:
                pid = int(owner.read_text())
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                continue
            prefix = owner.name
            for ns in _run("ip", "netns", "list", check=False).stdout.split():
                if re.fullmatch(rf"{prefix}h\d+", ns):
                    for p in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                        with contextlib.suppress(ProcessLookupError, ValueError):
                            os.kill(int(p), signal.SIGKILL)
                    _run("ip", "netns", "del", ns, check=False)
                    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            for link in re.findall(rf"\d+: ({prefix}v\d+)[@:]", _run("ip", "-o", "link", check=False).stdout):
                _run("ip", "link", "del", link, check=False)
            _run("ip", "link", "del", f"{prefix}br", check=False)
            owner.unlink(missing_ok=True)

    def _claim(self) -> None:
        """A 10.77.X.0/24 no other run uses (X random, not from the pid: suites sharing a machine
        each get their own), claimed by creating its bridge ``pdXbr``: a second run that picks
        the same X fails to create it and picks again."""
        used = set(re.findall(r"10\.77\.(\d+)\.", _run("ip", "-4", "-o", "addr").stdout))
        spaces = set(_run("ip", "netns", "list", check=False).stdout.split())
        for x in random.SystemRandom().sample(range(10, 250), 240):
            if str(x) in used or f"pd{x}h0" in spaces:
                continue
            if _run("ip", "link", "add", f"pd{x}br", "type", "bridge", check=False).returncode != 0:
                continue  # taken meanwhile
            OWNERS.mkdir(parents=True, exist_ok=True)
            (OWNERS / f"pd{x}").write_text(str(os.getpid()))
            self.subnet, self.prefix = x, f"pd{x}"
            self.bridge, self.gateway = f"pd{x}br", f"10.77.{x}.1"
            self.hosts = [TestHost(f"h{i}", f"pd{x}h{i}", f"10.77.{x}.{i + 2}") for i in range(self.count)]
            return
        raise RuntimeError("no free 10.77.X.0/24 for test hosts")

    def _network(self) -> None:
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            outer, inner = f"{self.prefix}v{i}", f"{self.prefix}p{i}"
            _run("ip", "netns", "add", host.netns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", host.netns)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            ns = ("ip", "netns", "exec", host.netns)
            _run(*ns, "ip", "addr", "add", f"{host.ip}/24", "dev", inner)
            _run(*ns, "ip", "link", "set", inner, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
            _run(*ns, "ip", "route", "add", "default", "via", self.gateway)
        self._names()

    def _names(self) -> None:
        """Each test host resolves every address of the set, the control machine's (the gateway)
        too, from its hosts file, and asks no nameserver: the machine's is not reachable from a
        test host, so each reverse lookup (torch's c10d does one per connection: "the hostname of
        the client socket cannot be retrieved") waited 10 s for its timeouts: about 30 s of a
        cross-host weight push."""
        system = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
        ours = [f"{self.gateway} {self.prefix}-control"] + [f"{h.ip} {h.netns}" for h in self.hosts]
        for host in self.hosts:
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(system.rstrip("\n") + "\n" + "\n".join(ours) + "\n")
            (etc / "resolv.conf").write_text("# a pdctl test host: no nameserver (tests/netns.py)\n")

    def _keys(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.client_key))
        (self.tmp / "authorized_keys").write_text((self.tmp / "client_key.pub").read_text())
        lines = []
        for i, host in enumerate(self.hosts):
            key = self.tmp / f"host_key_{i}"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            lines.append(
                f"{host.ip} {(self.tmp / f'host_key_{i}.pub').read_text().split(' ')[0]} "
                f"{(self.tmp / f'host_key_{i}.pub').read_text().split(' ')[1]}"
            )
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def _sshd(self, i: int, host: TestHost) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)
        config = self.tmp / f"sshd_{i}.conf"
        config.write_text(
            "\n".join(
                [
                    "Port 22",
                    f"ListenAddress {host.ip}",
                    f"HostKey {self.tmp / f'host_key_{i}'}",
                    f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}",
                    "PidFile none",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "StrictModes no",
                    "PubkeyAuthentication yes",
                    "MaxStartups 100:30:200",
                    "MaxSessions 100",
                    "LogLevel ERROR",
                ]
            )
            + "\n"
        )
        log = (self.tmp / f"sshd_{i}.log").open("w")
        host.sshd = host.exec("/usr/sbin/sshd", "-D", "-e", "-f", str(config), stdout=log, stderr=subprocess.STDOUT)

    def _wait_sshd(self, host: TestHost, timeout: float = 300) -> None:
        """Until the host's sshd takes connections (an event: however loaded the machine), or it
        exits; ``timeout`` only stops a hang from holding the suite."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host.ip, 22), timeout=1):
                return
            if host.sshd is not None and host.sshd.poll() is not None:
                log = (self.tmp / f"sshd_{self.hosts.index(host)}.log").read_text()[-2000:]
                raise RuntimeError(f"sshd on {host.ip} exited with {host.sshd.returncode}: {log}")
            time.sleep(0.05)
        raise TimeoutError(f"sshd on {host.ip}:22 took no connection within {timeout:.0f}s")

    # -- helpers for tests ------------------------------------------------------------------
    def node(self, i: int, **extra) -> dict:
        """A topology node entry for host i."""
        ssh = {"user": "root", "key": str(self.client_key), "known_hosts": str(self.known_hosts)}
        ssh.update(extra.pop("ssh", {}))
        return {
            "name": self.hosts[i].name,
            "host": self.hosts[i].ip,
            "gpus": 4,
            "ssh": ssh,
            "python": os.environ.get("PDCTL_TEST_PYTHON", _venv_python()),
            "workdir": str(self.tmp / "runs" / self.hosts[i].name),
            **extra,
        }

    def stray_pids(self) -> dict[str, list[int]]:
        return {h.name: h.pids() for h in self.hosts if h.pids()}

    def kill_strays(self) -> None:
        for host in self.hosts:
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        for host in self.hosts:
            for pid in _run("ip", "netns", "pids", host.netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if host.sshd is not None:
                with contextlib.suppress(Exception):
                    host.sshd.kill()
                    host.sshd.wait(timeout=5)
            _run("ip", "netns", "del", host.netns, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        for i in range(len(self.hosts)):
            _run("ip", "link", "del", f"{self.prefix}v{i}", check=False)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        if self.prefix:
            (OWNERS / self.prefix).unlink(missing_ok=True)


def _venv_python() -> str:
    import sys

    return sys.executable
