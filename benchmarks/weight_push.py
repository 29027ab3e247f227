"""Weight push cost, side by side in one run: ``WeightSync.push`` against one bare broadcast.

Fleet: three sims, prefill tp 1, prefill tp 1, decode tp 2 (world 1 + 1 + 1 + 2 = 5 ranks over
gloo on loopback), behind pdctl's router (the push holds and releases it). Tensors have a real
model's layer shapes (hidden 1024, MLP 2816, 8 heads, vocabulary 8192: a 0.5B-class layer)
with as many layers as reach the size; the sim keeps weights in float64 (its arithmetic is
float64 so that greedy output does not depend on batching), so the tensors are float64 too and
a size is the bytes moved, not a parameter count.

The limit: one bare ``torch.distributed.broadcast`` of the same bytes among five processes in the
same layout (rank 0 sends; four receive, one flat buffer each), timed until every rank has it, in a
group that stands for the whole size (connections made and every page touched by a warm-up). Beside
it, in the same group, one bare broadcast per tensor of the same model (the collectives a ``names``
push makes, with nothing of pdctl around them): the push against it is what pdctl itself costs.
Every timed push comes right after its own pair of bare broadcasts (a trio), so that the machine's
drift (one broadcast here varies by +-30% from one to the next) hits all three; a ratio is the median
over all trios (ROUNDS rounds x REPS pushes per load format), reported with its quartiles.

Goals (the weights issue): transfer >= 0.95x the bare broadcast's bandwidth; everything but the
transfer (hold, pause, begin, end, version, verify, continue, release) < 0.5 s in total.

    python benchmarks/weight_push.py   # writes benchmarks/results/weight_push.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import free_port, wait

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
ROUNDS = int(os.environ.get("WEIGHT_BENCH_ROUNDS", 5))
REPS = int(os.environ.get("WEIGHT_BENCH_REPS", 3))
"""Timed trios (bare flat, bare per tensor, push) per load format in each round."""
SIZES_MB = [int(s) for s in os.environ.get("WEIGHT_BENCH_SIZES_MB", "256,1024").split(",")]
SHAPE = {"hidden": 1024, "heads": 8, "mlp": 2816, "vocab_size": 8192, "max_positions": 256}
ENGINES = [("prefill", 1), ("prefill", 1), ("decode", 2)]
FORMATS = ["names", "flattened_bucket"]
DIGEST = os.environ.get("WEIGHT_BENCH_DIGEST", "sample")
"""How the sims' TP ranks compare what they received (a check of the sim's own that SGLang does not
make; ``full`` reads every byte on every rank, on the same two cores as the broadcast)."""


def config_for(megabytes: int):
    """A sim model config with real layer shapes, as many layers as fit in ``megabytes`` (MiB)
    beside the embeddings, and the vocabulary sized so that the total comes out at that size."""
    from pdctl.sim.model import SimModelConfig, TinyLM

    base = SimModelConfig(**SHAPE, layers=1)
    per_layer = sum(p.numel() * 8 for n, p in TinyLM(base).named_parameters() if ".layers." in n)
    rest = sum(p.numel() * 8 for n, p in TinyLM(base).named_parameters() if ".layers." not in n)
    target = megabytes * 2**20
    layers = max(1, int((target - rest) // per_layer))
    per_token = 8 * (2 * SHAPE["hidden"] + 1)  # embed_tokens row, lm_head row and bias
    vocab = SHAPE["vocab_size"] + (target - rest - layers * per_layer) // per_token
    return replace(base, layers=layers, vocab_size=max(260, int(vocab)))


# -- the bare broadcast --------------------------------------------------------------------------------
BARE_KINDS = ("flat", "per_tensor", "exit")


def bare_rank(rank: int, world: int, port: int, megabytes: int) -> None:
    """One rank of a standing group for bare broadcasts, kept for a whole size so that each one can
    be timed right beside a push. Rank 0 reads a kind per line on stdin (``flat``: the model's bytes
    as one buffer, the goal's limit; ``per_tensor``: one broadcast per tensor of the same model, the
    collectives a ``names`` push makes with none of pdctl's work around them; ``exit``), tells the
    other ranks with a one-element broadcast, and prints the seconds until every rank has the data."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    shapes = model_shapes(megabytes)
    nbytes = sum(8 * math.prod(shape) for shape in shapes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flat = (torch.ones if rank == 0 else torch.empty)(nbytes, dtype=torch.uint8)
    tensors, offset = [], 0  # the same bytes as ``flat``, cut into the model's tensors
    for shape in shapes:
        size = 8 * math.prod(shape)
        tensors.append(flat[offset : offset + size].view(torch.float64).view(shape))
        offset += size

    def run(kind: str) -> None:
        if kind == "flat":
            dist.broadcast(flat, src=0)
        else:
            for work in [dist.broadcast(t, src=0, async_op=True) for t in tensors]:
                work.wait()

    for kind in BARE_KINDS[:2]:  # warm: connections made, every page of the buffer touched
        run(kind)
    dist.barrier()
    if rank == 0:
        print("ready", flush=True)
    command = torch.zeros(1, dtype=torch.int64)
    while True:
        if rank == 0:
            command[0] = BARE_KINDS.index(sys.stdin.readline().strip() or "exit")
        dist.broadcast(command, src=0)
        dist.barrier()
        kind = BARE_KINDS[int(command[0])]
        if kind == "exit":
            break
        started = time.perf_counter()
        run(kind)
        dist.barrier()  # every receiver has it, as a push's end waits for every engine's answer
        if rank == 0:
            print(time.perf_counter() - started, flush=True)
    dist.destroy_process_group()


def model_shapes(megabytes: int) -> list[tuple[int, ...]]:
    """The shapes of a ``megabytes`` model's tensors (see ``config_for``), in names order; built
    on the meta device, so no rank allocates the model only to read them."""
    import torch

    from pdctl.sim.model import TinyLM

    with torch.device("meta"):
        return [tuple(p.shape) for p in TinyLM(config_for(megabytes)).parameters()]


class BareGroup:
    """The bare broadcast's processes (one per rank of the push's group, in the same layout)."""

    def __init__(self, megabytes: int):
        world = 1 + sum(tp for _, tp in ENGINES)
        port = free_port()
        argv = [PY, __file__, "--bare-rank"]
        self.procs = [
            subprocess.Popen(
                [*argv, str(r), str(world), str(port), str(megabytes)],
                text=True,
                stdin=subprocess.PIPE if r == 0 else None,
                stdout=subprocess.PIPE if r == 0 else None,
            )
            for r in range(world)
        ]
        if self._line() != "ready":
            raise RuntimeError("the bare broadcast's ranks did not start")

    def _line(self) -> str:
        out = self.procs[0].stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError("the bare broadcast's rank 0 exited")
        return line.strip()

    def seconds(self, kind: str) -> float:
        """One timed broadcast of ``kind`` (``flat`` or ``per_tensor``)."""
        assert self.procs[0].stdin is not None
        self.procs[0].stdin.write(kind + "\n")
        self.procs[0].stdin.flush()
        return float(self._line())

    def close(self) -> None:
        try:
            if self.procs[0].stdin is not None:
                self.procs[0].stdin.write("exit\n")
                self.procs[0].stdin.close()
            for p in self.procs:
                p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            for p in self.procs:
                p.kill()

    def __enter__(self) -> BareGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the fleet -------------------------------------------------------------------------------------------
class Fleet:
    def __init__(self, tmp: Path, model_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.engines: list[dict] = []
        try:
            self._start(tmp, model_dir)
        except BaseException:
            self.stop()  # a failed start leaves nothing behind
            raise

    def _start(self, tmp: Path, model_dir: Path) -> None:
        prefills, decodes = [], []
        for i, (role, tp) in enumerate(ENGINES):
            port = free_port()
            argv = [
                PY,
                "-m",
                "pdctl.sim",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model-path",
                str(model_dir),
                "--load-format",
                "dummy",
                "--tp-size",
                str(tp),
                "--disaggregation-mode",
                role,
                "--max-running-requests",
                "2",
                "--sim-weight-digest",
                DIGEST,
            ]
            if role == "prefill":
                boot = free_port()
                argv += ["--disaggregation-bootstrap-port", str(boot)]
                prefills += ["--prefill", f"http://127.0.0.1:{port}", str(boot)]
            else:
                decodes += ["--decode", f"http://127.0.0.1:{port}"]
            log = (tmp / f"engine{i}.log").open("w")
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            self.engines.append({"id": f"{role}{i}-tp{tp}", "url": f"http://127.0.0.1:{port}", "gpus": tp})
        for e in self.engines:
            wait(e["url"] + "/health", timeout=180)  # a 1 GiB model takes a while to build
        self.router_url = f"http://127.0.0.1:{free_port()}"
        rport = self.router_url.rsplit(":", 1)[1]
        argv = [
            PY,
            "-m",
            "pdctl",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            rport,
            "--pd-disaggregation",
            *prefills,
            *decodes,
        ]
        log = (tmp / "router.log").open("w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        wait(self.router_url + "/readiness", timeout=180)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def measure(megabytes: int, tmp: Path) -> dict:
    from pdctl.sim.model import TinyLM
    from pdctl.weights import WeightSync

    config = config_for(megabytes)
    model_dir = tmp / f"model-{megabytes}"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(asdict(config)))
    trainer = TinyLM(config)
    tensors = list(trainer.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    fleet = Fleet(tmp, model_dir)
    rounds = []
    try:

        def sync_for(fmt: str) -> WeightSync:
            return WeightSync(
                fleet.engines,
                master_address="127.0.0.1",
                master_port=free_port(),
                backend="gloo",
                router_url=fleet.router_url,
                timeout_secs=600,
                load_format=fmt,
            )

        with sync_for("auto") as sync:
            auto = sync.push(tensors, version=f"bench-{megabytes}-auto").load_format
        with BareGroup(megabytes) as bare:
            for r in range(ROUNDS):
                row: dict[str, list[dict]] = {}
                for fmt in FORMATS:  # one group at a time; a warm-up push first touches the trainer's buffers
                    with sync_for(fmt) as sync:
                        sync.push(tensors, version=f"bench-{megabytes}-{r}-{fmt}-warm")
                        row[fmt] = []
                        for i in range(REPS):
                            # each push right after its own bare broadcasts: the machine's drift hits all three
                            flat, per_tensor = bare.seconds("flat"), bare.seconds("per_tensor")
                            report = sync.push(tensors, version=f"bench-{megabytes}-{r}-{fmt}-{i}").to_dict()
                            row[fmt].append(
                                {"bare_seconds": flat, "bare_per_tensor_seconds": per_tensor, "report": report}
                            )
                rounds.append(row)
                print(
                    f"  {megabytes} MB round {r}: "
                    + "; ".join(
                        f"{fmt} "
                        + ", ".join(
                            f"bare {t['bare_seconds']:.2f}s/{t['bare_per_tensor_seconds']:.2f}s "
                            f"push {t['report']['phases']['transfer']:.2f}s"
                            for t in trios
                        )
                        for fmt, trios in row.items()
                    ),
                    flush=True,
                )
    finally:
        fleet.stop()
    trios = {fmt: [t for row in rounds for t in row[fmt]] for fmt in FORMATS}
    every = [t for fmt in FORMATS for t in trios[fmt]]
    bare = statistics.median(t["bare_seconds"] for t in every)
    per_tensor = statistics.median(t["bare_per_tensor_seconds"] for t in every)
    out = {
        "megabytes": megabytes,
        "bytes": nbytes,
        "layers": config.layers,
        "auto": auto,
        "bare_seconds": bare,
        "bare_gbps": nbytes / bare / 1e9,
        "bare_per_tensor_seconds": per_tensor,
        "bare_per_tensor_gbps": nbytes / per_tensor / 1e9,
        "bare_per_tensor_ratio": statistics.median(t["bare_seconds"] / t["bare_per_tensor_seconds"] for t in every),
        "formats": {},
        "rounds": rounds,
    }
    for fmt in FORMATS:
        reports = [t["report"] for t in trios[fmt]]
        transfer = statistics.median(rep["phases"]["transfer"] for rep in reports)
        # each push against the bare broadcasts timed just before it, then the median: drift cancels within a trio
        ratios = [t["bare_seconds"] / t["report"]["phases"]["transfer"] for t in trios[fmt]]
        # against the same collectives with nothing around them: what pdctl itself costs
        same = "bare_seconds" if fmt == "flattened_bucket" else "bare_per_tensor_seconds"
        own = [t[same] / t["report"]["phases"]["transfer"] for t in trios[fmt]]
        phases = {k: statistics.median(rep["phases"].get(k, 0.0) for rep in reports) for k in reports[0]["phases"]}
        last = reports[-1]
        out["formats"][fmt] = {
            "load_format": last["load_format"],
            "verify": last["verify"],
            "tensors": last["tensors"],
            "buckets": last["buckets"],
            "collectives": last["collectives"],
            "http_calls": last["http_calls"],
            "pushes": len(reports),
            "transfer_seconds": transfer,
            "transfer_gbps": nbytes / transfer / 1e9,
            "transfer_ratio": statistics.median(ratios),
            "transfer_ratio_quartiles": quartiles(ratios),
            "same_collectives_ratio": statistics.median(own),
            "same_collectives_ratio_quartiles": quartiles(own),
            "phases": phases,
            "overhead_seconds": statistics.median(rep_other(rep) for rep in reports),
        }
    return out


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles: the spread of the middle half of ``values``."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def rep_other(report: dict) -> float:
    """Seconds of every phase but the transfer and the probe (the goal's 'everything else')."""
    return sum(v for k, v in report["phases"].items() if k not in ("transfer", "probe"))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-weight-bench-"))  # engine and router logs
    try:
        for mb in SIZES_MB:
            (tmp / str(mb)).mkdir()
            results.append(measure(mb, tmp / str(mb)))
    finally:
        if not os.environ.get("WEIGHT_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "rounds": ROUNDS,
        "reps": REPS,
        "sim_weight_digest": DIGEST,
        "engines": ENGINES,
        "shape": SHAPE,
    }
    (RESULTS / "weight_push.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [
        "| size | load format | tensors | buckets | collectives | bare GB/s | push transfer GB/s "
        "| ratio (goal >= 0.95) [quartiles] | vs the same collectives bare [quartiles] "
        "| other phases s (goal < 0.5) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for fmt, f in r["formats"].items():
            q, o = f["transfer_ratio_quartiles"], f["same_collectives_ratio_quartiles"]
            lines.append(
                f"| {r['bytes'] / 2**20:.0f} MiB | {fmt}{' (auto)' if fmt == r['auto'] else ''} | {f['tensors']} "
                f"| {f['buckets']} "
                f"| {f['collectives']} | {r['bare_gbps']:.2f} | {f['transfer_gbps']:.2f} "
                f"| {f['transfer_ratio']:.2f}x [{q[0]:.2f}-{q[1]:.2f}] "
                f"| {f['same_collectives_ratio']:.2f}x [{o[0]:.2f}-{o[1]:.2f}] | {f['overhead_seconds']:.3f} |"
            )
    lines += [
        "",
        "Bare broadcasts (median seconds; ratio: one flat broadcast against one per tensor, "
        "the median over every trio):",
        "",
        "| size | one flat broadcast | one per tensor | tensors | flat / per tensor |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['bytes'] / 2**20:.0f} MiB | {r['bare_seconds']:.3f} | {r['bare_per_tensor_seconds']:.3f} "
            f"| {r['formats']['names']['tensors']} | {r['bare_per_tensor_ratio']:.2f}x |"
        )
    lines += ["", "Per phase (median seconds):", ""]
    names = list(results[0]["formats"][FORMATS[0]]["phases"])
    lines.append("| size | load format | " + " | ".join(names) + " |")
    lines.append("|---|---|" + "---|" * len(names))
    for r in results:
        for fmt, f in r["formats"].items():
            lines.append(
                f"| {r['bytes'] / 2**20:.0f} MiB | {fmt} | "
                + " | ".join(f"{f['phases'].get(n, 0.0):.3f}" for n in names)
                + " |"
            )
    lines += [
        "",
        f"Medians over {ROUNDS} rounds x {REPS} trios per load format on {meta['cpus']} CPUs; a trio is one bare "
        f"flat broadcast, one bare broadcast per tensor and one push, back to back (ratio: bare flat / push "
        f"transfer of each trio, then the median and quartiles; 'the same collectives bare': one broadcast per "
        f"tensor for names, the flat one for flattened_bucket); gloo over loopback; engines "
        f"{', '.join(f'{role} tp {tp}' for role, tp in ENGINES)}; "
        f"verify {results[0]['formats'][FORMATS[0]]['verify']}; sims with --sim-weight-digest {DIGEST}; "
        "(auto): what a push picks by default. "
        "'other phases' excludes probe (the /server_info round that decides whether the group must be rebuilt).",
    ]
    (RESULTS / "weight_push.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bare-rank", nargs=4, type=int, metavar=("RANK", "WORLD", "PORT", "MEGABYTES"))
    cli = parser.parse_args()
    if cli.bare_rank:
        bare_rank(*cli.bare_rank)
    else:
        main()
