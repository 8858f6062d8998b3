"""The host record's conditional writes: a member renews or removes its record only while the
record still names its own incarnation (``schema.host_key``; ``ClusterNode`` runs them).

Runs wherever the node runs, on its event loop: script text, reply checks, the record's
queueing, and the two reads a registration starts with (:func:`redis_time`,
:func:`predecessor`). Why: two daemons
that share a host id (two daemons on one machine both default to hostname/boot-id, or a
copied ``--host-id``) would otherwise write their records and index over each other at every
heartbeat and batch, each registration unlinking the other's sets. The rule is a restart's:
the member that started later owns the host id (:func:`taken_by`); the earlier one finds the
record names the later one and steps down (``unavailable``, saying why) until the id is free.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from kvserver.cluster import schema
from kvserver.cluster.schema import HostInfo
from kvserver.errors import InvalidState

# KEYS[1]: any key of the {fleet} slot (the server that holds the records answers). Redis's
# TIME: a member's ``started_at``, taken at its first registration, so that :func:`taken_by`
# compares two readings of one clock, not the clocks of two hosts.
TIME_SCRIPT = "return redis.call('TIME')"

# Membership must survive a Redis that is full under ``noeviction``, so the membership's
# writes (and the write fence's) are scripts flagged ``allow-oom``: Redis runs them when it
# refuses every other write that may need memory (``SET``, ``SADD``, ``HSET``, even one that
# changes nothing). Each writes a few hundred bytes at most, and nothing when the value is
# there already; the index's adds (kilobytes to megabytes) stay refused (``writer.py``).
ALLOW_OOM = "#!lua flags=allow-oom\n"

# KEYS[1]: the record. ARGV: the new record, its TTL (ms), the incarnation's JSON field.
# Renews the record while it names this incarnation (1): its TTL alone when its contents are
# the same, else rewritten; otherwise changes nothing and returns the record there (nil:
# none).
RENEW_SCRIPT = (
    ALLOW_OOM
    + """
local cur = redis.call('GET', KEYS[1])
if not cur then return false end
if not string.find(cur, ARGV[3], 1, true) then return cur end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
"""
)

# KEYS[1]: a string. ARGV: its value, its TTL (ms). A registration's record, a resync's
# new fence number (``SET .. PX``, allowed while Redis is full).
SET_SCRIPT = ALLOW_OOM + "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])"

# KEYS[1]: the hosts set. ARGV[1]: a host id (already there at every heartbeat: nothing
# allocated).
JOIN_SCRIPT = ALLOW_OOM + "return redis.call('SADD', KEYS[1], ARGV[1])"

# KEYS[1]: the namespace specs. ARGV: ns id, spec, ... (the same at every heartbeat: an ns
# id is a digest of its spec).
SPECS_SCRIPT = ALLOW_OOM + "return redis.call('HSET', KEYS[1], unpack(ARGV))"

# KEYS[1]: the record, KEYS[2]: the hosts set (one slot). ARGV: the host id, the
# incarnation's JSON field. Removes both while the record names this incarnation.
LEAVE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if cur and string.find(cur, ARGV[2], 1, true) then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


class HostIdTaken(InvalidState):
    """Another daemon, started later, registered this daemon's host id."""


def field(incarnation: str) -> str:
    """The incarnation as it appears in an encoded record (``HostInfo.encode``)."""
    return f'"incarnation":"{incarnation}"'


def taken_by(mine: HostInfo, raw: Any) -> HostInfo | None:
    """The member that owns the host id instead of ``mine``, given the record ``raw`` found
    there: one that started after it (``started_at``: Redis's time at each one's first
    registration; ties: the larger incarnation); None when ``raw`` is
    ``mine``'s, an earlier incarnation's (a restart: ``mine`` takes over) or unreadable."""
    try:
        other = HostInfo.decode(raw)
    except Exception:
        return None
    if other.incarnation == mine.incarnation:
        return None
    later = (other.started_at, other.incarnation) > (mine.started_at, mine.incarnation)
    return other if later else None


def taken(mine: HostInfo, other: HostInfo) -> HostIdTaken:
    return HostIdTaken(
        f"host id {mine.host_id!r} is registered by another daemon started later "
        f"(incarnation {other.incarnation}, data plane {other.data_address}); this one "
        "stays out of the fleet until it is free: give each daemon its own --host-id"
    )


async def redis_time(redis: Any, timeout_s: float) -> float:
    """Redis's time (seconds since the epoch; :data:`TIME_SCRIPT`, read-only: it runs while
    the server pauses writes): a member's ``started_at``, so :func:`taken_by` compares two
    readings of one clock, not the clocks of two hosts."""
    sec, usec = await asyncio.wait_for(
        redis.execute_command("EVAL_RO", TIME_SCRIPT, 1, schema.hosts_key()), timeout_s
    )
    return int(sec) + int(usec) / 1e6


async def predecessor(redis: Any, mine: HostInfo, timeout_s: float) -> list[str]:
    """The keys to unlink of the incarnation the host id's record names, when it is an
    earlier one of this host ([] when none, or ``mine``); :class:`HostIdTaken` when a
    daemon started later owns the id."""
    raw = await asyncio.wait_for(redis.get(schema.host_key(mine.host_id)), timeout_s)
    if raw is None:
        return []
    other = taken_by(mine, raw)
    if other is not None:
        raise taken(mine, other)
    with contextlib.suppress(Exception):
        old = HostInfo.decode(raw)
        if old.incarnation != mine.incarnation:
            return [*old.index_keys(), schema.fence_key(old.host_id, old.incarnation)]
    return []


def set_px(pipe: Any, key: str, value: Any, ttl_ms: int) -> Any:
    """``SET key value PX ttl_ms`` on ``pipe`` (queued), or a client (its awaitable), done
    even while Redis is full (:data:`SET_SCRIPT`)."""
    return pipe.execute_command("EVAL", SET_SCRIPT, 1, key, value, ttl_ms)


def queue(pipe: Any, info: HostInfo, ttl_ms: int, specs: Mapping[str, str], *, exists: bool) -> int:
    """Queue ``info``'s record on ``pipe`` (``exists``: renewed only while it names this
    incarnation, :data:`RENEW_SCRIPT`; else set), its id in the hosts set and the namespace
    ``specs``; returns the number of commands queued (the record's first). Every one is
    done while Redis is full (:data:`ALLOW_OOM`): a member's heartbeat never fails for
    memory, so a full Redis does not make the fleet's members leave and rejoin."""
    key = schema.host_key(info.host_id)
    if exists:
        mine = field(info.incarnation)
        pipe.execute_command("EVAL", RENEW_SCRIPT, 1, key, info.encode(), ttl_ms, mine)
    else:
        set_px(pipe, key, info.encode(), ttl_ms)
    pipe.execute_command("EVAL", JOIN_SCRIPT, 1, schema.hosts_key(), info.host_id)
    if specs:
        flat = [part for item in sorted(specs.items()) for part in item]
        pipe.execute_command("EVAL", SPECS_SCRIPT, 1, schema.namespaces_key(), *flat)
        return 3
    return 2
