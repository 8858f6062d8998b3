"""A client's ``put`` and ``get`` on the peer stream: the payload straight into and out of the
arena.

Runs in the daemon process, on its event loop (loop only, not thread-safe); called by
``stream_server.py`` for each op request (``wire_stream.OP_MAGIC``: ``docs/wire.md`` §6,
"Client ops") of a connection whose hello passed, with the request's head read. The format is
:mod:`kvserver.wire_stream`; the client's end is ``kvserver/client/stream.py``.

Why: over ZMQ a remote put's parts land in ZMQ's buffers and the daemon's loop copies each
into the arena (~4 ms of the loop per 64 MiB on the project's 2-core VMs), and a get's parts
go out through ZMQ's I/O thread. Here the daemon reserves the put's pages first and receives
the payload into them (``recvmsg_into`` of the pages' views: the kernel's copy the only one),
and sends a get's parts from the pages under a load lease (``sendmsg``), as for a peer.

Each op has the ZMQ op's semantics and errors: its ``args`` are checked by the ZMQ schema
(``wire_requests.check_args``), the caller's access by ``access.authorize`` (the connection's
principal, from its hello), a lease owner the daemon keeps for itself is refused, the time goes
to ``service.op_seconds`` (labelled by ``op_labels.op_label``) and the service publishes the KV
events. A put:

- is checked whole before anything is reserved (the namespace, duplicate keys, the payload's
  announced size against ``len(keys) x tp x part_bytes``); a refused one has its payload read
  and dropped first (the stream stays in step), then its error reply;
- reserves with the daemon's longest lease (``max_lease_s``), owned by the daemon
  (``owners.STREAM_PUT_CLIENT``: the client releasing its leases, or a lease op naming the
  reservation's id, cannot give the pages back while bytes land in them), receives each
  granted key's parts into its pages and the others' (present, filtered, or all when DRAM is full:
  ``rejected``) into a scratch buffer that is dropped; each read waits at most the
  connection's timeout, the whole payload at most half that lease (so no byte lands in a page
  after the reservation ended);
- completes the reservation only once every byte has arrived: a connection that ends, fails,
  stalls for the timeout or runs past half the lease mid-payload rolls the whole reservation
  back (nothing half received becomes readable) and is closed.

A payload announced larger than ``max_message_bytes`` is refused (id 0) and the connection
closed, as the local channel does: a stream cannot skip what it will not read.

The DRAM that puts hold while their bytes arrive is bounded: a put's pages are reserved from
its header, before its payload, so without a bound a client sending headers alone over many
connections would hold (and evict for) DRAM it never fills. A put that would take the bytes
reserved by the stream's puts in flight past ``max_reserved_bytes`` (a quarter of DRAM) is
refused with ``capacity`` after its payload is drained, unless no other put is in flight (one
put, however large, always proceeds); the client sends it over ZMQ instead.

The ops are counted in :class:`OpCounters` of their own (``stats()["peer_stream"]``'s
``client_*`` fields), apart from the peers' fetches the stream server counts.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserver import wire, wire_stream
from kvserver.daemon.access import authorize
from kvserver.daemon.auth import Principal
from kvserver.daemon.op_labels import op_label
from kvserver.daemon.owners import DAEMON_OWNERS, STREAM_CLIENT, STREAM_PUT_CLIENT
from kvserver.daemon.results import Fetched, Pending
from kvserver.daemon.service import KVService
from kvserver.daemon.stream_io import Closed, PlainIO, TlsIO
from kvserver.errors import CapacityError, InvalidArgument, KVServerError

StreamIO = PlainIO | TlsIO


@dataclass(slots=True)
class OpCounters:
    """Counters of clients' ``put`` and ``get`` on the stream (never reset); the stream
    server's ``stats()`` names them ``client_<field>``."""

    #: op requests read (``put`` and ``get``, refused ones too).
    requests: int = 0
    #: error replies to them.
    errors: int = 0
    #: chunks and payload bytes sent to clients' gets.
    sent_chunks: int = 0
    sent_bytes: int = 0
    #: chunks and payload bytes stored by clients' puts.
    received_chunks: int = 0
    received_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class StreamOps:
    """The op requests of the stream's connections; see the module docstring. Counted in
    ``counters`` (clients' ops only)."""

    def __init__(
        self, service: KVService, *, max_payload_bytes: int, max_reserved_bytes: int
    ) -> None:
        self._service = service
        self.counters = OpCounters()
        self._max_payload = max_payload_bytes
        self._max_reserved = max_reserved_bytes
        #: bytes of DRAM reserved by puts whose payload is still arriving
        self.reserved_bytes = 0

    async def serve(self, io: StreamIO, length: int, who: Principal) -> None:
        """One op request whose head announced a header of ``length`` bytes: read it and its
        payload, carry it out, reply. Raises :class:`Closed` when the connection is to be
        closed (an oversized payload, the connection lost mid-payload)."""
        raw = await io.read(wire_stream.OP_PAYLOAD.size, io.timeout_s)
        assert raw is not None
        (payload,) = wire_stream.OP_PAYLOAD.unpack(raw)
        if payload > self._max_payload:
            error = InvalidArgument("message too large", size=payload, max=self._max_payload)
            await refuse(io, self.counters, 0, error)
            await io.linger()
            raise Closed
        header = await io.read(length, io.timeout_s)
        assert header is not None
        self.counters.requests += 1
        try:
            request = wire_stream.decode_op_request(header)
        except KVServerError as exc:
            await io.drain(payload, self._within_s())
            await refuse(io, self.counters, getattr(exc, "request_id", 0), exc)
            return
        timer = self._service.op_seconds.labels(op_label(request.op, request.args))
        start = time.perf_counter()
        try:
            if request.op == wire.PUT:
                await self._put(io, request, payload, who)
            else:
                await self._get(io, request, payload, who)
        finally:
            timer.observe(time.perf_counter() - start)

    def _within_s(self) -> float:
        """The bound on a put's whole payload (received or dropped): half the longest lease."""
        return float(self._service.engine.config.max_lease_s) / 2

    async def _put(
        self, io: StreamIO, request: wire_stream.OpRequest, payload: int, who: Principal
    ) -> None:
        service, args = self._service, request.args
        ns_id, keys = args["ns_id"], args["keys"]
        try:
            if request.client in DAEMON_OWNERS:
                raise InvalidArgument("header field 'client' names a lease owner reserved for "
                                      "the daemon itself", client=request.client)  # fmt: skip
            authorize(who, service, wire.PUT, args)
            spec = service.namespace(ns_id)
            tp, size = spec.tp_world_size, spec.part_bytes
            if len(set(keys)) != len(keys):
                raise InvalidArgument("put: duplicate keys")
            if payload != len(keys) * tp * size:
                raise InvalidArgument("payload size does not match the slot", payload=payload,
                                      expected=len(keys) * tp * size)  # fmt: skip
            page = service.engine.config.page_size
            per_key = tp * -(-size // page) * page  # DRAM a key's parts take, whole pages
            if (
                self.reserved_bytes
                and self.reserved_bytes + len(keys) * per_key > self._max_reserved
            ):
                raise CapacityError("stream puts in flight hold their DRAM; send it over ZMQ",
                                    reserved=self.reserved_bytes, payload=payload,
                                    max=self._max_reserved)  # fmt: skip
            # the daemon's own reservation while bytes land in its pages: no request (the
            # client's release, a complete_store naming its id) may end it early
            grant = service.prepare_store(
                ns_id, keys, client=STREAM_PUT_CLIENT, lease_s=service.engine.config.max_lease_s
            )
        except KVServerError as exc:
            await io.drain(payload, self._within_s())
            await refuse(io, self.counters, request.request_id, exc)
            return
        if grant is None:  # DRAM full: nothing reserved
            await io.drain(payload, self._within_s())
            result = {"stored": [], "present": [], "filtered": [], "rejected": True}
            await io.send([wire_stream.encode_result(request.request_id, result)])
            return
        held = len(grant.keys) * per_key
        self.reserved_bytes += held
        try:
            stored = await self._receive(io, keys, grant, tp, size)
        finally:
            self.reserved_bytes -= held
        self.counters.received_chunks += len(stored)
        self.counters.received_bytes += len(stored) * tp * size
        result = {"stored": stored, "present": grant.present, "filtered": grant.filtered,
                  "rejected": False}  # fmt: skip
        await io.send([wire_stream.encode_result(request.request_id, result)])

    async def _receive(
        self, io: StreamIO, keys: list[bytes], grant: Any, tp: int, size: int
    ) -> list[bytes]:
        """Receive the payload (granted keys into their pages, the others dropped) and
        complete the reservation; rolled back, and :class:`Closed` raised, when it does not
        all arrive."""
        service = self._service
        try:
            pages = service.store_views(grant)
            scratch: list[memoryview] = []
            views: list[memoryview] = []
            for key in keys:
                row = pages.get(key)
                if row is None:  # present or filtered: its bytes are read and dropped
                    scratch = scratch or [memoryview(bytearray(size))] * tp
                    row = scratch
                views.extend(row)
            # within half the reservation's lease: never a byte into a page given back
            await io.read_into(views, self._within_s())
        except BaseException:
            pages, views = {}, []
            if grant.keys:
                with contextlib.suppress(KVServerError):
                    service.complete_store(grant.lease_id, success=False)
            raise
        pages, views = {}, []  # the arena's views go before the pages can
        if not grant.keys:  # every key present or filtered
            return []
        return service.complete_store(grant.lease_id, success=True)

    async def _get(
        self, io: StreamIO, request: wire_stream.OpRequest, payload: int, who: Principal
    ) -> None:
        service, args = self._service, request.args
        try:
            if payload:
                await io.drain(payload, self._within_s())
                raise InvalidArgument("get takes no payload", payload=payload)
            authorize(who, service, wire.GET, args)
            spec = service.namespace(args["ns_id"])
            got: Fetched | Pending[Fetched] = service.get(
                args["ns_id"], args["keys"], args["ranks"], client=STREAM_CLIENT,
                leading=args["leading"] is True,
            )  # fmt: skip
            if isinstance(got, Pending):
                got = await got.run()
        except KVServerError as exc:
            await refuse(io, self.counters, request.request_id, exc)
            return
        await send_fetched(io, service, self.counters, request.request_id, got, spec.part_bytes)


async def send_fetched(
    io: StreamIO, service: KVService, counters: Any, request_id: int, got: Fetched,
    part_bytes: int,
) -> None:  # fmt: skip
    """An ok reply of ``got``'s parts, sent from the arena (``tp``: the ranks sent per
    chunk); its load lease ends once they are sent, or the connection failed."""
    try:
        count, per_key = len(got.keys), len(got.ranks)
        head = wire_stream.encode_ok(request_id, count, per_key, part_bytes)
        await io.send([head, *(view for part in got.parts for view in part)])
        counters.sent_chunks += count
        counters.sent_bytes += count * per_key * part_bytes
    finally:
        if got.lease_id:
            with contextlib.suppress(KVServerError):
                service.complete_load(got.lease_id)


async def refuse(io: StreamIO, counters: Any, request_id: int, exc: KVServerError) -> None:
    """An error reply."""
    counters.errors += 1
    await io.send([wire_stream.encode_error(request_id, exc)])
