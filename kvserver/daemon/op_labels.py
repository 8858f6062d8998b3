"""The ``op`` label a data-plane request's time is recorded under in
``kvserver_op_duration_seconds`` (``KVService.op_seconds``; ``docs/metrics.md``).

Pure functions and constants (no state, thread-safe); called on the daemon's event loop by the
front ends that time their requests: the ZMQ ops and the local channel (``zmq_ops.py``), the
stream port's peer fetches (``stream_server.py``) and clients' ops (``stream_ops.py``).

A request is labelled with its wire op, except a peer daemon's fetch: a ``get`` with
``leading`` (how daemons ask each other, ``docs/wire.md`` §2) is :data:`PEER_FETCH`, whichever
transport carried it (ZMQ, or the stream port's fetch request, which is that ``get``), so a
peer's fetches are neither mixed into clients' ``get`` nor split by transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserver import wire

#: the label of a peer daemon's fetch (``get`` with ``leading``), over ZMQ or the stream port.
PEER_FETCH = "peer_fetch"


def op_label(op: str, args: Mapping[str, Any]) -> str:
    """The label of a request of wire op ``op`` with its checked header ``args``: ``op``, or
    :data:`PEER_FETCH` for a ``get`` with ``leading`` true."""
    return PEER_FETCH if op == wire.GET and args.get("leading") is True else op
