"""``FleetReader``: what the fleet holds, read from Redis / Valkey (schema in ``schema.py``).

Runs in any process with an asyncio loop: the daemon (its peer tier and ``ScoreHosts``), a
router, ``kvserver lookup --fleet``. One reader per loop; not thread-safe. Every call is
bounded by a timeout and raises :class:`~kvserver.errors.Unavailable` when Redis does not
answer in time (the caller then treats the fleet as empty: the index is an optimisation).

API (the contract the peer tier and routers code against)::

    reader = FleetReader(redis_client, config)     # client from config.connect()
    hosts  = await reader.hosts()                  # live members, cached members_max_age_s
    runs   = await reader.lookup(ns_id, keys, hosts=None, exclude=(my_host_id,))
    # -> [HostRun(host=HostInfo, hit_chunks=n, tiers={"dram": a, "ssd": b})], one per live
    #    host with n >= 1, longest first; n = the leading run of ``keys`` that host holds.
    spec   = await reader.namespace_spec(ns_id)    # spec JSON published by a member, or None

Liveness: a host is live while its record exists (``PX`` = the member TTL, renewed by its
heartbeat); only the incarnation named in the record is read, so a restarted host's old
entries are ignored at once and expire within the TTL.

Untrusted contents: what Redis holds may come from another version's daemon, a buggy one or
anyone who can write there. A hosts-set member that is not a host id (forgotten, as ids whose
record expired are: no daemon registers under it), and a record that is not
what a version-1 daemon writes (``HostInfo.decode``) or that names another host than the key
it is stored under, are skipped, never raised: the rest of the fleet is read as ever, the
member keeps heartbeating. :attr:`FleetReader.bad_records` counts those of the last read (the
node's ``stats()``, ``kvserver_cluster_bad_records``), and a warning names them whenever they
change (not at every read). An index set that is not a set (another type at its key) holds
nothing for the lookups, for that host only (the script's calls are protected,
``redis.pcall``), and is counted in :attr:`FleetReader.unreadable_sets`.

Exactness: ``lookup(..., exact=True)`` (default) tests every key up to the first miss, per
host, in a server-side script (``SMISMEMBER`` of :data:`RUN_SLICE` keys at a time, native;
one script for all hosts on one server, one per host on a Redis Cluster). ``exact=False``
finds the run by binary search, assuming what a host holds of one prompt is prefix-closed
(true unless a middle chunk was evicted alone, when the run is over-estimated); it costs
O(log n) lookups per host instead of O(n) and is what ``ScoreHosts`` uses by default for long
prompts. The index lags
the truth either way: it is never trusted for bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

from kvserver.cluster import schema
from kvserver.cluster.config import ClusterConfig, client_errors
from kvserver.cluster.schema import HostInfo
from kvserver.cluster.scoring import HostRun
from kvserver.errors import InvalidArgument, Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: most fingerprints in one SMISMEMBER of the exact lookup (Lua's unpack stops at about 8,000
#: values: a longer prompt is tested in slices, up to the slice of its first key held nowhere).
RUN_SLICE = 4096

# KEYS: per host, its DRAM set then its SSD set. ARGV: the concatenated fingerprints, their
# width, "1" exact / "0" binary search. Returns per host {dram, ssd}: its leading run by tier.
_RUN_SCRIPT = """
local blob, w, exact = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local n = #blob / w
local function fp(j) return string.sub(blob, (j - 1) * w + 1, j * w) end
local slices = {}  -- the k-th STEP fingerprints, made once for every host
local function slice(k)
  local t = slices[k]
  if t == nil then
    t = {}
    for j = (k - 1) * STEP + 1, math.min(k * STEP, n) do t[#t + 1] = fp(j) end
    slices[k] = t
  end
  return t
end
-- A key of another type than a set (written by something other than a daemon) answers
-- WRONGTYPE: caught (pcall), it holds nothing, for its host only, and is reported (-1).
local bad = false
local function members(key, part)
  local r = redis.pcall('SMISMEMBER', key, unpack(part))
  if r.err then bad = true return {} end
  return r
end
local function member(key, k)
  local r = redis.pcall('SISMEMBER', key, k)
  if type(r) == 'table' then bad = true return 0 end
  return r
end
local function exact_run(dkey, skey)
  local nd, ns = 0, 0
  for k = 1, math.ceil(n / STEP) do
    local part = slice(k)
    local d = members(dkey, part)
    local s = nil
    for j = 1, #part do
      if d[j] == 1 then nd = nd + 1
      else
        if s == nil then s = members(skey, part) end
        if s[j] == 1 then ns = ns + 1 else return nd, ns end
      end
    end
  end
  return nd, ns
end
local function last(keys, hi)
  local lo = 0
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local k = fp(mid)
    local hit = false
    for _, key in ipairs(keys) do
      if member(key, k) == 1 then hit = true break end
    end
    if hit then lo = mid else hi = mid - 1 end
  end
  return lo
end
local out = {}
for i = 1, #KEYS, 2 do
  local nd, ns
  bad = false
  if exact then nd, ns = exact_run(KEYS[i], KEYS[i + 1])
  else
    local total = last({KEYS[i], KEYS[i + 1]}, n)
    nd = last({KEYS[i]}, total)
    ns = total - nd
  end
  if bad then nd, ns = -1, 0 end
  out[#out + 1] = nd
  out[#out + 1] = ns
end
return out
""".replace("STEP", str(RUN_SLICE))

#: the most hosts-set members one read forgets (one script call: a hosts set filled with
#: ids no daemon has is cleaned over several reads, each bounded, not in one call that could
#: outlast the cluster timeout at every heartbeat).
FORGET_MAX = 4096

# KEYS[1]: the hosts set; KEYS[2..]: the records of members read as gone; ARGV: their ids.
# Forgets a member only while its record is still absent: one that registered again since
# the read (its SADD a no-op, its id still in the set) stays listed.
_FORGET_SCRIPT = """
local n = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    n = n + redis.call('SREM', KEYS[1], ARGV[i - 1])
  end
end
return n
"""


def _decode(host_id: str, raw: bytes) -> HostInfo | str:
    """The member whose record, stored under ``host_id``, is ``raw``; or why it is skipped
    (not what a version-1 daemon writes, or it names another host)."""
    try:
        info = HostInfo.decode(raw)
    except InvalidArgument as exc:
        return f"{host_id}: {exc}"
    if info.host_id != host_id:
        return f"{host_id}: bad host record: it names host {info.host_id!r}"
    return info


class FleetReader:
    """Reads membership and the fleet index (module docstring)."""

    def __init__(self, redis: Any, config: ClusterConfig) -> None:
        self.redis = redis
        self.config = config
        self._hosts: list[HostInfo] = []
        self._hosts_at = -1e9
        #: a Redis Cluster (one script per host) or one server (one script for all hosts)
        self._per_host = config.target().cluster
        #: what the client raises when the server is unreachable (either library)
        self._errors = client_errors(redis)
        #: hosts-set members and records skipped at the last read of the members (not what a
        #: daemon writes: module docstring), and what was said of them last
        self.bad_records = 0
        self._bad_said: tuple[str, ...] = ()
        #: index sets found of another type than a set by lookups (counted per lookup)
        self.unreadable_sets = 0
        self._unreadable_said: set[str] = set()
        #: each member's record as last read, and what it decoded to (the member, or why it
        #: was skipped): a record unchanged since is not decoded again (a read of 5,000
        #: members decoded them all, ~45 ms of the loop; records change at a restart or a
        #: new namespace)
        self._decoded: dict[str, tuple[bytes, HostInfo | str]] = {}

    @property
    def known_hosts(self) -> list[HostInfo]:
        """The live members as last read by :meth:`hosts` (or a lookup), sorted by host id;
        no I/O ([] before the first read). The list is replaced, never changed: read only."""
        return self._hosts

    async def hosts(
        self, *, refresh: bool = False, timeout_s: float | None = None, forget: bool = True
    ) -> list[HostInfo]:
        """Live members sorted by host id; cached for ``members_max_age_s`` unless ``refresh``.
        ``forget``: a read also removes from the hosts set the ids whose record expired (a
        script that writes: it waits out a server pausing writes, as a failover does, so the
        reads of lookups and ``ScoreHosts`` leave it to the members' heartbeats)."""
        now = time.monotonic()
        if refresh or now - self._hosts_at > self.config.members_max_age_s:
            self._hosts = await self._bounded(self._read_hosts(forget), timeout_s)
            self._hosts_at = time.monotonic()
        return list(self._hosts)

    async def _read_hosts(self, forget: bool) -> list[HostInfo]:
        ids: list[str] = []
        bad: list[str] = []
        gone: list[bytes] = []  # members to forget: records expired, or ids no daemon has
        for member in await self.redis.smembers(schema.hosts_key()):
            try:
                ids.append(schema.check_host_id(bytes(member).decode()))
            except (UnicodeDecodeError, InvalidArgument):
                bad.append(f"hosts set member {bytes(member)[:64]!r} is not a host id")
                gone.append(bytes(member))  # no daemon registers under it: forgotten
        ids.sort()
        raws = await self.redis.mget([schema.host_key(h) for h in ids]) if ids else []
        live = []
        decoded, self._decoded = self._decoded, {}
        for host_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(host_id.encode())
                continue
            raw = bytes(raw)
            known = decoded.get(host_id)
            info = known[1] if known is not None and known[0] == raw else _decode(host_id, raw)
            self._decoded[host_id] = (raw, info)
            if isinstance(info, str):  # another version's or a buggy writer's: skipped
                bad.append(info)
            else:
                live.append(info)
        self._note_bad(bad)
        if gone and forget:  # lazily forget members whose record expired (re-added by their
            # heartbeat), at most FORGET_MAX a read (the rest at the reads after)
            gone = gone[:FORGET_MAX]
            prefix = schema.host_key("").encode()
            records = [prefix + h for h in gone]  # one slot with the set: {fleet}
            await self.redis.execute_command(
                "EVAL", _FORGET_SCRIPT, 1 + len(gone), schema.hosts_key(), *records, *gone
            )
        return live

    async def lookup(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        *,
        hosts: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        exact: bool = True,
        timeout_s: float | None = None,
    ) -> list[HostRun]:
        """Per live host (of ``hosts`` if given, minus ``exclude``) holding at least the first
        chunk: its leading run of ``keys``, longest first (module docstring)."""
        if not keys:
            return []
        members = await self.hosts(timeout_s=timeout_s, forget=False)  # reads only
        wanted = set(hosts) if hosts is not None else None
        skip = set(exclude)
        chosen = [
            h for h in members
            if (wanted is None or h.host_id in wanted) and h.host_id not in skip
            and ns_id in h.namespaces
        ]  # fmt: skip
        if not chosen:
            return []
        blob = b"".join(map(schema.fingerprint, keys))
        # A Redis Cluster: one script per host (its sets share a slot), in one pipeline (one
        # round trip per node). One server: one script for every host, the prompt sent once.
        groups = [[h] for h in chosen] if self._per_host else [chosen]
        pipe = self.redis.pipeline(transaction=False)
        for group in groups:
            sets = [
                schema.index_key(h.host_id, h.incarnation, ns_id, tier)
                for h in group
                for tier in (schema.TIER_DRAM, schema.TIER_SSD)
            ]
            mode = "1" if exact else "0"
            # read-only: runs while the server pauses writes (a failover's CLIENT PAUSE WRITE)
            fps = (blob, schema.FP_BYTES, mode)
            pipe.execute_command("EVAL_RO", _RUN_SCRIPT, len(sets), *sets, *fps)
        replies = await self._bounded(pipe.execute(), timeout_s)
        counts = [int(n) for reply in replies for n in reply]
        runs = []
        for i, host in enumerate(chosen):
            dram, ssd = counts[2 * i], counts[2 * i + 1]
            if dram < 0:  # an index set of another type (the script's ``bad``): holds nothing
                self._unreadable(host, ns_id)
                continue
            if dram + ssd:
                runs.append(
                    HostRun(host, dram + ssd, {schema.TIER_DRAM: dram, schema.TIER_SSD: ssd})
                )
        runs.sort(key=lambda r: (-r.hit_chunks, r.host.host_id))
        return runs

    async def namespace_spec(self, ns_id: str, *, timeout_s: float | None = None) -> bytes | None:
        """The namespace spec a member published for ``ns_id`` (JSON, as Redis holds it: not
        trusted, the caller parses and checks it), or None."""
        raw = await self._bounded(self.redis.hget(schema.namespaces_key(), ns_id), timeout_s)
        return None if raw is None else bytes(raw)

    def _note_bad(self, bad: list[str]) -> None:
        """Count the entries a read of the members skipped; warn when they change."""
        self.bad_records = len(bad)
        said = tuple(sorted(bad))
        if said != self._bad_said:
            self._bad_said = said
            if said:
                logger.warning(
                    "fleet: %d entr%s on Redis skipped (not what a kvserver daemon writes; "
                    "another version, or a buggy writer): %s",
                    len(said), "y" if len(said) == 1 else "ies", "; ".join(said[:3]),
                )  # fmt: skip

    def _unreadable(self, host: HostInfo, ns_id: str) -> None:
        """A lookup met an index set of ``host`` that is not a set: count it, warn once."""
        self.unreadable_sets += 1
        name = f"{host.host_id}/{host.incarnation}/{ns_id}"
        if name not in self._unreadable_said and len(self._unreadable_said) < 1024:
            self._unreadable_said.add(name)
            logger.warning(
                "fleet: an index set of %s (namespace %s) is not a set on Redis (another "
                "version's, or a buggy writer's): that host is taken to hold nothing there",
                host.host_id, ns_id,
            )  # fmt: skip

    async def _bounded(self, call: Awaitable[T], timeout_s: float | None) -> T:
        try:
            return await asyncio.wait_for(call, timeout_s or self.config.timeout_s)
        except TimeoutError:
            raise Unavailable("fleet index: Redis did not answer in time") from None
        except self._errors as exc:
            raise Unavailable(f"fleet index: {type(exc).__name__}: {exc}") from None
