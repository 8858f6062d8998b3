"""The scheduler's side of KV connector transfers: loads it waits for, frees it delays.

Runs in the scheduler process, owned by :class:`~scheduler.scheduler.Scheduler` (not
thread-safe). The connector plans and tracks the transfers themselves; this class keeps what
the *scheduler* must remember about them, driven by the connector's
:class:`~scheduler.connector_base.TransferReport` each step:

- a request admitted with an asynchronous load (WAITING_FOR_REMOTE_KVS) holds its blocks; once
  the report lists it in ``finished_recving`` it *lands*: the valid prefix (all of it, or what
  ``load_errors`` says) becomes computed, its blocks are published in the prefix cache, and
  the last prompt token is always left to compute (the step needs logits);
- a failed load of a *running* request (a synchronous load) rewinds it: its blocks from the
  first invalid one leave the prefix cache and the tokens after the valid prefix are
  recomputed; that step's sample is void;
- a finished request for which ``request_finished`` returned True keeps its blocks until the
  report lists it in ``finished_sending``;
- a request aborted while its load is in flight keeps its blocks (the load still writes them)
  until the report says the load is over.

Invariant: every request named here holds blocks in the KV cache manager, and only those.
Deterministic: report sets are walked in sorted order, so a run does not depend on string
hashing (a trace replays identically).
"""

from __future__ import annotations

import logging

from scheduler.connector_base import TransferReport
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class TransferTracker:
    """See the module docstring."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        #: finished requests whose blocks the connector still reads
        self.delayed_free: dict[str, Request] = {}
        #: aborted while their load was in flight
        self.aborted_loading: dict[str, Request] = {}
        #: loading requests whose load is over (they land at the next admission)
        self.landed: set[str] = set()
        #: loading requests → local prefix-hit tokens of that admission
        self._local: dict[str, int] = {}
        #: loading requests with a failed load → leading tokens whose KV is valid
        self._valid: dict[str, int] = {}

    @property
    def has_pending(self) -> bool:
        """Blocks held for the connector that only a later report releases."""
        return bool(self.delayed_free or self.aborted_loading)

    def start_load(self, request: Request, num_local: int) -> None:
        """``request`` was admitted with an asynchronous load after ``num_local`` hit tokens."""
        request.status = _LOADING
        self._local[request.request_id] = num_local

    def land(self, request: Request) -> None:
        """A landed load: the request becomes WAITING with its valid prefix computed.
        REQUIRES: ``request.request_id in landed``."""
        req_id = request.request_id
        self.landed.discard(req_id)
        local = self._local.pop(req_id, 0)
        num_computed = request.num_computed_tokens
        valid = self._valid.pop(req_id, None)
        if valid is not None:
            num_computed = min(num_computed, valid)
        num_computed = max(min(num_computed, request.num_tokens - 1), local)
        if request.num_preemptions == 0:  # first admission: where the prompt came from
            request.num_external_computed_tokens = num_computed - local
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        self.kv.cache_blocks(request, num_computed)
        request.status = RequestStatus.WAITING

    def apply(self, report: TransferReport, requests: dict[str, Request]) -> set[str]:
        """Take one step's report; returns the running requests a failed load rewound."""
        kv = self.kv
        if report.invalid_block_ids:
            blocks = kv.pool.blocks
            kv.pool.uncache(blocks[i] for i in report.invalid_block_ids if 0 < i < len(blocks))
        rewound: set[str] = set()
        for req_id, valid in report.load_errors.items():
            request = requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING and valid < request.num_computed_tokens:
                logger.warning("load of %s failed: recomputing from token %d", req_id, valid)
                request.num_computed_tokens = valid
                kv.uncache_from(request, valid // kv.block_size)
                if request.num_preemptions == 0 and request.num_cached_tokens > valid:
                    request.num_external_computed_tokens -= request.num_cached_tokens - valid
                    request.num_cached_tokens = valid
                rewound.add(req_id)
            elif request.status == _LOADING:
                self._valid[req_id] = valid
        for req_id in sorted(report.finished_recving):  # sorted: deterministic free order
            aborted = self.aborted_loading.pop(req_id, None)
            if aborted is not None:
                kv.free(aborted)
                continue
            request = requests.get(req_id)
            if request is not None and request.status == _LOADING:
                self.landed.add(req_id)
        for req_id in sorted(report.finished_sending):
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                kv.free(request)
        return rewound

    def finished(self, request: Request, was_loading: bool, delay_free: bool) -> None:
        """``request`` ended (after ``request_finished`` answered ``delay_free``): free its
        blocks now, when its in-flight load is over, or when its stores are done."""
        req_id = request.request_id
        self._local.pop(req_id, None)
        self._valid.pop(req_id, None)
        landed = req_id in self.landed
        self.landed.discard(req_id)
        if was_loading and not landed:
            self.aborted_loading[req_id] = request
        elif delay_free:
            self.delayed_free[req_id] = request
        else:
            self.kv.free(request)

    def release_all(self) -> None:
        """The workers lost their KV: free every block held for the connector."""
        for request in [*self.delayed_free.values(), *self.aborted_loading.values()]:
            self.kv.free(request)
        self.delayed_free.clear()
        self.aborted_loading.clear()
        self.landed.clear()
        self._local.clear()
        self._valid.clear()
