"""One error hierarchy for pdctl.

    PdctlError                 anything pdctl reports to a user (CLI prints it, exit 1)
    ├── TopologyError          the YAML is invalid; carries every Issue found
    ├── AllocationError        the allocation-mode string is invalid; carries the column
    ├── PlanError              a plan invariant failed (a bug or an impossible topology)
    ├── RemoteError            SSH / local execution failed (unreachable, bad host key, ...)
    │   └── NodeUnreachable    no connection, or no SSH banner, within the bound (pdctl.cluster.nodes)
    ├── LifecycleError         up/down/status could not do what was asked
    │   └── ReadinessError     a process did not become ready (pdctl.cluster.up)
    ├── RouterConfigError      a router setting is out of its range (names the flag)
    ├── SimError               the sim engine refused a request or a weight update
    │   ├── ValidationError    SGLang's pydantic stage would refuse the body (pdctl.sim.body)
    │   ├── ContractError      /generate's strict JSON contract refuses it (pdctl.sim.body)
    │   └── PrefillAborted     a decode's prefill ended the request without KV (pdctl.sim.kv)
    ├── WeightSyncError        the trainer-side weight push failed
    ├── DataPlaneError         the colocated data plane failed (names the engine rank; pdctl.colocate)
    ├── BenchError             a benchmark could not run (pdctl.bench.runner)
    ├── WorkloadError          a benchmark workload cannot be built (pdctl.bench.workloads)
    ├── RolloutError           the RL example could not sample rollouts (pdctl.examples.rl_sim)
    └── FeedError              the draft example could not send its prompts (pdctl.examples.colocate_draft)

tests/test_structure.py holds this drawing against the real classes.

Foreign errors (yaml, jsonschema, paramiko, aiohttp) are converted at their seam with
``raise ... from exc`` so that the CLI never shows a traceback unless ``--debug``.
"""

from __future__ import annotations

from dataclasses import dataclass


class PdctlError(Exception):
    """Base class: an error with a message fit for a user."""


@dataclass(frozen=True)
class Issue:
    """One problem in a topology file.

    ``path`` is dotted (``prefill.args.port``, ``nodes[1].host``); ``line``/``col`` are
    1-based positions in the file, or 0 when unknown; ``severity`` is ``error`` or ``warning``.
    """

    path: str
    message: str
    line: int = 0
    col: int = 0
    severity: str = "error"
    hint: str = ""

    def format(self, filename: str) -> str:
        """The issue as one line for a user: ``file:line:col: path: message``, with the severity when it
        is not an error and the hint when there is one."""
        where = f"{filename}:{self.line}:{self.col}" if self.line else filename
        text = f"{where}: {self.path or '<root>'}: {self.message}"
        if self.severity != "error":
            text = f"{where}: {self.severity}: {self.path or '<root>'}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


class TopologyError(PdctlError):
    """The topology is invalid. ``issues`` holds every error (and warning) found."""

    def __init__(self, filename: str, issues: list[Issue]):
        self.filename = filename
        self.issues = issues
        errors = [i for i in issues if i.severity == "error"]
        super().__init__("\n".join(i.format(filename) for i in errors) or "invalid topology")


class AllocationError(PdctlError):
    """An allocation-mode string is invalid; ``col`` is the 1-based column of the fault."""

    def __init__(self, message: str, text: str = "", col: int = 0):
        self.text = text
        self.col = col
        self.reason = message
        pointer = f"\n  {text}\n  {' ' * max(col - 1, 0)}^" if text and col else ""
        super().__init__(f"{message}{pointer}")


class PlanError(PdctlError):
    """A plan invariant does not hold; the message names the invariant."""


class RemoteError(PdctlError):
    """Running something on a node failed; the message names the node."""


class NodeUnreachable(RemoteError):
    """A node took no connection, or took one and never spoke SSH, within the connect bound: a
    command asks it nothing more (pdctl.cluster.nodes)."""


class LifecycleError(PdctlError):
    """up / down / status / logs could not complete."""


class RouterConfigError(PdctlError):
    """A router setting out of its range; the message names the flag and the rule."""


class SimError(PdctlError):
    """The sim engine rejected something; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class DataPlaneError(PdctlError):
    """The colocated data plane (pdctl.colocate) failed: ``engine`` and ``rank`` name the engine
    rank that did not send (or could not be reached), ``step`` the step it owed, where known."""

    def __init__(self, message: str, *, engine: str | None = None, rank: int | None = None, step: int | None = None):
        super().__init__(message)
        self.engine = engine
        self.rank = rank
        self.step = step


class WeightSyncError(PdctlError):
    """A trainer-side weight push failed.

    ``engine`` names the engine at fault (None when the trainer or the router failed),
    ``phase`` the step of the transaction (a ``pdctl.weights.phase.Phase``, typed as the str it
    is: this module imports nothing of pdctl): connect, probe, hold, pause, begin, transfer, end,
    version, verify, continue, release ("phase" means only this in pdctl); ``report`` what the
    push did anyway (a PushReport).
    """

    def __init__(self, message: str, *, engine: str | None = None, phase: str | None = None, report: object = None):
        super().__init__(message)
        self.engine = engine
        self.phase = phase
        self.report = report
