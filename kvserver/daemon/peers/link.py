"""The data-plane connections to one peer, and the checks on what it sends.

Runs in the daemon process, on its event loop (``zmq.asyncio``). Not thread-safe: loop only.

Call order: ``PeerLink(peer, ...)`` → ``await fetch(spec, keys)`` / ``await lookup(...)``, from
any number of tasks at once (each call takes one of at most ``connections`` DEALER sockets,
opened on first use; more calls wait for one) → ``await close()``. Calls that belong together
(the windows of one fetch) can share one socket instead: ``async with connection() as kv``,
then ``fetch(spec, keys, via=kv)`` from concurrent tasks: they are pipelined on it, and the
replies arrive one after another, each whole, in the order asked (one TCP stream), so the
caller can copy one while the next is still on the wire.

A peer is asked with the data plane's ``get`` and ``leading=True``: it sends the leading run
of the keys it holds in its own tiers (DRAM, or promoted from its SSD) and never asks its own
peers in turn, so fetches cannot chain or loop. The connections are remote ones
(``colocated=False``) even when the peer runs on this host, so its arena is never mapped.

Fetches take the peer's stream port instead when it advertises one this daemon may dial
(:meth:`PeerLink.stream`, ``stream.py``): a ``tcp://`` one unless this daemon uses CURVE, a
``tls://`` one when it has a CA for its peers' certificates): ``PeerFetches`` then drives the
:class:`~kvserver.daemon.peers.stream.PeerStream`, which shares this link's timeout, token and
connection bound.

Every call is bounded by ``timeout_s`` in all (connecting, the session handshake, the reply):
past it, or when the peer's reply is malformed or not a kvserver's at all (whatever the client
raises reading it), the call raises :class:`PeerFailed` and the socket it used is closed (a
late reply cannot be mistaken for the next one). What the peer
sends is checked before anyone sees it (:func:`check_rows`), and what it can make this daemon
receive is bounded per frame: a reply frame over ``max_frame_bytes`` is refused at its length
prefix (ZMQ ``MAXMSGSIZE`` applies to frames, not to a multipart reply's sum).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvserver.client.aio import AsyncKVClient
from kvserver.daemon.peers.directory import Peer, PeerFailed
from kvserver.daemon.peers.stream import TLS_SCHEME, PeerStream, split_address
from kvserver.errors import (
    CapacityError,
    InvalidArgument,
    KVServerError,
    Unavailable,
    UnknownKey,
    UnknownNamespace,
)
from kvserver.namespace import NamespaceSpec
from kvserver.netaddr import host_port

T = TypeVar("T")

__all__ = [
    "DEFAULT_CONNECTIONS",
    "DEFAULT_MAX_FRAME_BYTES",
    "ZMQ_WINDOWS_IN_FLIGHT",
    "PeerFailed",
    "PeerLink",
    "check_rows",
]

#: DEALER sockets per peer unless configured otherwise.
DEFAULT_CONNECTIONS = 4
#: a fetch's windows asked over ZMQ and not yet received, at most, per connection, of a peer
#: that does not announce its ``zmq_send_max_unsent`` (older): two, so one is copied into
#: DRAM while the next is on the wire (``zmq_windows.py``).
ZMQ_WINDOWS_IN_FLIGHT = 2
#: the largest frame a peer's reply may carry over ZMQ unless configured otherwise: the
#: daemon's own bound on inbound frames (``max_message_bytes``), for what its peers send.
DEFAULT_MAX_FRAME_BYTES = 1 << 30


class PeerLink:
    """Connections to one incarnation of one peer; see the module docstring."""

    def __init__(
        self,
        peer: Peer,
        *,
        timeout_s: float,
        auth_token: str = "",
        connections: int = DEFAULT_CONNECTIONS,
        client_id: str | None = None,
        client_options: dict[str, Any] | None = None,
        stream: bool = True,
        stream_tls: ssl.SSLContext | None = None,
        tls_server_name: str = "",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        """``stream``: a plain (``tcp://``) stream port may be used; ``stream_tls``: how a
        ``tls://`` one is dialled (None: it is not); ``tls_server_name``: the name its
        certificate must carry ("" = the host of its address); ``max_frame_bytes``: the
        largest reply frame taken from the peer over ZMQ (a larger one is refused at its
        length prefix, before its bytes are received: the call fails, :class:`PeerFailed`)."""
        if timeout_s <= 0 or connections < 1:
            raise ValueError("need timeout_s > 0 and connections >= 1")
        self.peer = peer
        self.timeout_s = timeout_s
        self._auth_token = auth_token
        self._client_id = client_id
        self._options = dict(client_options or {})
        self._max_frame = max_frame_bytes
        self._max = connections
        self._idle: list[AsyncKVClient] = []
        self._opened = 0
        self._freed = asyncio.Condition()
        self._closed = False
        #: shared connections (``connection()``) a call failed on: closed when given back.
        self._spoiled: set[AsyncKVClient] = set()
        self._stream_allowed = stream
        self._stream_tls = stream_tls
        self._tls_server_name = tls_server_name
        self._stream: PeerStream | None = None
        self._stream_known = False
        #: the peer's cap on a connection's unsent replies, from its ``hello`` (None: not
        #: asked yet; 0: it announces none).
        self._unsent_cap: int | None = None
        #: at most this many windows in flight, once the peer refused one at its cap (0: none
        #: refused): one fewer than the fetch that was refused had.
        self._refused_at = 0

    @property
    def connections_open(self) -> int:
        """Connections opened and not closed (in use or idle)."""
        return self._opened

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncKVClient]:
        """One of our connections for calls pipelined on it (``via=``; module docstring),
        taken within ``timeout_s`` (else :class:`PeerFailed`) and given back when the block
        ends: kept for reuse unless a call on it failed (then closed, so that a late reply
        cannot be taken for another's)."""
        waiting: list[bool] = [False]  # waited for a busy connection
        try:
            async with asyncio.timeout(self.timeout_s):
                kv = await self._acquire(waiting)
        except TimeoutError:
            msg = "no connection to the peer in time"
            if waiting[0]:
                msg += f" (all {self._max} busy with other calls)"
            raise PeerFailed(msg, timed_out=True, busy=waiting[0], peer=self.peer.host_id) from None
        try:
            yield kv
        finally:
            spoiled = kv in self._spoiled
            self._spoiled.discard(kv)
            await self._release(kv, reuse=not spoiled)

    async def fetch(
        self, spec: NamespaceSpec, keys: Sequence[bytes], *, via: AsyncKVClient | None = None
    ) -> list[list[memoryview]]:
        """The parts (one per rank, rank order) of the leading run of ``keys`` the peer holds:
        ``result[i]`` belongs to ``keys[i]``, and ``len(result) <= len(keys)`` (0: it holds
        none of them, or not this namespace). ``via``: a connection of ``connection()``
        (else one is taken for this call). Raises :class:`PeerFailed`, or CapacityError when
        the peer has too many reply bytes unsent to this connection (``zmq_send_max_unsent``:
        ask again once the replies before it have arrived)."""
        ns_id = spec.ns_id
        try:
            rows = await self._call(lambda kv: kv.get(ns_id, keys, leading=True, spec=spec), via)
        except (UnknownNamespace, UnknownKey):
            return []
        check_rows(spec, keys, rows, self.peer)
        return rows

    async def stream(self) -> PeerStream | None:
        """The peer's stream port (``kvserver/wire_stream.py``) when fetches may use it: the
        peer advertises one (its fleet record, or, for a configured peer list, its ``hello``)
        in a mode this daemon may dial: ``tcp://`` when plain streams are allowed
        (``stream``: not with CURVE, whose fleet must not send chunks in clear), ``tls://``
        when ``stream_tls`` is set. A plain stream is never dialled to a TLS port, nor a TLS
        one to a plain port. A port learnt from the ``hello`` that then refuses a connection
        is forgotten and the ``hello`` asked again (a peer restarted on the same data port
        opens another stream port). None: fetch over ZMQ. Raises :class:`PeerFailed` when the
        ``hello`` that would tell fails."""
        if not self._stream_allowed and self._stream_tls is None:
            return None
        stale = self._stream
        if stale is not None and stale.unreachable and self.peer.stream_address is None:
            # learnt from a hello, and its port refused us: the peer may have restarted (same
            # data port, another ephemeral stream port); ask its hello again
            self._stream, self._stream_known = None, False
            await stale.close()
        if not self._stream_known:
            address = self.peer.stream_address
            if address is None:
                info = await self._call(lambda kv: kv.hello())
                address = stream_address_from(self.peer.data_address, info)
                self._note_cap(info)  # for a fetch over ZMQ: no second hello
            stream = None
            tls = address.startswith(TLS_SCHEME)
            if address and (self._stream_tls is not None if tls else self._stream_allowed):
                try:
                    stream = PeerStream(
                        self.peer,
                        address,
                        timeout_s=self.timeout_s,
                        auth_token=self._auth_token,
                        connections=self._max,
                        tls=self._stream_tls if tls else None,
                        server_name=self._tls_server_name,
                    )
                except ValueError:  # a malformed advertised address: ZMQ it is
                    stream = None
            self._stream, self._stream_known = stream, True
        return self._stream

    async def windows_in_flight(self, window_bytes: int) -> int:
        """How many windows of at most ``window_bytes`` a fetch may keep asked and not yet
        received on one ZMQ connection so that the peer never refuses one (``zmq_windows.py``):
        windows of half the ``zmq_send_max_unsent`` its ``hello`` announces (asked once per
        link; at least one): when the next is asked, the peer counts as unsent the ``n - 1``
        others in flight and those just received whose release lags (several on a loaded
        host: the other half is their slack); :data:`ZMQ_WINDOWS_IN_FLIGHT` when it announces
        none (an older peer); after a refusal all the same, one fewer than the fetch that was
        refused had (:meth:`refused`). Raises :class:`PeerFailed` (its hello)."""
        if self._unsent_cap is None:
            self._note_cap(await self._call(lambda kv: kv.hello()))
        if not self._unsent_cap:
            n = ZMQ_WINDOWS_IN_FLIGHT
        else:
            n = max(1, self._unsent_cap // (2 * window_bytes))
        return min(n, self._refused_at) if self._refused_at else n

    def _note_cap(self, hello: dict[str, Any]) -> None:
        cap = hello.get("zmq_send_max_unsent")
        self._unsent_cap = cap if type(cap) is int and cap > 0 else 0

    def refused(self, in_flight: int) -> None:
        """The peer refused a window at its cap (``capacity``) while ``in_flight`` were
        asked: later fetches keep one fewer in flight (at least one: one unsent reply is never
        refused)."""
        self._refused_at = max(1, in_flight - 1)

    async def lookup(self, ns_id: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a leading run) the peer holds in its own tiers. Raises
        :class:`PeerFailed`."""
        try:
            result = await self._call(lambda kv: kv.lookup(ns_id, keys, local=True))
        except UnknownNamespace:
            return 0
        if not 0 <= result.hit_chunks <= len(keys):
            msg = "peer answered an impossible lookup"
            raise PeerFailed(msg, timed_out=False, peer=self.peer.host_id, hits=result.hit_chunks)
        return result.hit_chunks

    async def close(self) -> None:
        """Close every idle connection; connections in use close when their call ends."""
        self._closed = True
        if self._stream is not None:
            await self._stream.close()
        idle, self._idle = self._idle, []
        for kv in idle:
            await kv.close()

    async def _call(
        self, op: Callable[[AsyncKVClient], Awaitable[T]], via: AsyncKVClient | None = None
    ) -> T:
        """Run ``op(client)`` within ``timeout_s`` in all, on ``via`` (a shared connection:
        marked spoiled if the call fails) or on a connection taken for it."""
        kv: AsyncKVClient | None = via
        ok = False
        waiting: list[bool] = [False]  # waited for a busy connection
        try:
            async with asyncio.timeout(self.timeout_s):
                if kv is None:
                    kv = await self._acquire(waiting)
                result = await op(kv)
            ok = True
            return result
        except TimeoutError:
            raise PeerFailed(
                "no connection to the peer in time (all busy with other calls)"
                if waiting[0]
                else "peer did not answer in time",
                timed_out=True,
                busy=waiting[0],
                peer=self.peer.host_id,
                timeout_s=self.timeout_s,
            ) from None
        except (UnknownNamespace, UnknownKey, CapacityError):
            ok = True  # a clean answer (capacity: "retry later"): the connection is fine
            raise
        except PeerFailed:  # a bad address (_acquire): already the peer's failure
            raise
        except Unavailable as exc:
            msg = f"peer unavailable: {exc.message}"
            raise PeerFailed(msg, timed_out=True, peer=self.peer.host_id) from None
        except KVServerError as exc:
            msg = f"peer refused: {exc}"
            raise PeerFailed(msg, timed_out=False, peer=self.peer.host_id) from None
        except Exception as exc:  # not a kvserver's answer (another version, not a kvserver:
            # a hello without its fields, a reply the client cannot use), or an address ZMQ
            # refuses: a failure of that peer, never an error of the load that asked it
            msg = f"peer answered what a kvserver does not ({type(exc).__name__}: {exc})"
            raise PeerFailed(msg, timed_out=False, peer=self.peer.host_id) from None
        finally:
            if via is not None:
                if not ok:
                    self._spoiled.add(via)
            elif kv is not None:
                await self._release(kv, reuse=ok)

    async def _acquire(self, waiting: list[bool]) -> AsyncKVClient:
        """An idle connection, or a new one; sets ``waiting[0]`` once every connection was
        in use and this waited for one to be given back (a timeout then is not the peer's)."""
        async with self._freed:
            while not self._idle and self._opened >= self._max:
                waiting[0] = True
                await self._freed.wait()
            if self._idle:
                return self._idle.pop()
            self._opened += 1
        try:
            return AsyncKVClient(
                self.peer.data_address,
                timeout=self.timeout_s,
                client_id=self._client_id,
                auth_token=self._auth_token,
                colocated=False,
                max_frame_bytes=self._max_frame,
                **self._options,
            )
        except InvalidArgument as exc:  # an address no client takes (a record or --peers
            # entry ZMQ would refuse): the peer fails, and no connection is counted open
            self._opened -= 1
            async with self._freed:
                self._freed.notify()
            raise PeerFailed(
                f"bad peer address: {exc.message}", timed_out=False, peer=self.peer.host_id
            ) from None

    async def _release(self, kv: AsyncKVClient, *, reuse: bool) -> None:
        if reuse and not self._closed:
            self._idle.append(kv)
        else:
            self._opened -= 1
            with contextlib.suppress(Exception):
                await asyncio.shield(kv.close())
        async with self._freed:
            self._freed.notify()


def stream_address_from(data_address: str, hello: dict[str, Any]) -> str:
    """The stream address of a peer whose ``hello`` is ``hello``: ``tls://`` with the port of
    ``peer_stream_tls_port``, else ``tcp://`` with ``peer_stream_port`` (its host is the data
    plane's); "" when it announces neither (an older daemon, none open). An older daemon never
    sees a TLS port (it reads only ``peer_stream_port``), so it never dials one in clear."""
    tls_port, port = hello.get("peer_stream_tls_port"), hello.get("peer_stream_port")
    scheme = TLS_SCHEME if _is_port(tls_port) else "tcp://"
    port = tls_port if _is_port(tls_port) else port
    if not _is_port(port):
        return ""
    try:
        host, _ = split_address(data_address)
    except ValueError:
        return ""
    return f"{scheme}{host_port(host, str(port))}"


def _is_port(port: object) -> bool:
    return type(port) is int and 0 < port < 65536


def check_rows(
    spec: NamespaceSpec, keys: Sequence[bytes], rows: list[list[memoryview]], peer: Peer
) -> None:
    """Refuse (:class:`PeerFailed`) a fetch reply that is not at most ``len(keys)`` rows of
    exactly one part per rank, each exactly ``part_bytes`` long."""
    if len(rows) > len(keys):
        msg = "peer sent more chunks than were asked for"
        raise PeerFailed(msg, timed_out=False, peer=peer.host_id, rows=len(rows), keys=len(keys))
    tp, size = spec.tp_world_size, spec.part_bytes
    for i, row in enumerate(rows):
        if len(row) != tp or any(part.nbytes != size for part in row):
            raise PeerFailed(
                "peer sent parts of the wrong number or size",
                timed_out=False,
                peer=peer.host_id,
                key=keys[i],
                parts=len(row),
                tp_world_size=tp,
                part_bytes=size,
            )
