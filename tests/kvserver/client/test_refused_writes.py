"""A request the DEALER refuses (ZMQ's EAGAIN on a NOBLOCK write) fails at the send, in both
clients: the DEALER's queue is full when SNDHWM requests wait for a daemon that never took them
(here: a port nobody listens on, so nothing is ever delivered and the refusal is certain). The
other cause, a handshake that failed before the write, is tests/kvserver/daemon/
test_handshake_auth.py's."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvserver import wire
from kvserver.client.aio_transport import AioSlot, AioTransport
from kvserver.client.calls import Call
from kvserver.client.common import Session
from kvserver.client.transport import Slot, Transport
from kvserver.errors import Unavailable
from tests.support.ports import free_port

#: far past the DEALER's SNDHWM (1000 by default): the refusal comes long before
SENDS = 10_000
HELLO = Call(wire.HELLO, {})


def _session() -> tuple[str, Session]:
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
    return address, Session(address, auth_token="any", colocated=False)


def test_the_blocking_client_fails_the_request_its_full_dealer_refuses() -> None:
    """The twin of the asyncio case below, which the blocking client already handled."""
    address, session = _session()
    transport = Transport(session, local=False)
    sent: list[Slot] = []
    try:
        with pytest.raises(Unavailable, match=f"no reply from {address}"):
            for _ in range(SENDS):
                sent.append(transport.send(HELLO, 60.0)[1])
        assert 0 < len(sent) < SENDS
        assert all(isinstance(slot.outcome, Unavailable) for slot in sent)
        assert transport.sent_by_op[wire.HELLO] == len(sent)
    finally:
        transport.drop()


async def test_the_asyncio_client_fails_the_request_its_full_dealer_refuses() -> None:
    """zmq.asyncio reports a refused NOBLOCK write in the future ``send_multipart`` returns,
    never by raising: the transport's ``except zmq.Again`` could not run, every request was
    counted as sent and left to wait out its timeout (the refused ones had never left), and
    each refusal's future was logged "Future exception was never retrieved" when collected.
    Now the first refused request fails at the send, the DEALER is replaced and the requests
    queued on it fail with Unavailable; nothing is left unretrieved."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    address, session = _session()
    transport = AioTransport(session, local=False)
    sent: list[AioSlot] = []
    try:
        with pytest.raises(Unavailable, match=f"no reply from {address}"):
            for _ in range(SENDS):
                sent.append(await transport.send(HELLO, 60.0))
        assert 0 < len(sent) < SENDS
        assert transport.outstanding == 0 and transport.sent_by_op[wire.HELLO] == len(sent)
        assert all(isinstance(slot.future.exception(), Unavailable) for slot in sent)
    finally:
        await transport.close("the test ended")
    gc.collect()  # an exception nobody retrieved is reported as its future is collected
    assert unhandled == []
