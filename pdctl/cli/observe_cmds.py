"""top and metrics: watching a running cluster (pdctl.cluster.watch, pdctl.cluster.scrape)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import termios
import threading
import tty
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import click
from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pdctl.cli.tables import print_table, stdout_console
from pdctl.cluster import ClusterState, ClusterStatus, NodeSet, StateStore
from pdctl.cluster import status as cluster_status
from pdctl.cluster.endpoints import endpoints as cluster_endpoints
from pdctl.cluster.inspect import load_state
from pdctl.cluster.keys import load_keys
from pdctl.cluster.sampling import Sampler
from pdctl.cluster.scrape import TARGETS_FILE, scrape_config, targets, write_targets
from pdctl.cluster.watch import Frame, Watch
from pdctl.signals import interrupt_where_it_lands


@click.command()
@click.argument("name", required=False)
@click.option(
    "--once", is_flag=True, help="Print one frame and exit (it takes one refresh interval: rates need two samples)."
)
@click.option("--json", "as_json", is_flag=True, help="Frames as JSON: one object with --once, else one per line.")
@click.option(
    "--interval",
    "interval_secs",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.2),
    help="Seconds between frames.",
)
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many frames.")
def top(name: str | None, once: bool, as_json: bool, interval_secs: float, count: int | None) -> None:
    """A live view of cluster NAME, refreshed every second; `q` or Ctrl-C quits.

    Per engine: role, node, health (serving; down: its port refuses connections; no answer;
    restarting; quarantined: not on the fleet's weights; cordoned; breaker open), weight
    version, running and queued requests, KV use, prompt and generated tokens/s, restarts. The
    router: requests/s, 5xx/s, p50/p99 latency over the last 10 s, retries/s, breakers open.
    The latest weight update with its phases, and the trainer. Restarts and the trainer come
    from the node agents every 5 s; everything else from the processes' HTTP endpoints each frame.
    """
    store = StateStore()
    name = store.resolve_name(name)
    state = load_state(store, name)
    keys = load_keys(store, name)
    frames = 1 if once else count
    try:
        with interrupt_where_it_lands() as stopped:  # (a Ctrl-C something dropped still quits, at the next frame)
            asyncio.run(_watch(store, state, keys, interval_secs, frames, as_json, stopped))
    except KeyboardInterrupt:
        pass  # the way out of a live view: no traceback, no error


async def _watch(
    store, state, keys, interval_secs: float, frames: int | None, as_json: bool, stopped: threading.Event
) -> None:
    live_view = not as_json and frames is None and sys.stdout.isatty()
    with NodeSet(state.node_objects().values()) as nodes:
        async with aiohttp.ClientSession() as session:

            def now() -> tuple[ClusterState, ClusterStatus]:
                current = load_state(store, state.name)
                nodes.nodes.update(current.node_objects())  # a node an apply added
                return current, cluster_status(state.name, store=store, nodes=nodes)

            watch = Watch(state, Sampler(state, keys, session), now)
            try:
                await watch.refresh_status()  # restarts and the trainer in the first frame already
                await watch.frame()  # the first sample: rates need two

                async def next_frame() -> Frame:
                    nodes.forget_unreachable()  # a node down at the last frame may be back
                    return await watch.frame()

                if live_view:
                    await _live(next_frame, interval_secs, stopped)
                    return
                shown = 0
                while (frames is None or shown < frames) and not stopped.is_set():
                    await asyncio.sleep(interval_secs)
                    # the frame --once shows asks what the first sample asked
                    frame = await (next_frame() if shown else watch.frame())
                    if as_json:
                        click.echo(json.dumps(frame.to_dict(), indent=2 if frames == 1 else None))
                    else:
                        _print_frame(stdout_console(highlight=False), frame)
                    sys.stdout.flush()
                    shown += 1
            finally:
                await watch.close()


async def _live(next_frame: Callable[[], Awaitable[Frame]], interval_secs: float, stopped: threading.Event) -> None:
    quit_pressed = asyncio.Event()
    with (
        _keys_pressed(lambda key: quit_pressed.set() if key in ("q", "Q") else None),
        Live(Text("sampling ..."), auto_refresh=False, screen=False, transient=False) as live,
    ):
        while True:  # the wait comes first: the sample before the first frame was just taken
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(quit_pressed.wait(), interval_secs)
            if quit_pressed.is_set() or stopped.is_set():
                return
            frame = await next_frame()
            live.update(_render(frame, live.console.width, live.console.is_terminal), refresh=True)


@contextlib.contextmanager
def _keys_pressed(on_key) -> Iterator[None]:
    """Calls ``on_key(char)`` for each key typed while inside (stdin in cbreak mode: no Enter
    needed); nothing when stdin is not a terminal. The terminal is restored however it ends."""
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()
    tty.setcbreak(fd)
    loop.add_reader(fd, lambda: on_key(os.read(fd, 1).decode(errors="replace")))
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _render(frame: Frame, width: int, color: bool) -> Text:
    out = Console(
        file=io.StringIO(),
        width=width,
        force_terminal=color,
        color_system="standard" if color else None,
        highlight=False,  # no colours inside words: "prefill-0" stays one run of text
    )
    _print_frame(out, frame)
    return Text.from_ansi(out.file.getvalue())  # type: ignore[attr-defined]


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _print_frame(out: Console, f: Frame) -> None:
    out.print(f"[bold]{f.cluster}[/]: {f.status}, {len(f.engines)} engines, every {f.interval_secs:.1f}s")
    # One space between columns and short headers (tokens/s in and out, ↻ restarts): an ordinary
    # fleet's table fits 80 columns; a wider one folds into a block per engine.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True, title=None)
    for col, justify in (
        ("engine", "left"),
        ("role", "left"),
        ("node", "left"),
        ("health", "left"),
        ("weights", "left"),
        ("run", "right"),
        ("queue", "right"),
        ("kv", "right"),
        ("in/s", "right"),
        ("out/s", "right"),
        ("↻", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for e in f.engines:
        color = "green" if e.health == "serving" else ("yellow" if e.health in ("restarting", "cordoned") else "red")
        table.add_row(
            e.engine,
            e.role,
            e.node,
            f"[{color}]{e.health}[/]",
            e.weight_version or "-",
            _num(e.running),
            _num(e.queued),
            _num(None if e.kv_use is None else e.kv_use * 100, "{:.0f}%"),
            _num(e.prompt_tokens_per_s),
            _num(e.generation_tokens_per_s),
            _num(e.restarts),
        )
    print_table(out, table)
    r = f.router
    if r is not None:
        breakers = ", ".join(r.open_breakers) if r.open_breakers else "none open"
        out.print(
            f"[bold]router[/] {r.health}: {_num(r.requests_per_s, '{:.1f}')} req/s, {_num(r.errors_per_s, '{:.1f}')} "
            f"5xx/s, p50 {_num(r.p50_ms, '{:.0f} ms')}, p99 {_num(r.p99_ms, '{:.0f} ms')} (last 10 s), "
            f"{_num(r.retries_per_s, '{:.1f}')} "
            f"retries/s, {_num(r.in_flight)} in flight, {_num(r.queued)} queued, breakers {breakers}, "
            f"restarts {_num(r.restarts)}"
        )
    w = f.weights
    if w is None:
        out.print("[bold]weights[/]: no update through the router yet")
    else:
        took = f" in {w['seconds']:.2f} s" if w.get("seconds") is not None else ""
        ago = f", {w['secs_ago']:.0f} s ago" if w.get("secs_ago") is not None else ""
        phases = ", ".join(f"{k} {v:.2f}" for k, v in w["phases"].items())
        line = f"[bold]weights[/]: {w['version']} {w['state']} ({w.get('refit')}){took}{ago}"
        out.print(line + (f"; phases (s): {phases}" if phases else ""))
        for engine, why in w.get("failed", {}).items():
            out.print(f"  [red]{engine}: {why}[/]")
    t = f.trainer
    if t is not None:
        out.print(f"[bold]trainer[/]: {t.state} ({t.processes} process(es)), restarts {_num(t.restarts)}")
    p = f.planner
    if p is not None:
        runs = {True: "running", False: "[red]not running[/]", None: "not started by up"}[p["alive"]]
        last = p["last"]
        said = ""
        if last is not None:
            outcome = f" -> {last['outcome']}" if last.get("outcome") else ""
            said = f"; {last['secs_ago']:.0f} s ago ({last['mode']}): {last['action']}: {last['reason']}{outcome}"
            said = escape(said)
        out.print(f"[bold]planner[/]: {runs}{said}")
    if f.processes_error:
        out.print(f"[red]node agents: {f.processes_error}[/] (restarts and trainer as last known)")


@click.command()
@click.argument("name", required=False)
@click.option("--prometheus-config", "config", is_flag=True, help="Print a Prometheus configuration that scrapes NAME.")
@click.option(
    "--targets",
    "show_targets",
    is_flag=True,
    help=f"Print NAME's file_sd target list (kept current in its state directory as {TARGETS_FILE}).",
)
@click.option(
    "--scrape-interval",
    "interval_secs",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="Seconds between scrapes, in the configuration.",
)
def metrics(name: str | None, config: bool, show_targets: bool, interval_secs: float) -> None:
    """Prometheus for cluster NAME: `--prometheus-config` prints a configuration whose job reads
    the target list that `up`, `apply`, `restart` and `down` keep current; `--targets` prints
    that list. The engines' and the router's /metrics need no key, and none is written.

    Example: `pdctl metrics --prometheus-config > prom.yml && prometheus --config.file=prom.yml`.
    A Grafana dashboard for it: dashboards/pdctl-fleet.json.
    """
    if config == show_targets:
        raise click.UsageError("give one of --prometheus-config or --targets")
    store = StateStore()
    name = store.resolve_name(name)
    state = load_state(store, name)
    processes = state.scrape_targets()
    path = write_targets(store.dir(name), name, processes)  # current, whatever wrote the state last
    if show_targets:
        click.echo(json.dumps(targets(name, processes), indent=2))
    else:
        click.echo(scrape_config(name, path, interval_secs=interval_secs), nl=False)


@click.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Engines, rank offsets and settings as JSON.")
def endpoints(name: str | None, as_json: bool) -> None:
    """What an RL framework needs to drive cluster NAME: each engine's URL, role, TP, bootstrap
    port and rank offset, and settings to paste for AReaL, slime and skyrl-train.

    AReaL and skyrl-train take the router as one SGLang engine of tp = every engine's ranks: it
    answers SGLang's control routes for the whole fleet (pause, continue, weight groups and
    updates), with each engine's own rank offset, as one transaction. slime keeps its own list of
    engines and registers them with the router. See docs/frameworks.md.
    """
    store = StateStore()
    found = cluster_endpoints(load_state(store, store.resolve_name(name)))
    if as_json:
        click.echo(json.dumps(found.to_dict(), indent=2))
        return
    console = stdout_console()
    table = Table(title=f"{found.cluster}: router {found.router_url}", box=box.SIMPLE_HEAD)
    for column in ("engine", "role", "url", "tp", "bootstrap", "ranks"):
        table.add_column(column)
    for e in found.engines:
        ranks = f"{e.rank_offset}" if e.tp == 1 else f"{e.rank_offset}-{e.rank_offset + e.tp - 1}"
        table.add_row(e.id, e.role, e.url, str(e.tp), str(e.bootstrap_port or "-"), ranks)
    print_table(console, table)
    console.print(f"weight group: world size {found.ranks + 1} (trainer rank 0 + {found.ranks} engine ranks)\n")
    for framework, settings in found.settings().items():
        console.print(f"[bold]{framework}[/bold]", highlight=False)
        for key, value in settings.items():
            if key == "note":
                console.print(f"  # {value}", highlight=False, soft_wrap=True)
            else:
                console.print(f"  {key}={value}" if not key.startswith("--") else f"  {key} {value}", highlight=False)


COMMANDS = [top, metrics, endpoints]
