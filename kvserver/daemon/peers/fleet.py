"""``FleetDirectory``: the network tier's ``PeerDirectory`` over the fleet index on Redis.

Runs in the daemon process, on its event loop (loop only, not thread-safe). The network tier
(``kvserver/daemon/peers/``) asks it who the peers are and which of them hold which chunk;
it answers from the ``ClusterNode``'s view of the fleet:

- ``peers()``: the live members other than this daemon, from the member list the node's
  reader last read (at every heartbeat, and by the lookups of ``holders``: so a restarted
  member is fetched from at the address of the incarnation the index named, not of the one
  the last heartbeat saw; no I/O; a member that died is listed until its record expires and
  a read notices, at most TTL + one heartbeat interval; a fetch from it fails and the tier
  marks it suspect meanwhile); none while the node is not ``ok``
  (Redis unreachable: the tier then answers at once from local tiers instead of waiting for
  a Redis timeout on every lookup), and ``error`` says why. Never a member that advertises
  this daemon's own data address (``self_named``: daemons on other hosts left at the
  default ``--host 127.0.0.1`` and fixed ports all advertise ``tcp://127.0.0.1:9471``):
  fetching from it would ask this daemon itself, which holds none of those chunks (every
  such load missed, silently, and its lookups counted peer hits that no fetch could bring);
  ``error`` names them, so the network tier is ``degraded`` with the fix in its detail;
- ``holders(ns_id, keys)``: one ``FleetReader.lookup`` (exact leading runs, one server-side
  script for all live members, bounded by the cluster timeout), turned into per-key holder sets; an
  unreachable Redis answers no holders (the tier then serves local tiers only). After a
  lookup Redis did not answer, the next :data:`RETRY_S` seconds answer no holders at once
  (``skipped_lookups``): a Redis that stalls (a slow command, ``CLIENT PAUSE``, a failover)
  cost every lookup that missed locally the whole cluster timeout (1 s by default) until the
  node's own writes timed out (4 timeouts) and it went ``unavailable``; now one a second.

Usage (``kvserver/daemon/process.py`` when both ``--cluster`` and the network tier are on)::

    directory = FleetDirectory(node)      # node: the started ClusterNode
    PeerTier(..., directory=directory)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from kvserver.cluster.node import ClusterNode
from kvserver.daemon.peers.directory import Peer
from kvserver.errors import Unavailable

logger = logging.getLogger(__name__)

#: seconds during which lookups answer no holders without asking Redis, after one that Redis
#: did not answer (module docstring).
RETRY_S = 1.0


class FleetDirectory:
    """A :class:`~kvserver.daemon.peers.directory.PeerDirectory` over the fleet index."""

    #: holders() reads the index on Redis, not the peers.
    asks_peers = False

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        #: lookups Redis did not answer (in time), and lookups not sent in the RETRY_S after one
        self.unavailable_lookups = 0
        self.skipped_lookups = 0
        self._retry_at = 0.0
        self._failure = ""

    @property
    def error(self) -> str:
        """Why the fleet state cannot be read now ("" while the node is ``ok``)."""
        node = self.node
        if node.readable:  # degraded (Redis full) reads as ok does
            if time.monotonic() < self._retry_at:
                return f"fleet index lookups skipped for {RETRY_S:g} s: {self._failure}"
            named = self.self_named()
            if named:
                return (f"member(s) {', '.join(named)} advertise this daemon's own address "
                        f"{node.info.data_address}, so they are not asked: give each an "
                        "--advertise-addr its peers reach")  # fmt: skip
            return ""
        detail = node.condition_detail
        return f"{node.condition}: {detail}" if detail else node.condition

    def peers(self) -> Mapping[str, Peer]:
        if not self.node.readable:  # Redis unreachable: no peers, so no lookup waits on it
            return {}
        me, mine = self.node.host_id, self.node.info.data_address
        return {
            h.host_id: Peer(h.host_id, h.incarnation, h.data_address, h.stream_address)
            for h in self.node.members
            if h.host_id != me and h.data_address != mine
        }

    def self_named(self) -> list[str]:
        """The members other than this daemon that advertise its data address (module
        docstring): unreachable at it from here, never asked."""
        me, mine = self.node.host_id, self.node.info.data_address
        return sorted(h.host_id for h in self.node.members
                      if h.host_id != me and h.data_address == mine)  # fmt: skip

    async def holders(self, ns_id: str, keys: Sequence[bytes]) -> list[frozenset[str]]:
        if time.monotonic() < self._retry_at:  # Redis just failed a lookup: not again yet
            self.skipped_lookups += 1
            return []
        try:
            exclude = (self.node.host_id, *self.self_named())
            runs = await self.node.reader.lookup(ns_id, keys, exclude=exclude)
        except Unavailable as exc:
            self.unavailable_lookups += 1
            self._retry_at = time.monotonic() + RETRY_S
            self._failure = str(exc)
            logger.debug("fleet directory: %s", exc)
            return []
        if not runs:
            return []
        longest = runs[0].hit_chunks  # runs come longest first
        return [frozenset(r.host.host_id for r in runs if r.hit_chunks > i) for i in range(longest)]
