"""A sim engine over two nodes (two processes on loopback here; across hosts in
tests/cluster/test_multinode_ssh.py): one engine to its clients, every TP rank in a weight
push, and node 0 failing as SGLang's does when a TP peer dies."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from pdctl.sim import weights_checksum
from pdctl.sim.model import PRESETS, TinyLM
from pdctl.weights import WeightSync
from tests.helpers import SimProcess, eventually, free_port, get, post

PROMPTS = ["the quick brown fox", "hello world", "a b c d e f"]


def two_nodes(tmp, *extra: str) -> tuple[SimProcess, SimProcess]:
    dist = f"127.0.0.1:{free_port()}"
    common = ("--tp-size", "4", "--nnodes", "2", "--dist-init-addr", dist, *extra)
    return (
        SimProcess(tmp, *common, "--node-rank", "0", name="node0"),
        SimProcess(tmp, *common, "--node-rank", "1", name="node1"),
    )


def generate(url: str, prompt: str) -> list[int]:
    code, out = post(url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert code == 200, out
    return out["output_ids"]


def wait_exit(proc: subprocess.Popen, timeout: float = 20) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pid {proc.pid} still runs after {timeout}s")


def test_two_node_engine_serves_as_one_and_takes_a_push_on_every_rank(tmp_path) -> None:
    node0, node1 = two_nodes(tmp_path)
    single = SimProcess(tmp_path, name="single")
    with_all = [node0, node1, single]
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(3) as pool:  # node 0 waits for node 1, so they start together
            list(pool.map(SimProcess.start, with_all))
        for prompt in PROMPTS:
            assert generate(node0.url, prompt) == generate(single.url, prompt)
        code, info = get(node0.url + "/server_info")
        assert code == 200 and info["tp_size"] == 4 and info["nnodes"] == 2
        # node 1 serves SGLang's dummy health server and nothing else
        for path in ("/health", "/health_generate", "/ping"):
            assert get(node1.url + path)[0] == 200, path
        assert post(node1.url + "/generate", {"text": "x"})[0] == 404
        assert get(node1.url + "/server_info")[0] == 404

        model = TinyLM(replace(PRESETS["tiny"], seed=17))
        port = free_port()
        with WeightSync(
            [{"id": "e", "url": node0.url, "gpus": 4}],
            master_address="127.0.0.1",
            master_port=port,
            backend="gloo",
            bucket_mb=1,
            verify="full",
        ) as sync:
            report = sync.push(list(model.named_parameters()), version="v17")
        assert report.engines == ["e"]
        code, out = post(node0.url + "/weights_checker", {"action": "checksum"})
        assert out["checksums"] == weights_checksum(model) and out["weight_version"] == "v17"
        # every bucket reached node 1's two ranks (world 5: the trainer, ranks 1..2 here, 3..4 there)
        crc0 = re.findall(r"digest (\w+), on ranks 1\.\.4", node0.log.read_text())
        crc1 = re.findall(r"digest (\w+), on ranks 3\.\.4", node1.log.read_text())
        assert crc0 and crc0 == crc1
        assert generate(node0.url, PROMPTS[0]) != generate(single.url, PROMPTS[0])
    finally:
        for p in with_all:
            p.stop()


def test_a_dead_peer_fails_node0_and_node0_ending_ends_the_peer(tmp_path) -> None:
    node0, node1 = two_nodes(tmp_path)
    import concurrent.futures as cf

    try:
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(SimProcess.start, [node0, node1]))
        assert node0.proc is not None and node1.proc is not None
        node1.proc.send_signal(signal.SIGTERM)  # joined peers ignore SIGTERM, as SGLang's do

        def took_it() -> bool:
            if "waiting for the rank-0 ShutdownReq" in node1.log.read_text():
                return True
            assert node1.proc.poll() is None, "a joined peer ended on SIGTERM"
            return False

        eventually(took_it, 60, what="the peer saying it took SIGTERM")  # it took the signal...
        assert node1.proc.poll() is None  # ...and runs on
        node1.proc.kill()
        assert wait_exit(node0.proc) == 1
        assert "TP peer node rank 1 went away" in node0.log.read_text()
    finally:
        node0.stop()
        node1.stop()

    node0, node1 = two_nodes(tmp_path)
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(SimProcess.start, [node0, node1]))
        assert node0.proc is not None and node1.proc is not None
        node0.proc.terminate()  # node 0 stopping shuts its peer down (exit 0)
        assert wait_exit(node0.proc) == 0 and wait_exit(node1.proc) == 0
        node1_log = node1.log.read_text()
        assert "node 0 asked to shut down" in node1_log
    finally:
        node0.stop()
        node1.stop()


def test_node0_waits_for_its_peers_and_refuses_a_stranger(tmp_path) -> None:
    node0, _ = two_nodes(tmp_path)
    dist = node0.args[node0.args.index("--dist-init-addr") + 1]
    argv = [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--host", "127.0.0.1"]
    lead = subprocess.Popen(
        [*argv, "--port", str(node0.port), *node0.args], stdout=node0.log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        # a node with another TP size is refused and exits 1; node 0 keeps waiting, not serving
        wrong = subprocess.run(
            [
                *argv,
                "--port",
                str(free_port()),
                "--tp-size",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--dist-init-addr",
                dist,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 1 and "tp_size 2 differs from node 0's 4" in wrong.stderr, wrong.stderr
        assert lead.poll() is None
        with pytest.raises(OSError):
            import urllib.request

            urllib.request.urlopen(node0.url + "/health", timeout=2)
    finally:
        lead.terminate()
        lead.wait(timeout=20)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2", "--node-rank", "1"], "--nnodes > 1 needs --dist-init-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank must be in [0, 1]"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "--tp-size 3 must be a multiple"),
        (["--nnodes", "2", "--dist-init-addr", "nohost"], "--dist-init-addr must be HOST:PORT"),
    ],
)
def test_bad_node_flags_exit_2(flags, message) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", *flags], capture_output=True, text=True
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
