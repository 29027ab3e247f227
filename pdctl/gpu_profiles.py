"""GPU cost profiles for the sim (``python -m pdctl.sim --sim-profile NAME``): what a forward
pass of a real model on real GPUs costs, so that a fleet of sim engines queues, batches and
transfers KV as a fleet of SGLang engines on those GPUs would.

A profile is a cost model, not a measurement: a prefill forward costs a fixed amount plus a
per-token cost and an attention cost that grows with each token's context (chunked at
``chunk_tokens``); a decode step costs the weights' read (a constant), a per-request cost and
the KV read (per token of context in the batch); a PD KV transfer costs its bytes over the
link; the first switch to decode pays the decode CUDA graphs' capture. Its constants are fitted
to published measurements, each cited with its conditions in ``figures`` and in
docs/sim-profiles.md; tests/sim/test_profiles.py checks every profile against them (within 15%).

The sim waits the modelled time rather than computing it (pdctl.sim.costed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdctl.choices import Choice


class Metric(Choice):
    """What a published figure measured, as the profile computes it."""

    DECODE_STEP_MS = "decode_step_ms"
    """One decode step (ITL/TPOT) of ``batch`` requests of ``context`` tokens each."""
    PREFILL_MS = "prefill_ms"
    """One prefill (TTFT less queueing) of ``batch`` prompts of ``tokens`` new tokens each."""
    DECODE_TOKENS_PER_S = "decode_tokens_per_s"
    """Output tokens per second of a decode batch of ``batch`` requests at ``context`` tokens each."""
    PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
    """Prompt tokens per second of a prefill of ``batch`` prompts of ``tokens`` tokens each."""


@dataclass(frozen=True)
class Figure:
    """A published measurement a profile must reproduce (within 15%)."""

    metric: Metric
    value: float
    conditions: str
    """Model, GPUs, engine and version, lengths: as the source states them."""
    source: str
    """Where it is published (URL, or repository and path), and the row or sentence."""
    batch: int = 1
    tokens: int = 0
    """Prefill: new tokens per prompt."""
    context: int = 0
    """Decode: tokens of context per request (prompt plus output so far, on average)."""


@dataclass(frozen=True)
class SimProfile:
    """The cost model of one model on one GPU setup: what prefill forwards, decode steps and KV transfers cost, and the
    KV pool and limits an SGLang engine there has. ``figures`` are the published measurements it reproduces within
    15%."""

    name: str
    model: str
    hardware: str
    tp: int
    prefill_ms_per_forward: float
    """Fixed cost of one prefill forward (launch, sampling, scheduling)."""
    prefill_us_per_token: float
    """Per new token: the weights' FLOPs at the GPU's achieved rate."""
    prefill_us_per_token_per_ktok: float
    """Attention: per new token, per 1,000 tokens of context it attends to."""
    decode_ms_per_step: float
    """A decode step of one short request: reading the weights once."""
    decode_us_per_request: float
    """Per running request of a step (its share of compute, sampling, bookkeeping)."""
    decode_us_per_ktok: float
    """Per 1,000 tokens of KV read by a step (every running request's context)."""
    kv_pool_tokens: int
    """KV tokens the engine holds (SGLang's ``max_total_num_tokens``)."""
    kv_bytes_per_token: int
    """KV bytes per token over all TP ranks: layers x KV heads x head dim x 2 (K, V) x dtype bytes."""
    link_gbytes_per_s: float
    """Effective P->D KV transfer bandwidth of the engine (all its GPUs' NICs), GB/s."""
    graph_capture_secs: float
    """Decode CUDA graph capture, paid by the first switch to decode."""
    context_length: int
    max_running_requests: int
    """SGLang's default for this pool (``--max-running-requests`` overrides it)."""
    chunk_tokens: int = 8192
    """SGLang's ``--chunked-prefill-size`` default on this GPU: a longer prompt takes several forwards."""
    figures: tuple[Figure, ...] = ()
    description: str = ""

    # -- costs, in milliseconds -------------------------------------------------------------------
    def prefill_ms(self, prompts: Sequence[tuple[int, int]]) -> float:
        """One prefill batch: ``prompts`` as (new tokens, tokens already cached before them). The
        batch runs as ``ceil(new / chunk_tokens)`` forwards (at least one)."""
        new = sum(n for n, _ in prompts)
        if new <= 0:
            return 0.0
        # Attention: new token i of a prompt attends to cached + i tokens.
        attended = sum(n * (c + (n + 1) / 2) for n, c in prompts)
        forwards = math.ceil(new / self.chunk_tokens)
        return (
            forwards * self.prefill_ms_per_forward
            + new * self.prefill_us_per_token / 1000
            + attended / 1000 * self.prefill_us_per_token_per_ktok / 1000
        )

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_ms_per_step
            + batch * self.decode_us_per_request / 1000
            + context_tokens / 1000 * self.decode_us_per_ktok / 1000
        )

    def transfer_ms(self, tokens: int) -> float:
        """Moving ``tokens`` tokens of KV from a prefill to a decode."""
        return tokens * self.kv_bytes_per_token / (self.link_gbytes_per_s * 1e9) * 1000

    def predict(self, figure: Figure) -> float:
        """What this profile says ``figure`` measured, in its units."""
        if figure.metric is Metric.DECODE_STEP_MS:
            return self.decode_step_ms(figure.batch, figure.batch * figure.context)
        if figure.metric is Metric.DECODE_TOKENS_PER_S:
            return figure.batch / self.decode_step_ms(figure.batch, figure.batch * figure.context) * 1000
        prefill = self.prefill_ms([(figure.tokens, 0)] * figure.batch)
        if figure.metric is Metric.PREFILL_MS:
            return prefill
        return figure.batch * figure.tokens / prefill * 1000


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes


PROFILES: dict[str, SimProfile] = {}


def _register(profile: SimProfile) -> SimProfile:
    PROFILES[profile.name] = profile
    return profile


def profile_named(name: str) -> SimProfile:
    """The profile called ``name``; ValueError listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def describe_profiles() -> str:
    """One line per profile (``--list-profiles``)."""
    lines = []
    for p in PROFILES.values():
        lines.append(
            f"{p.name}: {p.model} on {p.hardware} (TP {p.tp}); decode step {p.decode_step_ms(1, 1024):.1f} ms at "
            f"batch 1, {p.decode_step_ms(64, 64 * 2048):.1f} ms at 64 x 2k; prefill of 2k tokens "
            f"{p.prefill_ms([(2048, 0)]):.0f} ms; KV pool {p.kv_pool_tokens} tokens"
        )
    return "\n".join(lines)


_LAMBDA = (
    "LambdaLabsML/vllm-benchmark, results/prompt_{n}/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json "
    "(vLLM, BF16, TP 1, ShareGPT prompts, all sent at once; run of 2024-09-07)"
)
_SGLANG_060 = (
    "sgl-project/sglang benchmark/benchmark_vllm_060/README.md, 'Llama 3.1 70B Instruct 4 x H100 80G' online "
    "table (SGLang v0.3.0, BF16, TP 4, --disable-radix-cache, bench_serving ShareGPT)"
)

LLAMA_8B_H100 = _register(
    SimProfile(
        name="llama3-8b-h100",
        model="Llama-3.1-8B-Instruct, BF16",
        hardware="1x H100 SXM 80GB",
        tp=1,
        prefill_ms_per_forward=3.0,
        prefill_us_per_token=30.0,
        prefill_us_per_token_per_ktok=1.3,
        decode_ms_per_step=6.9,
        decode_us_per_request=20.0,
        decode_us_per_ktok=60.0,
        kv_pool_tokens=440_000,
        kv_bytes_per_token=_kv_bytes(32, 8, 128),
        link_gbytes_per_s=24.0,
        graph_capture_secs=12.0,
        context_length=131_072,
        max_running_requests=1024,
        figures=(
            Figure(
                Metric.DECODE_STEP_MS,
                7.56,
                "Llama-3-8B-Instruct BF16, 1x H100 SXM, vLLM, 10 ShareGPT prompts at once: median TPOT 7.56 ms "
                "(batch 10; context taken as 500 tokens, ShareGPT's prompt plus half its answer)",
                _LAMBDA.format(n=10),
                batch=10,
                context=500,
            ),
            Figure(
                Metric.DECODE_STEP_MS,
                9.94,
                "the same with 80 prompts at once: median TPOT 9.94 ms (batch 80, context 500; the TPOT includes "
                "the stalls of the other prompts' prefills, which the profile's step alone does not)",
                _LAMBDA.format(n=80),
                batch=80,
                context=500,
            ),
            Figure(
                Metric.PREFILL_TOKENS_PER_S,
                27_670.26,
                "Llama-3.1-8B-Instruct, SGLang, --random-input 8192 --random-output 8, 1000 prompts, radix cache "
                "off: input token throughput 27,670.26 tok/s (prefill-bound: one 8192-token prompt per forward)",
                "sgl-project/sglang pull request #1060, comment of 2024-08-13 (H100 FP8/BF16 fix)",
                tokens=8192,
            ),
        ),
        description="8B-class dense model on one H100: the common RL rollout engine.",
    )
)

LLAMA_70B_H100_TP4 = _register(
    SimProfile(
        name="llama3-70b-h100-tp4",
        model="Llama-3.1-70B-Instruct, BF16",
        hardware="4x H100 SXM 80GB (NVLink)",
        tp=4,
        prefill_ms_per_forward=5.0,
        prefill_us_per_token=65.0,
        prefill_us_per_token_per_ktok=1.3,
        decode_ms_per_step=18.8,
        decode_us_per_request=150.0,
        decode_us_per_ktok=60.0,
        kv_pool_tokens=350_000,
        kv_bytes_per_token=_kv_bytes(80, 8, 128),
        link_gbytes_per_s=95.0,
        graph_capture_secs=15.0,
        context_length=131_072,
        max_running_requests=512,
        figures=(
            Figure(
                Metric.DECODE_STEP_MS,
                21.67,
                "Llama 3.1 70B Instruct BF16, 4x H100, SGLang v0.3.0, ShareGPT at 4 requests/s: median ITL 21.67 ms "
                "(batch 12 by Little's law: 4/s x median E2E 3.0 s; context 400)",
                _SGLANG_060,
                batch=12,
                context=400,
            ),
            Figure(
                Metric.DECODE_STEP_MS,
                24.45,
                "the same at 8 requests/s: median ITL 24.45 ms (batch 33: 8/s x 4.06 s; context 400)",
                _SGLANG_060,
                batch=33,
                context=400,
            ),
            Figure(
                Metric.DECODE_STEP_MS,
                18.12,
                "Llama-3-70B-Instruct BF16, 4x H100 SXM, vLLM, 10 ShareGPT prompts at once: median TPOT 18.12 ms "
                "(batch 10, context 400)",
                "LambdaLabsML/vllm-benchmark, results/prompt_10/, the 4x H100 80GB SXM result of "
                "Meta-Llama-3-70B-Instruct at TP 4 (vLLM, BF16; run of 2024-09-07)",
                batch=10,
                context=400,
            ),
        ),
        description="70B-class dense model on four H100s (TP 4): the large-model rollout engine.",
    )
)
