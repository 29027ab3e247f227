"""``pdctl bench``: a serving benchmark (workloads, a streaming client, load points, report)."""

from pdctl.bench.metrics import Slo, summarize
from pdctl.bench.runner import BenchConfig, BenchError, LoadPoint, run_bench
from pdctl.bench.workloads import BenchRequest, WorkloadError

__all__ = ["BenchConfig", "BenchError", "BenchRequest", "LoadPoint", "Slo", "WorkloadError", "run_bench", "summarize"]
