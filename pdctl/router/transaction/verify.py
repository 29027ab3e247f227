"""The one verification rule of a fleet transaction (pdctl.router.transaction.runner's docstring
says why it is right for sims and SGLang engines): which engines are compared, and which differ."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdctl.refit import VerifyMode
from pdctl.router.fanout import WorkerAnswer
from pdctl.router.transaction.state import FleetTxn, Mark
from pdctl.router.workers import Worker


def engines_to_verify(txn: FleetTxn, sourced: bool, verify: VerifyMode) -> list[Worker]:
    """The engines whose checksums are compared: none when off; every taker when the driver asked
    for a mode; else the sims among them, and without the source's checksums (``sourced``) only
    when every taker is a sim (a majority of all of them)."""
    takers = txn.engines_marked(Mark.TAKING)
    if verify is VerifyMode.OFF:
        return []
    if verify is not VerifyMode.AUTO:
        return takers
    members = {m.url: m for g in txn.groups.values() for m in g.members}
    sims = [w for w in takers if w.url in members and members[w.url].is_sim]
    return sims if sourced or len(sims) == len(takers) else []


def checksum_body(names: Sequence[str], verify: VerifyMode) -> dict[str, Any]:
    """The ``/weights_checker`` body that asks an engine for its checksums of ``names``."""
    mode = "full" if verify is VerifyMode.FULL else "sample"
    return {"action": "checksum", "names": list(dict.fromkeys(names)), "mode": mode}


def differing(
    answers: Sequence[WorkerAnswer], names: Sequence[str], source: Mapping[str, str] | None
) -> dict[str, str]:
    """URL -> why, for the engines whose checksums of ``names`` differ from ``source``'s, or
    without it from the strict majority's (a tie fails everyone), or that gave none."""
    failed: dict[str, str] = {}
    sums: dict[str, list[str]] = {}
    for a in answers:
        checksums = a.body.get("checksums") if a.ok and isinstance(a.body, dict) else None
        if not isinstance(checksums, dict):
            failed[a.worker.url] = f"verify: {a.why()}"
        elif source is not None:
            bad = [n for n in dict.fromkeys(names) if checksums.get(n) != source.get(n)]
            if bad:
                failed[a.worker.url] = f"checksum differs for {len(bad)} tensor(s), first {bad[0]}"
        else:
            sums.setdefault(repr(sorted(checksums.items())), []).append(a.worker.url)
    if len(sums) > 1:
        sides = sorted(sums.values(), key=len, reverse=True)
        best = sides[0] if len(sides[0]) > len(sides[1]) else []
        for side in sides:
            if side is not best:
                for url in side:
                    failed[url] = f"its weights differ from {len(best) or 'every other'} engine(s)' after the update"
    return failed
