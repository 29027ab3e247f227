"""Seeding's explicit states: where a seed relay stands (``RelayState``) and how an engine's last
start from a peer went (``PeerState``), each with its one transition table, and the one ``Machine``
that moves between states and refuses any move its table does not hold.

The relay (pdctl.node.peer_weights.SeedRelay) serves one transfer at a time::

    IDLE      -> ARMED      a receiver's supervisor arms it
    ARMED     -> JOINING    the receiver's init is passed on to the engine
              -> IDLE       the arm ends: disarmed, lapsed, or a send refused
    JOINING   -> JOINED     the engine made the pair group
              -> IDLE       the engine's init failed (no group)
              -> DRAINING   the arm ends while the engine answers the init
    JOINED    -> SENDING    the receiver's send is passed on
              -> LEFT_OPEN  the arm ends with the group unused
    SENDING   -> IDLE       the engine answered the send
              -> DRAINING   the arm ends while the engine sends
    DRAINING  -> LEFT_OPEN  the answer to an init came: its group, if made, is never used
              -> IDLE       the answer to a send came (or its engine restarted meanwhile)
    LEFT_OPEN -> IDLE       its engine restarted

A supervisor's story (pdctl.node.supervise) says how its engine's last start took its weights::

    NONE, DONE, FAILED -> NONE       a start from disk
                       -> RECEIVING  a start from a peer
    RECEIVING          -> DONE       the weights came and their checksums matched
                       -> FAILED     they did not (``detail`` says why)

Light on purpose: ``pdctl status`` (pdctl.cluster.inspect) reads ``PeerState`` from a story.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdctl.choices import Choice

__all__ = ["PEER_MOVES", "RELAY_MOVES", "Machine", "PeerState", "Refusal", "RelayState"]

S = TypeVar("S", bound=Choice)


class RelayState(Choice):
    """Where a seed relay stands in its one transfer (the module's drawing)."""

    IDLE = "idle"
    """Not armed: any receiver's supervisor may arm it."""
    ARMED = "armed"
    """Armed for one receiver, whose init has not come yet; the arm lapses when its supervisor stops
    asking for the outcome."""
    JOINING = "joining"
    """The receiver's init is with the engine (SGLang's blocks until the pair group forms)."""
    JOINED = "joined"
    """The init made the pair group; the receiver's send is awaited."""
    SENDING = "sending"
    """The send is with the engine (it broadcasts the weights, then destroys the group)."""
    DRAINING = "draining"
    """The arm ended while the engine still answers its init or send: nothing is armed until that
    answer comes."""
    LEFT_OPEN = "left_open"
    """An arm ended after its init made a group and before a send used it: SGLang keeps that group,
    and its port, for the engine process's life, so the relay refuses every arm until its engine
    restarts."""


RELAY_MOVES: Mapping[RelayState, frozenset[RelayState]] = {
    RelayState.IDLE: frozenset({RelayState.ARMED}),
    RelayState.ARMED: frozenset({RelayState.JOINING, RelayState.IDLE}),
    RelayState.JOINING: frozenset({RelayState.JOINED, RelayState.IDLE, RelayState.DRAINING}),
    RelayState.JOINED: frozenset({RelayState.SENDING, RelayState.LEFT_OPEN}),
    RelayState.SENDING: frozenset({RelayState.IDLE, RelayState.DRAINING}),
    RelayState.DRAINING: frozenset({RelayState.IDLE, RelayState.LEFT_OPEN}),
    RelayState.LEFT_OPEN: frozenset({RelayState.IDLE}),
}
"""Every move a seed relay may make: state -> the states it may move to next."""


class PeerState(Choice):
    """How an engine's last start took its weights (a supervisor story's ``peer.state``; ``pdctl
    status`` shows it while the engine is out of rotation)."""

    NONE = "none"
    """From disk: no peer held the fleet's weights, every seed was busy, or the last start from a
    peer failed (``detail`` says which)."""
    RECEIVING = "receiving"
    """From a peer: the transfer, or the check of its checksums, is under way."""
    DONE = "done"
    """From a peer: the checksums matched and the engine holds the seed's version."""
    FAILED = "failed"
    """From a peer, and it failed (``detail`` says how): the next start loads from disk, unless only
    the check of the weights could not be made (then it tries a peer again)."""


PEER_MOVES: Mapping[PeerState, frozenset[PeerState]] = {
    PeerState.NONE: frozenset({PeerState.NONE, PeerState.RECEIVING}),
    PeerState.RECEIVING: frozenset({PeerState.DONE, PeerState.FAILED}),
    PeerState.DONE: frozenset({PeerState.NONE, PeerState.RECEIVING}),
    PeerState.FAILED: frozenset({PeerState.NONE, PeerState.RECEIVING}),
}
"""Every move of a story's peer state: state -> the states it may move to next. A start's transfer
ends (done or failed) before the next start begins."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A move a transition table does not hold: ``machine`` names the state machine, ``state`` is
    where it stays and ``to`` where it was asked to go."""

    machine: str
    state: str
    to: str

    def __str__(self) -> str:
        return f"{self.machine}: no move from {self.state} to {self.to}"


class Machine(Generic[S]):
    """One state of a closed set and the table of its moves; ``move`` is the only way to change the
    state, and it refuses any move the table does not hold. Not locked: its owner moves it under
    the lock that guards the data that goes with the state.

        relay = Machine("seed relay", RELAY_MOVES, RelayState.IDLE)
        relay.move(RelayState.ARMED)    # None: moved
        relay.move(RelayState.SENDING)  # a Refusal: it stays ARMED
    """

    def __init__(self, name: str, moves: Mapping[S, frozenset[S]], state: S):
        """Start at ``state``. Raises ``ValueError`` when the table has no row for a member of the
        state's set (a state with no way out is a row with an empty set)."""
        missing = [str(s) for s in type(state) if s not in moves]
        if missing:
            raise ValueError(f"{name}: the transition table has no row for {', '.join(missing)}")
        self.name = name
        self.moves = moves
        self._state = state

    @property
    def state(self) -> S:
        """The state now."""
        return self._state

    def allows(self, to: S) -> bool:
        """Whether the table holds a move from the state now to ``to``."""
        return to in self.moves[self._state]

    def move(self, to: S) -> Refusal | None:
        """Move to ``to`` and return None when the table holds that move; otherwise stay and return
        the ``Refusal``."""
        if not self.allows(to):
            return Refusal(self.name, str(self._state), str(to))
        self._state = to
        return None
