"""The fleet's Redis fails over to a replica behind one address (a DNS name or a virtual IP
that moves, as Sentinel-managed and managed Redis deployments do): the old master stays up,
demoted to a replica of the new one, which lacks the writes it had not replicated yet.

The address is a loopback proxy (:class:`MovingAddress`): a connection opened before the
move stays with the old server, one opened after goes to the new one, as a TCP connection
to a name or an IP that moved does. Real redis-servers, a real replication.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from kvserver.cluster import FleetReader, schema
from kvserver.cluster.config import connect
from tests.kvserver.cluster.builders import NS, Member, cluster_config, eventually, keys
from tests.support.redis import RedisServer, require_redis


class MovingAddress:
    """A loopback port whose new connections go to ``target`` (a Redis port, changed by
    :meth:`move`); connections already open stay with the server they reached."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def move(self, target: int) -> None:
        self.target = target

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        if self.tasks:  # each ends once its client closed (the node and reader stopped first)
            await asyncio.wait(self.tasks, timeout=10.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
        finally:
            for w in (up_w, writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    with contextlib.suppress(Exception):
        dst.write_eof()


async def test_a_failover_behind_one_address_to_a_lagging_replica_is_followed(
    tmp_path: Path,
) -> None:
    """The member's pooled connection reaches the old master, which now answers every write
    READONLY: the member must connect anew (reaching the new master) and resync there, the
    index whole again although the replica was promoted without the member's last writes.
    Before, the member kept its pooled connection to the demoted server and stayed
    ``unavailable`` (READONLY at every retry) for as long as that connection lived."""
    require_redis()
    old = RedisServer.start(tmp_path / "old")
    new = RedisServer.start(tmp_path / "new")
    address = MovingAddress(old.port)
    port = await address.start()
    config = cluster_config(f"redis://127.0.0.1:{port}/0", ttl_s=30.0, heartbeat_s=0.3)
    a = Member("host-a", config)
    reader = FleetReader(connect(config), config)
    node = None
    try:
        new.cli("REPLICAOF", "127.0.0.1", str(old.port))
        node = await a.start()
        ks = keys(200)
        a.store(ks[:100])
        await a.settled()
        await eventually(lambda: _replicated(new, node.writer.index_keys()[0], 100), timeout=20.0)
        new.cli("REPLICAOF", "NO", "ONE")  # promoted: replication stops here
        a.store(ks[100:])  # written to the old master only: lost with the failover
        await a.settled()
        old.cli("REPLICAOF", "127.0.0.1", str(new.port))  # demoted: READONLY from now on
        address.move(new.port)
        await reader.redis.connection_pool.disconnect()  # the test's reader: the new server

        async def whole_on_the_new_master() -> bool:
            runs = await reader.lookup(NS, ks)
            return node.condition == "ok" and [r.hit_chunks for r in runs] == [200]

        await eventually(whole_on_the_new_master, timeout=20.0)
        assert node.counters.errors >= 1  # READONLY, once
        assert int(new.cli("EXISTS", schema.host_key("host-a"))) == 1
    finally:
        await reader.redis.aclose()
        if node is not None:
            await node.stop()
        await address.close()
        old.stop()
        new.stop()


async def _replicated(server: RedisServer, key: str, members: int) -> bool:
    return server.cli("SCARD", key) == str(members)
