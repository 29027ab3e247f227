"""Sampling parameters as SGLang 0.5.23 accepts them, and the sampler.

``SAMPLING_PARAMS`` is the JSON contract of ``sampling_params`` (an unknown key is refused);
``SamplingOptions.from_json`` then checks the values as ``SamplingParams.normalize`` and
``verify`` do, in their order and words. Keys the sim cannot honour (structured output,
beams) are refused after that with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pdctl.errors import SimError
from pdctl.sim.body import BOOL, F64, I64, STR, Check, map_of, or_list, seq_of, struct

_STR_OR_LIST = or_list("StringOrList", lambda v: isinstance(v, str), STR)
# SGLang 0.5.23 sglang/api/v1/api_types.py SamplingParams, in its order.
SAMPLING_PARAMS: dict[str, Check] = {
    "max_new_tokens": I64,
    "stop": _STR_OR_LIST,
    "stop_token_ids": seq_of(I64),
    "stop_regex": _STR_OR_LIST,
    "temperature": F64,
    "top_p": F64,
    "top_k": I64,
    "min_p": F64,
    "frequency_penalty": F64,
    "presence_penalty": F64,
    "repetition_penalty": F64,
    "min_new_tokens": I64,
    "n": I64,
    "json_schema": STR,
    "regex": STR,
    "ebnf": STR,
    "structural_tag": STR,
    "ignore_eos": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "no_stop_trim": BOOL,
    "stream_interval": I64,
    "logit_bias": map_of(F64),
    "sampling_seed": I64,
    "custom_params": lambda v, path: None,
    "beam_width": I64,
    "watermark": struct("WatermarkRequestConfig", {"enabled": BOOL, "key": STR, "context_window": I64}),
    "choice": seq_of(STR),
}
SGLANG_SAMPLING_KEYS = set(SAMPLING_PARAMS)
check_sampling_params = struct("SamplingParams", SAMPLING_PARAMS)
_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")
TOP_K_ALL = 1 << 30
MAX_STOP_COUNT = 32
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class SamplingOptions:
    """One request's checked sampling parameters, with SGLang's defaults (``max_new_tokens`` 128, temperature 1.0, no
    top-p/top-k/min-p cut)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
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
    stream_interval: int | None = None
    """Tokens between a stream's updates (SGLang's per-request ``stream_interval``); None: the
    engine's ``--stream-interval``."""

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to the most likely token (temperature near 0 or ``top_k`` 1)."""
        return self.temperature <= 1e-6 or self.top_k == 1

    @property
    def plain(self) -> bool:
        """True when only the temperature shapes the distribution (no top-k, top-p or min-p cut; not greedy)."""
        return not self.greedy and self.top_k == TOP_K_ALL and self.top_p >= 1.0 and self.min_p <= 0.0

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, vocab_size: int) -> SamplingOptions:
        """``raw``: sampling parameters of the right types (``check_sampling_params`` or an
        OpenAI route's coercion passed them); null is a key's default. Raises SimError (400)
        with SGLang's words for values it refuses."""
        unbounded = raw is not None and "max_new_tokens" in raw and raw["max_new_tokens"] is None
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        verify(raw, vocab_size, unbounded=unbounded)
        for key in _UNSUPPORTED:
            value = raw.get(key)
            if value not in (None, [], {}, "") and not (key == "beam_width" and value == 1):
                raise SimError(f"sampling_params.{key} is not supported by the sim engine")
        stop = raw.get("stop", ())
        top_k = raw.get("top_k", -1)
        return cls(
            max_new_tokens=raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            min_new_tokens=raw.get("min_new_tokens", 0),
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=TOP_K_ALL if top_k == -1 else top_k,
            min_p=float(raw.get("min_p", 0.0)),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(raw.get("stop_token_ids", ())),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            no_stop_trim=bool(raw.get("no_stop_trim", False)),
            sampling_seed=raw.get("sampling_seed"),
            stream_interval=raw.get("stream_interval") or None,
        )


def verify(raw: dict[str, Any], vocab_size: int, *, unbounded: bool = False) -> None:
    """SGLang's ``SamplingParams.normalize`` then ``verify`` (sampling/sampling_params.py) on
    ``raw`` (no nulls): the first value they refuse, in their words. ``unbounded``: a null
    max_new_tokens, which SGLang does not compare min_new_tokens with."""
    for key, what in (("stop", "stop strings"), ("stop_regex", "stop_regex patterns")):
        many = raw.get(key)
        if isinstance(many, list) and len(many) > MAX_STOP_COUNT:
            raise SimError(f"at most {MAX_STOP_COUNT} {what} are allowed, got {len(many)}")
    temperature, top_k = raw.get("temperature", 1.0), raw.get("top_k", -1)
    if 0 <= temperature < 1e-6:  # SGLang: greedy is top_k 1
        temperature, top_k = 1.0, 1
    top_k = TOP_K_ALL if top_k == -1 else top_k
    if raw.get("beam_width", 1) < 1:
        raise SimError(f"beam_width must be at least 1, got {raw['beam_width']}.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SimError(f"temperature must be a non-negative finite number, got {temperature}.")
    _in_range(raw, "top_p", 1.0, lambda x: 0 < x <= 1, "in (0, 1]")
    _in_range(raw, "min_p", 0.0, lambda x: 0 <= x <= 1, "in [0, 1]")
    if top_k < 1:
        raise SimError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    _in_range(raw, "frequency_penalty", 0.0, lambda x: -2 <= x <= 2, "in [-2, 2]")
    _in_range(raw, "presence_penalty", 0.0, lambda x: -2 <= x <= 2, "in [-2, 2]")
    _in_range(raw, "repetition_penalty", 1.0, lambda x: 0 < x <= 2, "in (0, 2] (1.0 = no penalty)")
    low = raw.get("min_new_tokens", 0)
    if low < 0:
        raise SimError(f"min_new_tokens must be in [0, max_new_tokens], got {low}.")
    high = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if high < 0:
        raise SimError(f"max_new_tokens must be at least 0, got {high}.")
    if low > high and not unbounded:
        raise SimError(f"min_new_tokens must be in [0, max_new_tokens({high})], got {low}.")
    for token in raw.get("logit_bias", {}):
        try:
            ok = 0 <= int(token) < vocab_size
        except ValueError as exc:
            raise SimError(f"logit_bias: {exc}") from None
        if not ok:
            raise SimError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token}.")
    seed = raw.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise SimError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(bool(raw.get(k)) for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise SimError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def _in_range(raw: dict[str, Any], key: str, default: float, ok: Any, rule: str) -> None:
    value = raw.get(key, default)
    if not ok(value):
        raise SimError(f"{key} must be {rule}, got {value}.")


def sample(logits: torch.Tensor, opts: SamplingOptions, draw: float) -> int:
    """One token from one row of logits: greedy, or the token at ``draw`` (a uniform number in
    [0, 1) from the request's own random stream) in the cumulative distribution that the
    temperature, top-k, top-p and min-p leave. A token thus depends on the request's own draws
    and logits only, never on the batch it ran in; ``sample_plain`` draws the same tokens for a
    whole batch at once."""
    if opts.greedy:
        return int(torch.argmax(logits))
    if opts.plain:
        return sample_plain(logits.unsqueeze(0), [opts.temperature], [draw])[0]
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
    return _at_draws(probs.unsqueeze(0), [draw])[0]


def sample_plain(logits: torch.Tensor, temperatures: list[float], draws: list[float]) -> list[int]:
    """One token per row of ``logits`` [B, V] for requests that set only a temperature (no top-k,
    top-p or min-p cut: ``SamplingOptions.plain``), each at its own ``draws`` entry: a few
    tensor operations for the whole batch, where one ``torch.multinomial`` per request with its
    own generator cost a profile engine most of its CPU per token."""
    scale = torch.tensor(temperatures, dtype=logits.dtype).unsqueeze(1)
    return _at_draws(torch.softmax(logits / scale, dim=-1), draws)


def _at_draws(probs: torch.Tensor, draws: list[float]) -> list[int]:
    """Inverse-CDF sampling of each row of ``probs`` [B, V] (not necessarily normalised) at its
    draw in [0, 1). The sum is taken in float64 so that a draw just under 1 still lands on a
    token of nonzero probability; ``right=True`` never picks a zero-probability token."""
    cum = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    at = torch.tensor(draws, dtype=torch.float64).unsqueeze(1) * cum[:, -1:]
    picked = torch.searchsorted(cum, at, right=True).clamp_(max=probs.shape[-1] - 1)
    return picked.squeeze(1).tolist()
