"""The planner: topology in, exact processes out (pure; design.md "Planning rules")."""

from pdctl.plan.model import EngineSpec, LaunchSpec, Plan, WeightGroup, url_host
from pdctl.plan.planner import check_invariants, make_plan

__all__ = [
    "EngineSpec",
    "LaunchSpec",
    "Plan",
    "WeightGroup",
    "check_invariants",
    "make_plan",
    "url_host",
]
