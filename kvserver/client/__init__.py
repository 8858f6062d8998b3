"""Python clients of the kvserver daemon's ZMQ data plane: :class:`KVClient` (blocking) and
:class:`AsyncKVClient` (asyncio), with the same operations and the same session behaviour
(timeouts, reconnection, shared-memory data path and local channel when co-located,
pipelining: ``submit_*``), defined once in :mod:`kvserver.client.ops`. See ``docs/wire.md``."""

from kvserver.client.aio import AsyncKVClient
from kvserver.client.calls import LookupResult, NamespaceInfo, PutResult
from kvserver.client.pending import Pending
from kvserver.client.sync import KVClient

__all__ = ["AsyncKVClient", "KVClient", "LookupResult", "NamespaceInfo", "Pending", "PutResult"]
