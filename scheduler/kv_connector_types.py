"""Value types of the scheduler-side KV connector (:mod:`scheduler.kv_connector`).

Its configuration and counters, what it reads from a scheduled step, and the records it keeps
per daemon lease (the per-request state, with its invariants, is
:mod:`scheduler.kv_connector_request`). Data only; the records belong to one connector and are
mutated only by it (scheduler thread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvserver.client import Pending
from kvserver.crypto import CurveClient
from kvserver.errors import InvalidArgument
from kvserver.grants import StoreGrant, StoreReservation
from kvserver.namespace import NamespaceSpec
from scheduler.kv_connector_request import RequestState
from step_protocol import RequestTransfers


class NewReqLike(Protocol):
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


class CachedReqLike(Protocol):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class ScheduledStep(Protocol):
    """What ``build_connector_meta`` reads (``step_protocol.StepPlan``; a vLLM
    wrapper adapts SchedulerOutput): ``new_reqs[i].block_ids`` is a request's whole block
    table, ``cached_reqs[i].new_block_ids`` are appended to it, ``num_computed_tokens`` counts
    the tokens computed before this step."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...
    @property
    def new_reqs(self) -> Sequence[NewReqLike]: ...
    @property
    def cached_reqs(self) -> Sequence[CachedReqLike]: ...
    @property
    def preempted_req_ids(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class KVConnectorConfig:
    """Where the daemon is, the namespace of this model, and the bounds on every call."""

    address: str
    spec: NamespaceSpec
    lookup_timeout_s: float = 0.1
    #: how long a waiting request asked again reuses its last lookup's answer (0: never;
    #: scheduler/kv_connector_loads.py says when it is looked up again sooner).
    lookup_reuse_s: float = 0.25
    #: prepare_* / complete_* (these run inside a scheduler step too).
    op_timeout_s: float = 1.0
    down_backoff_s: float = 5.0
    #: store reservation / load pin lifetime (None: the daemon's default).
    lease_s: float | None = None
    auth_token: str = ""
    #: CURVE settings for the daemon's data plane (None: plain TCP; docs/security.md)
    curve: CurveClient | None = None
    client_id: str | None = None
    #: most chunks one step's prepare_store asks for (the daemon's default keys-per-request
    #: limit); a batch the cache cannot hold is halved until it fits.
    max_store_batch_chunks: int = 1 << 16
    #: most events kept for ``take_events``; beyond it the oldest are dropped (and counted in
    #: ``ConnectorStats.dropped_events``): a process that never drains them does not grow.
    max_pending_events: int = 4096
    #: most steps a store completion waits for a prepare_store to carry it: at the end of
    #: the ``build_connector_meta`` of the N-th step after ``update_connector_output`` held
    #: it, it goes alone (1: the next step's). Its chunks become visible to other clients
    #: up to that many steps later; this connector's own lookups and pins send it first.
    completion_hold_steps: int = 8

    def __post_init__(self) -> None:
        for name in ("lookup_timeout_s", "op_timeout_s", "down_backoff_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0", value=getattr(self, name))
        if not self.lookup_reuse_s >= 0:
            raise InvalidArgument("lookup_reuse_s must be >= 0", value=self.lookup_reuse_s)
        if self.max_pending_events < 1:
            raise InvalidArgument("max_pending_events must be >= 1", value=self.max_pending_events)
        if self.completion_hold_steps < 1:
            raise InvalidArgument(
                "completion_hold_steps must be >= 1", value=self.completion_hold_steps
            )
        if self.max_store_batch_chunks < 1:
            raise InvalidArgument(
                "max_store_batch_chunks must be >= 1", value=self.max_store_batch_chunks
            )


@dataclass(slots=True)
class ConnectorStats:
    """Counters. ``lookups``: lookups sent to the daemon; ``lookups_reused``: answers
    given from a request's last lookup instead (``lookup_reuse_s``); ``hit_tokens``: tokens
    of the offered hits the scheduler took (allocated blocks for), each once however often it
    asked; ``lookups_failed``: answered "no hit" as
    the daemon failed or was marked down;
    ``timeouts``: calls that found it unreachable (each marks it down for down_backoff_s);
    ``completion_errors``: completions not applied — refused, unanswered, or skipped while
    the daemon was marked down (their chunks count as not stored; the daemon reclaims the
    lease at its deadline); ``dropped_events``: events discarded, oldest first, because
    nobody called ``take_events`` while ``max_pending_events`` were waiting;
    ``carried_completions``: store completions sent on a prepare_store rather than alone.

    Store accounting (docs/connector.md, "Store accounting"): ``planned_chunks`` counts each
    request's chunks each time they go out in a prepare_store (a request's chunk once, thanks to
    its cursor, unless the batch was not reserved: then again when re-planned). Every planned
    chunk ends up in exactly one of: ``shared_chunks`` (another request planned the same key
    earlier in the same batch: asked for once, stored for that request), ``present_chunks`` (the
    daemon had it already, stored or being written), ``filtered_chunks`` (the daemon did not
    admit it: reuse gating, or its policy declined it), ``unreserved_chunks`` (the batch got no
    reservation: cache full or daemon unreachable — planned again — or refused, or dropped by
    ``reset``), ``granted_chunks`` (reserved: a store job), or the batch still in flight.
    ``stored_chunks`` (made ready by a completion) is at most ``granted_chunks``; the difference
    is stores in flight, chunks a rank failed (rolled back), expired leases and
    ``completion_errors``."""

    lookups: int = 0
    lookups_reused: int = 0
    hit_tokens: int = 0
    lookups_failed: int = 0
    loads: int = 0
    load_errors: int = 0
    planned_chunks: int = 0
    shared_chunks: int = 0
    present_chunks: int = 0
    filtered_chunks: int = 0
    unreserved_chunks: int = 0
    granted_chunks: int = 0
    stored_chunks: int = 0
    store_rejections: int = 0
    timeouts: int = 0
    expired_jobs: int = 0
    completion_errors: int = 0
    dropped_events: int = 0
    carried_completions: int = 0


@dataclass(slots=True, eq=False)
class TransferJob:
    """One request's transfers under one daemon lease: its load (a lease of its own), or its
    share of one step's store batch (the lease is shared by the batch's requests). ``id``
    is ``(is_load, req_id, lease_id)``, how the workers' reports name it."""

    transfers: RequestTransfers
    is_load: bool
    #: its chunks (not changed once made: a store job may share its plan's list).
    keys: Sequence[bytes]
    deadline: float
    id: tuple[bool, str, int]
    #: loads: per key, the first token it fills (a failure invalidates from there on).
    first_tokens: Sequence[int] = ()
    #: loads: the chunk index of keys[0] in the request (a failure moves the cursor back).
    first_chunk: int = 0
    shipped: bool = False
    #: bit ``r`` is set once TP rank ``r`` has reported the job.
    ranks: int = 0
    #: keys some rank failed to copy (replaced, not changed: the default is shared).
    failed: AbstractSet[bytes] = frozenset()


@dataclass(slots=True, eq=False)
class PlannedStore:
    """One request's share of a store batch: its chunks ``[first, end)``, their keys, and the
    GPU blocks they occupy (taken when planned: the table may be dropped before the reply)."""

    state: RequestState
    first: int
    end: int
    keys: Sequence[bytes]
    block_ids: list[int]


@dataclass(slots=True, eq=False)
class HeldCompletion:
    """A ``complete_store`` (``kind`` "store", or "rollback" for chunks some rank failed) held
    until a ``prepare_store`` of the next ``completion_hold_steps`` steps carries it, or sent
    alone at the end of the last of them."""

    kind: Literal["store", "rollback"]
    lease_id: int
    keys: list[bytes]


@dataclass(slots=True, eq=False)
class StoreBatch:
    """The one ``prepare_store`` of a step, in flight: ``keys`` (deduplicated) for ``planned``;
    ``grant`` once its reply was taken (the jobs queued), and then ``ungranted``: the planned
    requests left without a job."""

    pending: Pending[StoreReservation]
    planned: list[PlannedStore]
    keys: list[bytes]
    #: the completions it carries, until their results are applied.
    carried: list[HeldCompletion] = field(default_factory=list)
    grant: StoreGrant | None = None
    ungranted: list[PlannedStore] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Completion:
    """A ``complete_store`` (``kind`` "store", or "rollback" for chunks some rank failed) or a
    ``complete_load`` sent without waiting; its reply is applied on the next step."""

    pending: Pending[Any]
    kind: Literal["store", "rollback", "load"]
    lease_id: int
