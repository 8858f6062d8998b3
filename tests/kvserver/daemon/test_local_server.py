"""The local channel's connection protocol, driven without sockets: reassembly of messages
split anywhere, messages larger than the receive buffer, the size limit, backpressure."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvserver import wire_local
from kvserver.daemon.local_server import (
    RECV_BUFFER,
    InflightBudget,
    LocalConnection,
    LocalMessage,
    Refused,
)

LIMIT = 4 << 20


class FakeTransport:
    """What a connection asks of its transport, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.reading = True
        self.closing = False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: the client's process is unknown (local_exits.py)

    def writelines(self, data: list[Any]) -> None:
        self.written.append(b"".join(bytes(b) for b in data))

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


class Harness:
    """A connection on a fake transport; ``feed`` pushes bytes through get_buffer and
    buffer_updated in pieces of the given sizes, as an event loop would."""

    def __init__(self, budget: InflightBudget | None = None) -> None:
        self.got: list[LocalMessage] = []
        self.conn = LocalConnection("local-test", self.deliver, LIMIT, budget=budget)
        self.transport = FakeTransport()
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]

    def deliver(self, conn: LocalConnection, message: LocalMessage) -> None:
        assert conn is self.conn
        self.got.append(message if isinstance(message, Refused) else bytes(message))

    def feed(self, data: bytes, pieces: list[int]) -> None:
        pos = 0
        cuts = iter(pieces)
        while pos < len(data):
            buf = self.conn.get_buffer(-1)
            n = min(len(data) - pos, len(buf), max(1, next(cuts, len(data))))
            buf[:n] = data[pos : pos + n]
            self.conn.buffer_updated(n)
            pos += n


def message(frames: list[bytes]) -> tuple[bytes, bytes]:
    """(wire bytes, the body the connection should deliver)."""
    data = b"".join(bytes(b) for b in wire_local.encode(frames))
    return data, data[wire_local.SIZE.size :]


@given(
    st.lists(st.lists(st.binary(max_size=200), min_size=1, max_size=3), min_size=1, max_size=6),
    st.lists(st.integers(1, 300), max_size=40),
)
def test_messages_split_anywhere_arrive_whole_and_in_order(
    batches: list[list[bytes]], pieces: list[int]
) -> None:
    h = Harness()
    wire_bytes, bodies = zip(*(message(frames) for frames in batches), strict=True)
    h.feed(b"".join(wire_bytes), pieces)
    assert h.got == list(bodies)


def test_a_message_larger_than_the_receive_buffer_is_received_in_one_piece() -> None:
    big = bytes(range(256)) * (3 * RECV_BUFFER // 256)
    first, first_body = message([b"head", big])
    second, second_body = message([b"next"])
    h = Harness()
    h.feed(first + second, [7, 100_000, 5, 300_000, 1, 1 << 20])
    assert h.got == [first_body, second_body]


def test_a_size_over_the_limit_is_delivered_once_and_reading_stops() -> None:
    h = Harness()
    ok, ok_body = message([b"fine"])
    h.feed(ok + wire_local.SIZE.pack(wire_local.max_size(0) + LIMIT + 1) + bytes(100), [])
    assert h.got[0] == ok_body
    (refused,) = h.got[1:]
    assert isinstance(refused, Refused) and refused.error.code == "invalid_argument"
    assert refused.error.context["max"] == LIMIT
    assert not h.transport.reading
    h.conn.buffer_updated(0)  # anything more is ignored
    assert len(h.got) == 2


def test_no_message_is_handled_while_replies_wait_to_be_written() -> None:
    """Backpressure: pause_writing stops reading and handling what is buffered; resume_writing
    handles it and reads again."""
    h = Harness()
    one, one_body = message([b"one"])
    two, two_body = message([b"two"])
    h.conn.pause_writing()
    assert not h.transport.reading
    h.feed(one + two, [])
    assert h.got == []
    h.conn.resume_writing()
    assert h.got == [one_body, two_body] and h.transport.reading


def test_replies_are_framed_and_nothing_is_written_once_closed() -> None:
    h = Harness()
    h.conn.send([b"reply", b"payload"])
    (written,) = h.transport.written
    assert written == message([b"reply", b"payload"])[0]
    h.conn.close()
    h.conn.send([b"late"])
    assert len(h.transport.written) == 1 and h.conn.closed


def test_messages_that_straddle_the_end_of_the_receive_buffer() -> None:
    """Messages of about a third of the buffer each, fed in odd pieces: the unparsed tail is
    moved to the front whenever the buffer fills up."""
    batches = [[bytes([i]) * (RECV_BUFFER // 3 + 17 * i)] for i in range(9)]
    wire_bytes, bodies = zip(*(message(frames) for frames in batches), strict=True)
    h = Harness()
    h.feed(b"".join(wire_bytes), [RECV_BUFFER // 5, 3, RECV_BUFFER // 2, 1000] * 10)
    assert h.got == list(bodies)


def test_an_announced_size_allocates_nothing_until_its_bytes_arrive() -> None:
    """Memory amplification: a size field announcing the limit, then a trickle of bytes,
    takes budget only as the bytes arrive (at most twice what arrived)."""
    budget = InflightBudget(LIMIT)
    h = Harness(budget)
    h.feed(wire_local.SIZE.pack(LIMIT) + bytes(100), [])
    assert budget.used == 0 and h.got == []
    h.feed(bytes(RECV_BUFFER), [])  # the fixed buffer fills up: now a buffer of its own
    assert 0 < budget.used <= 2 * RECV_BUFFER + 200
    h.feed(bytes(RECV_BUFFER), [])
    assert budget.used <= 4 * RECV_BUFFER + 400
    h.conn.connection_lost(None)
    assert budget.used == 0


def test_a_message_larger_than_the_budget_left_is_refused_with_a_capacity_error() -> None:
    """Two connections share a budget: the second one's large message does not fit while
    the first one holds its buffer; it is refused and reading stops; the first completes."""
    budget = InflightBudget(3 * RECV_BUFFER)
    first, second = Harness(budget), Harness(budget)
    body = bytes(range(256)) * (2 * RECV_BUFFER // 256)
    data, want = message([body])
    first.feed(data[: RECV_BUFFER + 10], [])
    second.feed(data[: 2 * RECV_BUFFER], [])
    (refused,) = second.got
    assert isinstance(refused, Refused) and refused.error.code == "capacity"
    assert not second.transport.reading
    first.feed(data[RECV_BUFFER + 10 :], [])
    assert first.got == [want]
    assert budget.used == 0


def test_the_budget_takes_all_or_nothing() -> None:
    budget = InflightBudget(10)
    assert budget.take(6) and not budget.take(5) and budget.used == 6
    budget.give(6)
    assert budget.take(10) and budget.used == 10
