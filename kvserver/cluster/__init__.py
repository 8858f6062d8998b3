"""The fleet tier: membership, fleet index and host scoring on Redis / Valkey (docs/cluster.md).

Runs in the daemon (``ClusterNode``, started by ``kvserver/daemon/process.py`` when
``--cluster URL`` is given) and in any process that wants to read the fleet state
(``FleetReader``: the peer tier, routers, ``kvserver lookup --fleet``).

Modules, one concept each (imports go one way, down this list):

- ``schema``: every Redis key name, the fingerprint width, the host record's JSON (the format
  both the writer and the readers import; versioned by the ``kvs1`` prefix);
- ``config``: ``ClusterConfig`` (URL parsing, TTLs, timeouts, tier weights) and ``connect()``;
- ``scoring``: pure: per-host runs → scores with tier weights;
- ``reader``: ``FleetReader``: live hosts, and for a prompt's chunk keys the leading run each
  live host holds, per tier (bounded by timeouts);
- ``writer``: ``IndexWriter``: the daemon's own storage events → pipelined Redis batches;
- ``node``: ``ClusterNode``: the daemon's member: register, heartbeat, write the index from
  the event log (``kvserver/eventlog.py``), degrade when Redis is unreachable, re-register and
  resync when it returns.

Nothing here imports ``kvserver/daemon/`` (the daemon builds on this package): the network
tier's ``PeerDirectory`` over the node, ``FleetDirectory``, is ``kvserver/daemon/peers/fleet.py``.

Public API for other packages: ``ClusterConfig``, ``ClusterNode``, ``FleetReader``,
``HostInfo``, ``HostRun``, ``HostScore``, ``score_runs``.
"""

from __future__ import annotations

from kvserver.cluster.config import ClusterConfig
from kvserver.cluster.node import ClusterNode
from kvserver.cluster.reader import FleetReader
from kvserver.cluster.schema import HostInfo
from kvserver.cluster.scoring import HostRun, HostScore, score_runs

__all__ = [
    "ClusterConfig",
    "ClusterNode",
    "FleetReader",
    "HostInfo",
    "HostRun",
    "HostScore",
    "score_runs",
]
