"""``python -m tests.support.lying_worker LIE [synthetic worker flags]``: the real synthetic
worker (``python -m scheduler.synthetic``) whose reply to its first step is ``LIE`` (one of
:data:`LIES`) instead of its result; every other message, the later steps included, is
answered honestly. A correct worker cannot send any of these: the fault is injected here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import msgpack

import step_protocol.serve
from scheduler import synthetic
from step_protocol import KIND_ERROR, KIND_RESULT, STEP_PROTOCOL_VERSION, decode, encode_body
from step_protocol.limits import FLOOR_BYTES


def _lie(name: str, step: int) -> bytes:
    if name == "garbage":
        return b"\xc1 not msgpack at all"
    if name == "not-a-map":
        return bytes(msgpack.packb([1, 2, 3]))
    if name == "wrong-version":
        return bytes(msgpack.packb({"v": STEP_PROTOCOL_VERSION + 1, "kind": KIND_RESULT,
                                    "body": {"step": step}}))  # fmt: skip
    if name == "wrong-shape":
        return encode_body(KIND_RESULT, {"step": step, "sampled": "all of them", "rank": -3})
    if name == "error-for-another-step":
        return encode_body(KIND_ERROR, {"step": step + 1000, "message": "not this one"})
    if name == "oversized":  # one byte over a scheduler's least limit (step_protocol/limits.py)
        return bytes(FLOOR_BYTES + 1)
    raise ValueError(name)


#: the lies this worker can tell, each a reply no correct worker sends
LIES = (
    "garbage", "not-a-map", "wrong-version", "wrong-shape", "error-for-another-step", "oversized",
)  # fmt: skip


def _lying(honest: Callable[[Any, bytes], bytes | None], name: str) -> Callable[..., Any]:
    told = False

    def handle(worker: Any, data: bytes, *rest: Any) -> bytes | None:
        nonlocal told
        reply = honest(worker, data, *rest)
        kind, body = decode(data)
        if not told and kind == "step":
            told = True
            return _lie(name, int(body["step"]))
        return reply

    return handle


def main() -> int:
    name = sys.argv[1]
    if name not in LIES:
        raise SystemExit(f"lying_worker: no lie {name!r}; the lies: {', '.join(LIES)}")
    step_protocol.serve.handle_message = _lying(step_protocol.serve.handle_message, name)
    return synthetic.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
