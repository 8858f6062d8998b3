"""The load side of the scheduler connector: lookups and pins (:class:`LoadPlanner`).

Runs in the scheduler process, on the scheduler's thread, inside ``schedule()`` (admission of
a waiting request); not thread-safe; part of
:class:`~scheduler.kv_connector.KVServerSchedulerConnector`.

Call order, per admitted request::

    offer(state, num_computed)           lookup (record, touch) -> (n_ext | None, is_async)
    ... the scheduler allocates GPU blocks ...
    pin(state, block_ids, n_ext)         prepare_load of the offered hit -> one load job

Both calls are synchronous and bounded (``lookup_timeout_s``, ``op_timeout_s``) behind the
link's circuit breaker. The offer ends where vLLM's own prefix cache would: at the last full
block before the last token (one token is always left to compute). A chunk whose blocks are
all full blocks of the prompt is looked up even when that limit cuts it: its leading blocks
are loaded, its trailing ones are not (so a hit costs the same recomputation as a local
prefix-cache hit, whatever the chunk size). A hit is always asynchronous.

"Ask again" (None) is answered only while an earlier transfer of the request is in flight;
while the first missing chunk is being stored by this connector (the hit grows once that
store lands); or while the first chunk past the local hit is being loaded for another
request: once that load has landed, the scheduler's prefix cache holds those blocks and
serves them to this request as well, instead of a second copy of the same chunks into blocks
of its own (many requests sharing a prefix often arrive together). A hit that can no longer
be pinned (evicted meanwhile, daemon unreachable) becomes a load error from its first missing
chunk.

**A request asked again reuses its last answer** for ``lookup_reuse_s`` (vLLM asks
``get_num_new_matched_tokens`` at every step while a waiting request cannot get its blocks:
without this, a daemon round trip per step for the head of the waiting queue, and one per
request answered "ask again"), unless the daemon is marked down, the request's keys changed, or
this connector saw one of the chunks the answer rests on change since (the hit chunks found
gone, the first missing chunk made ready or answered present by a store batch:
``LeaseBook.changed_since``). What it cannot see — another client storing the first missing
chunk, or the daemon evicting a hit chunk — is seen by the next lookup, at most
``lookup_reuse_s`` later; until then a stale hit fails safe at :meth:`pin` (a load error from
the first chunk gone: recomputed) and a stale miss only loads less. Reused answers are not
recorded or touched again on the daemon: a request that waits is one sighting for reuse
gating, not one per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvserver.errors import InvalidArgument, KVServerError, UnknownKey
from kvserver.events import BlockRemoved
from kvserver.grants import LoadGrant
from kvserver.hashing import BlockHasher
from kvserver.prometheus import latency_histogram
from scheduler.kv_connector_leases import LeaseBook
from scheduler.kv_connector_link import DaemonLink
from scheduler.kv_connector_request import RequestState
from scheduler.kv_connector_types import ConnectorStats, TransferJob
from step_protocol import ChunkLoad, RequestTransfers

logger = logging.getLogger(__name__)


class LoadPlanner:
    """Offers external hits to the scheduler and pins them once blocks are allocated."""

    def __init__(
        self,
        link: DaemonLink,
        leases: LeaseBook,
        stats: ConnectorStats,
        hasher: BlockHasher,
        is_storing: Callable[[bytes], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``is_storing(key)``: a store of chunk ``key`` is planned or in flight."""
        self.spec = link.config.spec
        self._reuse_s = link.config.lookup_reuse_s
        self._clock = clock
        self._link = link
        self._leases = leases
        self._stats = stats
        self._hasher = hasher
        self._is_storing = is_storing
        #: seconds per lookup (daemon round trip, timeouts included); /metrics shows it
        self.lookup_seconds = latency_histogram(
            "scheduler_connector_lookup_duration_seconds",
            "Time of the connector's kvserver lookup (get_num_new_matched_tokens).",
        )

    def offer(self, state: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` for ``state.request``: look the chunks past the
        local hit up and remember the hit (``state.offer``) for :meth:`pin`."""
        request = state.request
        state.offered(None)
        if state.is_busy:
            return None, False  # an earlier transfer of this request is in flight
        bs, ct, cb = self.spec.block_size, self.spec.chunk_tokens, self.spec.chunk_blocks
        hashes = state.block_hashes(self._hasher)
        # Blocks before the last token (one token is left to compute), in chunks of which
        # every block is a full block of the prompt (a chunk's key is its last block's hash).
        max_blocks = min(len(hashes), (len(request.all_token_ids) - 1) // bs)
        max_chunks = min(len(hashes) // cb, -(-max_blocks // cb))
        start = num_computed_tokens // ct
        if max_chunks <= start or max_blocks * bs <= num_computed_tokens:
            return 0, False  # nothing past the local hit could be offered: no lookup
        keys = list(hashes[start * cb + cb - 1 : max_chunks * cb : cb])
        if keys[0] in self._leases.loading:
            return None, False  # being loaded for another request: ask again once it landed
        hits = self._reusable(state, keys)
        if hits is None:
            hits = self._lookup(state, keys)
            if hits is None:
                return 0, False
        if hits < len(keys) and self._is_storing(keys[hits]):
            return None, False  # the next chunk is being stored right now: ask again
        end_tokens = min((start + hits) * ct, max_blocks * bs)
        if end_tokens <= num_computed_tokens:
            return 0, False
        num_external = end_tokens - num_computed_tokens
        state.offered((num_computed_tokens, start, keys[:hits], end_tokens))
        return num_external, True

    def _reusable(self, state: RequestState, keys: list[bytes]) -> int | None:
        """The hits of the request's last lookup if they still stand for ``keys`` (see the
        module docstring), else None."""
        last = state.last_lookup
        if last is None:
            return None
        last_keys, hits, at, mark = last
        if (
            self._clock() - at >= self._reuse_s
            or last_keys != keys
            or self._link.is_down
            or self._leases.changed_since(keys[: hits + 1], mark)
        ):
            return None
        self._stats.lookups_reused += 1
        return hits

    def _lookup(self, state: RequestState, keys: list[bytes]) -> int | None:
        """Ask the daemon how many leading chunks of ``keys`` are ready (remembered for
        :meth:`_reusable`); None when it failed (no hit)."""
        self._stats.lookups += 1
        mark = self._leases.change_mark
        try:
            with self.lookup_seconds.time():
                hits = self._link.lookup(keys, planning=True)
        except KVServerError as exc:
            self._stats.lookups_failed += 1
            state.looked_up(None)
            logger.debug("lookup for %s failed, no external hit: %s", state.req_id, exc)
            return None
        if self._reuse_s > 0:
            state.looked_up((keys, hits, self._clock(), mark))
        return hits

    def pin(self, state: RequestState, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: pins the offered hit and pairs its chunks with
        ``block_ids`` (the request's blocks from 0) as one load job.

        Raises InvalidArgument (nothing changed) if ``num_external_tokens`` is neither 0 nor
        what the last :meth:`offer` offered, or the blocks do not cover it. A hit that can no
        longer be pinned is reported by the next report as a finished load with a load error
        (the scheduler recomputes those tokens).
        """
        req_id, offer = state.req_id, state.offer
        bs, cb = self.spec.block_size, self.spec.chunk_blocks
        if num_external_tokens and offer is None:
            raise InvalidArgument("no external tokens were offered", request=req_id)
        if not num_external_tokens or offer is None:
            # A request without a block table is new or preempted: store from chunk 0. One
            # that holds blocks is admitted after its load landed: keep its cursor (past the
            # loaded chunks), or the stored chunks would be planned again.
            is_new_table = not state.block_ids
            state.take_offer(block_ids)
            if is_new_table:
                state.restart(0)
            return
        num_local, start, keys, end_tokens = offer
        end_block = end_tokens // bs
        if num_local + num_external_tokens != end_tokens or len(block_ids) < end_block:
            raise InvalidArgument(
                "num_external_tokens or block_ids do not match the offered hit",
                got=num_external_tokens, offered=end_tokens - num_local, blocks=len(block_ids),
            )  # fmt: skip
        state.take_offer(block_ids)
        # counted when taken: vLLM asks again every step a request waits for blocks
        self._stats.hit_tokens += num_external_tokens
        loads: list[ChunkLoad] = []
        first_tokens: list[int] = []
        for i, key in enumerate(keys, start):
            skip = max(0, num_local // bs - i * cb)  # leading sub-blocks already on the GPU
            last = min((i + 1) * cb, end_block)  # the offer may end inside the last chunk
            loads.append(ChunkLoad(key, state.block_ids[i * cb + skip : last], skip))
            first_tokens.append(max(num_local, (i * cb + skip) * bs))
        self._stats.loads += 1
        grant: LoadGrant | None = None
        try:
            grant = self._link.prepare_load(keys)
        except UnknownKey:  # evicted since the lookup: pin what is left of the prefix
            grant = self._pin_prefix(keys)
        except KVServerError as exc:
            logger.info("cannot pin the hit of %s, recomputing it: %s", req_id, exc)
        num_ok = len(grant.keys) if grant is not None else 0
        if num_ok < len(keys):
            failed = [c.block_ids for c in loads[num_ok:]]
            self._leases.pin_failed(req_id, first_tokens[num_ok], failed, finished=not num_ok)
        if grant is None or not num_ok:
            return
        # kvserver has the loaded chunks, the GPU prefix cache the ones before: store after.
        state.load_pinned(start + num_ok)
        for load, location in zip(loads, grant.locations, strict=False):
            load.extents = [list(extents) for extents in location]
        transfers = RequestTransfers(
            req_id, grant.lease_id, loads=loads[:num_ok], granted_by=grant.granted_by
        )
        job = TransferJob(
            transfers, True, keys[:num_ok], grant.deadline, (True, req_id, grant.lease_id),
            first_tokens[:num_ok], start,
        )  # fmt: skip
        self._leases.add_load(job)

    def _pin_prefix(self, keys: list[bytes]) -> LoadGrant | None:
        """Pin the leading run of ``keys`` still ready; announce the first one that is gone."""
        try:
            hits = self._link.lookup(keys, planning=False)
            self._leases.emit(BlockRemoved, keys[hits : hits + 1])
            if hits:
                return self._link.prepare_load(keys[:hits])
        except KVServerError as exc:
            logger.info("cannot pin what is left of a hit: %s", exc)
        return None
