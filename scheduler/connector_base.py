"""The scheduler half of a KV connector: the planning seam between the scheduler and kvserver.

Runs inside the scheduler process, synchronously inside ``schedule()`` and
``update_from_output()``; it holds no tensors and never blocks a step on the network for longer
than its bounded timeouts. Mirrors vLLM V1's ``KVConnectorBase_V1`` scheduler role
so the same implementation can be wrapped for vLLM.

Call order per engine step (the connector's five touchpoints, as in vLLM V1)::

    for each WAITING request, after the local GPU prefix-cache lookup:
        get_num_new_matched_tokens(req, num_local_computed)   -> (n_ext | None, is_async)
        ... scheduler allocates GPU blocks ...
        update_state_after_alloc(req, block_ids, n_ext)
    build_connector_meta(scheduled)                           -> metadata shipped to workers
    dispatched()                 the plan went to the workers (optional: kvserver's scheduler)
    ... workers run the step ...
    update_connector_output(outputs of every TP rank)
    request_finished(req, block_ids)                          -> (delay_free, params)  once
    take_events()

Between steps the scheduler reads ``has_pending_transfers`` (keep stepping, empty steps
included, while it is true) and calls ``reset()`` when the workers lost their KV.

The request objects only need the :class:`RequestLike` protocol, which vLLM's ``Request`` also
satisfies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class RequestLike(Protocol):
    """The part of a request the connector reads (vLLM's Request has all of these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...


@dataclass(slots=True)
class TransferReport:
    """What :meth:`SchedulerConnector.update_connector_output` tells the scheduler.

    - ``finished_recving``: requests whose asynchronous load is over (successfully or not);
      they leave WAITING_FOR_REMOTE_KVS and may be scheduled. Also listed when the request was
      aborted meanwhile (its blocks are no longer written).
    - ``finished_sending``: requests that ``request_finished`` kept (it returned True) whose
      transfers are all over: free their GPU blocks now.
    - ``load_errors``: request id -> number of leading tokens whose KV is valid after a failed
      load; the scheduler sets ``num_computed_tokens`` to at most that and recomputes the rest.
    - ``invalid_block_ids``: the GPU blocks a failed load did not fill (vLLM's
      ``get_block_ids_with_load_errors``); never prefix-cache them.
    """

    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    load_errors: dict[str, int] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)


class SchedulerConnector(ABC):
    """Scheduler-side connector contract; see the module docstring for the call order."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvserver can provide.

        ``(None, False)``: undecided ("ask again next step"), e.g. a lookup or an earlier
        transfer of this request is pending. ``(n, True)``: n tokens will be loaded
        asynchronously (the request waits in WAITING_FOR_REMOTE_KVS). ``(0, False)``: no hit.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """GPU blocks were allocated; pin the hit chunks and pair them with ``block_ids``."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Loads planned this step plus stores deferred from the previous one."""

    @abstractmethod
    def update_connector_output(self, outputs: Sequence[Any]) -> TransferReport:
        """Completion reports from every TP rank; completes loads/stores reported by all.

        Returns what finished since the previous call (including failures the connector found
        itself, e.g. a load it could not pin): see :class:`TransferReport`.
        """

    @abstractmethod
    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends; True = keep its GPU blocks until stores finish."""

    @abstractmethod
    def take_events(self) -> list[Any]:
        """Storage events (BlockStored/BlockRemoved) observed since the last call."""

    @property
    @abstractmethod
    def has_pending_transfers(self) -> bool:
        """True while a load or store is planned or in flight: the scheduler keeps stepping
        (empty steps included) so that workers can report them and finished requests release
        their blocks (``finished_sending``)."""

    def dispatched(self) -> None:  # noqa: B027 - a hook with a do-nothing default
        """The step's plan went to the workers and the scheduler now waits for them: a
        connector may do here the work of ``build_connector_meta`` that the workers do not
        need (a connector's daemon call). A scheduler that calls it calls it after every
        ``build_connector_meta``; one that never calls it (vLLM) loses nothing."""

    def reset(self, *, release: bool = True) -> None:  # noqa: B027 - a do-nothing default
        """The workers lost their KV (a worker died; the scheduler failed every request that
        held blocks): forget every request and every planned or in-flight transfer, and give
        back what they hold outside the scheduler (kvserver leases, pins). Afterwards
        ``has_pending_transfers`` is False and no report mentions the forgotten requests.
        ``release=False``: give them back only at :meth:`release_forgotten`, once the workers
        cannot be copying for them any more (they answered a hello).

        The default does nothing, which is right only for a connector that keeps no
        per-request state; every connector that plans transfers overrides it.
        """

    def release_forgotten(self) -> None:  # noqa: B027 - a hook with a do-nothing default
        """The workers answered a hello since ``reset(release=False)``: give back what the
        forgotten transfers held. Nothing if no such reset came since the last call."""
