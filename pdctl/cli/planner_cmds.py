"""planner: the P:D planner's loop over a running cluster (pdctl.role_planner)."""

from __future__ import annotations

import faulthandler
import json
import signal
import sys

import click
from rich.console import Console

from pdctl.cluster import StateStore
from pdctl.errors import LifecycleError

console = Console(stderr=True, log_path=False)


@click.command()
@click.argument("name", required=False)
@click.option("--mode", type=click.Choice(["advise", "act"]), help="Override the topology's planner.mode.")
@click.option("--interval", "interval_secs", type=float, help="Override planner.interval_secs (seconds).")
@click.option("--cooldown", "cooldown_secs", type=float, help="Override planner.cooldown_secs (seconds).")
@click.option("--intervals", type=int, help="Stop after this many intervals (default: run until Ctrl-C).")
@click.option("--history", is_flag=True, help="Print the latest decisions (planner.jsonl) as JSON and exit.")
def planner(
    name: str | None,
    mode: str | None,
    interval_secs: float | None,
    cooldown_secs: float | None,
    intervals: int | None,
    history: bool,
) -> None:
    """Run the P:D planner on cluster NAME: move engines between prefill and decode as the load shifts.

    Every interval it samples each engine's queues, running requests, slots and tokens/s and the
    router's hold, finds the role that holds the fleet back (a queue; or decodes that run full
    while the prefills idle: docs/planner.md), and in `act` mode switches the idlest engine of the
    other role to it with `pdctl switch`'s own code (drained first; a Ctrl-C is safe). A step
    boundary a trainer announces (`pdctl.step_hint.announce_step`, POST /pdctl/step on the router)
    may move a decode to prefill ahead of the burst. In
    `advise` mode it says what it would do and why, and changes nothing. Only engines of
    `role_switch` groups move; it never goes below the topology's planner.min_prefill/min_decode
    (unset: a quarter of the PD engines each, one at least),
    never switches while a weight update or a framework's pause holds the fleet, and waits
    planner.cooldown_secs after each switch, except that a whole batch queued per engine at the
    role it took from, and none at the other, moves back at once, and a move whose next reading
    agrees (the role it took from idle, the balance further that way) goes on at once.
    Each decision is printed and kept in the cluster's planner.jsonl (`--history`, `pdctl
    status`, `pdctl top`) and counted by the router (pdctl_planner_decisions_total). Settings:
    the topology's `planner:` section. `kill -USR1` prints every thread's stack (a planner that
    seems stuck).
    """
    # (a long-running process with threads and an event loop: when one seems stuck, its stacks
    # say where; seen once, a planner that did not stop on SIGINT in a loaded suite run)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    from pdctl.cluster.planner_loop import PlannerLoop, planner_config
    from pdctl.cluster.planner_record import recent_decisions
    from pdctl.role_planner.config import PlannerMode

    store = StateStore()
    name = store.resolve_name(name)
    if history:
        click.echo(json.dumps(recent_decisions(store, name, 50), indent=2))
        return
    state = store.load(name)
    if state is None:
        raise LifecycleError(f"no cluster {name!r} in {store.root}")
    config = planner_config(state, {"mode": mode, "interval_secs": interval_secs, "cooldown_secs": cooldown_secs})
    if config.mode is PlannerMode.OFF:
        raise LifecycleError(f"cluster {name!r} has planner.mode off: give --mode advise or --mode act")
    console.log(
        f"planner on {name}: mode {config.mode.value}, objective {config.objective.value}, every "
        f"{config.interval_secs:g} s, cooldown {config.cooldown_secs:g} s"
    )
    loop = PlannerLoop(name, config, store, events=lambda p, m: console.log(f"{p}: {m}"))
    try:
        loop.run(intervals)
    except KeyboardInterrupt:
        loop.stop.set()
        console.log("planner stopped")


COMMANDS = [planner]
