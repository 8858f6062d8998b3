"""Both clients when the connection breaks: a daemon SIGKILLed and restarted on the same port
is reached by the very next call (the lost DEALER is replaced instead of left to its own,
ever slower reconnect attempts); requests outstanding when the daemon dies fail at once with
Unavailable (the DEALER's monitor reports the lost connection; the local channel reads EOF),
not after their timeout, and none is sent again; and a link that fails while requests are
outstanding fails them at once with Unavailable naming the cause.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import zmq

from kvserver import wire
from kvserver.client import AsyncKVClient, KVClient, LookupResult, links
from kvserver.errors import Unavailable
from tests.kvserver.builders import make_keys
from tests.kvserver.client.test_client import SPEC, parts
from tests.support.daemon import DaemonProc, port_kept, start_daemon, wait_until

#: every call's timeout: ample for one round trip on a loaded machine, far below the reconnect
#: interval the sockets are given here.
TIMEOUT_S = 5.0

#: the timeout of calls that must fail sooner, by the lost connection: the tests bound their
#: duration by a third of it (any bound far above a round trip would do).
LONG_TIMEOUT_S = 30.0

#: what the outstanding requests fail with when the daemon dies, by transport.
LOST = {False: "connection to the daemon was lost", None: "local channel failed"}

#: the clients on ZMQ (remote, stream=False: the stream's own restart is test_stream_fallback's)
#: and on the daemon's local channel (co-located).
TRANSPORTS = pytest.mark.parametrize("colocated", [False, None], ids=["zmq", "local"])

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def slow_reconnects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DEALER left to itself retries a lost connection only after a minute here, so only a
    client that notices the loss and replaces the socket reaches a restarted daemon in time
    (the default intervals make the same race a matter of luck)."""
    monkeypatch.setattr(links, "RECONNECT_IVL_MS", 60_000)
    monkeypatch.setattr(links, "RECONNECT_IVL_MAX_MS", 60_000)


def kill_and_restart(d: DaemonProc, tmp_path: Path) -> DaemonProc:
    """SIGKILL (no goodbye on any socket), then a new daemon on the same ZMQ port."""
    d.kill()
    return start_daemon(tmp_path / "restarted", "--zmq-port", str(d.info["zmq_port"]))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "first", *port_kept())
    yield d
    d.kill()


@TRANSPORTS
def test_sync_client_reaches_a_daemon_killed_and_restarted_with_its_next_call(
    daemon: DaemonProc, tmp_path: Path, colocated: bool | None, slow_reconnects: None
) -> None:
    """Restart after SIGKILL: the first call afterwards is answered by the new daemon within
    its one timeout (no Unavailable first), the session is renewed, nothing sent twice."""
    keys = make_keys(2, tag=f"kill-{colocated}")
    with KVClient(daemon.zmq_address, timeout=TIMEOUT_S, colocated=colocated, stream=False) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert kv.is_local is (colocated is None)
        puts = kv.sent_by_op[wire.PUT]
        restarted = kill_and_restart(daemon, tmp_path)
        try:
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0  # the new daemon answered
            assert kv.hello()["arena_path"] == restarted.arena_path
            assert kv.put(ns.ns_id, keys, parts(keys)).stored == keys
            assert kv.sent_by_op[wire.PUT] == puts + 1
        finally:
            restarted.kill()


@TRANSPORTS
async def test_async_client_reaches_a_daemon_killed_and_restarted_with_its_next_call(
    daemon: DaemonProc, tmp_path: Path, colocated: bool | None, slow_reconnects: None
) -> None:
    """The asyncio twin of the test above."""
    keys = make_keys(2, tag=f"akill-{colocated}")
    async with AsyncKVClient(
        daemon.zmq_address, timeout=TIMEOUT_S, colocated=colocated, stream=False
    ) as kv:
        ns = await kv.register_namespace(SPEC)
        assert await kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert kv.is_local is (colocated is None)
        puts = kv.sent_by_op[wire.PUT]
        restarted = await asyncio.to_thread(kill_and_restart, daemon, tmp_path)
        try:
            assert (await kv.lookup(ns.ns_id, keys)).hit_chunks == 0
            assert (await kv.hello())["arena_path"] == restarted.arena_path
            assert (await kv.put(ns.ns_id, keys, parts(keys))).stored == keys
            assert kv.sent_by_op[wire.PUT] == puts + 1
        finally:
            restarted.kill()


def restart(d: DaemonProc, tmp_path: Path) -> DaemonProc:
    """A new daemon on the ZMQ port of ``d`` (killed)."""
    return start_daemon(tmp_path / "restarted", "--zmq-port", str(d.info["zmq_port"]))


@TRANSPORTS
def test_sync_requests_outstanding_when_the_daemon_dies_fail_at_once(
    daemon: DaemonProc, tmp_path: Path, colocated: bool | None, slow_reconnects: None
) -> None:
    """The daemon is stopped (SIGSTOP: it reads nothing), two lookups are sent, then it is
    SIGKILLed: both fail with Unavailable naming the lost connection, long before their 30 s
    timeout, and neither is sent again; the next call reaches the restarted daemon."""
    keys = make_keys(2, tag=f"dies-{colocated}")
    with KVClient(daemon.zmq_address, timeout=LONG_TIMEOUT_S, colocated=colocated) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert kv.is_local is (colocated is None)
        daemon.proc.send_signal(signal.SIGSTOP)
        first = kv.submit_lookup(ns.ns_id, keys)
        second = kv.submit_lookup(ns.ns_id, keys[:1])
        lookups = kv.sent_by_op[wire.LOOKUP]
        started = time.monotonic()
        daemon.kill()
        for pending in (first, second):
            with pytest.raises(Unavailable, match=LOST[colocated]):
                pending.result()
        assert time.monotonic() - started < LONG_TIMEOUT_S / 3
        assert kv.sent_by_op[wire.LOOKUP] == lookups  # nothing was sent again
        restarted = restart(daemon, tmp_path)
        try:
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0  # the new daemon answered
            assert kv.hello()["arena_path"] == restarted.arena_path
        finally:
            restarted.kill()


@TRANSPORTS
def test_sync_blocking_call_outstanding_when_the_daemon_dies_fails_at_once(
    daemon: DaemonProc, tmp_path: Path, colocated: bool | None, slow_reconnects: None
) -> None:
    """A blocking call waits in its poll when the stopped daemon is SIGKILLed (by another
    thread, once the call was sent): Unavailable long before its timeout, sent once."""
    keys = make_keys(1, tag=f"blocking-{colocated}")
    with KVClient(daemon.zmq_address, timeout=LONG_TIMEOUT_S, colocated=colocated) as kv:
        ns = kv.register_namespace(SPEC)
        assert kv.is_local is (colocated is None)
        daemon.proc.send_signal(signal.SIGSTOP)
        lookups = kv.sent_by_op[wire.LOOKUP]

        def kill_once_sent() -> None:
            wait_until(lambda: kv.sent_by_op[wire.LOOKUP] > lookups)
            daemon.kill()

        killer = threading.Thread(target=kill_once_sent)
        started = time.monotonic()
        killer.start()
        try:
            with pytest.raises(Unavailable, match=LOST[colocated]):
                kv.lookup(ns.ns_id, keys)
        finally:
            killer.join()
        assert kv.sent_by_op[wire.LOOKUP] == lookups + 1
        assert time.monotonic() - started < LONG_TIMEOUT_S / 3
        restarted = restart(daemon, tmp_path)
        try:
            assert kv.lookup(ns.ns_id, keys).hit_chunks == 0
        finally:
            restarted.kill()


@TRANSPORTS
async def test_async_requests_outstanding_when_the_daemon_dies_fail_at_once(
    daemon: DaemonProc, tmp_path: Path, colocated: bool | None, slow_reconnects: None
) -> None:
    """The asyncio twin: the reader task (local channel) or the event loop's watch of the
    DEALER's monitor fails both lookups at once; none is sent again; the next call works."""
    keys = make_keys(2, tag=f"adies-{colocated}")
    async with AsyncKVClient(daemon.zmq_address, timeout=LONG_TIMEOUT_S, colocated=colocated) as kv:
        ns = await kv.register_namespace(SPEC)
        assert await kv.store(ns.ns_id, keys, parts(keys)) == keys
        assert kv.is_local is (colocated is None)
        daemon.proc.send_signal(signal.SIGSTOP)
        first = await kv.submit_lookup(ns.ns_id, keys)
        second = await kv.submit_lookup(ns.ns_id, keys[:1])
        lookups = kv.sent_by_op[wire.LOOKUP]
        started = time.monotonic()
        daemon.kill()
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        for error in outcomes:
            assert isinstance(error, Unavailable), outcomes
            assert LOST[colocated] in str(error), outcomes
        assert time.monotonic() - started < LONG_TIMEOUT_S / 3
        assert kv.sent_by_op[wire.LOOKUP] == lookups
        assert kv.outstanding == 0
        restarted = await asyncio.to_thread(restart, daemon, tmp_path)
        try:
            assert (await kv.lookup(ns.ns_id, keys)).hit_chunks == 0
            assert (await kv.hello())["arena_path"] == restarted.arena_path
        finally:
            restarted.kill()


def test_sync_reply_received_before_the_daemon_died_is_delivered(
    daemon: DaemonProc, tmp_path: Path, slow_reconnects: None
) -> None:
    """A reply already in the DEALER when the connection is lost is still routed to its
    request; only the request still unanswered fails."""
    keys = make_keys(1, tag="answered")
    with KVClient(daemon.zmq_address, timeout=LONG_TIMEOUT_S, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        answered = kv.submit_lookup(ns.ns_id, keys)
        link = kv._t._zmq
        assert link is not None
        wait_until(link.ready)  # its reply is in, not yet read
        daemon.proc.send_signal(signal.SIGSTOP)
        unanswered = kv.submit_lookup(ns.ns_id, keys)
        daemon.kill()
        with pytest.raises(Unavailable, match=LOST[False]):
            unanswered.result()
        assert answered.result().hit_chunks == 0


async def test_async_reply_received_before_the_daemon_died_is_delivered(
    daemon: DaemonProc, tmp_path: Path, slow_reconnects: None
) -> None:
    """The asyncio twin: the loss is seen by the event loop while the reply still waits in the
    DEALER (nothing yielded to the loop since it came): the reader routes it first."""
    keys = make_keys(1, tag="aanswered")
    async with AsyncKVClient(daemon.zmq_address, timeout=LONG_TIMEOUT_S, colocated=False) as kv:
        ns = await kv.register_namespace(SPEC)
        answered = await kv.submit_lookup(ns.ns_id, keys)
        sock = kv._t._zmq
        assert sock is not None
        # asks the socket without waking the loop
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        wait_until(lambda: kv.outstanding == 0 or cast(int, plain.get(zmq.EVENTS)) & zmq.POLLIN)
        daemon.proc.send_signal(signal.SIGSTOP)
        unanswered = await kv.submit_lookup(ns.ns_id, keys)
        daemon.kill()
        outcomes = await asyncio.gather(answered, unanswered, return_exceptions=True)
        assert isinstance(outcomes[0], LookupResult), outcomes
        assert isinstance(outcomes[1], Unavailable), outcomes
        assert LOST[False] in str(outcomes[1])


# ------------------------------------------------------------------ a link that fails (injected)


def broken_recv(*_: Any, **__: Any) -> Any:
    """A DEALER's receive failing as libzmq can (e.g. its context terminated), which the real
    socket does not do on demand."""
    raise zmq.ZMQError(zmq.ETERM)


async def async_broken_recv(*_: Any, **__: Any) -> Any:
    raise zmq.ZMQError(zmq.ETERM)


def test_sync_client_fails_fast_when_its_dealer_fails(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ZMQError while reading fails the call at once with Unavailable naming it (not the raw
    ZMQError, not a timeout); the next call opens a new socket and is answered."""
    with KVClient(daemon.zmq_address, timeout=60.0, colocated=False) as kv:
        ns = kv.register_namespace(SPEC)
        link = kv._t._zmq
        assert link is not None
        monkeypatch.setattr(link._sock, "recv", broken_recv)
        with pytest.raises(Unavailable, match=r"connection failed.*ZMQError"):
            kv.lookup(ns.ns_id, make_keys(1, tag="broken"))
        assert kv.lookup(ns.ns_id, make_keys(1, tag="broken")).hit_chunks == 0


async def test_async_client_fails_outstanding_requests_when_its_reader_fails(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DEALER's reader task meets a ZMQError while two requests are outstanding:
    both fail at once with Unavailable naming it (not after their 60 s timeout); the next
    call opens a new socket and is answered."""
    async with AsyncKVClient(daemon.zmq_address, timeout=60.0, colocated=False) as kv:
        ns = await kv.register_namespace(SPEC)
        sock = kv._t._zmq
        assert sock is not None
        # the reader is parked in a receive begun before the fault: the reply to `first`
        # completes it, and the reader's next receive fails
        monkeypatch.setattr(sock, "recv", async_broken_recv)
        first = await kv.submit_lookup(ns.ns_id, make_keys(1, tag="a"))
        second = await kv.submit_lookup(ns.ns_id, make_keys(1, tag="b"))
        third = await kv.submit_lookup(ns.ns_id, make_keys(1, tag="c"))
        outcomes = await asyncio.gather(first, second, third, return_exceptions=True)
        assert isinstance(outcomes[0], LookupResult), outcomes
        for error in outcomes[1:]:
            assert isinstance(error, Unavailable), outcomes
            assert "connection failed" in str(error) and "ZMQError" in str(error)
        assert kv.outstanding == 0
        assert (await kv.lookup(ns.ns_id, make_keys(1, tag="d"))).hit_chunks == 0
        assert kv._t._zmq is not sock
