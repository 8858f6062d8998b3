"""The scheduler connector's kvserver client behind a circuit breaker (:class:`DaemonLink`).

Runs in the scheduler process, on the scheduler's thread (the client is not thread-safe); used
by every part of :class:`~scheduler.kv_connector.KVServerSchedulerConnector`.

Every call is bounded: lookups by ``lookup_timeout_s``, everything else by ``op_timeout_s``.
An ``Unavailable`` (no reply in time, or the socket was replaced by a timeout meanwhile) marks
the daemon down for ``down_backoff_s``; while it is down every call is refused at once with
``Unavailable`` ("daemon marked down") without touching the network, so a dead daemon costs
one timeout per backoff period, not one per request per step. The namespace is registered on
the first call (and again by the client after a daemon restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kvserver.client import KVClient, Pending
from kvserver.errors import KVServerError, Unavailable
from scheduler.kv_connector_types import ConnectorStats, KVConnectorConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DaemonLink:
    """One kvserver client with the connector's timeouts and circuit breaker."""

    def __init__(
        self,
        config: KVConnectorConfig,
        stats: ConnectorStats,
        clock: Callable[[], float],
        client: KVClient | None = None,
    ) -> None:
        """``client``: the kvserver client to use; by default one for ``config.address`` that
        never maps the arena (the scheduler moves no bytes)."""
        self.config = config
        self.stats = stats
        self.kv = client or KVClient(
            config.address, timeout=config.op_timeout_s, client_id=config.client_id,
            auth_token=config.auth_token, colocated=False,
        )  # fmt: skip
        self._clock = clock
        self._registered = False
        self._down_until = 0.0

    @property
    def is_down(self) -> bool:
        """True while the daemon is marked down (every call is refused at once)."""
        return self._clock() < self._down_until

    def call(self, timeout: float, fn: Callable[[KVClient], T]) -> T:
        """One client call under ``timeout``, skipped at once while the daemon is marked down.
        Raises the call's KVServerError; Unavailable marks the daemon down."""
        if self.is_down:
            raise Unavailable("daemon marked down", address=self.config.address)
        self.kv.timeout = timeout
        try:
            if not self._registered:
                self.kv.register_namespace(self.config.spec)
                self._registered = True
            return fn(self.kv)
        except Unavailable:
            self._mark_down()
            raise

    def op(self, fn: Callable[[KVClient], T]) -> T:
        """:meth:`call` under ``op_timeout_s`` (prepare_*, complete_*, release)."""
        return self.call(self.config.op_timeout_s, fn)

    def submit(self, fn: Callable[[KVClient], Pending[T]]) -> Pending[T] | None:
        """Send one call without waiting; None (logged) when it could not be sent: the daemon
        is marked down, or unreachable now (which marks it down)."""
        try:
            return self.op(fn)
        except KVServerError as exc:
            logger.debug("not sent: %s", exc)
            return None

    def result(self, pending: Pending[T]) -> T:
        """The reply of a call sent earlier, waited for at most ``op_timeout_s``. Unavailable
        (no reply in time, or the socket was replaced by a timeout meanwhile) marks the daemon
        down unless it already is."""
        try:
            return pending.result(self.config.op_timeout_s)
        except Unavailable:
            if not self.is_down:
                self._mark_down()
            raise

    def _mark_down(self) -> None:
        self.stats.timeouts += 1
        self._down_until = self._clock() + self.config.down_backoff_s
        logger.warning(
            "kvserver at %s unreachable; skipped for %.1fs",
            self.config.address, self.config.down_backoff_s,
        )  # fmt: skip
