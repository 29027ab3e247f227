"""A stop signal whose KeyboardInterrupt something dropped still stops the command that took it
(pdctl.signals.interrupt_where_it_lands): CPython only prints an exception raised in a weakref
callback, and asyncio's set of tasks runs one whenever a task ends."""

from __future__ import annotations

import asyncio
import signal
import threading
import weakref

import pytest

from pdctl.cli import observe_cmds
from pdctl.cluster.watch import Frame
from pdctl.signals import interrupt_on_every_stop_signal, interrupt_where_it_lands

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the drop itself)


class _Referent:
    pass


def _signal_dropped(sig: signal.Signals) -> None:
    """``sig`` raised inside a weakref callback, where CPython drops the handler's exception."""
    referent = _Referent()
    _ref = weakref.ref(referent, lambda _r: signal.raise_signal(sig))
    del referent


@pytest.fixture
def stop_signals_as_pdctl_takes_them():
    """SIGTERM and SIGHUP raise as SIGINT does (what pdctl's main sets); restored after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a suite started in the background ignores it)
    interrupt_on_every_stop_signal()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_dropped_stop_signal_sets_the_events_and_ends_the_block_in_keyboard_interrupt(
    stop_signals_as_pdctl_takes_them, sig
) -> None:
    told = threading.Event()
    laps = 0
    with pytest.raises(KeyboardInterrupt), interrupt_where_it_lands(told) as interrupted:
        while not told.is_set() and laps < 5:
            laps += 1
            _signal_dropped(sig)  # (the loop goes on: nothing was raised here)
    assert laps == 1 and interrupted.is_set()
    assert signal.getsignal(sig) is signal.default_int_handler  # (restored)


def test_an_interrupt_turned_into_another_error_ends_the_block_in_keyboard_interrupt(
    stop_signals_as_pdctl_takes_them,
) -> None:
    with pytest.raises(KeyboardInterrupt) as raised, interrupt_where_it_lands():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt as exc:  # (as aiohttp's parser does with one raised in its callbacks)
            raise ValueError("payload error") from exc
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(ValueError), interrupt_where_it_lands():  # (no signal: the error is the error)
        raise ValueError("no signal")


def test_top_quits_at_the_next_frame_on_a_dropped_ctrl_c(stop_signals_as_pdctl_takes_them) -> None:
    frames = 0

    async def next_frame() -> Frame:
        nonlocal frames
        frames += 1
        if frames == 1:
            _signal_dropped(signal.SIGINT)
        return Frame("c", "up", 0.2, [], None, None, None, None)

    stopped = threading.Event()
    with pytest.raises(KeyboardInterrupt), interrupt_where_it_lands(stopped):
        asyncio.run(asyncio.wait_for(observe_cmds._live(next_frame, 0.01, stopped), 60))
    assert frames == 1  # (it would draw frames until the 60 s ran out without the event)
