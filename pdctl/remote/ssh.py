"""Remote nodes over SSH (paramiko): ~/.ssh/config, ssh-agent and the topology's key; host
keys checked against known_hosts; one connection per node, reused for every call.

Host-key policy: an unknown host is refused unless ``ssh.accept_new_host_key`` is set (then
its key is recorded, like StrictHostKeyChecking=accept-new); a changed key is always
refused. paramiko and socket errors become RemoteError here and nowhere else.
"""

from __future__ import annotations

import shlex
import threading
from pathlib import Path

import paramiko

from pdctl.errors import NodeUnreachable, RemoteError
from pdctl.remote.base import Executor
from pdctl.topology.model import Node

CONNECT_TIMEOUT_SECS = 10.0


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Record an unknown host's key in ``path``; paramiko itself refuses changed keys."""

    def __init__(self, path: Path):
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


class SSHExecutor(Executor):
    """The executor of a remote node: one SSH connection, opened on first use and reused by every call
    (module docstring for the host-key policy). Raises ``RemoteError`` when the node's configured
    key file does not exist."""

    def __init__(self, node: Node):
        super().__init__(node)
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        cfg = paramiko.SSHConfig()
        user_config = Path("~/.ssh/config").expanduser()
        if user_config.is_file():
            cfg = paramiko.SSHConfig.from_path(str(user_config))
        found = cfg.lookup(node.host)
        self.hostname = found.get("hostname", node.host)
        self.port = node.ssh.port or int(found.get("port", 22))
        self.user = node.ssh.user or found.get("user")
        keys = [node.ssh.key] if node.ssh.key else list(found.get("identityfile", []))
        self.key_files = [str(Path(k).expanduser()) for k in keys if Path(k).expanduser().is_file()]
        if node.ssh.key and not self.key_files:
            raise RemoteError(f"node {node.name}: ssh key {node.ssh.key} does not exist")
        self.known_hosts = Path(node.ssh.known_hosts or "~/.ssh/known_hosts").expanduser()

    @property
    def where(self) -> str:
        """The node and its SSH address, for messages."""
        return f"node {self.node.name} ({self.user + '@' if self.user else ''}{self.hostname}:{self.port})"

    def connect(self) -> None:
        """Open the connection unless one is open. Raises ``NodeUnreachable`` when the host cannot be
        reached or never speaks SSH, and ``RemoteError`` for a host key that is unknown or changed,
        failed authentication or another SSH error."""
        with self._lock:
            if self._client is not None:
                return
            client = paramiko.SSHClient()
            # No known_hosts file: still connect (refusing every key), so that an unreachable host
            # says so rather than hiding behind the missing file.
            if self.known_hosts.is_file():
                client.load_host_keys(str(self.known_hosts))
            if self.node.ssh.accept_new_host_key:
                client.set_missing_host_key_policy(_AcceptNewPolicy(self.known_hosts))
            else:
                client.set_missing_host_key_policy(paramiko.RejectPolicy())
            try:
                client.connect(
                    self.hostname,
                    port=self.port,
                    username=self.user,
                    key_filename=self.key_files or None,  # type: ignore[arg-type]  # paramiko takes a list too
                    timeout=CONNECT_TIMEOUT_SECS,
                    banner_timeout=CONNECT_TIMEOUT_SECS,
                    auth_timeout=CONNECT_TIMEOUT_SECS,
                    allow_agent=True,
                    look_for_keys=not self.key_files,
                )
            except paramiko.BadHostKeyException as exc:
                client.close()
                raise RemoteError(
                    f"{self.where}: host key does not match {self.known_hosts} "
                    f"(expected {exc.expected_key.get_name()}, got {exc.key.get_name()}); refusing to connect. "
                    f"If the host was reinstalled, remove the old key with `ssh-keygen -R {self.hostname}`"
                ) from exc
            except paramiko.AuthenticationException as exc:
                client.close()
                raise RemoteError(f"{self.where}: authentication failed ({exc}); check ssh.user and ssh.key") from exc
            except paramiko.SSHException as exc:
                transport = client.get_transport()
                spoke = transport is not None and bool(transport.remote_version)
                client.close()
                if "not found in known_hosts" in str(exc):
                    where = "" if self.known_hosts.is_file() else ", which does not exist"
                    raise RemoteError(
                        f"{self.where}: host key unknown (not in {self.known_hosts}{where}); add it with "
                        f"`ssh-keyscan -p {self.port} {self.hostname} >> {self.known_hosts}` after checking it, "
                        "or set ssh.accept_new_host_key: true"
                    ) from exc
                if not spoke:  # it took the connection and never sent an SSH banner
                    raise NodeUnreachable(
                        f"{self.where}: unreachable: it took the connection and never spoke SSH ({exc})"
                    ) from exc
                raise RemoteError(f"{self.where}: SSH error: {exc}") from exc
            except (TimeoutError, OSError) as exc:
                client.close()
                raise NodeUnreachable(f"{self.where}: unreachable: {_reason(exc)}") from exc
            self._client = client

    def _run(self, argv: list[str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        self.connect()
        assert self._client is not None
        # NOTE: the one place a remote shell sees our argv: quote every word.
        command = shlex.join(argv)
        try:
            chan_in, chan_out, chan_err = self._client.exec_command(command, timeout=timeout)
            chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read()
            err = chan_err.read()
            code = chan_out.channel.recv_exit_status()
        except (TimeoutError, paramiko.SSHException, OSError) as exc:
            self.close()
            raise RemoteError(f"{self.where}: `{' '.join(argv[2:])}` failed: {exc}") from exc
        return code, out, err

    def close(self) -> None:
        """Close the connection, if open; the next call opens a new one."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _reason(exc: OSError) -> str:
    """An OS error as a person reads it: paramiko's connection errors carry no errno ("[Errno None]")."""
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        causes = {getattr(e, "strerror", None) or type(e).__name__ for e in exc.errors.values()}
        return f"cannot connect ({', '.join(sorted(causes))})"
    return exc.strerror or str(exc) or f"no answer within {CONNECT_TIMEOUT_SECS:g}s"
