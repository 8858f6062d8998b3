"""Pipelined calls of the blocking client: :class:`Pending`, a request sent without waiting.

Runs in client processes, on the thread that owns the :class:`~kvserver.client.KVClient`; not
thread-safe (a Pending belongs to its client). Call order::

    p = kv.submit_prepare_store(ns_id, keys)   # sent now; the caller goes on working
    ...                                        # other calls, blocking or submitted
    grant = p.result(timeout=1.0)              # the reply (usually already read), or an error

One DEALER socket carries any number of outstanding requests. The daemon answers them in
arrival order and every reply echoes its request id, so the client keeps the reply of each
outstanding request in that request's :class:`Slot` — whichever call happens to read it from
the socket (a blocking call, ``result()`` of another Pending, ``done()``) — and replies may be
collected in any order. A reply nobody waits for any more (a cancelled Pending, a socket
replaced after a timeout) is discarded as stale.

Failure contract: a timeout (of a blocking call or of ``result()``) replaces the socket, so
every request outstanding on it fails with :class:`~kvserver.errors.Unavailable`: its reply can
no longer arrive, and what the daemon did with it is unknown (a lease it granted is reclaimed
at its deadline). A daemon restarted on the same address answers requests queued before the
restart with its new session id: the client then renews the session on its next call.
"""

from __future__ import annotations

from typing import Generic, Protocol

from kvserver.client.calls import Proc, T
from kvserver.client.transport import Slot
from kvserver.errors import InvalidState, KVServerError


class PendingOwner(Protocol):
    """What a :class:`Pending` needs of the client that made it (the blocking client)."""

    timeout: float

    def _read_arrived(self) -> None: ...
    def _finish(self, proc: Proc[T], slot: Slot, timeout: float) -> T: ...
    def _forget(self, req_id: int) -> None: ...


class Pending(Generic[T]):
    """A request sent without waiting for its reply; made by ``KVClient.submit_*``.

    ``done()`` tells (without blocking) whether the reply is in; ``result(timeout)`` returns
    the value or raises the daemon's typed error, or :class:`~kvserver.errors.Unavailable`
    after ``timeout`` seconds (the client's socket is then replaced: see the module docstring).
    The outcome is kept: later ``result()`` calls return or raise it again. ``cancel()``
    forgets the request (its reply is discarded; the daemon still carries it out).

    A namespace the daemon does not know any more (restarted) is registered again and the
    request retried once, as the blocking calls do.
    """

    __slots__ = ("_client", "_error", "_proc", "_req_id", "_slot", "_state", "_value")

    def __init__(self, client: PendingOwner, proc: Proc[T], slot: Slot, req_id: int) -> None:
        self._client = client
        self._proc = proc
        self._slot = slot
        self._req_id = req_id
        self._state = "sent"  # sent -> returned | raised | cancelled
        self._value: T | None = None
        self._error: KVServerError | None = None

    def __repr__(self) -> str:
        return f"<Pending {self.op} #{self._req_id} {self._state}>"

    @property
    def op(self) -> str:
        return self._slot.call.op

    @property
    def sent_at(self) -> float:
        """When the request was sent (``time.monotonic()``)."""
        return self._slot.sent_at

    def done(self) -> bool:
        """True once the outcome is known (reads the replies already arrived; never blocks)."""
        if self._state == "sent" and self._slot.outcome is None:
            self._client._read_arrived()
        return self._state != "sent" or self._slot.outcome is not None

    def result(self, timeout: float | None = None) -> T:
        """The reply's value; waits at most ``timeout`` seconds (default: the client's).

        Raises the daemon's typed error, :class:`~kvserver.errors.Unavailable` when no reply
        came in time (or the socket was replaced meanwhile), InvalidState after ``cancel()``.
        """
        if self._state == "sent":
            wait = self._client.timeout if timeout is None else timeout
            try:
                self._value = self._client._finish(self._proc, self._slot, wait)
                self._state = "returned"
            except KVServerError as exc:
                self._error, self._state = exc, "raised"
        if self._state == "cancelled":
            raise InvalidState("the request was cancelled", op=self.op)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def cancel(self) -> None:
        """Forget the request: its reply, when it comes, is discarded. No effect once the
        outcome was collected by ``result()``."""
        if self._state == "sent":
            self._state = "cancelled"
            self._client._forget(self._req_id)
            self._proc.close()
