"""The scheduler connector's kvserver client behind a circuit breaker (:class:`DaemonLink`).

Runs in the scheduler process, on the scheduler's thread (the client is not thread-safe); used
by every part of :class:`~scheduler.kv_connector.KVServerSchedulerConnector`.

One named method per daemon call the connector makes (blocking: :meth:`lookup`,
:meth:`prepare_load`, :meth:`release`; sent without waiting, the reply read later with
:meth:`result`: ``send_*``, of which ``send_prepare_store`` may carry store completions); no
caller hands the client a closure. Every call is bounded: lookups by ``lookup_timeout_s``,
everything else by ``op_timeout_s``. An ``Unavailable`` (no
reply in time, or the socket was replaced by a timeout meanwhile) marks the daemon down for
``down_backoff_s``; while it is down every call is refused at once with ``Unavailable``
("daemon marked down") without touching the network, so a dead daemon costs one timeout per
backoff period, not one per request per step. The namespace is registered on the first call
(and again by the client after a daemon restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from kvserver import wire
from kvserver.client import KVClient, Pending
from kvserver.errors import KVServerError, Unavailable
from kvserver.grants import LoadGrant, StoreCompletion, StoreReservation
from scheduler.kv_connector_types import ConnectorStats, HeldCompletion, KVConnectorConfig

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
            auth_token=config.auth_token, colocated=False, curve=config.curve,
        )  # fmt: skip
        self.ns_id = config.spec.ns_id  # a property that hashes the spec: computed once
        self._clock = clock
        self._registered = False
        self._down_until = 0.0

    @property
    def is_down(self) -> bool:
        """True while the daemon is marked down (every call is refused at once)."""
        return self._clock() < self._down_until

    # ------------------------------------------------------------------ the daemon calls

    def lookup(self, keys: list[bytes], *, planning: bool) -> int:
        """How many leading chunks of ``keys`` are ready. ``planning``: the admission lookup
        of ``get_num_new_matched_tokens`` (recorded for reuse gating, touched; under
        ``lookup_timeout_s``); else a plain lookup under ``op_timeout_s``."""
        timeout = self.config.lookup_timeout_s if planning else self.config.op_timeout_s
        with self._guard(timeout) as kv:
            return kv.lookup(self.ns_id, keys, record=planning, touch=planning).hit_chunks

    def prepare_load(self, keys: list[bytes]) -> LoadGrant:
        """Pin ``keys`` for a load (blocking, ``op_timeout_s``)."""
        with self._guard(self.config.op_timeout_s) as kv:
            return kv.prepare_load(self.ns_id, keys, lease_s=self.config.lease_s)

    def register(self) -> None:
        """Register the namespace now (blocking, ``op_timeout_s``): the start-up check; without
        it the first call registers."""
        with self._guard(self.config.op_timeout_s):
            pass

    def release(self) -> None:
        """Roll back this client's reservations and release its pins (blocking)."""
        with self._guard(self.config.op_timeout_s) as kv:
            kv.release()

    @property
    def carries_completions(self) -> bool:
        """The daemon announced ``store_completions``: a prepare_store may carry the
        completions of earlier store leases (:meth:`send_prepare_store`)."""
        return wire.CAP_STORE_COMPLETIONS in self.kv.capabilities

    def send_prepare_store(
        self, keys: list[bytes], completions: list[HeldCompletion]
    ) -> Pending[StoreReservation] | None:
        """Apply ``completions`` (each: make its keys ready, or roll them back), then reserve
        ``keys`` for a store, in one message without waiting (separate calls against a daemon
        without ``store_completions``); None if not sent (:meth:`_not_sent`)."""
        carried = [
            StoreCompletion(c.lease_id, success=c.kind == "store", keys=c.keys) for c in completions
        ]
        try:
            with self._guard(self.config.op_timeout_s) as kv:
                return kv.submit_prepare_store_completing(
                    self.ns_id, keys, carried, lease_s=self.config.lease_s
                )
        except KVServerError as exc:
            return self._not_sent(exc)

    def send_complete_store(
        self, lease_id: int, keys: list[bytes], *, success: bool
    ) -> Pending[list[bytes]] | None:
        """Make ``keys`` of store lease ``lease_id`` ready (``success``) or roll them back,
        without waiting; None if not sent (:meth:`_not_sent`)."""
        try:
            with self._guard(self.config.op_timeout_s) as kv:
                return kv.submit_complete_store(lease_id, success=success, keys=keys)
        except KVServerError as exc:
            return self._not_sent(exc)

    def send_complete_load(self, lease_id: int) -> Pending[None] | None:
        """Unpin load lease ``lease_id`` without waiting; None if not sent (:meth:`_not_sent`)."""
        try:
            with self._guard(self.config.op_timeout_s) as kv:
                return kv.submit_complete_load(lease_id)
        except KVServerError as exc:
            return self._not_sent(exc)

    # ------------------------------------------------------------------ the breaker

    @contextmanager
    def _guard(self, timeout: float) -> Iterator[KVClient]:
        """The client for one call under ``timeout``, refused at once while the daemon is
        marked down. The call's KVServerError propagates; Unavailable marks the daemon down."""
        if self.is_down:
            raise Unavailable("daemon marked down", address=self.config.address)
        self.kv.timeout = timeout
        try:
            if not self._registered:
                self.kv.register_namespace(self.config.spec)
                self._registered = True
            yield self.kv
        except Unavailable as exc:
            self._mark_down(exc)
            raise

    @staticmethod
    def _not_sent(exc: KVServerError) -> None:
        """A call sent without waiting could not be sent: the daemon is marked down, or was
        unreachable now (which marked it down). Logged; the caller skips it."""
        logger.debug("not sent: %s", exc)

    def result(self, pending: Pending[T]) -> T:
        """The reply of a call sent earlier, waited for at most ``op_timeout_s``. Unavailable
        (no reply in time, or the socket was replaced by a timeout meanwhile) marks the daemon
        down unless it already is."""
        try:
            return pending.result(self.config.op_timeout_s)
        except Unavailable as exc:
            if not self.is_down:
                self._mark_down(exc)
            raise

    def _mark_down(self, why: Unavailable) -> None:
        self.stats.timeouts += 1
        self._down_until = self._clock() + self.config.down_backoff_s
        logger.warning(
            "kvserver at %s unreachable (%s); skipped for %.1fs",
            self.config.address, why.message, self.config.down_backoff_s,
        )  # fmt: skip
