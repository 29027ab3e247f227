"""The planner: topology in, exact processes out (pure; design.md "Planning rules")."""

from pdctl.plan.load import Planned, load_plan, load_plan_text
from pdctl.plan.model import EngineSpec, LaunchSpec, Plan, WeightGroup, url_host
from pdctl.plan.planner import check_invariants, make_plan

__all__ = [
    "EngineSpec",
    "LaunchSpec",
    "Plan",
    "Planned",
    "WeightGroup",
    "check_invariants",
    "load_plan",
    "load_plan_text",
    "make_plan",
    "url_host",
]
