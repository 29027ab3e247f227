"""Sampling parameters as SGLang accepts them, and the sampler.

Keys are checked strictly like SGLang's ``SamplingParams`` (an unknown key is rejected);
keys the sim cannot honour (structured output, beams) are refused with a clear error
instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdctl.errors import SimError

# SGLang 0.5.23 sglang/api/v1/api_types.py SamplingParams fields, with their defaults.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
}
_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")
TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    @classmethod
    def from_json(cls, raw: Any) -> SamplingOptions:
        """Parse ``sampling_params``; raises SimError with SGLang-like messages."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise SimError("sampling_params must be an object")
        unknown = sorted(set(raw) - SGLANG_SAMPLING_KEYS)
        if unknown:
            raise SimError(f"unknown field {unknown[0]}")
        for key in _UNSUPPORTED:
            if raw.get(key) not in (None, [], {}):
                raise SimError(f"sampling_params.{key} is not supported by the sim engine")
        n = raw.get("n", 1)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SimError("n must be a positive integer")  # the caller expands n > 1 into n requests
        stop = raw.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        opts = cls(
            max_new_tokens=_int(raw, "max_new_tokens", 128),
            min_new_tokens=_int(raw, "min_new_tokens", 0),
            temperature=_float(raw, "temperature", 1.0),
            top_p=_float(raw, "top_p", 1.0),
            top_k=_int(raw, "top_k", TOP_K_ALL),
            min_p=_float(raw, "min_p", 0.0),
            stop=stop,
            stop_token_ids=tuple(raw.get("stop_token_ids") or ()),
            ignore_eos=bool(raw.get("ignore_eos") or False),
            no_stop_trim=bool(raw.get("no_stop_trim") or False),
            sampling_seed=raw.get("sampling_seed"),
        )
        if opts.max_new_tokens < 0:
            raise SimError("max_new_tokens must be >= 0")
        if opts.temperature < 0:
            raise SimError("temperature must be >= 0")
        if not 0 < opts.top_p <= 1:
            raise SimError("top_p must be in (0, 1]")
        if opts.top_k < 1 and opts.top_k != -1:
            raise SimError("top_k must be -1 or >= 1")
        return opts


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SimError(f"{key} must be an integer")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SimError(f"{key} must be a number")
    return float(value)


def sample(logits: torch.Tensor, opts: SamplingOptions, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if opts.greedy:
        return int(torch.argmax(logits))
    scores = logits / opts.temperature
    if 0 < opts.top_k < scores.numel():
        kth = torch.topk(scores, opts.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if opts.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < opts.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = probs * mask
    if opts.min_p > 0:
        probs = probs * (probs >= opts.min_p * probs.max())
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
