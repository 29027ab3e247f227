"""up, down, status, logs: thin commands over pdctl.cluster."""

from __future__ import annotations

import json
import sys
import threading
import time

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pdctl.cli.tables import print_table, stdout_console
from pdctl.cluster import ClusterStatus, StateStore
from pdctl.cluster import down as cluster_down
from pdctl.cluster import logs as cluster_logs
from pdctl.cluster import status as cluster_status
from pdctl.cluster import up as cluster_up
from pdctl.cluster.inspect import EngineStatus, rotation_of
from pdctl.cluster.restart import restart as cluster_restart
from pdctl.cluster.state import Phase
from pdctl.errors import LifecycleError

console = Console(stderr=True, log_path=False)  # log lines without pdctl's source file name


class Progress:
    """A live table of process states, fed from worker threads."""

    def __init__(self, ids: list[str]):
        self.rows = {i: "planned" for i in ids}
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.live = Live(self.render(), console=console, refresh_per_second=4, transient=False)
        self.shown = False

    def event(self, process: str, message: str) -> None:
        """Show ``message`` as ``process``'s state: its row in the live table, or a log line when it has
        no row or the console is not a terminal. Safe to call from any thread."""
        if not console.is_terminal:  # piped or logged: one plain line per event, no redrawn table
            console.log(f"{process}: {message}")
            return
        with self.lock:
            if not self.shown:  # only once something happens: an early refusal prints no table
                self.live.start()
                self.shown = True
            if process in self.rows:
                self.rows[process] = message
            else:
                console.log(f"{process}: {message}")
        self.live.update(self.render())

    def render(self) -> Table:
        """The table of every process's state now, titled with the seconds since it started."""
        table = Table(title=f"pdctl up ({time.monotonic() - self.started:.1f}s)", expand=False)
        table.add_column("process")
        table.add_column("state")
        for pid, state in self.rows.items():
            color = "green" if state in ("healthy", "stopped") or state.startswith("started") else "yellow"
            table.add_row(pid, f"[{color}]{state}[/]")
        return table


@click.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--timeout", "timeout_secs", default=900.0, show_default=True, help="Seconds to wait for engines.")
def up(file: str | None, timeout_secs: float) -> None:
    """Launch FILE's cluster (default: the embedded sim topology on localhost).

    Preflights every node (reachable, pdctl importable, ports free), starts engines, waits
    until they are healthy, starts the router, then the trainer. On any failure or Ctrl-C
    everything already started is stopped and the failing process's log tail is shown.
    """
    from pdctl.cli.topology_cmds import load_or_default  # (the topology loader and its schema: up and apply only)

    planned, filename = load_or_default(file)
    top, plan = planned.topology, planned.plan
    progress = Progress([p.id for p in plan.processes])
    try:
        state = cluster_up(top, plan, ready_timeout_secs=timeout_secs, events=progress.event, source=filename)
    finally:
        if progress.shown:
            progress.live.stop()
    console.print(f"[green]cluster {state.name!r} is up[/] in {time.monotonic() - progress.started:.1f}s")
    click.echo(f"router: {state.router_url}")
    _print_status(cluster_status(state.name))


@click.command()
@click.argument("name", required=False)
@click.option("--purge", is_flag=True, help="Also remove run directories (logs) on the nodes and the state.")
def down(name: str | None, purge: bool) -> None:
    """Stop every process of cluster NAME on every node; idempotent (exit 1 for a NAME that has no
    state: a misspelled name must not look like success).

    SIGTERM to whole process groups, SIGKILL after a grace period, trainer rank 0 last,
    then a check that nothing of the cluster is left. An unreachable node keeps its
    entries in the state so that running down again finishes the job.
    """
    store = StateStore()
    name = store.resolve_name(name)
    if store.load(name) is None:  # a misspelled name must not look like a cluster stopped
        known = ", ".join(store.names()) or "none"
        raise LifecycleError(f"no cluster {name!r} in {store.root} (clusters: {known}); nothing was stopped")
    click.echo(cluster_down(name, store=store, purge=purge, events=lambda p, m: None))


@click.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(name: str | None, as_json: bool) -> None:
    """Each process of NAME: role, node, pid, alive, health, ports, weight version, uptime,
    restarts (↻N: its node's supervisor restarted it N times; JSON `restarts`, `last_exit`);
    then each engine as a unit (a multi-node engine is down when any of its processes is).
    With no NAME and several clusters: one row per cluster (state, router, processes up).

    Exit 1 when anything is down, restarting or unhealthy; 0 once everything is back. A trainer
    that exited 0 has completed (the header says so): that is not a failure.
    """
    store = StateStore()
    if name is None and len(store.names()) > 1 and not as_json:
        _print_summary(store)
        return
    result = cluster_status(store.resolve_name(name), store=store)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_status(result)
    if not result.ok:
        sys.exit(1)


def _print_summary(store: StateStore) -> None:
    """Every cluster in one table: name, state, router, processes up of total. Exit 1 unless all
    clusters that are not down are whole."""
    table = Table(title=f"clusters in {store.root}")
    for col in ("cluster", "state", "router", "processes up"):
        table.add_column(col)
    whole = True
    for cluster in store.names():
        result = cluster_status(cluster, store=store)
        up = sum(1 for p in result.processes if p.ok)
        table.add_row(cluster, result.status, result.router_url or "-", f"{up}/{len(result.processes)}")
        whole &= result.status == Phase.DOWN or result.ok
    print_table(Console(width=None if sys.stdout.isatty() else 160), table)
    click.echo("`pdctl status NAME` shows one cluster's processes")
    if not whole:
        sys.exit(1)


def _print_status(result: ClusterStatus) -> None:
    out = stdout_console()
    if not result.processes:  # a stopped cluster: a sentence, not an empty table
        out.print(f"cluster {result.name!r} is {result.status}: no processes (start it with `pdctl up`)")
        return
    phase = f"{result.status}, trainer completed" if result.completed else str(result.status)
    table = Table(title=f"{result.name}: {phase}  router {result.router_url}")
    for col in ("process", "role", "node", "pid", "alive", "health", "weights", "ports", "uptime"):
        table.add_column(col)
    for p in result.processes:
        alive = "?" if p.alive is None else ("[green]yes[/]" if p.alive else "[red]no[/]")
        if p.alive is False and p.exit_code is not None:
            alive = f"[{'green' if p.exit_code == 0 else 'red'}]exited {p.exit_code}[/]"
        if p.supervisor == "backoff":
            alive = "[yellow]restarting[/]"
        elif p.supervisor == "gave_up":
            alive = "[red]left down[/]"
        if p.restarts:
            alive += f" ↻{p.restarts}"
        health = "-" if p.healthy is None else ("[green]ok[/]" if p.healthy else "[red]failing[/]")
        uptime = f"{p.uptime_secs:.0f}s" if p.uptime_secs is not None else "-"
        ports = "\n".join(f"{k}={v}" for k, v in p.ports.items())
        table.add_row(p.id, p.role, p.node, str(p.pid), alive, health, p.weight_version or "-", ports, uptime)
    print_table(out, table)  # whole, or one block per process when the terminal is narrower
    for p in result.processes:
        if p.error:
            out.print(f"[red]{p.node}: {p.error}[/]")
        if p.kept_args:
            kept = ", ".join(f"{flag} {mine} (its group's: {theirs})" for flag, (mine, theirs) in p.kept_args.items())
            out.print(f"{p.id}: switched role; until its next restart it keeps {kept}")
        if p.reason:
            out.print(f"[red]{p.id}: {p.reason}[/]")
        elif p.restarts and p.last_exit:
            out.print(f"{p.id}: restarted {p.restarts} time(s); last exit {_exit_text(p.last_exit)}")
    if result.engines:

        def engine(e: EngineStatus) -> str:
            if not e.up:
                return f"{e.id} [red]DOWN[/] ({e.problem})"
            if e.rotation and e.rotation.startswith("paused:"):
                return f"{e.id} [yellow]paused[/]"
            if e.rotation:
                return f"{e.id} [yellow]OUT OF ROTATION[/] ({e.rotation})"
            return f"{e.id} [green]up[/]"

        out.print(f"engines: {', '.join(engine(e) for e in result.engines)}")
    if result.hold:
        out.print(f"[yellow]requests wait: the router is {result.hold.get('reason')}[/]")
    if result.planner_process is not None:
        planner = result.planner_process
        alive = "[green]running[/]" if planner["alive"] else "[red]not running[/]"
        last = result.planner[-1] if result.planner else None
        said = f"; last: {last['action']}: {last['reason']}" if last else ""
        where = f"pid {planner['pid']}, restarts {planner['restarts']}, log {planner['log']}"
        out.print(f"planner: {alive} ({where}){said}")
    if result.step:
        out.print(f"[yellow]{result.step}[/]" if result.step.startswith("in progress") else f"[red]{result.step}[/]")
    for d in result.mps:
        if d.running is None:
            state = f"[red]unknown[/] ({d.error})"
        elif d.running:
            state = "[green]running[/]" + ("" if d.control_pipe else " [red](no control pipe)[/]")
        else:
            state = "[red]not running[/]"
        owner = "started by pdctl" if d.started else "not pdctl's: down leaves it"
        out.print(f"mps {d.node}: {state} (pid {d.pid}, {owner})")
    if result.router_workers is not None:
        workers = ", ".join(
            f"{w['worker_type']} {w['url']} ({rotation_of(w) or 'in rotation'}, v={w.get('weight_version')})"
            for w in result.router_workers
        )
        out.print(f"router workers: {workers or 'none'}")


def _exit_text(last_exit: dict) -> str:
    code = last_exit.get("code")
    how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"code {code}"
    at = last_exit.get("at")
    text = how + (f" at {time.strftime('%H:%M:%S', time.localtime(at))}" if isinstance(at, (int, float)) else "")
    return text + (f" (killed: it {last_exit['why']})" if last_exit.get("why") else "")


@click.command()
@click.argument("args", nargs=-1)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output.")
@click.option(
    "-n", "--lines", default=50, show_default=True, type=click.IntRange(min=0), help="Lines of history to show."
)
def logs(args: tuple[str, ...], follow: bool, lines: int) -> None:
    """Print the log of process PROC of cluster NAME: `pdctl logs [NAME] [PROC]`.

    PROC defaults to the router; NAME to the only cluster there is.
    """
    store = StateStore()
    if len(args) > 2:
        raise click.UsageError("usage: pdctl logs [NAME] [PROC]")
    names = store.names()
    if len(args) == 2:
        name, proc = args
    elif len(args) == 1 and args[0] in names:
        name, proc = args[0], "router"
    elif len(args) == 1 and not names:
        raise LifecycleError(f"no cluster named {args[0]!r} (there are no clusters in {store.root})")
    else:
        name, proc = store.resolve_name(None), (args[0] if args else "router")
        if args and not _has_process(store, name, proc):
            raise LifecycleError(
                f"{proc!r} is neither a cluster ({', '.join(names)}) nor a process of cluster {name!r}"
            )
    try:
        for chunk in cluster_logs(name, proc, lines=lines, follow=follow, store=store):
            click.echo(chunk, nl=False)
    except KeyboardInterrupt:
        pass


def _has_process(store: StateStore, name: str, proc: str) -> bool:
    state = store.load(name)
    return state is not None and any(p.id == proc for p in state.plan.processes)


@click.command()
@click.argument("args", nargs=-1)
@click.option("--timeout", "timeout_secs", default=900.0, show_default=True, help="Seconds to wait for each engine.")
def restart(args: tuple[str, ...], timeout_secs: float) -> None:
    """Rolling restart: `pdctl restart [NAME] [PROC...]` (default: every engine of NAME).

    One engine at a time: the router stops sending it requests and waits for those it runs,
    its processes are stopped and started again on the same ports, and once the router routes
    to it again (healthy, on the fleet's weight version) the next one goes. PROC: an engine
    (`decode-1`), one of its processes, or `router` (its clients see a short outage). Trainer
    ranks cannot be restarted (they could not rejoin their job). Exit 1 when an engine does not
    come back; the engines after it are left as they were.
    """
    store = StateStore()
    names = store.names()
    if args and args[0] in names:
        name, targets = args[0], list(args[1:])
    else:
        name, targets = store.resolve_name(None), list(args)
    done = cluster_restart(
        name,
        targets or None,
        store=store,
        events=lambda p, m: console.log(f"{p}: {m}"),
        ready_timeout_secs=timeout_secs,
    )
    click.echo(f"restarted {', '.join(done) or 'nothing'}")


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--dry-run", is_flag=True, help="Print what would be added, replaced and removed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="The changes as JSON.")
@click.option(
    "--recreate", is_flag=True, help="Apply a change that cannot be made live by taking the cluster down and up."
)
@click.option("--timeout", "timeout_secs", default=900.0, show_default=True, help="Seconds to wait for each engine.")
def apply(file: str, dry_run: bool, as_json: bool, recreate: bool, timeout_secs: float) -> None:
    """Change the running cluster of FILE's name to match FILE.

    Added engines start and enter rotation once healthy and on the fleet's weight version;
    engines whose command line, environment, node or GPUs changed are replaced one at a time
    (drained first); an engine that moves between a prefill and a decode group that both have
    `role_switch: true` is switched live (drained, then SGLang's /pd_role_switch: no restart);
    removed engines are drained, then stopped. Added first, removed last, so no role drops to
    zero capacity; running processes keep their ports and GPUs. Changes that cannot be
    made live (model.path, engine, ports.base, trainer.command, placement) are refused, naming
    the field, unless --recreate. Exit 1 on a refusal or a failed step.
    """
    from pdctl.cli.topology_cmds import load_or_default  # (the topology loader and its schema: up and apply only)
    from pdctl.cluster.apply import apply as cluster_apply

    planned, filename = load_or_default(file)
    result = cluster_apply(
        planned.topology,
        dry_run=dry_run,
        recreate=recreate,
        events=lambda p, m: console.log(f"{p}: {m}"),
        source=filename,
        ready_timeout_secs=timeout_secs,
    )
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.text())
    if dry_run and result.refused and not recreate:
        sys.exit(1)


@click.command()
@click.argument("args", nargs=-1)
@click.option("--timeout", "timeout_secs", default=900.0, show_default=True, help="Seconds to wait for the engine.")
def switch(args: tuple[str, ...], timeout_secs: float) -> None:
    """Switch one engine's PD role live: `pdctl switch [NAME] ENGINE prefill|decode`.

    The router stops sending ENGINE requests and waits for those it runs; the engine switches
    (SGLang's /pd_role_switch: no restart, same process, GPUs and ports), its supervisor learns
    the command it restarts with from now on, and the router takes it back in its new role. It
    takes the next free id of its group's switch group (prefill-1 -> decode-2, say). Its group
    needs `role_switch: true` beside a group of the other role that allows it, with the same tp.
    An engine that refuses (busy, say) serves on as it was, and the error says why (exit 1).
    `pdctl apply` makes the same switch from an edited file (2 prefills, 2 decodes -> 1 and 3).
    """
    from pdctl.cluster.switch import switch as cluster_switch

    store = StateStore()
    if len(args) == 3:
        name, engine, role = args
    elif len(args) == 2:
        name, (engine, role) = store.resolve_name(None), args
    else:
        raise click.UsageError("pdctl switch [NAME] ENGINE prefill|decode")
    if role not in ("prefill", "decode"):
        raise click.UsageError(f"the role is prefill or decode, not {role!r}")
    new_id = cluster_switch(
        name, engine, role, store=store, events=lambda p, m: console.log(f"{p}: {m}"), ready_timeout_secs=timeout_secs
    )
    click.echo(f"{engine} is {role} {new_id}")


COMMANDS = [up, down, status, logs, restart, apply, switch]
