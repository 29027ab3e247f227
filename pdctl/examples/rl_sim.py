"""An RL loop on the sim: group-relative policy gradient (GRPO-style) with weight pushes.

The trainer keeps its own copy of the sim model, samples groups of rollouts per prompt through
pdctl's router (``n`` samples per prompt), scores them with a toy reward (the share of
characters in a target set), takes policy-gradient steps, and every ``--push-every`` steps
pushes its weights into every prefill and decode engine with ``pdctl.weights``. It logs one
JSON line per step: mean reward, the weight version the rollouts came from, push times.

``pdctl up topologies/rl-sim.yaml`` runs it under torchrun (one CPU rank, gloo group).

``--async-rollouts K`` (``topologies/rl-sim-async.yaml``) is the asynchronous loop: K groups of
rollouts stay in flight while the trainer trains and pushes, with the topology's
``weights.refit: interrupt``, so a push does not wait for the rollouts and a rollout may span
weight versions (``meta_info.weight_version_spans``). The trainer corrects for that with
per-token importance weights: each token's probability under the current policy over its
probability under the version that generated it (the engine's ``output_token_logprobs``, which
the router keeps for every token across an update), clipped at ``--clip``; ``max_staleness``
bounds how old a token can be.
To adapt it to a real model: replace ``TinyLM`` with your policy, ``score`` with your reward,
``logprobs_of`` with your model's forward; with FSDP2 push ``full_tensors(model, dtype=...)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch

from pdctl.errors import PdctlError
from pdctl.sim.model import TinyLM, encode, resolve_model
from pdctl.weights import WeightSync, apply_memory_fraction
from pdctl.weights.env import API_KEY_ENV_ENV, ROUTER_URL_ENV

PROMPTS = ("The cat", "Once upon", "Hello", "RL on CPU")
TARGET = set("aeiou ")


def score(text: str) -> float:
    """The toy reward: the share of characters that are vowels or spaces."""
    return sum(ch in TARGET for ch in text) / max(len(text), 1)


def rollouts(
    router_url: str,
    prompts: Sequence[str] | Sequence[list[int]],
    group: int,
    max_new_tokens: int,
    seed: int,
    logprobs: bool = False,
) -> list[dict]:
    """``group`` samples per prompt through the router (prompt-major), each with output_ids (and,
    with ``logprobs``, the engine's logprob of every output token). Prompts are text or token ids."""
    body: dict[str, Any] = {
        "sampling_params": {"n": group, "temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": seed},
        "return_logprob": logprobs,
    }
    body["text" if isinstance(prompts[0], str) else "input_ids"] = list(prompts)
    headers = {"Content-Type": "application/json"}
    key_env = os.environ.get(API_KEY_ENV_ENV)  # the router's key, when the topology sets router.api_key_env
    if key_env and os.environ.get(key_env):
        headers["Authorization"] = f"Bearer {os.environ[key_env]}"
    request = urllib.request.Request(router_url + "/generate", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RolloutError(f"the router answered {exc.code}: {exc.read()[:300]!r}") from exc
    except OSError as exc:
        raise RolloutError(f"the router at {router_url} did not answer: {exc}") from exc


class RolloutError(PdctlError):
    """Rollouts could not be sampled through the router."""


def logprobs_of(model: TinyLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Sum of log-probabilities of ``output`` after ``prompt`` under ``model`` (differentiable)."""
    return token_logprobs(model, prompt, output).sum()


def token_logprobs(model: TinyLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Each output token's log-probability after ``prompt`` under ``model`` (differentiable)."""
    logits, _ = model.prefill(prompt + output)
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output)), torch.tensor(output)]


def group_advantages(outs: list[dict], groups: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [groups, group], advantages flattened prompt-major): reward minus its group's mean,
    over the group's std."""
    rewards = torch.tensor([score(o["text"]) for o in outs], dtype=torch.float64).view(groups, group)
    return rewards, ((rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def train(sync: WeightSync, router_url: str, model: TinyLM, args: argparse.Namespace, log: Any = None) -> list[dict]:
    """Run ``args.steps`` steps; returns the per-step records (also written to ``log``)."""
    model.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    records = []
    prompts = [encode(p) for p in PROMPTS]
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        outs = rollouts(router_url, PROMPTS, args.group, args.max_new_tokens, seed=args.seed * 100_000 + step)
        rewards, advantages = group_advantages(outs, len(PROMPTS), args.group)
        loss = torch.zeros((), dtype=torch.float64)
        for index, out in enumerate(outs):
            ids = [t for t in out["output_ids"] if t < model.config.vocab_size]
            if ids:
                p = index // args.group
                loss = loss - advantages[index] * logprobs_of(model, prompts[p], ids) / len(outs)
        record = {"rollout_version": outs[0]["meta_info"]["weight_version"]}
        records.append(_step(sync, model, optimizer, loss, rewards, record, step, started, args, log))
    return records


def _step(
    sync: WeightSync,
    model: TinyLM,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    rewards: torch.Tensor,
    record: dict[str, Any],
    step: int,
    started: float,
    args: argparse.Namespace,
    log: Any,
) -> dict[str, Any]:
    """One optimizer step on ``loss``, a push every ``args.push_every`` steps, the step's record
    (``record`` plus step, time, reward, push) written to ``log``."""
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    record = {"step": step, "t": round(time.monotonic() - started, 3), "reward": float(rewards.mean()), **record}
    if step % args.push_every == 0:
        report = sync.push([(n, p.detach()) for n, p in model.named_parameters()], version=f"step-{step}")
        record.update(pushed=report.version, push_seconds=round(report.seconds, 4), refit=report.refit)
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
    return record


def train_async(
    sync: WeightSync, router_url: str, model: TinyLM, args: argparse.Namespace, log: Any = None
) -> list[dict]:
    """The asynchronous loop (see the module docstring): at most ``args.async_rollouts`` groups are
    in flight or finished and waiting (a sampler starts the next group as soon as the trainer takes
    one, so generation never waits for training and the trainer's data is at most that many groups
    old); each step trains on the oldest finished group with per-token importance weights, and
    pushes every ``args.push_every`` steps without waiting for the rollouts. It first pushes its
    starting weights, so that engines and trainer agree."""
    model.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    prompts = [encode(p) for p in PROMPTS]
    version = "step-0"
    sync.push([(n, p.detach()) for n, p in model.named_parameters()], version=version)
    done: queue.Queue[list[dict] | BaseException] = queue.Queue()
    room = threading.Semaphore(args.async_rollouts)  # groups in flight or waiting for the trainer
    stop = threading.Event()
    seeds = itertools.count(args.seed * 100_000)

    def sample() -> None:
        while not stop.is_set():
            if not room.acquire(timeout=0.5):
                continue
            try:
                item: list[dict] | BaseException = rollouts(
                    router_url, prompts, args.group, args.max_new_tokens, seed=next(seeds), logprobs=True
                )
            except RolloutError as exc:
                item = exc
            done.put(item)

    samplers = [
        threading.Thread(target=sample, name=f"rl-rollouts-{i}", daemon=True) for i in range(args.async_rollouts)
    ]
    for thread in samplers:
        thread.start()
    records = []
    started = time.monotonic()
    try:
        for step in range(1, args.steps + 1):
            outs = done.get()
            room.release()
            if isinstance(outs, BaseException):
                raise outs
            rewards, advantages = group_advantages(outs, len(PROMPTS), args.group)
            loss = torch.zeros((), dtype=torch.float64)
            tokens = off_policy = 0
            spans_seen: set[str] = set()
            for index, out in enumerate(outs):
                ids = list(out["output_ids"])
                if not ids:
                    continue
                meta = out["meta_info"]
                behaviour = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
                logp = token_logprobs(model, prompts[index // args.group], ids)
                weights = torch.exp(logp.detach() - behaviour).clamp(max=args.clip)
                loss = loss - advantages[index] * (weights * logp).sum() / len(outs)
                for span_version, n in meta.get("weight_version_spans") or [[meta["weight_version"], len(ids)]]:
                    spans_seen.add(span_version)
                    off_policy += n if span_version != version else 0
                tokens += len(ids)
            record = {
                "rollout_versions": sorted(spans_seen),
                "off_policy_tokens": round(off_policy / max(tokens, 1), 3),
            }
            records.append(_step(sync, model, optimizer, loss, rewards, record, step, started, args, log))
            if "pushed" in records[-1]:
                version = records[-1]["pushed"]
    finally:
        stop.set()
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sim://tiny", help="the engines' --model-path (the trainer starts equal)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (n)")
    parser.add_argument("--push-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="rewards.jsonl", help="JSON lines, one per step (relative to the run dir)")
    parser.add_argument(
        "--async-rollouts",
        type=int,
        default=0,
        help="keep this many rollout groups in flight while training (0: the synchronous loop)",
    )
    parser.add_argument("--clip", type=float, default=2.0, help="async: the largest per-token importance weight")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    router_url = os.environ.get(ROUTER_URL_ENV)
    if not router_url:
        sys.exit(f"rl_sim: ${ROUTER_URL_ENV} is not set; run it with `pdctl up topologies/rl-sim.yaml`")
    apply_memory_fraction()  # colocated: claim only train_frac of the GPU (a no-op otherwise, and on CPU)
    try:
        model = resolve_model(args.model, "auto", None)
        started = time.monotonic()
        with WeightSync.from_env() as sync, open(args.log, "w") as log:
            loop = train_async if args.async_rollouts > 0 else train
            records = loop(sync, router_url, model, args, log)
    except PdctlError as exc:  # a weight push or the model path failed: one line, not a traceback
        sys.exit(f"rl_sim: {exc}")
    first, last = records[:5], records[-5:]
    print(
        f"rl_sim: reward {sum(r['reward'] for r in first) / len(first):.3f} -> "
        f"{sum(r['reward'] for r in last) / len(last):.3f} in {len(records)} steps, {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
