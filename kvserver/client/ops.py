"""The client's public operations, defined once for :class:`KVClient` and
:class:`AsyncKVClient`: their signatures, defaults and contracts, as sans-I/O procedures.

Runs in client processes; imports no sockets. Each function takes the client's
:class:`~kvserver.client.common.Session` and the public arguments and returns a
:data:`~kvserver.client.calls.Proc` (the calls to exchange, then the value). A client turns
one into a method with its own driver: ``lookup = blocking(ops.lookup)`` in ``sync.py`` (the
method returns the value), ``lookup = awaiting(ops.lookup)`` in ``aio.py`` (a coroutine), and
``submit_lookup = submitting(ops.lookup)`` in both (sent now, collected later). A function is
called when its method is called, before the driver renews the session; the generator body
runs after. :class:`ClientBase` holds what is the same in both and needs no I/O (identity,
the arena helpers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvserver import wire
from kvserver.allocator import Extents
from kvserver.client.calls import LookupResult, NamespaceInfo, Proc, PutResult
from kvserver.client.common import Session
from kvserver.client.parts import (
    Parts,
    check_copied_in_time,
    check_extents,
    check_live,
    readinto_part,
    write_part,
)
from kvserver.grants import LoadGrant, StoreCompletion, StoreGrant, StoreReservation
from kvserver.namespace import NamespaceSpec


class ClientBase:
    """What both clients share without I/O. Subclasses set ``_s`` and ``_t`` (a transport
    with ``is_local`` and ``sent_by_op``)."""

    _s: Session
    _t: Any

    @property
    def client_id(self) -> str:
        return self._s.client_id

    @property
    def is_colocated(self) -> bool:
        """True once a hello mapped the daemon's arena (shared-memory data path)."""
        return self._s.arena is not None

    @property
    def capabilities(self) -> frozenset[str]:
        """What the daemon's last ``hello`` announced beyond protocol version 1
        (``wire.CAPABILITIES``); empty before the first hello, or from an older daemon."""
        return frozenset(self._s.server.get("capabilities", ()))

    @property
    def max_lease_s(self) -> float | None:
        """The longest lease the daemon grants (its last ``hello``'s ``max_lease_s``, the
        operator's ``--max-lease-s``): a ``lease_s`` past it is refused ``invalid_argument``,
        nothing clamped. None before the first hello, or from a daemon that does not say
        (older than this field: its max was 600 s)."""
        value = self._s.server.get("max_lease_s")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
        return None

    @property
    def is_local(self) -> bool:
        """True while requests go over the daemon's local channel (a Unix socket) rather
        than ZMQ: co-located, the daemon announced one, and it could be connected."""
        return bool(self._t.is_local)

    @property
    def sent_by_op(self) -> Counter[str]:
        """Requests sent on the wire, by op (session renewals and retries included)."""
        counts: Counter[str] = self._t.sent_by_op
        return counts

    def write(self, extents: Extents, data: Any, *, grant: StoreGrant | None = None) -> None:
        """Copy one part into the mapped arena. REQUIRES: a live store grant's extents.
        ``grant`` (the grant they are from): its deadline is checked first, LeaseExpired with
        nothing written once it has passed (the daemon may have handed the pages on)."""
        if grant is not None:
            check_live(grant.lease_id, grant.deadline)
        write_part(self._s.mapped(), extents, data)

    def read(self, extents: Extents, *, grant: LoadGrant | None = None) -> bytes:
        """Copy one part out of the mapped arena. REQUIRES: a live load grant's extents.
        ``grant`` (the grant they are from): its deadline is checked before (nothing read)
        and after the copy (LeaseExpired, the bytes dropped: the daemon may have handed the
        pages to another key once it passed). Extents outside the mapped arena raise
        InvalidArgument (``parts.check_extents``), nothing read."""
        arena = self._s.mapped()
        check_extents(arena, extents)
        if grant is None:
            return arena.read(extents)
        check_live(grant.lease_id, grant.deadline)
        data = arena.read(extents)
        check_copied_in_time(grant.lease_id, grant.deadline)
        return data

    def readinto(
        self,
        extents: Extents,
        out: bytearray | memoryview,
        *,
        grant: LoadGrant | None = None,
    ) -> None:
        """:meth:`read` into ``out``; with ``grant``, LeaseExpired means ``out`` holds
        nothing to use."""
        if grant is not None:
            check_live(grant.lease_id, grant.deadline)
        readinto_part(self._s.mapped(), extents, out)
        if grant is not None:
            check_copied_in_time(grant.lease_id, grant.deadline)


# ---------------------------------------------------------------------- session


def hello(s: Session) -> Proc[dict[str, Any]]:
    """Handshake (also done implicitly): daemon version, host_id, arena, sid, client id."""
    s.needs_hello = True  # now: the driver renews the session before running the proc
    return _server_info(s)


def _server_info(s: Session) -> Proc[dict[str, Any]]:
    yield from ()  # makes no call
    return dict(s.server)


def register_namespace(s: Session, spec: NamespaceSpec) -> Proc[NamespaceInfo]:
    """Register ``spec`` (idempotent); re-registered automatically after a restart."""
    return s.register_namespace(spec)


def namespaces(s: Session) -> Proc[list[NamespaceSpec]]:
    return s.namespaces()


def stats(s: Session) -> Proc[dict[str, Any]]:
    result: dict[str, Any] = yield from s.simple(wire.STATS, {})
    return result


def release(s: Session) -> Proc[int]:
    """Roll back every reservation and release every pin held by this client id."""
    return int((yield from s.simple(wire.RELEASE, {}, "released")))


# ---------------------------------------------------------------------- queries


def lookup(
    s: Session,
    ns_id: str,
    keys: Sequence[bytes],
    *,
    record: bool = False,
    touch: bool = False,
    local: bool = False,
) -> Proc[LookupResult]:
    """Length of the leading run of ready ``keys`` (``record``: count for reuse gating;
    ``local``: in the daemon's own tiers only, not counting what its peers hold)."""
    return s.lookup(ns_id, keys, record, touch, local)


def lookup_tokens(
    s: Session,
    ns_id: str,
    token_ids: Sequence[int],
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> Proc[LookupResult]:
    """Lookup by token ids; the daemon hashes them as a vLLM replica would."""
    return s.lookup_tokens(ns_id, token_ids, cache_salt, lora)


def touch(s: Session, ns_id: str, keys: Sequence[bytes]) -> Proc[None]:
    yield from s.simple(wire.TOUCH, {"ns_id": ns_id, "keys": list(keys)})


def pin(s: Session, ns_id: str, keys: Sequence[bytes], ttl_s: float) -> Proc[int]:
    """Keep ready ``keys`` from eviction for ``ttl_s``; returns how many were pinned."""
    args = {"ns_id": ns_id, "keys": list(keys), "ttl_s": ttl_s}
    return int((yield from s.simple(wire.PIN, args, "count")))


def unpin(s: Session, ns_id: str, keys: Sequence[bytes]) -> Proc[int]:
    args = {"ns_id": ns_id, "keys": list(keys)}
    return int((yield from s.simple(wire.UNPIN, args, "count")))


# ---------------------------------------------------------------------- leases (co-located)


def prepare_store(
    s: Session, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
) -> Proc[StoreGrant | None]:
    """Reserve the new keys; None if the cache cannot make room. Complete before
    ``grant.deadline`` (this process's monotonic clock, counted from the send) or it is
    rolled back."""
    return s.prepare_store(ns_id, keys, lease_s)


def complete_store(
    s: Session,
    lease_id: int,
    *,
    success: bool = True,
    ranks: Sequence[int] | None = None,
    keys: Sequence[bytes] | None = None,
) -> Proc[list[bytes]]:
    """Mark parts written (or roll back); returns the keys that became ready. The daemon
    applies requests in arrival order, so a later call of this client sees them ready."""
    return s.complete_store(lease_id, success, ranks, keys)


def prepare_store_completing(
    s: Session,
    ns_id: str,
    keys: Sequence[bytes],
    completions: Sequence[StoreCompletion],
    *,
    lease_s: float | None = None,
) -> Proc[StoreReservation]:
    """``complete_store`` of each of ``completions`` (in order, each with its own result or
    error), then :func:`prepare_store` of ``keys``: in ONE message when the daemon announced
    the ``store_completions`` capability, else as separate calls (an older daemon). A failed
    completion never fails the reservation; ``Unavailable`` (or a reservation error) fails the
    whole call, and completions already sent may have been applied."""
    return s.prepare_store_completing(ns_id, keys, completions, lease_s)


def prepare_load(
    s: Session, ns_id: str, keys: Sequence[bytes], *, lease_s: float | None = None
) -> Proc[LoadGrant]:
    """Pin ``keys`` (all must be ready); pinned until complete_load or the deadline
    (counted from the send)."""
    return s.prepare_load(ns_id, keys, lease_s)


def complete_load(s: Session, lease_id: int) -> Proc[None]:
    """Release the pins of load lease ``lease_id``."""
    return s.complete_load(lease_id)


# ---------------------------------------------------------------------- payload frames


def put(
    s: Session, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
) -> Proc[PutResult]:
    """Store whole entries in one round trip (``parts[i]``: a buffer, or one per rank). The
    clients' ``put`` methods send a payload of more than :data:`PUT_WINDOW_BYTES` as several
    of these, pipelined (:func:`put_windows`, :func:`merge_puts`)."""
    return s.put(ns_id, keys, parts, lease_s)


#: payload bytes per ``put`` message. A larger ``put`` travels as several puts of at most this
#: many bytes (at least one key each), sent back to back without waiting: the daemon copies one
#: into its arena while the next is still on the wire, instead of copying the whole payload
#: after the last byte arrived. Each is stored, or rejected, on its own.
PUT_WINDOW_BYTES = 16 << 20


def put_windows(keys: Sequence[bytes], parts: Parts) -> list[tuple[Sequence[bytes], Parts]]:
    """``keys`` and ``parts`` cut into consecutive runs of at most :data:`PUT_WINDOW_BYTES`
    of payload (one run when they fit; a key larger than that is a run of its own). Entries
    are not checked here: the daemon checks each window as it checks any put."""
    runs: list[tuple[Sequence[bytes], Parts]] = []
    start = size = 0
    for i, entry in enumerate(parts):
        try:
            nbytes = memoryview(entry).nbytes
        except TypeError:  # one buffer per rank
            nbytes = sum(memoryview(p).nbytes for p in entry)
        if size and size + nbytes > PUT_WINDOW_BYTES:
            runs.append((keys[start:i], parts[start:i]))
            start, size = i, 0
        size += nbytes
    if start < len(parts) or not runs:
        runs.append((keys[start:], parts[start:]))
    return runs


def merge_puts(results: Sequence[PutResult]) -> PutResult:
    """The windows' results as one: their keys in order; ``rejected`` when any window was
    (the other windows' keys may then be stored)."""
    return PutResult(
        [k for r in results for k in r.stored],
        [k for r in results for k in r.present],
        [k for r in results for k in r.filtered],
        rejected=any(r.rejected for r in results),
    )


def get(
    s: Session,
    ns_id: str,
    keys: Sequence[bytes],
    *,
    ranks: Sequence[int] | None = None,
    leading: bool = False,
    spec: NamespaceSpec | None = None,
) -> Proc[list[list[memoryview]]]:
    """Parts of ready ``keys`` (all must be ready): ``result[i][j]`` is rank ``ranks[j]``.
    ``leading``: only the leading run of ``keys`` the daemon holds in its own tiers (it
    does not ask its peers); the result may then be shorter than ``keys``. ``spec``:
    the namespace's, when this client did not register it (a peer daemon's link): a reply
    with more frames than ``len(keys)`` x ranks parts may take, or a part of another size
    than its ``part_bytes``, raises InvalidArgument before it is kept or copied."""
    return s.get(ns_id, keys, ranks, leading, spec)


def write_parts(
    s: Session,
    lease_id: int,
    keys: Sequence[bytes],
    rank: int,
    parts: Sequence[Any],
    *,
    complete: bool = True,
) -> Proc[list[bytes]]:
    """Write one rank's parts into a store lease (TP by rank); returns keys made ready."""
    return s.write_parts(lease_id, keys, rank, parts, complete)


def read_parts(
    s: Session, ns_id: str, lease_id: int, keys: Sequence[bytes], rank: int
) -> Proc[list[memoryview]]:
    """One rank's parts of keys pinned by load lease ``lease_id`` (TP by rank)."""
    return s.read_parts(ns_id, lease_id, keys, rank)


# ---------------------------------------------------------------------- either path


def store(
    s: Session, ns_id: str, keys: Sequence[bytes], parts: Parts, *, lease_s: float | None = None
) -> Proc[list[bytes]]:
    """Store whole entries through shared memory when co-located, else as frames."""
    return s.store(ns_id, keys, parts, lease_s)


def load(
    s: Session, ns_id: str, keys: Sequence[bytes], *, ranks: Sequence[int] | None = None
) -> Proc[list[list[memoryview]]]:
    """Load ready entries through shared memory when co-located, else as frames."""
    return s.load(ns_id, keys, ranks)
