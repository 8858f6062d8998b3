"""The lease owners that are the daemon itself, never a client.

Runs in the daemon process; constants only (no state, thread-safe). The daemon holds leases of
its own while bytes move in or out of arena pages outside any client's request: a promotion
from SSD reading into reserved pages, a fetch from a peer receiving into them (a worker thread
writes while the lease holds), a client's stream put receiving into them, the peer stream
and the zero-copy ZMQ send pinning the pages the kernel is still reading. Ending such a lease
early gives the pages back while bytes still land in them or leave them: the next store to
take them would be served with another key's bytes.
So no request may end one: a request header's ``client`` may not name these owners
(``zmq_requests.py``), and the lease ops (``complete_store``, ``write_parts``,
``complete_load``, ``read_parts``) refuse a lease they own (``access.py``).
"""

from __future__ import annotations

#: promotion reservations in the DRAM tier (``promotion.py``).
PROMOTE_CLIENT = "kvserver-ssd-promote"
#: the DRAM reservations that chunks fetched from peers are received into (``peers/place.py``).
FETCH_CLIENT = "kvserver-peer-fetch"
#: the pins a peer stream reply holds while it is sent (``stream_server.py``).
STREAM_CLIENT = "kvserver-peer-stream"
#: the pins that guard in-flight zero-copy ZMQ sends (``zmq_send.py``).
ZMQ_SEND_CLIENT = "kvserver-zmq-send"
#: the reservations a client's stream put receives its payload into (``stream_ops.py``):
#: not the client's, which could release them while its bytes still land in the pages.
STREAM_PUT_CLIENT = "kvserver-stream-put"

#: every lease owner that is the daemon itself.
DAEMON_OWNERS = frozenset(
    {PROMOTE_CLIENT, FETCH_CLIENT, STREAM_CLIENT, ZMQ_SEND_CLIENT, STREAM_PUT_CLIENT}
)
