"""Hold one direction of a worker's transfer engine (tests only).

A :class:`Gate` submits a transfer that waits for :meth:`Gate.open`; every later transfer of
the same direction is ordered after it, so stores (or loads) stay in flight, deterministically,
until the test opens the gate. A real synchronisation point, not a sleep.
"""

from __future__ import annotations

import threading
from typing import Any

from worker.kv_connector import KVServerWorkerConnector
from worker.transfer import Direction, Transfer


class Gate:
    """Holds ``direction`` of ``conn``'s engine: a transfer that waits for :meth:`open`."""

    def __init__(self, conn: KVServerWorkerConnector, direction: Direction) -> None:
        self.event = threading.Event()
        self.transfer = Transfer(direction, "gate", [], prepare=self._wait)
        assert conn.engine is not None
        conn.engine.submit(self.transfer)

    def _wait(self) -> list[Any]:
        self.event.wait()
        return []

    def open(self) -> None:
        self.event.set()

    @property
    def is_open(self) -> bool:
        return self.event.is_set()
