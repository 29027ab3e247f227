"""Command lines shown anywhere (a busy port's owner in up's preflight, the sim's /server_info)
never show an engine's key, in either spelling of the flag."""

from __future__ import annotations

from pdctl.node.proc import redact
from tests.helpers import SimProcess, get


def test_both_spellings_of_the_key_flags_are_redacted() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "-k1", "--admin-api-key=k2", "--port", "1"]
    assert redact(argv) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--api-key",
        "***",
        "--admin-api-key=***",
        "--port",
        "1",
    ]


def test_a_sims_launch_command_never_shows_its_key(tmp_path) -> None:
    sim = SimProcess(tmp_path, "--api-key=-secret-engine-key").start()  # a key may begin with '-'
    try:
        status, info = get(sim.url + "/server_info", headers={"Authorization": "Bearer -secret-engine-key"})
        assert status == 200 and "--api-key=***" in info["launch_command"], info.get("launch_command")
        assert "secret-engine-key" not in str(info)
    finally:
        sim.stop()
