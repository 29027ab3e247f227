"""Seeded request workloads for ``pdctl bench``; none needs a download.

Lengths are in tokens of a byte-level tokenizer (the sim's: one ASCII byte is one token), so
against the sim they are exact; against a real model the server's own counts (``meta_info``
or ``usage``) are what the report uses, and the requested lengths are kept beside them.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

from pdctl.errors import PdctlError


class WorkloadError(PdctlError):
    """A workload that cannot be built (bad parameters, unreadable or malformed dataset file)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt and the prompt and output lengths asked for."""

    prompt: str
    output_len: int
    input_len: int
    """Requested prompt length in byte-level tokens (what the server counts may differ)."""


_ALPHABET = string.ascii_lowercase + " "


def _text(rng: random.Random, n: int) -> str:
    """``n`` printable ASCII bytes (n byte-level tokens), words and spaces."""
    return "".join(rng.choices(_ALPHABET, k=n))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """bench_serving's rule: uniform in [mean * range_ratio, mean], at least 1."""
    low = max(1, int(mean * range_ratio))
    return rng.randint(low, max(low, mean))


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    if not 0.0 <= range_ratio <= 1.0:
        raise WorkloadError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ilen = _length(rng, input_len, range_ratio)
        out.append(BenchRequest(_text(rng, ilen), _length(rng, output_len, range_ratio), ilen))
    return out


def fixed_workload(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    return random_workload(n, input_len, output_len, 1.0, seed)


def shared_prefix_workload(
    n: int, groups: int, prefix_len: int, question_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """``groups`` system prompts of ``prefix_len`` tokens, each followed by distinct questions
    (cache-aware routing should keep a group on one engine); requests interleave the groups."""
    if groups < 1:
        raise WorkloadError(f"--prefix-groups must be >= 1, got {groups}")
    rng = random.Random(seed)
    prefixes = [_text(rng, prefix_len) for _ in range(groups)]
    out = []
    for i in range(n):
        prompt = prefixes[i % groups] + _text(rng, question_len)
        out.append(BenchRequest(prompt, output_len, len(prompt)))
    return out


def sharegpt_workload(path: Path, n: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """ShareGPT format: a JSON list of ``{"conversations": [{"from", "value"}, ...]}``; the
    first turn is the prompt, the second's length the output length (unless ``output_len``)."""
    data = _load_json(path)
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for i, item in enumerate(data):
        turns = item.get("conversations") or item.get("conversation") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue  # bench_serving skips conversations with fewer than two turns too
        first, second = turns[0], turns[1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, second)):
            raise WorkloadError(f"{path}: conversation {i}: each turn needs a string 'value'")
        pairs.append((first["value"], len(second["value"].encode())))
    if not pairs:
        raise WorkloadError(f"{path}: no conversation with two turns")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out = []
    for i in range(n):
        prompt, completion_len = pairs[i % len(pairs)]
        out.append(BenchRequest(prompt, max(1, output_len or completion_len), len(prompt.encode())))
    return out


def jsonl_workload(path: Path, n: int | None, output_len: int | None) -> list[BenchRequest]:
    """One ``{"prompt": str, "output_len": int}`` per line (``output_len`` may be left out when
    ``--output-len`` is given); ``n`` None takes every line, a larger ``n`` cycles."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read: {exc}") from exc
    items = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise WorkloadError(f"{path}:{lineno}: not JSON: {exc}") from exc
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise WorkloadError(f'{path}:{lineno}: each line must be {{"prompt": str, "output_len": int}}')
        length = item.get("output_len", output_len)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise WorkloadError(f"{path}:{lineno}: output_len must be a positive integer, got {length!r}")
        items.append(BenchRequest(item["prompt"], length, len(item["prompt"].encode())))
    if not items:
        raise WorkloadError(f"{path}: no requests in the file")
    count = len(items) if n is None else n
    return [items[i % len(items)] for i in range(count)]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read: {exc}") from exc
    except ValueError as exc:
        raise WorkloadError(f"{path}: not JSON: {exc}") from exc
