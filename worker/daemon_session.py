"""DaemonSession: a worker connector's session with its daemon: the clients, the data path
(the daemon's arena mapped, or one client per direction) and which daemon incarnation it is
with.

Runs in each worker process, owned by :class:`~worker.kv_connector.KVServerWorkerConnector`
and called on its thread only (not thread-safe; the transfer engine's threads use the
per-direction clients, never this object).

Lifecycle: made unconnected (the daemon may be down at start-up); ``connect`` registers the
namespace and chooses the data path; ``restarted`` asks the daemon whether it is still the
incarnation whose arena is mapped; ``drop_arena`` (the arena's file is gone: the daemon
stopped or restarted; the caller has waited for the copies into the old mapping) unmaps it
and starts over with new clients, unconnected; ``close`` once, at the end.

Invariants: ``arena`` is set only while ``connected``; ``arena_sid`` is the session id of the
``hello`` the arena was mapped after ("" while none is mapped); ``io`` holds a client per
direction only when no arena is mapped (the remote data path).
"""

from __future__ import annotations

import logging

import torch

from kvserver.arena import is_arena_name
from kvserver.client import KVClient
from kvserver.errors import InvalidState, KVServerError
from kvserver.namespace import NamespaceSpec
from kvserver.wire import host_id
from worker.config import WorkerConnectorConfig
from worker.host import MappedArena
from worker.transfer import Direction

logger = logging.getLogger(__name__)


class DaemonSession:
    """See the module docstring."""

    def __init__(self, config: WorkerConnectorConfig) -> None:
        self.config = config
        self.kv = self._client("main")
        self.io: dict[Direction, KVClient] = {}
        self.arena: MappedArena | None = None
        #: the daemon incarnation (session id) whose arena is mapped; "" when none is.
        self.arena_sid = ""
        #: False until the namespace is registered (the daemon may be down at start-up).
        self.connected = False

    def connect(self, spec: NamespaceSpec, device: torch.device) -> None:
        """Register the namespace and choose the data path (map the arena, else open one
        client per direction); ``device``: the KV caches'. Raises KVServerError if the
        daemon cannot be reached."""
        self.kv.register_namespace(spec)
        self._map_arena(device)
        if self.arena is None:
            for d in Direction:
                if d not in self.io:
                    self.io[d] = self._client(d.value)
                self.io[d].register_namespace(spec)
        self.connected = True

    def restarted(self) -> bool:
        """Whether the daemon is no longer the incarnation whose arena is mapped (asked with
        one ``hello``; a daemon that does not answer has not been seen to restart)."""
        try:
            return str(self.kv.hello().get("sid", "")) != self.arena_sid
        except KVServerError:
            return False

    def drop_arena(self) -> None:
        """Unmap the arena and close the clients (their sessions went with that daemon); new
        clients, not connected. REQUIRES: no copy into the mapping is in flight."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.arena_sid = ""
        for kv in (self.kv, *self.io.values()):
            kv.close()
        self.kv, self.io = self._client("main"), {}
        self.connected = False

    def close(self) -> None:
        """Unmap the arena and close the clients. REQUIRES: the transfer engine is closed."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for kv in (self.kv, *self.io.values()):
            kv.close()

    def _client(self, role: str) -> KVClient:
        base = self.config.client_id
        return KVClient(
            self.config.address, timeout=self.config.timeout_s, auth_token=self.config.auth_token,
            client_id=f"{base}-{role}" if base else None, colocated=False,
            curve=self.config.curve,
        )  # fmt: skip

    def _map_arena(self, device: torch.device) -> None:
        mode = self.config.colocated
        if mode is False:
            return
        info = self.kv.hello()
        path = info.get("arena_path")
        try:
            if info.get("host_id") != host_id() or not isinstance(path, str):
                raise InvalidState("the daemon runs on another host")
            if not is_arena_name(path):  # the daemon's word: never map just any file
                raise InvalidState("the daemon's arena_path does not name an arena", path=path)
            self.arena = MappedArena(path, pin=device.type == "cuda")
            self.arena_sid = str(info.get("sid", ""))
        except KVServerError as exc:
            if mode:
                raise
            logger.warning("cannot map the arena (%s); using payload frames", exc)
