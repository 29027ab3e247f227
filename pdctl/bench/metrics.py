"""A run's figures from its request results, under SGLang bench_serving's field names.

Every latency is in milliseconds: ``mean_``, ``median_``, ``std_``, ``p90_``, ``p95_``,
``p99_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_latency_ms``. Throughputs are per
second of the measured phase (the first send to the last answer).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdctl.bench.client import RequestResult

STATS = ("mean", "median", "std", "p90", "p95", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


@dataclass(frozen=True)
class Slo:
    """Goodput thresholds (bench_serving's ``--goodput ttft:MS tpot:MS e2el:MS``)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, r: RequestResult) -> bool:
        """Whether ``r`` succeeded within every threshold that is set."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and r.e2e * 1000 > self.e2e_ms)

    @property
    def any(self) -> bool:
        """True when any threshold is set."""
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values_secs: Sequence[float], name: str) -> dict[str, float]:
    """``mean_<name>_ms`` ... ``p99_<name>_ms`` of values given in seconds."""
    ms = sorted(v * 1000 for v in values_secs)
    n = len(ms)
    mean = sum(ms) / n if n else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / n) if n else 0.0
    return {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": std,
        f"p90_{name}_ms": percentile(ms, 90),
        f"p95_{name}_ms": percentile(ms, 95),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def summarize(results: Sequence[RequestResult], slo: Slo | None = None) -> dict[str, Any]:
    """The figures of one measured phase."""
    done = [r for r in results if r.ok]
    if results:
        start = min(r.start for r in results)
        duration = max(r.end for r in results) - start
    else:
        duration = 0.0
    per_sec = 1 / duration if duration > 0 else 0.0
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    out: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_sec,
        "input_throughput": input_tokens * per_sec,
        "output_throughput": output_tokens * per_sec,
        "total_throughput": (input_tokens + output_tokens) * per_sec,
        "concurrency": sum(r.e2e for r in done) * per_sec,
        # the server's counts against what was asked (ignore_eos: they should agree)
        "output_token_mismatches": sum(1 for r in done if r.output_tokens != r.output_len),
        "input_token_mismatches": sum(1 for r in done if r.prompt_tokens not in (None, r.input_len)),
    }
    out.update(describe([r.ttft for r in done], "ttft"))
    out.update(describe([t for r in done if (t := r.tpot) is not None], "tpot"))
    out.update(describe([g for r in done for g in r.itl], "itl"))
    out.update(describe([r.e2e for r in done], "e2e_latency"))
    if slo is not None and slo.any:
        good = sum(1 for r in results if slo.met(r))
        out["request_goodput"] = good * per_sec
        out["slo_attainment"] = good / len(results) if results else 0.0
    versions = Counter(r.weight_version for r in done if r.weight_version is not None)
    if versions:
        out["weight_versions"] = dict(versions)
    return out


def windows_split(results: Sequence[RequestResult], windows: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Latency and errors of requests that overlapped a weight-push window against the rest."""

    def inside(r: RequestResult) -> bool:
        return any(r.start < w_end and r.end > w_start for w_start, w_end in windows)

    split = {"inside": [r for r in results if inside(r)], "outside": [r for r in results if not inside(r)]}
    out: dict[str, Any] = {}
    for name, group in split.items():
        done = [r for r in group if r.ok]
        out[name] = {
            "requests": len(group),
            "failed": len(group) - len(done),
            "errors": dict(Counter(r.error for r in group if not r.ok)),
            **describe([r.ttft for r in done], "ttft"),
            **describe([r.e2e for r in done], "e2e_latency"),
        }
    return out


def refit_stall(
    results: Sequence[RequestResult], windows: Sequence[tuple[float, float]], updates: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """What the weight updates cost the requests around them (pdctl.refit): each update's wall
    time and transfer time, the longest gap between two tokens of any request that overlapped an
    update, and the TTFT of requests that were sent while an update ran."""

    def overlaps(r: RequestResult) -> bool:
        return any(r.start < end and r.end > start for start, end in windows)

    def arrived_during(r: RequestResult) -> bool:
        return any(start <= r.start < end for start, end in windows)

    gaps = [max(r.itl) for r in results if r.ok and r.itl and overlaps(r)]
    late = [r for r in results if arrived_during(r)]
    modes = sorted({str(u["refit"]) for u in updates if u.get("refit")})
    transfers = [float(u["transfer_s"]) for u in updates if u.get("transfer_s") is not None]
    walls = [end - start for start, end in windows]
    return {
        "refit": modes[0] if len(modes) == 1 else modes,
        "updates": len(windows),
        "update_wall_s": [round(w, 4) for w in walls],
        "transfer_s": [round(t, 4) for t in transfers],
        "max_update_wall_ms": max(walls) * 1000 if walls else 0.0,
        "max_stream_gap_ms": max(gaps) * 1000 if gaps else 0.0,
        "arrived_during_update": len(late),
        "failed_arrived_during_update": sum(1 for r in late if not r.ok),
        **describe([r.ttft for r in late if r.ok], "ttft_arrived_during_update"),
    }
