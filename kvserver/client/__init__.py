"""Python clients of the kvserver daemon's ZMQ data plane: :class:`KVClient` (blocking) and
:class:`AsyncKVClient` (asyncio), with the same operations and the same session behaviour
(timeouts, reconnection, shared-memory data path when co-located). See ``docs/wire.md``."""

from kvserver.client.aio import AsyncKVClient
from kvserver.client.common import LookupResult, NamespaceInfo, PutResult
from kvserver.client.sync import KVClient

__all__ = ["AsyncKVClient", "KVClient", "LookupResult", "NamespaceInfo", "PutResult"]
