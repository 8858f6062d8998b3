"""The fleet state's key schema and formats on Redis / Valkey: the one module both the writer
(a daemon's ``ClusterNode``) and every reader (``FleetReader``) import.

Pure: no I/O. Versioned by the key prefix ``kvs1``: an incompatible change gets ``kvs2`` and
both versions can share one Redis.

Keys (``{...}`` is the Redis Cluster hash tag: keys with the same tag live in one slot, so the
multi-key commands and scripts below never cross slots)::

    kvs1:{fleet}:hosts                        SET of host ids that registered (cleaned lazily)
    kvs1:{fleet}:host:<host_id>               STRING, the host record (JSON), PX = member TTL
    kvs1:{fleet}:ns                           HASH ns_id -> namespace spec (JSON), no TTL
    kvs1:{h:<host_id>}:<incarnation>:<ns_id>:d   SET of fingerprints of chunks in DRAM
    kvs1:{h:<host_id>}:<incarnation>:<ns_id>:s   SET of fingerprints of chunks on SSD
    kvs1:{h:<host_id>}:<incarnation>:fence       STRING, the number of the incarnation's last
                                                 index write, PX = member TTL

- Membership is tiny (one record per host) and lives in one slot (``{fleet}``), so reading it
  is ``SMEMBERS`` + one ``MGET``.
- A host's index sets share the tag ``{h:<host_id>}``: one host's sets are in one slot, so a
  read of one host is one script call (``reader.py``), and a fleet of H hosts spreads over the
  cluster's nodes by host. The sets of an incarnation carry the incarnation in their name: a
  restarted daemon (new incarnation) writes new sets, readers only read the incarnation named
  by the host's live record, and the old sets expire (their TTL is no longer renewed) or are
  unlinked at once by the new incarnation.
- Members of the index sets are **fingerprints**: ``xxh3_64`` of the chunk key (``FP_BYTES`` =
  8 bytes, a quarter of a sha256 key; hashing rather than truncating keeps any key uniform). A
  false positive needs a 64-bit collision within one host's set (about 1e-13 per lookup at
  1 M chunks). The index is never trusted for bytes, so a collision costs one failed fetch.
- The **fence** counts an incarnation's index writes: each pipeline of its index writes (and
  its heartbeat) ends with a script moving it from ``n - 1`` to ``n`` (``PX ttl``; only from
  ``n - 1``: ``writer.FENCE_SCRIPT``), in the slot of its sets, and expects ``n - 1`` back.
  Anything else means Redis lost or reordered some of its writes without the writer seeing
  an error (restarted from older data between two calls, whose client then
  retried the connection at once; a timed-out pipeline's tail run after a later one): the
  writer resyncs (``node.py``).
- Every index set has a TTL (``PEXPIRE ... NX`` in the script that adds its members, so it
  is never without one; renewed by each heartbeat): a host that stops heartbeating loses its
  record and its sets within the TTL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from kvserver.errors import InvalidArgument
from kvserver.events import MEDIUM_DRAM, MEDIUM_SSD

SCHEMA_VERSION = 1
PREFIX = f"kvs{SCHEMA_VERSION}"
#: bytes of a chunk key kept in the index (see the module docstring).
FP_BYTES = 8

TIER_DRAM = "dram"
TIER_SSD = "ssd"
#: the tiers the index records, fastest first.
TIERS = (TIER_DRAM, TIER_SSD)
_TIER_CODE = {TIER_DRAM: "d", TIER_SSD: "s"}
#: storage-event medium (kvserver/events.py) -> index tier.
MEDIUM_TIER = {MEDIUM_DRAM: TIER_DRAM, MEDIUM_SSD: TIER_SSD}

_HOST_ID = re.compile(r"[^\s{}]{1,200}")


def check_host_id(host_id: str) -> str:
    """``host_id`` if it can name a fleet member (1-200 chars, no space or brace)."""
    if not _HOST_ID.fullmatch(host_id):
        raise InvalidArgument(
            "host id must be 1-200 characters without spaces or braces", host_id=host_id
        )
    return host_id


def hosts_key() -> str:
    return f"{PREFIX}:{{fleet}}:hosts"


def host_key(host_id: str) -> str:
    return f"{PREFIX}:{{fleet}}:host:{host_id}"


def namespaces_key() -> str:
    return f"{PREFIX}:{{fleet}}:ns"


def index_key(host_id: str, incarnation: str, ns_id: str, tier: str) -> str:
    """The set of ``tier`` fingerprints that ``host_id``'s ``incarnation`` holds in ``ns_id``."""
    return f"{PREFIX}:{{h:{host_id}}}:{incarnation}:{ns_id}:{_TIER_CODE[tier]}"


def fence_key(host_id: str, incarnation: str) -> str:
    """The write fence of ``host_id``'s ``incarnation`` (module docstring); its sets' slot."""
    return f"{PREFIX}:{{h:{host_id}}}:{incarnation}:fence"


#: the index member for a chunk key (bytes -> FP_BYTES bytes).
fingerprint: Callable[[bytes], bytes] = xxhash.xxh3_64_digest


@dataclass(frozen=True, slots=True)
class HostInfo:
    """A fleet member as its record says (``kvs1:{fleet}:host:<host_id>``).

    ``data_address`` is the ZMQ data plane peers use (``tcp://HOST:PORT``), ``grpc_address``
    the query API (``HOST:PORT``), ``stream_address`` the peer stream port (``tcp://HOST:PORT``,
    ``tls://HOST:PORT`` when TLS; "" when it opens none; records written before the field have
    none: peers use ZMQ).
    ``capacity`` is bytes per tier; ``namespaces`` the ns ids
    this incarnation has index sets for (so a successor can unlink them).
    """

    host_id: str
    incarnation: str
    data_address: str
    grpc_address: str
    tiers: tuple[str, ...] = (TIER_DRAM,)
    capacity: dict[str, int] = field(default_factory=dict)
    namespaces: tuple[str, ...] = ()
    started_at: float = 0.0
    stream_address: str = ""
    version: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> HostInfo:
        """The record, or InvalidArgument if it is not a version-1 record."""
        try:
            d: dict[str, Any] = json.loads(raw)
            if d.get("version") != SCHEMA_VERSION:
                raise ValueError(f"version {d.get('version')!r}")
            return cls(
                host_id=str(d["host_id"]),
                incarnation=str(d["incarnation"]),
                data_address=str(d["data_address"]),
                grpc_address=str(d["grpc_address"]),
                tiers=tuple(str(t) for t in d.get("tiers", ())),
                capacity={str(k): int(v) for k, v in d.get("capacity", {}).items()},
                namespaces=tuple(str(n) for n in d.get("namespaces", ())),
                started_at=float(d.get("started_at", 0.0)),
                stream_address=str(d.get("stream_address", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(f"bad host record: {exc}") from None

    def index_keys(self) -> list[str]:
        """Every index set this incarnation may have written."""
        return [
            index_key(self.host_id, self.incarnation, ns, tier)
            for ns in self.namespaces
            for tier in TIERS
        ]
