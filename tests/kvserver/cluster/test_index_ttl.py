"""An index set never exists without a TTL, even when the writer's connection is cut between
two of a batch's commands (a daemon SIGKILLed, a network drop): a set that outlived its host
with no TTL would be kept forever.

The writer's pipeline goes to a real redis-server (Redis and Valkey, through either client)
through a proxy that forwards the first ``k`` complete commands only, then cuts the
connection; every ``k`` from the first command to the last is tried.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvserver.cluster import schema
from kvserver.cluster.config import connect
from kvserver.cluster.writer import IndexWriter
from kvserver.events import MEDIUM_DRAM, MEDIUM_SSD, BlockRemoved, BlockStored
from tests.kvserver.cluster.builders import NS, cluster_config, keys
from tests.support.redis import RedisServer

PING = b"*1\r\n$4\r\nPING\r\n"


def command_end(buf: bytes) -> int:
    """Where the first complete RESP command of ``buf`` ends (an array of bulk strings, as
    clients send), or 0 when it is not complete yet."""
    if not buf.startswith(b"*"):
        assert not buf, f"not a RESP command: {buf[:20]!r}"
        return 0
    eol = buf.find(b"\r\n")
    if eol < 0:
        return 0
    pos = eol + 2
    for _ in range(int(buf[1:eol])):
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return 0
        pos = eol + 2 + int(buf[pos + 1 : eol]) + 2
        if pos > len(buf):
            return 0
    return pos


class CuttingProxy:
    """Loopback proxy to ``upstream`` that forwards ``limit`` commands of a connection, then
    makes sure Redis ran them (a PING after them answered) and closes both ends."""

    def __init__(self, upstream: int, limit: int) -> None:
        self.upstream, self.limit = upstream, limit
        self.forwarded = 0
        #: the connections' handlers, awaited before the test checks Redis (and so that no
        #: socket outlives the test unclosed)
        self.handlers: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            raise
        try:
            await self._relay(reader, writer, up_r, up_w)
        finally:
            for w in (up_w, writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:

        async def replies() -> None:
            while data := await up_r.read(65536):
                writer.write(data)

        pump = asyncio.ensure_future(replies())
        buf = b""
        try:
            while self.forwarded < self.limit:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                while self.forwarded < self.limit and (end := command_end(buf)):
                    up_w.write(buf[:end])
                    buf = buf[end:]
                    self.forwarded += 1
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            up_w.write(PING)  # answered once Redis ran every command before it
            tail = b""
            while not tail.endswith(b"+PONG\r\n"):
                data = await up_r.read(65536)
                assert data, "Redis closed the connection"
                tail = (tail + data)[-64:]


def batch_writer(ttl_ms: int) -> IndexWriter:
    """A writer whose next batch creates a DRAM and an SSD set, and removes from the DRAM one."""
    w = IndexWriter("host-a", "inc1", ttl_ms)
    ks = keys(5)
    w.add(
        [BlockStored(1, NS, tuple(ks[:3]), MEDIUM_DRAM), BlockRemoved(2, NS, (ks[0],), MEDIUM_DRAM)]
    )
    w.add([BlockStored(3, NS, tuple(ks[3:]), MEDIUM_SSD)])
    return w


async def write_through(server: RedisServer, url: str, limit: int) -> int:
    """One batch written through a proxy forwarding ``limit`` commands; the commands
    forwarded (fewer than ``limit``: the whole batch went through)."""
    proxy = CuttingProxy(server.port, limit)
    listener = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = cluster_config(url.replace(f":{server.port}/", f":{port}/"))
    redis = connect(config)
    try:
        w = batch_writer(config.ttl_ms)
        batch = w.take_batch()
        assert batch is not None
        server.cli("SET", w.fence_key, "0", "PX", str(config.ttl_ms))  # the writes expect 0
        pipe = redis.pipeline(transaction=False)
        w.apply(pipe, batch, 0)
        with contextlib.suppress(Exception):  # the cut: a ConnectionError (or a timeout)
            await asyncio.wait_for(pipe.execute(), 5)
    finally:
        with contextlib.suppress(Exception):
            await redis.aclose()
        if proxy.handlers:  # the client is gone: each handler ends (Redis ran what it got)
            await asyncio.wait(proxy.handlers, timeout=10)
        listener.close()
        await listener.wait_closed()
    return proxy.forwarded


def untimed_keys(server: RedisServer) -> list[str]:
    """Keys of the fleet schema without a TTL (the hosts set and the specs have none)."""
    found = server.cli("--scan", "--pattern", f"{schema.PREFIX}:*").split()
    return [k for k in found if int(server.cli("PTTL", k)) == -1]


async def test_an_index_set_has_a_ttl_whatever_command_the_connection_is_cut_after(
    fleet_server: RedisServer, fleet_url: str
) -> None:
    whole = await write_through(fleet_server, fleet_url, 10_000)
    written = fleet_server.cli("--scan", "--pattern", f"{schema.PREFIX}:*").split()
    assert len(written) == 3 and untimed_keys(fleet_server) == []  # the batch, the fence
    for limit in range(1, whole):
        fleet_server.cli("FLUSHALL")
        assert await write_through(fleet_server, fleet_url, limit) == limit
        assert untimed_keys(fleet_server) == [], f"cut after {limit} of {whole} commands"
