"""The front door: gRPC ``kvserver.v1.Engine`` (``Generate``, ``EngineStats``) plus grpc.health.v1
and server reflection, served by the scheduler process; over TLS (optionally mutual) when
given a :class:`~kvserver.crypto.TlsServer` (required beyond loopback: scheduler/config.py).

Runs on the scheduler process's event loop (grpc.aio), next to the step loop; handlers only
talk to an :class:`EngineBackend` (``scheduler/engine_core.py``'s ``EngineCore``), never to the
scheduler directly. Call order: ``EngineService(backend, host, port)`` → ``await start()``
(returns the bound port) → serve → ``await stop(grace)``: health turns NOT_SERVING, new RPCs
are refused, in-flight ones get ``grace`` seconds, then they are cancelled (and a cancelled
``Generate`` aborts its request, freeing its blocks).

Auth: given an :class:`~kvserver.daemon.auth.Authenticator` that requires a token (by default
the scheduler makes a random one and leaves it for its own user, ``scheduler/process.py``),
``Generate`` and ``EngineStats`` need metadata ``authorization: Bearer <token>``, checked before
the request is decoded; a missing or wrong one is UNAUTHENTICATED and changes nothing. Health
and reflection stay open (a load balancer's probe).

Requests are decoded here (identity deserializers), so undecodable bytes are
INVALID_ARGUMENT, not grpc's INTERNAL. Errors map to status codes only here:
:data:`STATUS_BY_CODE`; every error also carries trailing metadata ``kvserver-error-code``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health

from kvserver._proto.kvserver.v1 import engine_pb2 as pb
from kvserver.crypto import TlsServer
from kvserver.daemon.auth import Authenticator
from kvserver.daemon.listening import bind_hint
from kvserver.errors import CapacityError, InvalidArgument, KVServerError, Unauthenticated
from kvserver.grpc_format import ERROR_CODE_KEY, bearer_token
from kvserver.grpc_limit import MAX_CONNECTIONS_PER_ADDRESS, ConnectionLimit
from kvserver.grpc_serve import start_server
from kvserver.prompts import MAX_PROMPT_TOKENS
from scheduler.request import PromptUsage, RequestOutput

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvserver.v1.Engine"
DEFAULT_PORT = 9480
MAX_STATUS_DETAILS = 1024
#: most stop_token_ids a request may name (held as a set for its life: 3M were +308 MB).
MAX_STOP_TOKEN_IDS = 1024

#: kvserver error code → gRPC status (subclasses walk up to their nearest listed base)
STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unsupported_version": grpc.StatusCode.INVALID_ARGUMENT,
    "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "invalid_state": grpc.StatusCode.FAILED_PRECONDITION,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "internal": grpc.StatusCode.INTERNAL,
}
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """A validated Generate request."""

    token_ids: list[int]
    max_tokens: int
    greedy: bool = True
    cache_salt: str | None = None
    request_id: str = ""
    priority: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0


class RequestStream(Protocol):
    """The outputs of one submitted request; ``close()`` aborts it if still unfinished."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...
    def close(self) -> None: ...


class EngineBackend(Protocol):
    """What the front door needs from the step loop."""

    def submit(self, params: GenerateParams) -> RequestStream:
        """Queue a request. Raises KVServerError (InvalidArgument, CapacityError,
        Unavailable while the workers are down) with nothing queued."""
        ...

    def stats(self) -> dict[str, Any]: ...


def status_for(exc: KVServerError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        status = STATUS_BY_CODE.get(getattr(cls, "code", ""))
        if status is not None:
            return status
    return grpc.StatusCode.INTERNAL


def params_from_proto(req: pb.GenerateRequest) -> GenerateParams:
    """Validate a GenerateRequest (InvalidArgument names the field; CapacityError for a
    prompt longer than any request may be: the daemon's bound, ``kvserver.prompts``; the
    scheduler's max_model_len then applies). The lists are counted before they are copied."""
    if not req.token_ids:
        raise InvalidArgument("token_ids: the prompt needs at least one token")
    if len(req.token_ids) > MAX_PROMPT_TOKENS:
        raise CapacityError(
            f"prompt too long: at most {MAX_PROMPT_TOKENS} token ids in one request",
            prompt_tokens=len(req.token_ids),
        )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", count=len(req.stop_token_ids)
        )
    if req.max_tokens < 1:
        raise InvalidArgument("max_tokens must be >= 1")
    if len(req.request_id) > 256:
        raise InvalidArgument("request_id too long", length=len(req.request_id))
    return GenerateParams(
        token_ids=list(req.token_ids),
        max_tokens=req.max_tokens,
        greedy=req.greedy,
        cache_salt=req.cache_salt or None,
        request_id=req.request_id,
        priority=req.priority,
        stop_token_ids=list(req.stop_token_ids),
        seed=req.seed,
    )


def _usage_proto(usage: PromptUsage) -> pb.PromptUsage:
    return pb.PromptUsage(
        prompt_tokens=usage.prompt_tokens,
        gpu_cached_tokens=usage.gpu_cached_tokens,
        kvserver_tokens=usage.kvserver_tokens,
        computed_tokens=usage.computed_tokens,
        num_preemptions=usage.num_preemptions,
    )


class _RequestFailed(KVServerError):
    """A request ended with an error after it started (its worker failed)."""

    code = "unavailable"


class EngineService:
    """Serves ``kvserver.v1.Engine`` for one backend; see the module docstring."""

    def __init__(
        self,
        backend: EngineBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: TlsServer | None = None,
        auth: Authenticator | None = None,
        token_hint: str = "",
        per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
    ) -> None:
        """``auth``: the tokens callers must present (None: none); ``token_hint``: where a
        caller finds the token, said when it presents none or a wrong one; ``per_address``:
        the most connections one address may hold (``grpc_limit.py``)."""
        self.backend = backend
        self._auth = auth or Authenticator()
        self.token_hint = token_hint
        self.host = host
        self.port = port
        self.tls = tls
        self.per_address = per_address
        self._server: grpc.aio.Server | None = None
        self._limit: ConnectionLimit | None = None
        self._health = health.aio.HealthServicer()

    async def start(self) -> int:
        """Bind ``host:port`` (0 = ephemeral) and serve (over TLS with ``tls``); returns the
        port. Raises KVServerError if the address cannot be bound or a TLS file read."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(self._generate),
            "EngineStats": grpc.unary_unary_rpc_method_handler(self._engine_stats),
        }
        credentials = self.tls.credentials() if self.tls is not None else None
        try:
            self._server, self.port, self._limit = await start_server(
                SERVICE_NAME, handlers, self._health, self.host, self.port,
                credentials=credentials, per_address=self.per_address,
            )  # fmt: skip
        except KVServerError as exc:  # gRPC says no more than "failed to bind": say what to do
            reason = exc.message.split("; set GRPC_VERBOSITY", 1)[0]
            raise KVServerError(f"{reason}{bind_hint('--grpc-port')}") from None
        return self.port

    async def stop(self, grace: float) -> None:
        """Refuse new RPCs, give in-flight ones ``grace`` seconds, then cancel. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._limit is not None:
            self._limit.stop()
        await self._health.enter_graceful_shutdown()
        await server.stop(grace)

    # ------------------------------------------------------------------ handlers

    async def _generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        try:
            self._authenticate(context)
            params = params_from_proto(pb.GenerateRequest.FromString(raw))
            stream = self.backend.submit(params)
        except Exception as exc:
            await self._abort(context, exc)
        try:
            async for out in stream:
                if out.error is not None:
                    raise _RequestFailed(out.error, request=stream.request_id)
                msg = pb.GenerateResponse(
                    request_id=stream.request_id,
                    token_ids=out.new_token_ids,
                    finished=out.finished,
                    finish_reason=_FINISH_REASONS.get(
                        out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED
                    ),
                )
                if out.usage is not None:
                    msg.usage.CopyFrom(_usage_proto(out.usage))
                yield msg.SerializeToString()
                if out.finished:
                    break
        except Exception as exc:
            await self._abort(context, exc)
        finally:
            stream.close()  # aborts the request if the client went away

    async def _engine_stats(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self._authenticate(context)
            pb.EngineStatsRequest.FromString(raw)
            s = self.backend.stats()
            reply = pb.EngineStatsResponse(
                step=s["step"],
                running=s["running"],
                waiting=s["waiting"],
                waiting_for_remote_kvs=s["waiting_for_remote_kvs"],
                free_blocks=s["free_blocks"],
                total_blocks=s["total_blocks"],
                gpu_cached_blocks=s["gpu_cached_blocks"],
                evicted_blocks=s["evicted_blocks"],
                workers=[
                    pb.WorkerStatus(rank=w["rank"], address=w["address"], up=w["up"])
                    for w in s["workers"]
                ],
                workers_error=s["workers_error"],
                kvserver_connector=s["kvserver_connector"],
            )
            data: bytes = reply.SerializeToString()
            return data
        except Exception as exc:
            await self._abort(context, exc)

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Raise Unauthenticated unless the call carries the front door's token."""
        if not self._auth.required:
            return
        try:
            self._auth.check(bearer_token(context.invocation_metadata()))
        except Unauthenticated:
            hint = f" ({self.token_hint})" if self.token_hint else ""
            raise Unauthenticated(
                "the scheduler's front door needs its token: missing or wrong "
                f"'authorization: Bearer <token>' metadata{hint}"
            ) from None

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        if isinstance(exc, DecodeError):
            exc = InvalidArgument(f"cannot decode the request: {exc}")
        if isinstance(exc, KVServerError):
            status, code, details = status_for(exc), exc.code, str(exc)
        else:
            logger.exception("Engine handler failed")
            status, code = grpc.StatusCode.INTERNAL, "internal"
            details = f"internal error ({type(exc).__name__}); see the scheduler log"
        await context.abort(
            status, details[:MAX_STATUS_DETAILS], trailing_metadata=((ERROR_CODE_KEY, code),)
        )
        raise AssertionError("context.abort returned")  # pragma: no cover
