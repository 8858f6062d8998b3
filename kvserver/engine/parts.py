"""The DRAM tier's payload path for clients that cannot map the arena: parts copied in, views out.

Runs inside the storage engine (``kvserver/engine/core.py``), which exposes these calls as its own
(``StorageEngine.write_parts`` / ``write_part`` / ``read_part`` / ``read_parts``): the ZMQ
``put`` / ``write_parts`` / ``get`` / ``read_parts`` ops of remote clients, and the daemon's own
writes (promotions, peer fetches). Single owner, no locks; it changes no state but the bytes of
the arena pages a store lease reserved.

Call order: a store lease (``prepare_store``) → :meth:`PartCopies.write_parts` /
:meth:`~PartCopies.write_part` → ``complete_store`` (these calls complete nothing); a load
lease (``prepare_load``) → :meth:`~PartCopies.read_parts` / :meth:`~PartCopies.read_part`
→ ``complete_load`` (the views are valid while the lease lives). Each call checks its whole
input first (the lease and its kind, each key held by it, each rank in range, each payload's
size): a raised :class:`~kvserver.errors.KVServerError` means nothing was written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvserver.arena import SharedArena
from kvserver.engine.index import IndexKey
from kvserver.engine.namespaces import NamespaceTable
from kvserver.engine.types import Entry
from kvserver.errors import InvalidArgument
from kvserver.leases import LeaseKind, LeaseTable


class PartCopies:
    """Copies into and views of the arena under leases; see the module docstring."""

    def __init__(
        self,
        arena: SharedArena,
        leases: LeaseTable,
        namespaces: NamespaceTable,
        entries: Mapping[IndexKey, Entry],
    ) -> None:
        self._arena = arena
        self._leases = leases
        self._namespaces = namespaces
        self._entries = entries

    def write_parts(
        self,
        lease_id: int,
        keys: Sequence[bytes],
        ranks: Sequence[int],
        parts: Sequence[bytes | memoryview],
    ) -> None:
        """Copy parts into the arena (remote clients): ``parts[i * len(ranks) + j]`` is rank
        ``ranks[j]``'s part of ``keys[i]``. Does not complete them (``complete_store``).

        ``write_part`` for a batch: checks everything first (the lease; each key reserved by
        it, each rank in range, named once and not completed yet; each payload's size), so a
        raised error means nothing was written; then copies.
        """
        lease = self._leases.get(lease_id, LeaseKind.STORE)
        spec = self._namespaces.specs[lease.ns]
        mask = lease.select_ranks(ranks, spec.tp_world_size)
        if len(ranks) != mask.bit_count():
            raise InvalidArgument("a rank is named twice", ranks=list(ranks))
        if len(parts) != len(keys) * len(ranks):
            raise InvalidArgument(
                "wrong number of parts", parts=len(parts), expected=len(keys) * len(ranks)
            )
        lease.check_parts(keys, mask)
        size = spec.part_bytes
        for i, data in enumerate(parts):
            if memoryview(data).nbytes != size:
                raise InvalidArgument(
                    "payload size does not match the part size",
                    part=i,
                    size=memoryview(data).nbytes,
                    part_bytes=size,
                )
        entries, ns, write = self._entries, lease.ns, self._arena.write
        per_key = len(ranks)
        for i, key in enumerate(keys):
            extents = entries[(ns, key)].extents
            for j, rank in enumerate(ranks):
                write(extents[rank], parts[i * per_key + j])

    def write_part(self, lease_id: int, key: bytes, rank: int, data: bytes | memoryview) -> None:
        """Copy one part's payload into the arena (remote clients). Does not complete it."""
        lease = self._leases.get(lease_id, LeaseKind.STORE)
        spec = self._namespaces.specs[lease.ns]
        lease.check_part(key, rank, spec.tp_world_size)
        entry = self._entries[(lease.ns, key)]
        if memoryview(data).nbytes != spec.part_bytes:
            raise InvalidArgument(
                "payload size does not match the part size",
                size=memoryview(data).nbytes,
                part_bytes=spec.part_bytes,
            )
        self._arena.write(entry.extents[rank], data)

    def read_part(self, lease_id: int, key: bytes, rank: int) -> list[memoryview]:
        """Zero-copy views of one pinned part (remote clients); valid while the lease lives."""
        lease = self._leases.get(lease_id, LeaseKind.LOAD)
        spec = self._namespaces.specs[lease.ns]
        if type(rank) is not int or not 0 <= rank < spec.tp_world_size:
            raise InvalidArgument("rank out of range", rank=rank)
        if key not in lease.keys:
            raise InvalidArgument("key is not pinned by this lease", key=key, lease=lease_id)
        return self._arena.views(self._entries[(lease.ns, key)].extents[rank])

    def read_parts(
        self, lease_id: int, keys: Sequence[bytes], ranks: Sequence[int]
    ) -> list[list[memoryview]]:
        """``read_part`` for a batch: the views of each rank of ``ranks`` of each of ``keys``,
        key-major (``[i * len(ranks) + j]`` is rank ``ranks[j]`` of ``keys[i]``). Checks every
        rank and key first (InvalidArgument); valid while the lease lives."""
        lease = self._leases.get(lease_id, LeaseKind.LOAD)
        world = self._namespaces.specs[lease.ns].tp_world_size
        for rank in ranks:
            if type(rank) is not int or not 0 <= rank < world:
                raise InvalidArgument("rank out of range", rank=rank)
        if keys != lease.keys:  # usually the lease's own keys: one C compare
            pinned = set(lease.keys)
            if not pinned.issuperset(keys):
                key = next(k for k in keys if k not in pinned)
                raise InvalidArgument("key is not pinned by this lease", key=key, lease=lease_id)
        entries, ns = self._entries, lease.ns
        if len(ranks) == 1:
            rank = ranks[0]
            return self._arena.views_of([entries[(ns, key)].extents[rank] for key in keys])
        return self._arena.views_of(
            [extents[rank] for key in keys for extents in (entries[(ns, key)].extents,)
             for rank in ranks]
        )  # fmt: skip
