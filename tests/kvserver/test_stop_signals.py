"""The stop signals' handler (``kvserver/stop_signals.py``): the first stops, a repeat within
the window is the same request, a later one exits once armed (on a clock the test moves, the
process exit replaced); and a real daemon given two SIGTERMs milliseconds apart."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from kvserver.stop_signals import REPEAT_WINDOW_S, Leaving, StopSignals
from tests.kvserver.builders import FakeClock
from tests.support.daemon import start_daemon
from tests.support.stop_signals import assert_stopped_in_order, send_burst


class Exited(Exception):
    """``os._exit`` was called (with ``args[0]``)."""


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> None:
    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)


def armed(tmp_path: Path, clock: FakeClock) -> tuple[asyncio.Event, StopSignals, Path]:
    stop = asyncio.Event()
    signals = StopSignals(stop, clock=clock)
    left = tmp_path / "ready.json"
    left.write_text("{}")
    signals.arm(Leaving(files=[str(left)]), "(test)")
    return stop, signals, left


def test_a_repeat_within_the_window_is_the_same_request(tmp_path: Path, exits: None) -> None:
    clock = FakeClock()
    stop, signals, left = armed(tmp_path, clock)
    signals(signal.SIGTERM)
    assert stop.is_set()
    for after in (0.0, 0.003, REPEAT_WINDOW_S):
        clock.now = 100.0 + after
        signals(signal.SIGTERM)  # no exit
    assert left.exists()


def test_a_signal_past_the_window_cleans_up_and_exits(tmp_path: Path, exits: None) -> None:
    clock = FakeClock()
    _stop, signals, left = armed(tmp_path, clock)
    signals(signal.SIGINT)
    clock.advance(REPEAT_WINDOW_S + 0.001)
    with pytest.raises(Exited) as exited:
        signals(signal.SIGINT)
    assert exited.value.args == (128 + signal.SIGINT,)
    assert not left.exists()


def test_before_it_is_armed_a_later_signal_changes_nothing(exits: None) -> None:
    """The daemon arms when its shutdown begins: until then a later signal only stops."""
    clock = FakeClock()
    stop = asyncio.Event()
    signals = StopSignals(stop, clock=clock)
    signals(signal.SIGTERM)
    clock.advance(10 * REPEAT_WINDOW_S)
    signals(signal.SIGTERM)
    assert stop.is_set()


@pytest.mark.multiprocess
def test_a_daemon_given_two_sigterms_milliseconds_apart_stops_in_order(tmp_path: Path) -> None:
    """``timeout`` forwarding its SIGTERM while a supervisor's ``pkill`` sends its own: the
    ordered shutdown, exit 0, the arena removed. Was: the second could exit at once (143),
    once the shutdown had begun."""
    d = start_daemon(tmp_path, "--dram", "4MiB")
    arena = Path(d.arena_path)
    try:
        assert arena.exists()
        send_burst(d.proc, signal.SIGTERM)
        assert d.proc.wait(60) == 0, d.log()
        assert_stopped_in_order(d.log(), "stopped; shared-memory arena removed")
        assert not arena.exists()
    finally:
        d.kill()
