"""The tests' sim engines are forked by tests/sim_forkserver.py (torch imported once) unless
``PDCTL_TEST_SIM_EXEC=1``: a forked engine must be the engine an exec'd ``python -m pdctl.sim``
is, to its clients and to the test that stops it."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.helpers import ForkedProcess, SimProcess, post

BODY = {"text": "the fork server", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


def start(tmp_path, monkeypatch, *, forked: bool, name: str) -> SimProcess:
    monkeypatch.setenv("PDCTL_TEST_SIM_EXEC", "0" if forked else "1")
    sim = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=9", name=name).start()
    assert isinstance(sim.proc, ForkedProcess) is forked
    return sim


def test_a_forked_engine_answers_and_exits_as_an_execd_one(tmp_path, monkeypatch) -> None:
    execd = start(tmp_path, monkeypatch, forked=False, name="execd")
    forked = start(tmp_path, monkeypatch, forked=True, name="forked")
    try:
        a, b = post(execd.url + "/generate", BODY), post(forked.url + "/generate", BODY)
        assert a[0] == b[0] == 200 and a[1]["text"] == b[1]["text"], (a, b)
        assert os.getsid(forked.proc.pid) == forked.proc.pid, "its own session, as start_new_session gives"
        # SIGTERM: a clean stop, exit 0, both ways; SIGKILL: -9
        for sim in (execd, forked):
            sim.proc.send_signal(signal.SIGTERM)
            assert sim.proc.wait(timeout=60) == 0
        again = start(tmp_path, monkeypatch, forked=True, name="killed")
        assert again.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            again.proc.wait(timeout=0.1)
        again.proc.kill()
        assert again.proc.wait(timeout=60) == -signal.SIGKILL and again.proc.returncode == -signal.SIGKILL
    finally:
        execd.stop()
        forked.stop()


@pytest.mark.parametrize("forked", [False, True])
def test_a_bad_flag_exits_2_with_argparses_words_in_the_log(tmp_path, monkeypatch, forked) -> None:
    monkeypatch.setenv("PDCTL_TEST_SIM_EXEC", "0" if forked else "1")
    sim = SimProcess(tmp_path, "--no-such-flag", name="bad")
    with pytest.raises(RuntimeError, match="exited with 2"):
        sim.start()
    assert "unrecognized arguments: --no-such-flag" in sim.log.read_text()
