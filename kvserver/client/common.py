"""The client core shared by :class:`KVClient` (sync) and :class:`AsyncKVClient` (asyncio).

Runs in client processes (scheduler, workers, tools); imports no daemon code. Not thread-safe:
one :class:`Session` belongs to one client object.

Sans-I/O: every operation is a generator that yields :class:`Call` s and receives
:class:`Answer` s (or has the daemon's error thrown into it), so the two clients differ only in
how they exchange one call for one answer. Multi-step operations (``store``, ``load`` on the
shared-memory path) therefore clean up the same way in both: a failed write rolls back its
reservation, a finished read releases its pins. Replies are read with :meth:`Session.decode`
and :meth:`Session.outcome`, so a client with several requests outstanding (the sync client's
``submit_*``, :mod:`kvserver.client.pending`) can hand each reply to its own request;
:meth:`Session.accept` is the one-request-in-flight shortcut.

Session life: the first call (and the first after a timeout or a daemon restart, recognised by
a new server session id ``sid`` in a reply) runs ``hello`` — which maps the arena when the
daemon is on this host — and re-registers every namespace this client registered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from kvserver import grants, wire
from kvserver.arena import ArenaView
from kvserver.client.handshake import Failure
from kvserver.client.parts import (
    Parts,
    flatten_parts,
    frame_buffer,
    readinto_part,
    split_parts,
    write_part,
)
from kvserver.crypto import CurveClient
from kvserver.errors import InvalidArgument, InvalidState, KVServerError, Unavailable
from kvserver.grants import LoadGrant, StoreCompletion, StoreGrant, StoreReservation
from kvserver.namespace import NamespaceSpec
from kvserver.token_file import TokenFile

logger = logging.getLogger(__name__)

T = TypeVar("T")
Buffer: TypeAlias = bytes | bytearray | memoryview

DEFAULT_TIMEOUT_S = 10.0
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000


@dataclass(frozen=True, slots=True)
class Call:
    op: str
    args: dict[str, Any]
    payload: Sequence[Any] = ()


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


def default_client_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class Session:
    """Identity, daemon session, registered namespaces, the mapped arena, request ids."""

    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        auth_token: str = "",
        colocated: bool | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.address = address
        self.client_id = client_id or default_client_id()
        self.auth_token = auth_token
        #: without a token of our own: the one a daemon on this host left for its user
        self._token_file = TokenFile(address) if not auth_token else None
        self._sent_token = auth_token  # the token of the last request encoded
        self._presented = ""  # the token the newest DEALER presents at its handshake
        #: CURVE settings applied to every ZMQ socket of this session (None: plain TCP).
        self.curve = curve
        #: None: use shared memory when possible; False: never; True: required.
        self.colocated_mode = colocated
        self.needs_hello = True
        self.sid: str | None = None
        self.server: dict[str, Any] = {}
        self.specs: dict[str, NamespaceSpec] = {}
        self.arena: ArenaView | None = None
        self._next_id = 0

    # ------------------------------------------------------------------ framing

    def encode(self, call: Call) -> tuple[int, list[Any]]:
        """Frames of ``call`` with a fresh request id, carrying the token read last (no
        system call: the token file is read at connect and after a refusal)."""
        self._next_id += 1
        auth = self.auth_token if self._token_file is None else self._token_file.token()
        self._sent_token = auth
        header = wire.encode_request(
            self._next_id, call.op, call.args, auth=auth, client=self.client_id
        )
        return self._next_id, [header, *call.payload]

    def accept(self, frames: Sequence[Any], req_id: int) -> Answer | None:
        """The answer to ``req_id`` in ``frames``; None for a stale or unreadable reply.

        For a client with one request in flight. Raises the daemon's error (a typed
        KVServerError) for an error reply. A reply from a new daemon instance marks the session
        for a fresh hello.
        """
        reply = self.decode(frames)
        if reply is None:
            return None
        # id 0: the daemon could not read our header, and only one request is in flight.
        if reply.req_id != req_id and not (reply.req_id == 0 and not reply.ok):
            logger.debug("discarding stale reply %d (waiting for %d)", reply.req_id, req_id)
            return None
        outcome = self.outcome(reply, frames)
        if isinstance(outcome, KVServerError):
            raise outcome
        return outcome

    def decode(self, frames: Sequence[Any]) -> wire.Reply | None:
        """The reply header in ``frames``; None (logged) when it cannot be read."""
        try:
            return wire.decode_reply(frame_buffer(frames[0]))
        except InvalidArgument as exc:
            logger.warning("discarding unreadable reply from %s: %s", self.address, exc)
            return None

    def outcome(self, reply: wire.Reply, frames: Sequence[Any]) -> Answer | KVServerError:
        """What the request ``reply`` answers got: an Answer, or the daemon's typed error. A
        reply from a new daemon instance marks the session for a fresh hello."""
        if self.sid is not None and reply.sid != self.sid:
            logger.info("daemon at %s restarted; renewing the session", self.address)
            self.needs_hello = True
        if reply.error is not None:
            return reply.error
        return Answer(reply.result, [frame_buffer(f) for f in frames[1:]], reply.sid)

    def token_changed(self) -> bool:
        """True when the token file (read again) holds another token than our last request
        carried or our DEALER presented (a restarted daemon refused it): retry once."""
        if self._token_file is None:
            return False
        token = self._token_file.reload()
        presented = self._presented if self.curve is None else token
        return bool(token) and (token != self._sent_token or token != presented)

    def handshake_token(self) -> str:
        """The token a new DEALER presents at the ZMQ handshake (``docs/wire.md`` §0): ours,
        else the token file's, read again (it may reach a restarted daemon); "" under CURVE
        (keys instead: a refused header token reloads it, :meth:`token_changed`) or without."""
        if self.curve is not None:
            return ""
        token = self.auth_token if self._token_file is None else self._token_file.reload()
        self._presented = token
        return token

    def timed_out(self, call: Call, timeout: float, why: Failure | None = None) -> KVServerError:
        """The error of a call without a reply (Unavailable); ``why``: the failed handshake
        that explains it (:meth:`kvserver.client.handshake.Failure.error`)."""
        self.needs_hello = True
        if why is not None:
            return why.error(f"cannot talk to {self.address}: {why}", op=call.op)
        return Unavailable(f"no reply from {self.address} within {timeout}s", op=call.op)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # ------------------------------------------------------------------ session

    def hello(self) -> Proc[dict[str, Any]]:
        answer = yield Call(wire.HELLO, {})
        info = answer.result
        self.sid, self.server = str(info["sid"]), info
        self.needs_hello = False
        self._map_arena(info)
        return info

    def _map_arena(self, info: dict[str, Any]) -> None:
        mode = self.colocated_mode
        path = info.get("arena_path")
        same_host = info.get("host_id") == wire.host_id() and isinstance(path, str)
        if self.arena is not None and (not same_host or self.arena.path != path):
            self.close()
        if mode is False or self.arena is not None:
            return
        if not same_host:
            if mode:
                raise InvalidState("colocated=True but the daemon runs on another host")
            return
        try:
            arena = ArenaView.attach(str(path))
        except KVServerError as exc:
            if mode:
                raise
            logger.info("cannot map the arena (%s); using the remote data path", exc)
            return
        if arena.size != info.get("arena_size"):
            arena.close()
            raise InvalidState("arena size differs from what the daemon reports", path=path)
        self.arena = arena

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
        args = {
            "ns_id": ns_id,
            "token_ids": list(token_ids),
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
        sent = time.monotonic()  # the deadline counts from the send (pipelined: not the read)
        answer = yield Call(
            wire.PREPARE_STORE, {"ns_id": ns_id, "keys": list(keys), "lease_s": lease_s}
        )
        data = answer.result["grant"]
        if data is None:
            return None
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
        sent = time.monotonic()
        args = {
            "ns_id": ns_id,
            "keys": list(keys),
            "lease_s": lease_s,
            "completions": grants.completions_to_wire(completions),
        }
        answer = yield Call(wire.PREPARE_STORE, args)
        data = answer.result["grant"]
        grant = None if data is None else grants.store_grant_from_wire(data, sent, answer.sid)
        done = grants.completion_results_from_wire(
            answer.result.get("completions"), len(completions)
        )
        return StoreReservation(grant, done)

    def prepare_load(
        self, ns_id: str, keys: Sequence[bytes], lease_s: float | None
    ) -> Proc[LoadGrant]:
        sent = time.monotonic()
        answer = yield Call(
            wire.PREPARE_LOAD, {"ns_id": ns_id, "keys": list(keys), "lease_s": lease_s}
        )
        return grants.load_grant_from_wire(answer.result["grant"], sent, answer.sid)

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
        r = answer.result
        return PutResult(r["stored"], r["present"], r["filtered"], r["rejected"])

    def get(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        ranks: Sequence[int] | None,
        leading: bool = False,
    ) -> Proc[list[list[memoryview]]]:
        """Parts of ``keys``; ``leading``: of the leading run the daemon holds in its own
        tiers (as many rows as keys it sent, at most ``len(keys)``)."""
        args: dict[str, Any] = {
            "ns_id": ns_id,
            "keys": list(keys),
            "ranks": list(ranks) if ranks else None,
            "leading": True if leading else None,
        }
        answer = yield Call(wire.GET, args)
        if not leading:
            return split_parts(answer.result, answer.payload, len(keys))
        sent = answer.result.get("keys")
        if not isinstance(sent, list) or len(sent) > len(keys) or sent != list(keys[: len(sent)]):
            raise InvalidArgument("get reply names keys that were not asked for")
        return split_parts(answer.result, answer.payload, len(sent))

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
        answer = yield Call(wire.READ_PARTS, args)
        return [views[0] for views in split_parts(answer.result, answer.payload, len(keys))]

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
        try:
            for key, extents in zip(grant.keys, grant.locations, strict=True):
                if len(extents) != per_key:
                    raise InvalidArgument(
                        "need one part per TP rank", parts=per_key, tp_world_size=len(extents)
                    )
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
            out: list[list[memoryview]] = []
            for extents in grant.locations:
                chosen = [extents[r] for r in ranks] if ranks else list(extents)
                row = []
                for ext in chosen:
                    buf = bytearray(sum(length for _, length in ext))
                    readinto_part(arena, ext, buf)
                    row.append(memoryview(buf))
                out.append(row)
        finally:
            yield Call(wire.COMPLETE_LOAD, {"lease_id": grant.lease_id})
        return out

    # ------------------------------------------------------------------ arena access

    def mapped(self) -> ArenaView:
        if self.arena is None:
            raise InvalidState("the arena is not mapped (daemon not co-located): use put/get")
        return self.arena


def _lookup_result(answer: Answer) -> LookupResult:
    r = answer.result
    return LookupResult(r["hit_chunks"], r["hit_tokens"], r["num_chunks"], dict(r["tiers"]))
