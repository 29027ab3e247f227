"""A draft head trained colocated with its target: TorchSpec's design on the CPU sim.

Every trainer rank shares its GPU with one TP rank of the target engine. Trainer rank 0 feeds
the engine prompts through pdctl's router (prefill only: ``max_new_tokens`` 1); the engine's
forward hooks (``pdctl.colocate.engine``) send each TP rank's shard of every step's hidden states
straight to its trainer rank over the data plane, and each rank trains its copy of the draft
head (FSDP2 over the trainer ranks) on what it received. No hidden state crosses HTTP.

The draft head has an Eagle head's shape: the target's final hidden state of token t and the
embedding of token t, joined by a linear layer, one MLP block, an output layer predicting
token t+1. Its loss (cross-entropy on the tokens the loss mask marks) falls as it learns from
the target's hidden states.

``pdctl up topologies/colocate-draft-sim.yaml`` runs it under torchrun (2 CPU ranks, a sim
engine of TP 2); each rank logs one JSON line per step (rank 0 also the mean loss over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pdctl.colocate import DataPlane, Step
from pdctl.errors import PdctlError
from pdctl.weights.env import API_KEY_ENV_ENV, READY_TIMEOUT_ENV, ROUTER_URL_ENV

CORPUS = (
    "the cat sat on the mat and the dog sat on the log. "
    "a bird sang in the tree while the sun rose over the hill. "
    "we train a draft head on the hidden states of its target. "
    "the quick brown fox jumps over the lazy dog again and again. "
)


class FeedError(PdctlError):
    """The prompts could not be sent to the engines."""


class DraftHead(nn.Module):
    """[target hidden state of token t ; embedding of token t] -> fc -> MLP block -> token t+1."""

    def __init__(self, hidden: int, vocab: int, width: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc = nn.Linear(hidden + width, width)
        self.norm = nn.RMSNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([hidden, self.embed(input_ids)], dim=-1))
        x = x + self.down(F.silu(self.up(self.norm(x))))
        return self.out(x)


def loss_of(head: nn.Module, step: Step) -> torch.Tensor:
    """Cross-entropy of predicting each masked token's successor (packed sequences: the
    successor is the next row; the mask is 0 on every sequence's last token)."""
    logits = head(step.hidden.float(), step.input_ids)
    targets = torch.roll(step.input_ids, -1)
    mask = step.loss_mask.bool()
    return F.cross_entropy(logits[mask], targets[mask])


def prompts(count: int, seed: int, length: tuple[int, int] = (24, 48)) -> list[str]:
    """Windows of the corpus (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        size = rng.randint(*length)
        start = rng.randrange(len(CORPUS) - size)
        out.append(CORPUS[start : start + size])
    return out


def wait_for_router(router_url: str, headers: dict[str, str], timeout_secs: float) -> None:
    """Until the router's ``/readiness`` answers 200 (the trainer starts first when colocated)."""
    deadline = time.monotonic() + timeout_secs
    while True:
        try:
            request = urllib.request.Request(router_url + "/readiness", headers=headers)
            with urllib.request.urlopen(request, timeout=10) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise FeedError(f"the router at {router_url} was not ready within {timeout_secs:g} s")
        time.sleep(0.5)


def feed(router_url: str, batches: Sequence[list[str]], ready_timeout_secs: float = 900.0) -> None:
    """Send each batch as one /generate request (prefill only) once the router is ready; the
    answers are not needed."""
    headers = {"Content-Type": "application/json"}
    key_env = os.environ.get(API_KEY_ENV_ENV)
    if key_env and os.environ.get(key_env):
        headers["Authorization"] = f"Bearer {os.environ[key_env]}"
    wait_for_router(router_url, headers, ready_timeout_secs)
    for batch in batches:
        body = {"text": batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        request = urllib.request.Request(router_url + "/generate", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=600) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise FeedError(f"the router at {router_url} did not take the prompts: {exc}") from exc


def train(plane: DataPlane, args: argparse.Namespace, log: Any = None) -> list[dict[str, Any]]:
    """``args.steps`` steps on this rank; returns the per-step records (also written to ``log``)."""
    group = plane.trainer_group
    torch.manual_seed(args.seed)
    first = plane.recv()  # the hidden size comes with the data
    head = DraftHead(first.hidden.shape[1], args.vocab)
    if group is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(head)
    optimizer = torch.optim.Adam(head.parameters(), lr=args.lr)
    records = []
    step: Step | None = first
    for index in range(args.steps):
        step = step if step is not None else plane.recv()
        loss = loss_of(head, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        if group is not None:
            dist.all_reduce(mean, group=group)
            mean /= dist.get_world_size(group)
        record = {
            "step": index,
            "rank": plane.rank,
            "loss": round(float(loss.detach()), 5),
            "mean_loss": round(float(mean), 5),
            "tokens": int(step.loss_mask.sum()),
            "engine": f"{step.engine}/tp{step.tp_rank}",
        }
        records.append(record)
        if log is not None:
            print(json.dumps(record), file=log, flush=True)
        step = None
    return records


def _feed_or_exit(router_url: str, batches: Sequence[list[str]]) -> None:
    """The feeder thread: without prompts no step comes, so a feeder that fails ends the job
    (torchrun then stops the other ranks) instead of leaving them to wait for their timeout."""
    try:
        feed(router_url, batches, float(os.environ.get(READY_TIMEOUT_ENV) or 900))
    except PdctlError as exc:
        print(f"colocate_draft feeder: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=260, help="the target's vocabulary (the sim's: 260)")
    parser.add_argument("--log", help="write rank R's JSON lines to this path ({rank} is replaced)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        plane = DataPlane.from_env()
    except PdctlError as exc:
        sys.exit(f"colocate_draft: {exc}")
    feeder = None
    if plane.rank == 0:
        spec = plane.spec
        texts = prompts(args.steps * spec.batch_size * len(spec.engines), args.seed)
        size = spec.batch_size
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        feeder = threading.Thread(target=_feed_or_exit, args=(os.environ[ROUTER_URL_ENV], batches), daemon=True)
        feeder.start()
    log = open(args.log.replace("{rank}", str(plane.rank)), "w") if args.log else sys.stdout  # noqa: SIM115
    try:
        train(plane, args, log)
    except PdctlError as exc:
        sys.exit(f"colocate_draft rank {plane.rank}: {exc}")
    finally:
        if log is not sys.stdout:
            log.close()
    if feeder is not None:
        feeder.join()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
