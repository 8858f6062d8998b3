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
- What Redis holds is not trusted: another version's daemon, a buggy one or anyone who can
  write to the fleet's Redis may put anything there. A record is read only if it is what a
  version-1 daemon writes (:meth:`HostInfo.decode`: at most :data:`MAX_RECORD_BYTES`, every
  field of its type, addresses ``tcp://HOST:PORT`` with a port in 1-65535, counts and sizes
  in range); anything else is skipped whole by the reader, which says so (``reader.py``).
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
#: an incarnation as a record names it (a daemon writes 16 hex digits).
_INCARNATION = re.compile(r"[^\s{}]{1,64}")

#: the longest host record read: a daemon's is a few hundred bytes and ~19 more per namespace
#: with index sets (4,096 at most, ``MAX_RECORD_NAMESPACES``: ~80 KB); a longer value (not a
#: daemon's) is skipped before it is parsed, so no reader decodes megabytes on its loop.
MAX_RECORD_BYTES = 256 << 10
#: the most namespaces a record may list (a daemon registers at most 4,096), and the longest
#: namespace id (16 hex digits in practice; 64 as every API takes).
MAX_RECORD_NAMESPACES = 4096
MAX_NS_ID = 64
#: the longest address (``tcp://HOST:PORT``; a DNS name is at most 253 characters) and the most
#: tiers a record may name.
MAX_ADDRESS = 300
MAX_RECORD_TIERS = 8
#: the longest namespace spec (JSON) read from the fleet (a daemon's is a few hundred bytes).
MAX_SPEC_BYTES = 64 << 10


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
        """The record, or InvalidArgument (saying what is wrong) unless it is what a
        version-1 daemon writes: JSON of at most :data:`MAX_RECORD_BYTES`, every field of its
        type and in range (module docstring). Fields a later version adds are ignored."""
        if len(raw) > MAX_RECORD_BYTES:
            raise InvalidArgument(
                f"bad host record: {len(raw)} bytes, more than {MAX_RECORD_BYTES}"
            )
        try:
            d: Any = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError(f"a JSON {type(d).__name__}, not an object")
            if d.get("version") != SCHEMA_VERSION:
                raise ValueError(f"version {d.get('version')!r}")
            return cls(
                host_id=check_host_id(_text(d["host_id"], "host_id")),
                incarnation=_incarnation(d["incarnation"]),
                data_address=_address(d["data_address"], ("tcp",), "data_address"),
                grpc_address=_address(d["grpc_address"], (), "grpc_address"),
                tiers=tuple(_texts(d.get("tiers", []), MAX_RECORD_TIERS, 32, "tiers")),
                capacity=_capacity(d.get("capacity", {})),
                namespaces=tuple(_namespaces(d.get("namespaces", []))),
                started_at=_time(d.get("started_at", 0.0)),
                stream_address=_address(
                    d.get("stream_address", ""), ("tcp", "tls"), "stream_address", empty=True
                ),
            )
        except InvalidArgument as exc:
            raise InvalidArgument(f"bad host record: {exc}") from None
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            # ValueError: not JSON, not UTF-8 (UnicodeDecodeError); KeyError: a field missing;
            # RecursionError: JSON nested thousands deep
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
            raise InvalidArgument(f"bad host record: {what}") from None

    def index_keys(self) -> list[str]:
        """Every index set this incarnation may have written."""
        return [
            index_key(self.host_id, self.incarnation, ns, tier)
            for ns in self.namespaces
            for tier in TIERS
        ]


# ---------------------------------------------------------------------- a record's fields


def _text(value: Any, what: str, longest: int = MAX_ADDRESS) -> str:
    if not isinstance(value, str) or len(value) > longest:
        raise ValueError(f"{what} is not a string of at most {longest} characters")
    return value


def _texts(value: Any, most: int, longest: int, what: str) -> list[str]:
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(f"{what} is not a list of at most {most}")
    return [_text(v, what, longest) for v in value]


def _namespaces(value: Any) -> list[str]:
    return _texts(value, MAX_RECORD_NAMESPACES, MAX_NS_ID, "namespaces")


def _incarnation(value: Any) -> str:
    if not isinstance(value, str) or not _INCARNATION.fullmatch(value):
        raise ValueError("incarnation is not 1-64 characters without spaces or braces")
    return value


def _address(value: Any, schemes: tuple[str, ...], what: str, *, empty: bool = False) -> str:
    """``value`` if it is ``SCHEME://HOST:PORT`` with a scheme of ``schemes`` (no scheme:
    ``HOST:PORT``), HOST without spaces, PORT in 1-65535 ("" too when ``empty``)."""
    text = _text(value, what)
    if empty and not text:
        return text
    if schemes:
        scheme, sep, rest = text.partition("://")
        ok = bool(sep) and scheme in schemes
    else:
        rest, ok = text, "://" not in text
    host, _, port = rest.rpartition(":")
    ok = ok and bool(host) and not any(c.isspace() for c in host)
    if not (ok and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        form = f"{'/'.join(schemes)}://HOST:PORT" if schemes else "HOST:PORT"
        raise ValueError(f"{what} {text[:80]!r} is not a {form} address")
    return text


def _capacity(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or len(value) > MAX_RECORD_TIERS:
        raise ValueError(f"capacity is not a map of at most {MAX_RECORD_TIERS} tiers")
    out: dict[str, int] = {}
    for tier, size in value.items():
        if type(size) is not int or not 0 <= size < 1 << 63:
            raise ValueError(f"capacity of {str(tier)[:32]!r} is not a byte count")
        out[_text(tier, "capacity", 32)] = size
    return out


def _time(value: Any) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1e11:  # NaN and inf fail too
        raise ValueError("started_at is not a time")
    return float(value)
