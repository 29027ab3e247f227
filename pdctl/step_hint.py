"""A trainer's or framework's word to the P:D planner: a new step (a batch of prompts) is
coming. ``announce_step`` sends ``POST /pdctl/step`` to the cluster's router with the URL and
control key ``pdctl up`` gives the trainer (``PDCTL_ROUTER_URL``, ``PDCTL_CONTROL_KEY``); the
planner reads it at its next sample and may move a decode to prefill ahead of the burst
(docs/planner.md). No torch here: any process with the two variables may call it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pdctl.errors import PdctlError

STEP_PATH = "/pdctl/step"
"""A step boundary, to the router (pdctl.router.planner_api)."""
PLANNER_PATH = "/pdctl/planner"
"""The planner's decisions, to the router; ``GET`` shows the latest step and decision."""


def announce_step(
    prompt_tokens: int | None = None,
    requests: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout_secs: float = 10.0,
) -> int:
    """Say a step boundary: ``prompt_tokens`` the step will prefill (its distinct prompts' tokens:
    GRPO's samples of one prompt share it) and ``requests`` it will send, either may be left out.
    Returns the router's count of announced steps. Raises ``PdctlError`` when the router is not
    configured or refuses; a planner in ``off`` mode or none at all makes the call harmless."""
    from pdctl.weights.client import CallFailure, JsonClient  # (the paths above need none of it)
    from pdctl.weights.env import CONTROL_KEY_ENV, ROUTER_URL_ENV

    env = os.environ if env is None else env
    url = env.get(ROUTER_URL_ENV)
    if not url:
        raise PdctlError(f"no router to tell: {ROUTER_URL_ENV} is not set (pdctl up sets it for the trainer)")
    body = {k: v for k, v in (("prompt_tokens", prompt_tokens), ("requests", requests)) if v is not None}
    client = JsonClient(env.get(CONTROL_KEY_ENV) or None, timeout_secs)
    try:
        answer = client.post(url.rstrip("/") + STEP_PATH, body)
    finally:
        client.close()
    if isinstance(answer, CallFailure):
        raise PdctlError(f"the router refused the step boundary: {answer}")
    return int(answer["steps"])
