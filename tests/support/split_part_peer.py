"""``python -m tests.support.split_part_peer FRAMES FRAME_BYTES [part|extra]``: a stand-in
peer daemon (a ZMQ ROUTER speaking just enough of ``docs/wire.md``) whose ``get`` reply (for
the first key asked, rank 0) carries ``FRAMES`` payload frames of ``FRAME_BYTES`` each:
``part`` (the default) names them all as one part (``part_frames: [FRAMES]``), a part far
larger than the namespace's; ``extra`` sends them as they are, far more parts than asked.
Replies no real daemon sends. It answers
``hello`` (no stream port, no cap), ``register_namespace`` (as a daemon would) and ``lookup``
(it holds every key), any other op with an ``invalid_argument`` error.
Prints its address on the first line of stdout, then serves until killed.
"""

from __future__ import annotations

import sys

import zmq

from kvserver import wire
from kvserver.namespace import NamespaceSpec
from kvserver.wire_requests import unpack_header

SID = "split-part-peer"


def main() -> int:
    frames, frame_bytes = int(sys.argv[1]), int(sys.argv[2])
    split = sys.argv[3:] in ([], ["part"])
    sock = zmq.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    payload = bytes(frame_bytes)
    while True:
        peer, header, *_ = sock.recv_multipart()
        request = unpack_header(header)
        req_id, op, args = request["id"], request["op"], request.get("args", {})
        if op == wire.HELLO:
            sock.send_multipart([peer, wire.encode_reply(req_id, SID, {"sid": SID})])
        elif op == wire.REGISTER_NAMESPACE:
            spec = NamespaceSpec.from_dict(args["spec"])
            result = {
                "ns_id": spec.ns_id,
                "part_bytes": spec.part_bytes,
                "key_size": 32,
                "tp_world_size": spec.tp_world_size,
                "chunk_tokens": spec.chunk_tokens,
            }
            sock.send_multipart([peer, wire.encode_reply(req_id, SID, result)])
        elif op == wire.LOOKUP:  # it holds every key asked
            n = len(args["keys"])
            result = {"hit_chunks": n, "hit_tokens": 0, "num_chunks": n, "tiers": {"dram": n}}
            sock.send_multipart([peer, wire.encode_reply(req_id, SID, result)])
        elif op == wire.GET:
            keys = args["keys"][:1]
            result = {"keys": keys, "ranks": [0]}
            if split:
                result["part_frames"] = [frames]
            sock.send(peer, zmq.SNDMORE)
            sock.send(wire.encode_reply(req_id, SID, result), zmq.SNDMORE)
            for _ in range(frames - 1):
                sock.send(payload, zmq.SNDMORE, copy=False)
            sock.send(payload, copy=False)
        else:
            error = wire.encode_error(req_id, SID, "invalid_argument", f"not served: {op}")
            sock.send_multipart([peer, error])


if __name__ == "__main__":
    sys.exit(main())
