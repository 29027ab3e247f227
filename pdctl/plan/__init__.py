"""The planner: topology in, exact processes out (pure; design.md "Planning rules")."""

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports

if TYPE_CHECKING:
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

__getattr__ = lazy_exports(
    __name__,
    {
        "EngineSpec": "pdctl.plan.model",
        "LaunchSpec": "pdctl.plan.model",
        "Plan": "pdctl.plan.model",
        "Planned": "pdctl.plan.load",
        "WeightGroup": "pdctl.plan.model",
        "check_invariants": "pdctl.plan.planner",
        "load_plan": "pdctl.plan.load",
        "load_plan_text": "pdctl.plan.load",
        "make_plan": "pdctl.plan.planner",
        "url_host": "pdctl.plan.model",
    },
)
