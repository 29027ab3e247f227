from __future__ import annotations

from pathlib import Path

import pytest

from tests.netns import TestHosts, netns_unavailable


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    """Three real SSH test hosts in network namespaces (see tests/netns.py)."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"multi-host tests skipped: {reason}")
    built = TestHosts(3, tmp_path_factory.mktemp("hosts")).start()
    try:
        yield built
    finally:  # removed whatever the tests did (a later run also sweeps sets whose owner was killed)
        built.close()


@pytest.fixture
def clean_hosts(hosts):
    """Asserts after the test that no process of ours is left on any host."""
    yield hosts
    strays = hosts.stray_pids()
    seen = {pid: _cmdline(pid) for pids in strays.values() for pid in pids}
    hosts.kill_strays()
    assert not strays, f"stray processes left on test hosts: {strays}: {seen}"


@pytest.fixture
def pdctl_home(tmp_path, monkeypatch):
    home = tmp_path / "pdctl-home"
    monkeypatch.setenv("PDCTL_HOME", str(home))
    return home


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"
