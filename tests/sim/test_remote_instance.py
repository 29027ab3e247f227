"""The sim's engine-to-engine weights, as SGLang 0.5.23 moves them: a receiver started with
``--load-format remote_instance`` takes a serving seed's weights over the seed's two routes
(real processes, a real gloo group between them)."""

from __future__ import annotations

import json

import pytest
import requests

from tests.helpers import SimProcess, eventually, free_port

GREEDY = {"text": "the seed says", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


def _checksum(sim: SimProcess, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.post(f"{sim.url}/weights_checker", json={"action": "checksum"}, headers=headers, timeout=30)
    r.raise_for_status()
    body = r.json()
    assert body["success"] and len(body["ranks"]) == 1, body
    return body["per_engine_checksum"]


def _text(sim: SimProcess) -> str:
    r = requests.post(f"{sim.url}/generate", json=GREEDY, timeout=30)
    r.raise_for_status()
    return r.json()["text"]


def _receiver_flags(seed: SimProcess, ports: list[int]) -> tuple[str, ...]:
    return (
        "--load-format", "remote_instance",
        "--remote-instance-weight-loader-seed-instance-ip", "127.0.0.1",
        "--remote-instance-weight-loader-seed-instance-service-port", str(seed.port),
        "--remote-instance-weight-loader-send-weights-group-ports", json.dumps(ports),
    )  # fmt: skip


@pytest.fixture
def seed(tmp_path):
    sim = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=1", name="seed").start()
    yield sim
    sim.stop()


def test_a_receiver_starts_on_the_seeds_weights_and_the_seed_serves_on(tmp_path, seed) -> None:
    alone = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=2", name="alone").start()
    try:
        assert _checksum(alone) != _checksum(seed)  # the receiver's own weights differ from the seed's
    finally:
        alone.stop()
    receiver = SimProcess(
        tmp_path, "--model-path", "sim://tiny?seed=2", *_receiver_flags(seed, [free_port()]), name="receiver"
    ).start()
    try:
        assert _checksum(receiver) == _checksum(seed)
        assert _text(receiver) == _text(seed)
        info = requests.get(f"{receiver.url}/model_info", timeout=10).json()
        assert info["weight_version"] == "default"  # SGLang's receiver keeps its own version: pdctl stamps it
    finally:
        receiver.stop()
    # Every transfer destroys its group: a second receiver needs (and gets) a new init.
    again = SimProcess(
        tmp_path, "--model-path", "sim://tiny?seed=3", *_receiver_flags(seed, [free_port()]), name="again"
    ).start()
    try:
        assert _checksum(again) == _checksum(seed)
    finally:
        again.stop()
    assert seed.proc.poll() is None


def test_incomplete_settings_fall_back_to_the_receivers_own_weights(tmp_path, seed) -> None:
    flags = ("--load-format", "remote_instance", "--remote-instance-weight-loader-seed-instance-ip", "127.0.0.1")
    receiver = SimProcess(tmp_path, "--model-path", "sim://tiny?seed=2", *flags, name="fallback").start()
    try:
        assert _checksum(receiver) != _checksum(seed)
        assert "Fallback load_format to 'auto'" in receiver.log.read_text()
    finally:
        receiver.stop()


def test_a_keyed_seed_refuses_the_receivers_own_unauthenticated_trigger(tmp_path) -> None:
    """SGLang's receiver POSTs to the seed with no key: a seed with a key (every pdctl engine)
    answers 401, so a launcher that keys its engines must carry the seed's side itself."""
    sim = SimProcess(tmp_path, "--api-key", "k" * 32, name="keyed").start()
    try:
        body = {"master_address": "127.0.0.1", "ports": "1", "group_rank": 0, "world_size": 2}
        r = requests.post(f"{sim.url}/init_weights_send_group_for_remote_instance", json=body, timeout=10)
        assert r.status_code == 401
        assert sim.proc.poll() is None
    finally:
        sim.stop()


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (
            "/init_weights_send_group_for_remote_instance",
            {"master_address": "127.0.0.1", "ports": "1,2", "group_rank": 0, "world_size": 2},
        ),
        ("/send_weights_to_remote_instance", {"master_address": "127.0.0.1", "ports": "1", "group_name": "none"}),
    ],
    ids=["port-count-not-tp", "send-without-init"],
)
def test_what_ends_an_sglang_seed_ends_the_sims(tmp_path, route, body) -> None:
    """Both are uncaught raises in SGLang 0.5.23's scheduler (an assert, a KeyError), which end
    the seed: the sim ends too, so that pdctl's own checks before these calls are tested."""
    sim = SimProcess(tmp_path, name="doomed").start()
    try:
        r = requests.post(sim.url + route, json=body, timeout=10)
        assert r.status_code == 500
        eventually(lambda: sim.proc.poll() is not None, 60, what="the seed's exit")
        assert sim.proc.returncode == 1
    finally:
        sim.stop()
