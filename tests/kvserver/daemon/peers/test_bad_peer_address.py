"""A peer at an address no client takes (a fleet record or ``--peers`` entry the checks
before let through, e.g. an unbalanced IPv6 bracket) is that peer failing, a
:class:`PeerFailed` as for any other failure of it, never an error of the load that asked it,
and leaves no connection counted open. No daemon: the address is refused before any socket."""

from __future__ import annotations

import pytest

from kvserver.daemon.peers.directory import Peer, PeerFailed
from kvserver.daemon.peers.link import PeerLink


@pytest.mark.parametrize("address", ["tcp://[::1:9471", "tcp://127.0.0.1:0", "nosuch://x"])
async def test_a_peer_at_a_bad_address_fails_at_once_and_holds_no_connection(
    address: str,
) -> None:
    """Was: ``tcp://127.0.0.1:0`` connected for ever (every call timed out after the peer
    timeout, ``timed_out``: the peer made suspect as a slow one); the others raised a bare
    ZMQError from the first call. Now each call fails at once, naming the address, and the
    one connection slot is free again for the next call (else it would wait for it)."""
    link = PeerLink(Peer("X", "1", address, ""), timeout_s=30.0, connections=1)
    try:
        for _ in range(2):
            with pytest.raises(PeerFailed, match="bad peer address: bad daemon address") as err:
                await link.lookup("ns", [b"k"])
            assert not err.value.timed_out and not err.value.busy
            assert link.connections_open == 0
        with pytest.raises(PeerFailed, match="bad peer address"):
            async with link.connection():
                pass
        assert link.connections_open == 0
    finally:
        await link.close()
