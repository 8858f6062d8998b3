"""A small typed client of the kvserver query/control API (gRPC ``kvserver.v1.KVServer``).

Runs in any process: the ``kvserver status`` / ``kvserver lookup`` commands, tests, routers.
Blocking (grpc's sync channel); like a grpc channel, one :class:`GrpcClient` may be shared by
threads. Call order: ``GrpcClient(target)`` → any calls → :meth:`GrpcClient.close` (or use it
as a context manager; an unclosed channel leaks a socket and a warning).

Every call has a deadline: the client's ``timeout`` unless the call passes its own (a
WatchEvents stream has none unless asked: it is meant to stay open). Errors are raised as
:class:`~kvserver.errors.KVServerError` subclasses: the daemon's typed errors rebuilt from the
``kvserver-error-code`` trailing metadata, :class:`~kvserver.errors.Unavailable` when the
daemon cannot be reached in time, :class:`EventsDropped` when a WatchEvents resume point is
gone.

The wire constants and the protobuf conversions are in ``kvserver/grpc_format.py``, which the
daemon's front end imports too; a failed call's error is made by ``kvserver/grpc_errors.py``;
a WatchEvents stream is a ``kvserver/grpc_events.py`` :class:`EventStream`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.crypto import TlsClient
from kvserver.errors import InvalidArgument
from kvserver.grpc_errors import EventsDropped, rpc_error
from kvserver.grpc_events import EventStream
from kvserver.grpc_format import (
    MAX_MESSAGE_BYTES,
    MEDIUM_FROM_PROTO,
    SERVICE_NAME,
    bearer_metadata,
    keys_to_proto,
    spec_from_proto,
    spec_to_proto,
    tokens_to_proto,
)
from kvserver.grpc_replies import (
    LookupReply,
    NamespaceReply,
    NamespaceStats,
    PinReply,
    ServerStats,
    TierStats,
    copy_fields,
)
from kvserver.namespace import NamespaceSpec
from kvserver.token_file import TokenFile

DEFAULT_TARGET = "127.0.0.1:9470"
DEFAULT_TIMEOUT_S = 5.0

#: EventStream and EventsDropped are defined in kvserver/grpc_events.py and grpc_errors.py and
#: importable from here, with the client that makes and raises them.
__all__ = ["DEFAULT_TARGET", "DEFAULT_TIMEOUT_S", "EventStream", "EventsDropped", "GrpcClient"]


# ---------------------------------------------------------------------- the client


class GrpcClient:
    """Blocking client of one daemon's gRPC API. See the module docstring for errors."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        auth_token: str | None = None,
        tls: TlsClient | None = None,
    ) -> None:
        """``tls``: connect with TLS, trusting its CA (and presenting its client certificate
        when it has one); None: plain TCP."""
        if timeout <= 0:
            raise InvalidArgument("timeout must be positive", timeout=timeout)
        self.target = target
        self.timeout = timeout
        self._auth_token = auth_token
        self._tls = tls is not None
        #: without a token of our own: the one a daemon on this host left for its user
        self._token_file = TokenFile(target) if not auth_token else None
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if tls is not None:
            self._channel = grpc.secure_channel(
                target, tls.credentials(), options=[*options, *tls.options()]
            )
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._methods: dict[str, Any] = {}
        #: send key prefixes as ``packed_keys``; turned off for good when the daemon turns
        #: out to predate that field (see :meth:`call_keys`)
        self.packed_keys = True
        #: send Lookup's token ids as ``packed_token_ids``; turned off likewise
        #: (:meth:`lookup_tokens`)
        self.packed_tokens = True

    def _metadata(self, reload: bool = False) -> tuple[tuple[str, str], ...] | None:
        """The call's bearer token: ours, else the token file's as read last (``reload``: read
        again if it changed)."""
        if self._token_file is None:
            return bearer_metadata(self._auth_token or "")
        return bearer_metadata(self._token_file.reload() if reload else self._token_file.token())

    def _token_renewed(self, exc: grpc.RpcError) -> bool:
        """After ``exc``: True when it is UNAUTHENTICATED and the token file now holds another
        token (a restarted daemon's): worth retrying once with it."""
        if self._token_file is None or exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return False
        before = self._token_file.token()
        return self._token_file.reload() not in ("", before)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ queries

    def lookup_keys(
        self, ns_id: str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> LookupReply:
        """Cached leading run of chunk ``keys`` (in prompt order) and its per-tier split."""
        req = pb.LookupRequest(namespace_id=ns_id)
        msg = self.call_keys("Lookup", req, keys, pb.LookupResponse, timeout)
        return _lookup_reply(msg)

    def lookup_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        timeout: float | None = None,
    ) -> LookupReply:
        """Like :meth:`lookup_keys`, the daemon hashing ``token_ids`` as vLLM would. The ids
        go as ``packed_token_ids`` while :attr:`packed_tokens`; a daemon that predates that
        field sees no tokens (``num_chunks`` 0 although the prompt holds a whole chunk): then
        the call is sent again with ``token_ids`` and this client stops packing."""
        req = pb.LookupRequest(namespace_id=ns_id)
        _set_tokens(req.tokens, token_ids, cache_salt, lora, packed=self.packed_tokens)
        msg = self._call("Lookup", req, pb.LookupResponse, timeout)
        if msg.num_chunks == 0 and 0 < msg.chunk_tokens <= len(token_ids) and self.packed_tokens:
            self.packed_tokens = False
            req.tokens.Clear()
            _set_tokens(req.tokens, token_ids, cache_salt, lora, packed=False)
            msg = self._call("Lookup", req, pb.LookupResponse, timeout)
        return _lookup_reply(msg)

    def stats(self, *, timeout: float | None = None) -> ServerStats:
        msg = self._call("Stats", pb.StatsRequest(), pb.StatsResponse, timeout)
        tiers = [
            copy_fields(TierStats, t, medium=MEDIUM_FROM_PROTO.get(t.medium, "")) for t in msg.tiers
        ]
        namespaces = [
            copy_fields(NamespaceStats, n, tiers={u.tier: (u.entries, u.bytes) for u in n.tiers})
            for n in msg.namespaces
        ]
        cluster = (
            {f.name: v for f, v in msg.cluster.ListFields()} if msg.HasField("cluster") else None
        )
        stats: ServerStats = copy_fields(
            ServerStats, msg, tiers=tiers, namespaces=namespaces, cluster=cluster
        )
        return stats

    def list_namespaces(
        self, model: str | None = None, *, timeout: float | None = None
    ) -> list[NamespaceReply]:
        """Registered namespaces (only ``model``'s when given)."""
        req = pb.ListNamespacesRequest(model=model or "")
        msg = self._call("ListNamespaces", req, pb.ListNamespacesResponse, timeout)
        return [_namespace_reply(ns) for ns in msg.namespaces]

    def register_namespace(
        self, spec: NamespaceSpec, *, timeout: float | None = None
    ) -> NamespaceReply:
        """Register ``spec`` (idempotent); returns it with its namespace_id."""
        req = pb.RegisterNamespaceRequest(spec=spec_to_proto(spec))
        return _namespace_reply(self._call("RegisterNamespace", req, pb.Namespace, timeout))

    # ------------------------------------------------------------------ pins

    def pin(
        self,
        ns_id: str,
        *,
        ttl_s: float,
        keys: Sequence[bytes] | None = None,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        timeout: float | None = None,
    ) -> PinReply:
        """Keep a prefix's cached chunks (by ``keys`` or ``token_ids``) for ``ttl_s`` seconds."""
        req = pb.PinRequest(namespace_id=ns_id, ttl_s=ttl_s)
        if keys is not None and token_ids is None:
            msg = self.call_keys("Pin", req, keys, pb.PinResponse, timeout)
        else:
            _set_prefix(req, keys, token_ids, cache_salt, lora)
            msg = self._call("Pin", req, pb.PinResponse, timeout)
        return PinReply(msg.pinned_chunks, msg.num_chunks)

    def unpin(
        self,
        ns_id: str,
        *,
        keys: Sequence[bytes] | None = None,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        timeout: float | None = None,
    ) -> PinReply:
        """Drop the TTL pins of a prefix's chunks."""
        req = pb.UnpinRequest(namespace_id=ns_id)
        if keys is not None and token_ids is None:
            msg = self.call_keys("Unpin", req, keys, pb.UnpinResponse, timeout)
        else:
            _set_prefix(req, keys, token_ids, cache_salt, lora)
            msg = self._call("Unpin", req, pb.UnpinResponse, timeout)
        return PinReply(msg.unpinned_chunks, msg.num_chunks)

    # ------------------------------------------------------------------ events, health

    def watch_events(
        self, from_seq: int = 0, *, log_id: str = "", timeout: float | None = None
    ) -> EventStream:
        """Events from ``from_seq`` (0 = only new ones); see :class:`EventStream`.

        Errors (EventsDropped, Unavailable ...) surface while iterating.
        """
        method = self._method("WatchEvents", pb.Event, stream=True)
        req = pb.WatchEventsRequest(from_seq=from_seq, log_id=log_id)
        call = method(req, timeout=timeout, metadata=self._metadata(reload=True))
        return EventStream(call, self.target, from_seq, log_id)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """grpc.health.v1 status name of ``service`` ("" = the server): "SERVING", ..."""
        from grpc_health.v1 import health_pb2

        method = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            msg = method(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout or self.timeout
            )
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.target, tls=self._tls) from None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status))

    # ------------------------------------------------------------------ plumbing

    def _method(self, name: str, response_type: Any, *, stream: bool = False) -> Any:
        method = self._methods.get(name)
        if method is None:
            factory = self._channel.unary_stream if stream else self._channel.unary_unary
            method = factory(
                f"/{SERVICE_NAME}/{name}",
                request_serializer=_serialize,
                response_deserializer=response_type.FromString,
            )
            self._methods[name] = method
        return method

    def call_keys(
        self,
        name: str,
        request: Any,
        keys: Sequence[bytes],
        response_type: Any,
        timeout: float | None,
    ) -> Any:
        """Call ``name`` with ``keys`` as ``request.keys`` (a ``KeyPrefix``): packed while
        :attr:`packed_keys`. A daemon that predates ``packed_keys`` sees an empty prefix and
        answers ``num_chunks`` 0: then the call is sent again with ``keys`` repeated and this
        client stops packing (one extra call per client against such a daemon)."""
        prefix = request.keys
        keys_to_proto(prefix, keys, packed=self.packed_keys)
        msg = self._call(name, request, response_type, timeout)
        if msg.num_chunks == 0 and prefix.packed_keys:
            self.packed_keys = False
            prefix.Clear()
            keys_to_proto(prefix, keys, packed=False)
            msg = self._call(name, request, response_type, timeout)
        return msg

    def _call(self, name: str, request: Any, response_type: Any, timeout: float | None) -> Any:
        method = self._method(name, response_type)
        try:
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._metadata())
            except grpc.RpcError as exc:
                if not self._token_renewed(exc):
                    raise
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata())
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.target, tls=self._tls) from None


def _serialize(msg: Any) -> bytes:
    data: bytes = msg.SerializeToString()
    return data


def _set_tokens(
    msg: Any,
    token_ids: Sequence[int],
    cache_salt: str | None,
    lora: tuple[str, str] | None,
    *,
    packed: bool = False,
) -> None:
    """Fill the request's TokenPrefix in place (``grpc_format.tokens_to_proto``): copying a
    built TokenPrefix into the request would serialize and parse it again."""
    tokens_to_proto(msg, token_ids, packed=packed)
    if cache_salt:
        msg.cache_salt = cache_salt
    if lora is not None:
        msg.lora.name, msg.lora.path = lora


def _set_prefix(
    req: Any,
    keys: Sequence[bytes] | None,
    token_ids: Sequence[int] | None,
    cache_salt: str | None,
    lora: tuple[str, str] | None,
) -> None:
    if (keys is None) == (token_ids is None):
        raise InvalidArgument("pass exactly one of keys= or token_ids=")
    if keys is not None:
        req.keys.keys.extend(keys)
        req.keys.SetInParent()
    else:
        _set_tokens(req.tokens, token_ids or (), cache_salt, lora)


def _lookup_reply(msg: Any) -> LookupReply:
    reply: LookupReply = copy_fields(LookupReply, msg, tiers={t.tier: t.chunks for t in msg.tiers})
    return reply


def _namespace_reply(msg: Any) -> NamespaceReply:
    info: NamespaceReply = copy_fields(NamespaceReply, msg, spec=spec_from_proto(msg.spec))
    return info
