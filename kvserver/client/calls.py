"""The calls a client session makes, one sans-I/O procedure per daemon operation, and the
values they exchange.

Runs in client processes; imports no daemon code and no sockets. :class:`SessionCalls` is the
half of :class:`~kvserver.client.common.Session` that speaks the operations (``docs/wire.md``):
each method is a generator that yields :class:`Call` s and receives :class:`Answer` s (a
:data:`Proc`), so :class:`~kvserver.client.sync.KVClient` and
:class:`~kvserver.client.aio.AsyncKVClient` drive the same code. The other half
(``common.py``) holds the session's identity, framing and the daemon's ``hello``; the public
signatures and defaults are ``ops.py``'s.

Multi-step procedures (``store``, ``load`` through the mapped arena) clean up the same way in
both clients: a failed write rolls back its reservation, a finished read releases its pins.
Both check the grant's deadline: nothing is copied into or out of a grant past it, and a load
whose copy finished past it raises LeaseExpired instead of returning what it copied (the
daemon may have handed the pages to another key by then).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from kvserver import grants, wire
from kvserver.arena import ArenaView
from kvserver.client.parts import (
    Parts,
    check_copied_in_time,
    check_grant_extents,
    check_live,
    flatten_parts,
    readinto_part,
    split_parts,
    write_part,
)
from kvserver.client.replies import frames_per_part
from kvserver.errors import InvalidArgument, InvalidState, KVServerError, Unavailable
from kvserver.grants import LoadGrant, StoreCompletion, StoreGrant, StoreReservation
from kvserver.namespace import NamespaceSpec
from kvserver.prompts import pack_token_ids

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    op: str
    args: dict[str, Any]
    payload: Sequence[Any] = ()
    #: payload frames its reply may carry at most (``replies.py``): more fail it.
    reply_frames: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    result: dict[str, Any]
    payload: list[memoryview]
    #: the session id of the daemon incarnation that replied ("" when not known)
    sid: str = ""


Proc: TypeAlias = Generator[Call, Answer, T]


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    ns_id: str
    part_bytes: int
    key_size: int
    tp_world_size: int
    chunk_tokens: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    #: chunks found per tier, e.g. {"dram": 3}
    tiers: dict[str, int]


@dataclass(frozen=True, slots=True)
class PutResult:
    #: keys that this call made ready.
    stored: list[bytes]
    #: keys already present (ready or being written by someone else).
    present: list[bytes]
    #: keys refused by reuse gating.
    filtered: list[bytes]
    #: True if the cache could not make room (nothing was stored).
    rejected: bool

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> PutResult:
        """A put reply's result (ZMQ's or the stream's; the daemon's ``put`` result)."""
        return cls(result["stored"], result["present"], result["filtered"], result["rejected"])


class SessionCalls:
    """The daemon operations of a session, as procedures (see the module docstring). Uses the
    session's ``server`` (the daemon's ``hello``: its capabilities), ``specs`` (namespaces
    registered, re-registered after a daemon restart) and ``arena`` (mapped when co-located)."""

    server: dict[str, Any]
    specs: dict[str, NamespaceSpec]
    arena: ArenaView | None

    def register_namespace(self, spec: NamespaceSpec) -> Proc[NamespaceInfo]:
        answer = yield Call(wire.REGISTER_NAMESPACE, {"spec": spec.to_dict()})
        r = answer.result
        info = NamespaceInfo(
            r["ns_id"], r["part_bytes"], r["key_size"], r["tp_world_size"], r["chunk_tokens"]
        )
        self.specs[info.ns_id] = spec
        return info

    # ------------------------------------------------------------------ queries

    def namespaces(self) -> Proc[list[NamespaceSpec]]:
        answer = yield Call(wire.NAMESPACES, {})
        return [NamespaceSpec.from_dict(d) for d in answer.result["namespaces"]]

    def lookup(
        self, ns_id: str, keys: Sequence[bytes], record: bool, touch: bool, local: bool = False
    ) -> Proc[LookupResult]:
        args = {"ns_id": ns_id, "keys": list(keys), "record": record, "touch": touch}
        if local:
            args["local"] = True
        answer = yield Call(wire.LOOKUP, args)
        return _lookup_result(answer)

    def lookup_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora: tuple[str, str] | None,
    ) -> Proc[LookupResult]:
        packed = None  # packed when the daemon takes it: one bin instead of a list of ints
        if wire.CAP_PACKED_TOKEN_IDS in self.server.get("capabilities", ()):
            packed = pack_token_ids(token_ids)
        args = {
            "ns_id": ns_id,
            "token_ids": packed if packed is not None else list(token_ids),
            "cache_salt": cache_salt,
            "lora": list(lora) if lora else None,
        }
        answer = yield Call(wire.LOOKUP_TOKENS, args)
        return _lookup_result(answer)

    def simple(self, op: str, args: dict[str, Any], field: str | None = None) -> Proc[Any]:
        """Ops whose result is one field (or the whole map when ``field`` is None)."""
        answer = yield Call(op, args)
        return answer.result if field is None else answer.result[field]

    # ------------------------------------------------------------------ leases

    def prepare_store(
        self, ns_id: str, keys: Sequence[bytes], lease_s: float | None
    ) -> Proc[StoreGrant | None]:
        """The reservation; the grant in the packed form (no key echoed) when the daemon
        announced ``packed_store_grant``."""
        sent = time.monotonic()  # the deadline counts from the send (pipelined: not the read)
        sent_keys = list(keys)
        args = {"ns_id": ns_id, "keys": sent_keys, "lease_s": lease_s}
        packed = self._ask_packed(args)
        answer = yield Call(wire.PREPARE_STORE, args)
        return self._store_grant(answer, ns_id, sent_keys, packed, sent)

    def _ask_packed(self, args: dict[str, Any]) -> bool:
        """Ask a daemon that announced ``packed_store_grant`` for the packed grant (an older
        daemon would refuse the argument)."""
        if wire.CAP_PACKED_STORE_GRANT in self.server.get("capabilities", ()):
            args["packed"] = True
            return True
        return False

    @staticmethod
    def _store_grant(
        answer: Answer, ns_id: str, keys: list[bytes], packed: bool, sent: float
    ) -> StoreGrant | None:
        """The grant of a ``prepare_store`` of ``keys`` in ``ns_id`` (None: the cache is
        full), in the form asked for; ``sent``: when the request went out (the deadline counts
        from there). Raises InvalidArgument if malformed."""
        data = answer.result["grant"]
        if data is None:
            return None
        if packed:
            return grants.packed_store_grant_from_wire(data, keys, ns_id, sent, answer.sid)
        return grants.store_grant_from_wire(data, sent, answer.sid)

    def prepare_store_completing(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        completions: Sequence[StoreCompletion],
        lease_s: float | None,
    ) -> Proc[StoreReservation]:
        """One ``prepare_store`` carrying ``completions`` when the daemon announced
        ``store_completions`` in ``hello``; else one ``complete_store`` per completion (each
        error its own; Unavailable ends the whole call), then the ``prepare_store``. Without
        completions: a plain ``prepare_store`` (any daemon)."""
        if not completions:
            return StoreReservation((yield from self.prepare_store(ns_id, keys, lease_s)), [])
        if wire.CAP_STORE_COMPLETIONS not in self.server.get("capabilities", ()):
            completed: list[list[bytes] | KVServerError] = []
            for c in completions:
                try:
                    ready = yield from self.complete_store(c.lease_id, c.success, c.ranks, c.keys)
                except Unavailable:
                    raise
                except KVServerError as exc:
                    completed.append(exc)
                else:
                    completed.append(ready)
            grant = yield from self.prepare_store(ns_id, keys, lease_s)
            return StoreReservation(grant, completed)
        sent, sent_keys = time.monotonic(), list(keys)
        args = {
            "ns_id": ns_id,
            "keys": sent_keys,
            "lease_s": lease_s,
            "completions": grants.completions_to_wire(completions),
        }
        packed = self._ask_packed(args)
        answer = yield Call(wire.PREPARE_STORE, args)
        grant = self._store_grant(answer, ns_id, sent_keys, packed, sent)
        done = grants.completion_results_from_wire(
            answer.result.get("completions"), len(completions)
        )
        return StoreReservation(grant, done)

    def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], lease_s: float | None
    ) -> Proc[LoadGrant]:
        """The pins; the grant in the packed form (no key echoed) when the daemon announced
        ``packed_load_grant``."""
        sent, sent_keys = time.monotonic(), list(keys)
        args: dict[str, Any] = {"ns_id": ns_id, "keys": sent_keys, "lease_s": lease_s}
        packed = wire.CAP_PACKED_LOAD_GRANT in self.server.get("capabilities", ())
        if packed:  # an older daemon would refuse the argument
            args["packed"] = True
        answer = yield Call(wire.PREPARE_LOAD, args)
        data = answer.result["grant"]
        if packed:
            return grants.packed_load_grant_from_wire(data, sent_keys, ns_id, sent, answer.sid)
        return grants.load_grant_from_wire(data, sent, answer.sid)

    def complete_store(
        self,
        lease_id: int,
        success: bool,
        ranks: Sequence[int] | None,
        keys: Sequence[bytes] | None,
    ) -> Proc[list[bytes]]:
        args = {
            "lease_id": lease_id,
            "success": success,
            "ranks": None if ranks is None else list(ranks),
            "keys": None if keys is None else list(keys),
        }
        answer = yield Call(wire.COMPLETE_STORE, args)
        return list(answer.result["ready"])

    def complete_load(self, lease_id: int) -> Proc[None]:
        yield Call(wire.COMPLETE_LOAD, {"lease_id": lease_id})

    # ------------------------------------------------------------------ payload paths

    def put(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, lease_s: float | None
    ) -> Proc[PutResult]:
        payload = flatten_parts(keys, parts)
        answer = yield Call(
            wire.PUT, {"ns_id": ns_id, "keys": list(keys), "lease_s": lease_s}, payload
        )
        return PutResult.from_result(answer.result)

    def get(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        ranks: Sequence[int] | None,
        leading: bool = False,
        spec: NamespaceSpec | None = None,
    ) -> Proc[list[list[memoryview]]]:
        """Parts of ``keys``; ``leading``: of the leading run the daemon holds in its own
        tiers (as many rows as keys it sent, at most ``len(keys)``). ``spec``: the
        namespace's, when this session did not register it (else the registered one): its
        reply may carry at most the frames of ``len(keys)`` x ranks parts (``replies.py``),
        and a split part of another size than ``part_bytes`` is refused before it is joined
        (``split_parts``)."""
        if spec is None:
            spec = self.specs.get(ns_id)
        part_bytes = spec.part_bytes if spec is not None else None
        per_key = len(ranks) if ranks else spec.tp_world_size if spec is not None else None
        args: dict[str, Any] = {
            "ns_id": ns_id,
            "keys": list(keys),
            "ranks": list(ranks) if ranks else None,
            "leading": True if leading else None,
        }
        answer = yield Call(
            wire.GET, args, reply_frames=_reply_frames(len(keys), per_key, part_bytes)
        )
        if not leading:
            return split_parts(answer.result, answer.payload, len(keys), part_bytes, per_key)
        sent = answer.result.get("keys")
        if not isinstance(sent, list) or len(sent) > len(keys) or sent != list(keys[: len(sent)]):
            raise InvalidArgument("get reply names keys that were not asked for")
        return split_parts(answer.result, answer.payload, len(sent), part_bytes, per_key)

    def _part_bytes(self, ns_id: str) -> int | None:
        """The part size of ``ns_id`` when this session registered it."""
        spec = self.specs.get(ns_id)
        return spec.part_bytes if spec is not None else None

    def write_parts(
        self,
        lease_id: int,
        keys: Sequence[bytes],
        rank: int,
        parts: Sequence[Any],
        complete: bool,
    ) -> Proc[list[bytes]]:
        args = {"lease_id": lease_id, "keys": list(keys), "rank": rank, "complete": complete}
        answer = yield Call(wire.WRITE_PARTS, args, list(parts))
        return list(answer.result["ready"])

    def read_parts(
        self, ns_id: str, lease_id: int, keys: Sequence[bytes], rank: int
    ) -> Proc[list[memoryview]]:
        args = {"ns_id": ns_id, "lease_id": lease_id, "keys": list(keys), "rank": rank}
        part_bytes = self._part_bytes(ns_id)
        budget = _reply_frames(len(keys), 1, part_bytes)
        answer = yield Call(wire.READ_PARTS, args, reply_frames=budget)
        rows = split_parts(answer.result, answer.payload, len(keys), part_bytes, 1)
        return [views[0] for views in rows]

    def store(
        self, ns_id: str, keys: Sequence[bytes], parts: Parts, lease_s: float | None
    ) -> Proc[list[bytes]]:
        """Whole entries: through the arena when mapped, else ``put``. Returns keys stored."""
        if self.arena is None:
            result = yield from self.put(ns_id, keys, parts, lease_s)
            return result.stored
        arena = self.arena
        flat = flatten_parts(keys, parts)
        per_key = len(flat) // len(keys) if keys else 0
        grant = yield from self.prepare_store(ns_id, keys, lease_s)
        if grant is None or not grant.keys:
            return []
        index = {key: i for i, key in enumerate(keys)}
        lease_id, deadline = grant.lease_id, grant.deadline
        try:
            for key, extents in zip(grant.keys, grant.locations, strict=True):
                if len(extents) != per_key:
                    raise InvalidArgument(
                        "need one part per TP rank", parts=per_key, tp_world_size=len(extents)
                    )
                check_live(lease_id, deadline)  # a stalled client writes nothing late
                for rank, ext in enumerate(extents):
                    write_part(arena, ext, flat[index[key] * per_key + rank])
        except Exception:
            with contextlib.suppress(KVServerError):
                yield Call(wire.COMPLETE_STORE, {"lease_id": grant.lease_id, "success": False})
            raise
        answer = yield Call(wire.COMPLETE_STORE, {"lease_id": grant.lease_id})
        return list(answer.result["ready"])

    def load(
        self, ns_id: str, keys: Sequence[bytes], ranks: Sequence[int] | None
    ) -> Proc[list[list[memoryview]]]:
        """Whole entries (or ``ranks``): copied out of the arena when mapped, else ``get``."""
        if self.arena is None:
            return (yield from self.get(ns_id, keys, ranks))
        arena = self.arena
        grant = yield from self.prepare_load(ns_id, keys, None)
        try:
            if len(grant.locations) != len(keys):  # it pins every key asked, in order
                raise InvalidArgument("load grant of another number of keys than asked",
                                      keys=len(keys), granted=len(grant.locations))  # fmt: skip
            check_grant_extents(arena, grant.locations)  # before a buffer is sized from them
            check_live(grant.lease_id, grant.deadline)  # a stalled client does not start late
            out: list[list[memoryview]] = []
            for extents in grant.locations:
                chosen = [extents[r] for r in ranks] if ranks else list(extents)
                row = []
                for ext in chosen:
                    buf = bytearray(sum(length for _, length in ext))
                    readinto_part(arena, ext, buf)
                    row.append(memoryview(buf))
                out.append(row)
            check_copied_in_time(grant.lease_id, grant.deadline)  # late: maybe another key's
        finally:
            yield Call(wire.COMPLETE_LOAD, {"lease_id": grant.lease_id})
        return out

    # ------------------------------------------------------------------ arena access

    def mapped(self) -> ArenaView:
        if self.arena is None:
            raise InvalidState("the arena is not mapped (daemon not co-located): use put/get")
        return self.arena


def _reply_frames(keys: int, per_key: int | None, part_bytes: int | None) -> int:
    """The payload frames a reply of ``keys`` x ``per_key`` parts of ``part_bytes`` may carry
    (unknown ranks or size: the reply's own limit on its list of parts)."""
    if per_key is None or part_bytes is None:
        return wire.MAX_REPLY_ARRAY_LEN
    return keys * per_key * frames_per_part(part_bytes)


def _lookup_result(answer: Answer) -> LookupResult:
    r = answer.result
    return LookupResult(r["hit_chunks"], r["hit_tokens"], r["num_chunks"], dict(r["tiers"]))
