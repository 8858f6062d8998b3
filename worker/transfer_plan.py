"""Planning one lease's transfer: which bytes of the KV caches go where, for one rank.

Runs in the worker process. :class:`TransferPlanner` turns a lease's chunk loads or stores
(step_protocol/connector.py) into a :class:`~worker.transfer.Transfer` for the transfer
engine: on the co-located path its copies go straight between the KV blocks and this rank's
extents of the mapped arena; on the remote path they go through a staging buffer that the
transfer reads with ``read_parts`` before its copies (``prepare``) or sends with
``write_parts(complete=False)`` after them (``finish``); those closures run on the engine's
threads. Planning runs on the worker's thread (worker/kv_connector.py calls it); a chunk that
cannot be planned fails that key only. Part layout: block ``j`` of a part at ``j *
block_bytes``; a load's ``block_ids[j]`` receives sub-block ``skip_blocks + j``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from kvserver.client import KVClient
from kvserver.errors import InvalidArgument
from kvserver.namespace import NamespaceSpec
from step_protocol import RankExtents, RequestTransfers
from worker.block_runs import host_array
from worker.host import MappedArena, staging_buffer, tensor_memoryview
from worker.layout import CanonicalKVCaches, plan_copies
from worker.transfer import Direction, KeyCopies, Transfer

logger = logging.getLogger(__name__)


def unreachable(t: RequestTransfers, is_load: bool, why: str = "kvserver unreachable") -> Transfer:
    """A transfer whose every chunk fails with ``why`` (by default: the daemon could not be
    reached)."""
    keys = [c.key for c in (t.loads if is_load else t.stores)]
    transfer = Transfer(
        Direction.LOAD if is_load else Direction.STORE, (is_load, t.req_id, t.lease_id), keys
    )
    transfer.copies = [KeyCopies(key, error=why) for key in keys]
    return transfer


class TransferPlanner:
    """Plans the transfers of one rank's KV caches under one namespace; see the module
    docstring. Holds no state across transfers."""

    def __init__(self, spec: NamespaceSpec, rank: int, caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.rank = rank
        self.caches = caches

    def plan(
        self,
        t: RequestTransfers,
        is_load: bool,
        arena: MappedArena | None,
        io: Mapping[Direction, KVClient],
    ) -> Transfer:
        """The transfer of lease ``t``'s loads (``is_load``) or stores: through ``arena`` when
        mapped, else through a staging buffer and ``io[direction]``'s client."""
        direction = Direction.LOAD if is_load else Direction.STORE
        chunks: list[tuple[bytes, list[int], int, list[tuple[int, int]]]] = [
            (c.key, c.block_ids, c.skip_blocks, self._rank_extents(c.extents)) for c in t.loads
        ] if is_load else [
            (c.key, c.block_ids, 0, self._rank_extents(c.extents)) for c in t.stores
        ]  # fmt: skip
        keys = [c[0] for c in chunks]
        transfer = Transfer(direction, (is_load, t.req_id, t.lease_id), keys)
        if arena is not None:
            for key, blocks, skip, extents in chunks:
                transfer.copies.append(self._key_copies(
                    key, blocks, skip, is_load, arena.tensor, extents, arena, arena.array
                ))  # fmt: skip
            return transfer
        pb = self.spec.part_bytes
        staging = staging_buffer(pb * len(chunks), pinned=self.caches.device.type == "cuda")
        transfer.keepalive.append(staging)
        array = host_array(staging) if self.caches.arrays is not None else None
        for i, (key, blocks, skip, _) in enumerate(chunks):  # one host tensor: the DMAs merge
            transfer.copies.append(self._key_copies(
                key, blocks, skip, is_load, staging, [(i * pb, pb)], None, array
            ))  # fmt: skip
        client = io[direction]
        if is_load:
            transfer.prepare = lambda: self._remote_read(client, t, transfer, staging)
        else:
            transfer.finish = lambda ok: self._remote_write(client, t, ok, staging, keys)
        return transfer

    def _rank_extents(self, extents: RankExtents) -> list[tuple[int, int]]:
        return list(extents[self.rank]) if self.rank < len(extents) else []

    def _key_copies(
        self,
        key: bytes,
        block_ids: list[int],
        skip: int,
        is_load: bool,
        host: torch.Tensor,
        extents: list[tuple[int, int]],
        arena: MappedArena | None,
        array: np.ndarray | None,
    ) -> KeyCopies:
        """The copies of one part (``array``: ``host`` as numpy, or None); planning errors
        fail this key only."""
        try:
            if arena is not None:
                arena.check_extents(extents, self.spec.part_bytes)
            return plan_copies(
                self.caches, key, block_ids, self.spec.chunk_blocks, host, extents,
                skip=skip, is_load=is_load, array=array,
            )  # fmt: skip
        except InvalidArgument as exc:
            logger.warning("cannot plan chunk %s: %s", key.hex()[:16], exc)
            return KeyCopies(key, error=str(exc))

    # ------------------------------------------------------------ remote path (engine threads)

    def _remote_read(
        self, io: KVClient, t: RequestTransfers, transfer: Transfer, staging: torch.Tensor
    ) -> list[KeyCopies]:
        pb = self.spec.part_bytes
        index = {c.key: i for i, c in enumerate(t.loads)}
        wanted = [kc.key for kc in transfer.copies if kc.error is None]
        if wanted:
            parts = io.read_parts(self.spec.ns_id, t.lease_id, wanted, self.rank)
            dst = tensor_memoryview(staging)
            for key, part in zip(wanted, parts, strict=True):
                if part.nbytes != pb:
                    raise InvalidArgument("part of the wrong size", size=part.nbytes)
                i = index[key]
                dst[i * pb : (i + 1) * pb] = part.cast("B")
        return transfer.copies

    def _remote_write(
        self,
        io: KVClient,
        t: RequestTransfers,
        ok: list[bytes],
        staging: torch.Tensor,
        keys: list[bytes],
    ) -> None:
        if not ok:
            return
        pb = self.spec.part_bytes
        view = tensor_memoryview(staging)
        index = {k: i for i, k in enumerate(keys)}
        parts = [view[index[k] * pb : (index[k] + 1) * pb] for k in ok]
        io.write_parts(t.lease_id, ok, self.rank, parts, complete=False)
