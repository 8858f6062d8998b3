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
daemon's front end imports too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import grpc

from kvserver._proto.kvserver.v1 import kvserver_pb2 as pb
from kvserver.crypto import TlsClient
from kvserver.errors import (
    InvalidArgument,
    KVServerError,
    Unauthenticated,
    Unavailable,
    error_from_code,
)
from kvserver.events import Event
from kvserver.grpc_format import (
    ERROR_CODE_KEY,
    EVENTS_DROPPED_CODE,
    FROM_SEQ_KEY,
    LOG_ID_KEY,
    MAX_MESSAGE_BYTES,
    MEDIUM_FROM_PROTO,
    OLDEST_SEQ_KEY,
    SERVICE_NAME,
    bearer_metadata,
    event_from_proto,
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


class EventsDropped(KVServerError):
    """WatchEvents cannot resume where asked (events dropped, or the daemon restarted).

    Resynchronise (e.g. Lookup what you track), then watch again from ``oldest_seq``.
    """

    code: ClassVar[str] = EVENTS_DROPPED_CODE

    def __init__(self, message: str, *, oldest_seq: int = 0) -> None:
        super().__init__(message)
        self.oldest_seq = oldest_seq


# ---------------------------------------------------------------------- the client


class EventStream:
    """Iterator over the events of one WatchEvents call; :meth:`close` ends it.

    :attr:`log_id` and :attr:`next_seq` say where the stream stands (before the first event:
    where the daemon started it). Resume after a disconnect, with no gap and no duplicate, by
    ``client.watch_events(stream.next_seq, log_id=stream.log_id)``. Iteration ends when the
    daemon shuts down or after :meth:`close`; errors are raised from ``next()``.
    """

    def __init__(self, call: Any, target: str, from_seq: int, log_id: str) -> None:
        self._rpc = call
        self._target = target
        self._closed = False
        self._log_id = log_id
        self._next_seq = from_seq  # 0 = not known until the daemon's headers arrive

    @property
    def log_id(self) -> str:
        self._resolve()
        return self._log_id

    @property
    def next_seq(self) -> int:
        """Seq of the next event this stream will deliver (0 if the call failed at once)."""
        self._resolve()
        return self._next_seq

    def _resolve(self) -> None:
        if self._next_seq and self._log_id:
            return
        try:
            metadata = dict(self._rpc.initial_metadata() or ())
        except grpc.RpcError:
            return
        self._log_id = self._log_id or str(metadata.get(LOG_ID_KEY, ""))
        seq = str(metadata.get(FROM_SEQ_KEY, ""))
        if not self._next_seq and seq.isdigit():
            self._next_seq = int(seq)

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        try:
            msg = next(self._rpc)
        except grpc.RpcError as exc:
            if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise _error(exc, self._target) from None
        self._log_id = msg.log_id
        self._next_seq = msg.seq + 1
        return event_from_proto(msg)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rpc.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            raise _error(exc, self.target, tls=self._tls) from None
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
            raise _error(exc, self.target, tls=self._tls) from None


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


def _error(exc: grpc.RpcError, target: str, tls: bool | None = None) -> KVServerError:
    """The kvserver error of a failed call (typed when the daemon said which). ``tls``:
    whether the channel uses TLS (None: unknown), to say when a TLS mismatch is the likely
    reason a connection failed."""
    call: Any = exc
    status = call.code()
    details = call.details() or status.name
    metadata = dict(call.trailing_metadata() or ())
    code = metadata.get(ERROR_CODE_KEY)
    if code == EVENTS_DROPPED_CODE:
        oldest = metadata.get(OLDEST_SEQ_KEY, "0")
        return EventsDropped(details, oldest_seq=int(oldest) if oldest.isdigit() else 0)
    if isinstance(code, str) and code:
        return error_from_code(code, details)
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = _tls_hint(details, tls)
        return Unavailable(f"kvserver at {target} is unreachable ({status.name}): {details}{hint}")
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if status in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return InvalidArgument(details, status=status.name)
    return KVServerError(details, status=status.name)


def _tls_hint(details: str, tls: bool | None) -> str:
    """What a connection failure's ``details`` say about TLS, in the client options' names."""
    low = details.lower()
    if tls and any(w in low for w in ("ssl", "handshake", "certificate", "tls")):
        return (
            "; the TLS handshake failed: tls_ca_file must be the CA of the daemon's "
            "certificate, tls_server_name a name in it, and tls_cert_file/tls_key_file a "
            "client certificate when the daemon requires one (docs/security.md)"
        )
    if tls is False and "socket closed" in low:
        return (
            "; the daemon closed the connection: if it serves gRPC over TLS, give tls_ca_file "
            "(--tls-ca-file; docs/security.md)"
        )
    return ""
