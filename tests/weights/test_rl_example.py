"""The RL example (pdctl.examples.rl_sim) against a real PD fleet: with a fixed seed, the reward
rises over a short CPU run, and rollouts come from the versions the trainer pushed."""

from __future__ import annotations

import torch

from pdctl.examples.rl_sim import parse_args, train
from pdctl.sim.model import resolve_model
from pdctl.weights import WeightSync
from tests.helpers import free_port
from tests.weights.conftest import targets


def test_reward_rises_and_rollouts_follow_pushes(fleet):
    procs, router = fleet
    torch.manual_seed(0)
    args = parse_args(["--steps", "8", "--push-every", "2", "--seed", "0"])
    model = resolve_model("sim://tiny", "auto", None)
    with WeightSync(
        targets(procs), master_address="127.0.0.1", master_port=free_port(), router_url=router.url, timeout_secs=60
    ) as sync:
        records = train(sync, router.url, model, args)
    first = sum(r["reward"] for r in records[:3]) / 3
    last = sum(r["reward"] for r in records[-3:]) / 3
    assert last > first + 0.05, [round(r["reward"], 3) for r in records]
    # The rollouts of step k come from the last push before it (pushes after steps 2, 4, ...).
    assert records[0]["rollout_version"] == "default"
    for r in records[2:]:
        assert r["rollout_version"] == f"step-{(r['step'] - 1) // 2 * 2}", r


def test_the_asynchronous_loop_learns_with_rollouts_that_span_pushes(fleet):
    """Rollouts stay in flight while the trainer pushes with refit interrupt: none fails, every
    token's version is one the trainer pushed, and the reward still rises (importance-weighted per
    token). Whether a rollout spans a push depends on speeds (the committed run shows how many do;
    tests/weights/test_refit.py checks spans themselves)."""
    from pdctl.examples.rl_sim import train_async

    procs, router = fleet
    torch.manual_seed(0)
    args = parse_args(["--steps", "12", "--push-every", "2", "--seed", "0", "--async-rollouts", "2"])
    args.max_new_tokens = 48  # long enough to be in flight across a push
    model = resolve_model("sim://tiny", "auto", None)
    with WeightSync(
        targets(procs),
        master_address="127.0.0.1",
        master_port=free_port(),
        router_url=router.url,
        timeout_secs=60,
        refit="interrupt",
    ) as sync:
        records = train_async(sync, router.url, model, args)
    first = sum(r["reward"] for r in records[:3]) / 3
    last = sum(r["reward"] for r in records[-3:]) / 3
    assert last > first + 0.05, [round(r["reward"], 3) for r in records]
    assert all(r.get("refit", "interrupt") == "interrupt" for r in records)
    pushed = {"step-0"} | {r["pushed"] for r in records if "pushed" in r}
    assert all(set(r["rollout_versions"]) <= pushed for r in records), [r["rollout_versions"] for r in records]
    assert all(0 <= r["off_policy_tokens"] <= 1 for r in records)
