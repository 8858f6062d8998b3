"""Starting a grpc.aio server the way every kvserver process does.

Runs on the caller's event loop (the daemon's, the scheduler's). One helper so the daemon's
``kvserver.v1.KVServer`` front end and the scheduler's ``kvserver.v1.Engine`` front door
cannot differ in how they bind, size messages, answer health checks and expose reflection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserver.errors import KVServerError
from kvserver.grpc_format import MAX_MESSAGE_BYTES
from kvserver.grpc_limit import (
    MAX_CONNECTIONS_PER_ADDRESS,
    ConnectionLimit,
    max_connections,
    server_options,
)
from kvserver.netaddr import host_port

logger = logging.getLogger(__name__)


async def start_server(
    service_name: str,
    handlers: Mapping[str, grpc.RpcMethodHandler],
    health_servicer: health.aio.HealthServicer,
    host: str,
    port: int,
    *,
    credentials: grpc.ServerCredentials | None = None,
    per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
) -> tuple[grpc.aio.Server, int, ConnectionLimit]:
    """Serve ``handlers`` as ``service_name`` on ``host:port`` (0 = ephemeral; IPv6 hosts
    bracketed), with grpc.health.v1 (``health_servicer``, set SERVING for "" and
    ``service_name``) and server reflection; TLS when ``credentials`` are given. Messages up to
    ``MAX_MESSAGE_BYTES`` each way; no SO_REUSEPORT (a second server on the same port must
    fail); its connections bounded (``grpc_limit.py``: in all, ``per_address`` from one address,
    idle, unfinished handshakes, calls per connection). Returns the started server, its port and
    the started per-address limit (stop it when the server stops). Raises KVServerError if the
    address cannot be bound (in use, bad host)."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *server_options(max_connections()),
        ]
    )
    table = dict(handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, table),))
    server.add_registered_method_handlers(service_name, table)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = host_port(host, port)
    try:
        if credentials is not None:
            bound: int = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise KVServerError(f"cannot bind gRPC to {address}: {exc}") from None
    if bound == 0:
        raise KVServerError(f"cannot bind gRPC to {address}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    limit = ConnectionLimit(bound, per_address, what=service_name)
    limit.start()
    logger.info("gRPC serving %s on %s", service_name, address.rsplit(":", 1)[0] + f":{bound}")
    return server, bound, limit
