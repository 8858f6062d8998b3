"""The gRPC front end: ``kvserver.v1.KVServer`` plus grpc.health.v1 and server reflection.

Runs in the daemon process, on its one event loop (uvloop in production): grpc.aio runs every
handler as a coroutine on that loop, so handlers call :class:`KVService` directly, without
locks, and never from another thread. Handlers are lean: decode, one batched service call,
encode — no per-block Python objects beyond the keys themselves.

Call order: ``GrpcFrontend(service, config)`` → ``await start()`` (returns the bound port) →
serve → ``await stop(grace)``: health turns NOT_SERVING, WatchEvents streams end (status OK),
the server stops accepting and in-flight RPCs get ``grace`` seconds before being cancelled.
The WatchEvents streams (where one resumes, at most ``max_event_watchers`` open) are
:class:`~kvserver.daemon.grpc_watch.EventStreams`; this module authenticates them and maps
their errors.

Requests are decoded here, not by grpc: methods are registered with identity (de)serializers
so that undecodable bytes become INVALID_ARGUMENT instead of grpc's generic INTERNAL. The
mapping from :class:`~kvserver.errors.KVServerError` codes to gRPC status codes lives here
only (:data:`STATUS_BY_CODE`, documented in docs/grpc.md); every error also carries trailing
metadata ``kvserver-error-code`` so clients can rebuild the typed error.

TLS: with ``tls_cert_file``/``tls_key_file`` the port is TLS only (``tls_client_ca_file``:
client certificates required, mutual TLS). Auth: when tokens are configured, every KVServer RPC
needs metadata ``authorization: Bearer <token>`` (UNAUTHENTICATED otherwise); health and
reflection stay open.
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.cluster.rpc import score_hosts
from kvserver.crypto import TlsServer
from kvserver.daemon.access import allow_prefix
from kvserver.daemon.auth import ANONYMOUS, Authenticator, Principal, not_registered
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.grpc_stats import MAX_STATUS_DETAILS, stats_response
from kvserver.daemon.grpc_watch import CannotResume, EventStreams
from kvserver.daemon.listening import bind_hint
from kvserver.daemon.results import LookupHits, Pending
from kvserver.daemon.service import KVService
from kvserver.errors import InvalidArgument, KVServerError, Unauthenticated
from kvserver.eventlog import EventGap
from kvserver.grpc_format import (
    ERROR_CODE_KEY,
    EVENTS_DROPPED_CODE,
    OLDEST_SEQ_KEY,
    SERVICE_NAME,
    bearer_token,
    keys_from_proto,
    namespace_to_proto,
    spec_from_proto,
    token_ids_from_proto,
)
from kvserver.grpc_limit import ConnectionLimit
from kvserver.grpc_serve import start_server
from kvserver.namespace import NamespaceSpec

logger = logging.getLogger(__name__)

#: kvserver error code → gRPC status; subclasses fall back to their nearest listed base.
STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unsupported_version": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_namespace": grpc.StatusCode.NOT_FOUND,
    "unknown_key": grpc.StatusCode.NOT_FOUND,
    "lease_error": grpc.StatusCode.FAILED_PRECONDITION,
    "lease_expired": grpc.StatusCode.FAILED_PRECONDITION,
    "invalid_state": grpc.StatusCode.FAILED_PRECONDITION,
    "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "storage_error": grpc.StatusCode.INTERNAL,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}

MAX_NAMESPACE_ID = 64
_SERVING = health_pb2.HealthCheckResponse.SERVING


#: how an RPC ends in error: status, details, trailing metadata.
_Failure = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


def _failure(exc: Exception) -> _Failure:
    """The status, details and trailing metadata for ``exc`` (logs unexpected exceptions)."""
    extra: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, DecodeError):
        exc = InvalidArgument(f"cannot decode the request: {exc}")
    if isinstance(exc, EventGap):
        exc = CannotResume(f"{exc}; resynchronise, then resume from seq {exc.oldest}", exc.oldest)
    if isinstance(exc, CannotResume):
        status, code, details = grpc.StatusCode.OUT_OF_RANGE, EVENTS_DROPPED_CODE, str(exc)
        extra = ((OLDEST_SEQ_KEY, str(exc.oldest)),)
    elif isinstance(exc, KVServerError):
        status, code, details = status_for(exc), exc.code, str(exc)
    else:
        logger.error("gRPC handler failed", exc_info=exc)
        status, code = grpc.StatusCode.INTERNAL, "internal"
        details = f"internal error ({type(exc).__name__}); see the daemon log"
    return status, details[:MAX_STATUS_DETAILS], ((ERROR_CODE_KEY, code), *extra)


async def _abort(context: grpc.aio.ServicerContext, failure: _Failure) -> NoReturn:
    """End the RPC with ``failure``; call it outside any except clause (see ``_unary``)."""
    status, details, metadata = failure
    await context.abort(status, details, trailing_metadata=metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover


def status_for(exc: KVServerError) -> grpc.StatusCode:
    """The gRPC status code of a kvserver error (by ``code``, walking up its classes)."""
    for cls in type(exc).__mro__:
        status = STATUS_BY_CODE.get(getattr(cls, "code", ""))
        if status is not None:
            return status
    return grpc.StatusCode.INTERNAL


class GrpcFrontend:
    """Serves the query/control API of one :class:`KVService` over grpc.aio."""

    def __init__(
        self, service: KVService, config: DaemonConfig, auth: Authenticator | None = None
    ) -> None:
        self.service = service
        self.config = config
        #: identity of this daemon run's event log (sequence numbers restart with the daemon).
        self.log_id = secrets.token_hex(8)
        self._auth = auth if auth is not None else Authenticator.single(config.auth_token)
        self._specs: dict[str, NamespaceSpec] = {}
        self._server: grpc.aio.Server | None = None
        self._limit: ConnectionLimit | None = None
        self._health = health.aio.HealthServicer()
        self._streams = EventStreams(service, self.log_id, config.max_event_watchers)
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Bind ``config.host:config.grpc_port`` (0 = ephemeral) and serve; returns the port.

        REQUIRES: called on the daemon's running event loop, once. Raises KVServerError if the
        address cannot be bound (in use, bad host).
        """
        handlers = {
            "Lookup": self._unary(pb.LookupRequest, self._lookup),
            "Stats": self._unary(pb.StatsRequest, self._stats),
            "ListNamespaces": self._unary(pb.ListNamespacesRequest, self._list_namespaces),
            "RegisterNamespace": self._unary(pb.RegisterNamespaceRequest, self._register),
            "Pin": self._unary(pb.PinRequest, self._pin),
            "Unpin": self._unary(pb.UnpinRequest, self._unpin),
            "WatchEvents": grpc.unary_stream_rpc_method_handler(self._watch_events),
            "ScoreHosts": self._unary(pb.ScoreHostsRequest, self._score_hosts),
        }
        cfg = self.config
        credentials = None
        if cfg.tls_cert_file:
            tls = TlsServer(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            credentials = tls.credentials()
        try:
            self._server, self.port, self._limit = await start_server(
                SERVICE_NAME, handlers, self._health, cfg.host, cfg.grpc_port,
                credentials=credentials, per_address=cfg.grpc_max_connections_per_address,
            )  # fmt: skip
        except KVServerError as exc:  # gRPC says no more than "failed to bind"
            reason = exc.message.split("; set GRPC_VERBOSITY", 1)[0]
            raise KVServerError(f"{reason}{bind_hint('--grpc-port')}") from None
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop accepting, end WatchEvents streams, let in-flight RPCs finish within ``grace``
        seconds (then cancel them). Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._limit is not None:
            self._limit.stop()
        await self._health.enter_graceful_shutdown()
        self._streams.stop()
        await server.stop(grace)

    # ------------------------------------------------------------------ plumbing

    def _unary(
        self, request_type: type[Message], method: Callable[[Principal, Any], Any]
    ) -> grpc.RpcMethodHandler:
        """``method(principal, request)``: the caller's principal decides what it may do."""
        parse = request_type.FromString

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                who = self._authenticate(context)
                reply = method(who, parse(raw))  # async for calls that wait on I/O (ScoreHosts)
                reply = await reply if inspect.isawaitable(reply) else reply
                data: bytes = reply.SerializeToString()
                return data
            except Exception as exc:
                failure = _failure(exc)
            # Abort outside the except clause, the request dropped: an abort raised inside it
            # chains the error, whose traceback holds this frame and so the request's bytes
            # until the cycle collector runs (150 refused 10 MB requests grew RSS by 2.6 GB).
            del raw
            await _abort(context, failure)

        return grpc.unary_unary_rpc_method_handler(handle)

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Principal:
        """The caller's principal, from ``authorization: Bearer <token>`` metadata."""
        if not self._auth.required:
            return ANONYMOUS
        token = bearer_token(context.invocation_metadata())
        if token is None:
            raise Unauthenticated("missing or wrong 'authorization: Bearer <token>' metadata")
        return self._auth.check(token)

    def _namespace(self, ns_id: str) -> NamespaceSpec:
        """The spec of ``ns_id``; InvalidArgument if empty/oversized, UnknownNamespace."""
        spec = self._specs.get(ns_id)
        if spec is not None:
            return spec
        if not ns_id:
            raise InvalidArgument("namespace_id is required")
        if len(ns_id) > MAX_NAMESPACE_ID:
            raise InvalidArgument("namespace_id too long", length=len(ns_id))
        self._specs = {s.ns_id: s for s in self.service.list_namespaces()}
        spec = self._specs.get(ns_id)
        if spec is None:
            raise not_registered(ns_id)
        return spec

    def _prefix_keys(
        self, who: Principal, ns_id: str, request: Any
    ) -> Sequence[bytes] | Awaitable[Sequence[bytes]]:
        """Chunk keys of a request's ``prefix`` oneof (tokens are hashed by the service: a long
        prompt on a thread, then awaitable keys, after its checks)."""
        which = request.WhichOneof("prefix")
        if which == "keys":
            key_size = self._namespace(ns_id).key_size
            return keys_from_proto(request.keys, key_size, self.service.max_keys_per_request)
        if which == "tokens":
            t = request.tokens
            lora = (t.lora.name, t.lora.path) if t.HasField("lora") else None
            # one uint32 array, which the hasher takes as it is
            return self.service.prompts.prompt_keys(
                ns_id,
                token_ids_from_proto(t),
                cache_salt=t.cache_salt or None,
                lora=lora,
                caller=who.name,
            )
        raise InvalidArgument("set exactly one of 'tokens' or 'keys'")

    # ------------------------------------------------------------------ unary methods

    def _lookup(self, who: Principal, req: pb.LookupRequest) -> Message | Awaitable[Message]:
        ns_id = req.namespace_id
        spec = self._namespace(ns_id)
        allow_prefix(who, spec, req)
        chunk_tokens = spec.chunk_tokens

        def answer(keys: Sequence[bytes]) -> Message | Awaitable[Message]:
            result = self.service.lookup(ns_id, keys)
            if isinstance(result, Pending):
                pending = result

                async def finish() -> Message:
                    return _lookup_response(ns_id, chunk_tokens, await pending.run())

                return finish()
            return _lookup_response(ns_id, chunk_tokens, result)

        return _then(self._prefix_keys(who, ns_id, req), answer)

    def _score_hosts(self, who: Principal, req: pb.ScoreHostsRequest) -> Awaitable[Message]:
        allow = None if who.is_admin else partial(allow_prefix, who)
        return score_hosts(self.service, req, allow=allow, caller=who.name)

    def _pin(self, who: Principal, req: pb.PinRequest) -> Message | Awaitable[Message]:
        ns_id = req.namespace_id
        allow_prefix(who, self._namespace(ns_id), req, write=True)
        return _then(
            self._prefix_keys(who, ns_id, req),
            lambda keys: pb.PinResponse(
                pinned_chunks=self.service.pin(ns_id, keys, req.ttl_s), num_chunks=len(keys)
            ),
        )

    def _unpin(self, who: Principal, req: pb.UnpinRequest) -> Message | Awaitable[Message]:
        ns_id = req.namespace_id
        allow_prefix(who, self._namespace(ns_id), req, write=True)
        return _then(
            self._prefix_keys(who, ns_id, req),
            lambda keys: pb.UnpinResponse(
                unpinned_chunks=self.service.unpin(ns_id, keys), num_chunks=len(keys)
            ),
        )

    def _list_namespaces(
        self, who: Principal, req: pb.ListNamespacesRequest
    ) -> pb.ListNamespacesResponse:
        reply = pb.ListNamespacesResponse()
        for spec in self.service.list_namespaces():
            if req.model in ("", spec.model) and who.sees(spec):
                try:
                    reply.namespaces.append(namespace_to_proto(spec))
                except ValueError:  # registered over ZMQ with values beyond the proto's ints
                    logger.warning("namespace %s cannot be listed over gRPC", spec.ns_id)
        return reply

    def _register(self, who: Principal, req: pb.RegisterNamespaceRequest) -> pb.Namespace:
        if not req.HasField("spec"):
            raise InvalidArgument("spec is required")
        spec = spec_from_proto(req.spec)
        who.may_register(spec)
        try:
            reply = namespace_to_proto(spec)  # check before registering: nothing half-done
        except ValueError as exc:
            raise InvalidArgument(f"namespace parameters out of range: {exc}") from None
        self.service.register_namespace(spec)
        return reply

    def _stats(self, who: Principal, req: pb.StatsRequest) -> pb.StatsResponse:
        return stats_response(self.service, who, self.log_id)

    # ------------------------------------------------------------------ WatchEvents

    async def _watch_events(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        who = ANONYMOUS
        try:
            who = self._authenticate(context)
            from_seq = self._streams.admit(pb.WatchEventsRequest.FromString(raw))
            failure = None
        except Exception as exc:
            failure = _failure(exc)
        if failure is not None:
            await _abort(context, failure)
        try:
            await self._streams.serve(from_seq, context, who)
            return
        except EventGap as exc:  # the subscriber fell behind the bounded log
            failure = _failure(exc)
        await _abort(context, failure)


def _then(
    keys: Sequence[bytes] | Awaitable[Sequence[bytes]],
    answer: Callable[[Sequence[bytes]], Message | Awaitable[Message]],
) -> Message | Awaitable[Message]:
    """``answer(keys)``, now, or on the loop once awaitable ``keys`` are hashed."""
    if not inspect.isawaitable(keys):
        return answer(keys)
    hashing = keys

    async def later() -> Message:
        reply = answer(await hashing)
        return await reply if inspect.isawaitable(reply) else reply

    return later()


def _lookup_response(ns_id: str, chunk_tokens: int, result: LookupHits) -> pb.LookupResponse:
    return pb.LookupResponse(
        namespace_id=ns_id,
        hit_chunks=result.hit_chunks,
        hit_tokens=result.hit_tokens,
        num_chunks=result.num_chunks,
        chunk_tokens=chunk_tokens,
        tiers=[
            pb.TierHits(tier=tier, chunks=n, tokens=n * chunk_tokens)
            for tier, n in result.tiers.items()
        ],
    )
