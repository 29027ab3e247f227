"""How many GPU-costed sim engines this machine holds at their profile's speed (issue 58: "timing
is by waiting, not computing, so one 2-core machine runs a fleet of 8 such engines").

For N = 1, 2, 4 and 8 engines (``python -m pdctl.sim --sim-profile llama3-8b-h100``, no PD, each
on its own port), every engine gets 16 closed-loop clients at once, each sending a 64-token
prompt of random tokens (nothing cached) for 256 tokens, non-streamed (the client's own CPU
stays small); then 4 and 8 engines again with every request streamed, each token an update
(SGLang's default ``--stream-interval 1``), and with ``--stream-interval 8``. A request's time
against what the profile says it costs: its prefill plus 255 decode steps at batch 16 with the
batch's mean context, ``SimProfile.decode_step_ms``. The figure per row is the median ratio of
measured to modelled time over every request after the first round; 1.00 is the profile's
speed, and what the machine adds shows above it. An engine count "holds" while the ratio stays
within 1.10.

    python benchmarks/sim_fleet.py   # writes benchmarks/results/sim_fleet.{json,md}
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdctl.gpu_profiles import PROFILES

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
PROFILE = PROFILES["llama3-8b-h100"]
CLIENTS, PROMPT, OUT, ROUNDS = 16, 64, 256, 4
HOLDS = 1.10


def modelled_secs() -> float:
    """A request's time at the profile's speed in a steady batch of ``CLIENTS``."""
    mean_context = CLIENTS * (PROMPT + OUT / 2)
    step = PROFILE.decode_step_ms(CLIENTS, mean_context)
    return (PROFILE.prefill_ms([(PROMPT, 0)]) + (OUT - 1) * step) / 1000


MODES = {"plain": (False, 1), "streamed": (True, 1), "streamed, --stream-interval 8": (True, 8)}
"""How the clients ask: (streamed, the engines' --stream-interval)."""


def start(work: Path, row: int, i: int, interval: int = 1) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT.parent))
    from tests.helpers import bound_ports  # the tests' reader of a server's port file

    log, ports = work / f"sim-{row}-{i}.log", work / f"sim-{row}-{i}.ports"  # (a fleet of its own per row)
    argv = [PY, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--sim-profile", PROFILE.name]
    argv += ["--max-running-requests", str(CLIENTS), "--port", "0", "--sim-port-file", str(ports)]
    argv += ["--stream-interval", str(interval)]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    port = bound_ports(ports, proc, log)["port"]
    return proc, f"http://127.0.0.1:{port}"


async def load(urls: list[str], stream: bool = False) -> list[float]:
    """ROUNDS requests per client, every client of every engine at once; the measured/modelled
    ratio of each request after each client's first (which starts the batch)."""
    modelled = modelled_secs()
    ratios: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client(url: str, seed: int) -> None:
            rng = random.Random(seed)
            for round_ in range(ROUNDS):
                body = {
                    "input_ids": [rng.randrange(256) for _ in range(PROMPT)],
                    "sampling_params": {"max_new_tokens": OUT},
                    "stream": stream,
                }
                sent = time.monotonic()
                async with session.post(url + "/generate", json=body) as resp:
                    if stream:
                        async for line in resp.content:
                            if line.startswith(b"data: {"):
                                answer = json.loads(line[6:])
                    else:
                        answer = await resp.json()
                took = time.monotonic() - sent
                assert resp.status == 200 and answer["meta_info"]["completion_tokens"] == OUT, answer
                if round_:
                    ratios.append(took / modelled)

        await asyncio.gather(*(client(url, e * 1000 + c) for e, url in enumerate(urls) for c in range(CLIENTS)))
    return ratios


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="pdctl-sim-fleet-"))
    rows = []
    runs = [(n, "plain") for n in (1, 2, 4, 8)] + [(n, m) for m in list(MODES)[1:] for n in (4, 8)]
    for row_number, (n, mode) in enumerate(runs):
        stream, interval = MODES[mode]
        procs = [start(work, row_number, i, interval) for i in range(n)]
        try:  # (each wrote its port file once it serves)
            ratios = asyncio.run(load([url for _, url in procs], stream))
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                proc.wait(60)
        row = {
            "engines": n,
            "mode": mode,
            "requests": len(ratios),
            "median_ratio": statistics.median(ratios),
            "p90_ratio": statistics.quantiles(ratios, n=10)[-1],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows)


def write(rows: list[dict]) -> None:
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "profile": PROFILE.name,
        "modelled_secs": round(modelled_secs(), 3),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_fleet.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"| engines ({PROFILE.name}, {CLIENTS} clients each) | answers | requests | measured / modelled (median) "
        "| p90 |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['engines']} | {r['mode']} | {r['requests']} | {r['median_ratio']:.3f} | {r['p90_ratio']:.3f} |"
        for r in rows
    ]
    held = [r["engines"] for r in rows if r["median_ratio"] <= HOLDS and r["mode"] == "plain"]
    streamed = {r["mode"]: r["engines"] for r in rows if r["median_ratio"] <= HOLDS and r["mode"] != "plain"}
    lines += [
        "",
        f"A request modelled at {meta['modelled_secs']} s (prefill of {PROMPT} tokens, {OUT - 1} decode steps at "
        f"batch {CLIENTS}). This machine ({meta['cpus']} CPUs) holds up to "
        f"{max(held) if held else 0} such engines within {HOLDS:.2f}x of the profile's speed"
        + "".join(f"; {mode}: {n}" for mode, n in streamed.items())
        + ".",
    ]
    (RESULTS / "sim_fleet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
