"""``python -m tests.support.older_peer start ...``: ``kvserver start`` whose ``hello`` does
not announce ``zmq_send_max_unsent``, as a daemon from before session 11 (the daemon is
otherwise the real one, its cap on unsent replies enforced as ever). With the environment's
``OLDER_PEER_DROP`` (hello fields, comma-separated): without those fields instead (e.g.
``stream_put_max_reserved``, as a daemon older than windowed stream puts).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvserver.daemon.zmq_ops import DataOps


def _without_cap(hello: Any) -> Any:
    def wrapper(self: DataOps, call: Any) -> dict[str, Any]:
        result: dict[str, Any] = hello(self, call)
        for field in os.environ.get("OLDER_PEER_DROP", "zmq_send_max_unsent").split(","):
            result.pop(field, None)
        return result

    return wrapper


def main() -> int:
    DataOps._hello = _without_cap(DataOps._hello)  # type: ignore[method-assign]
    from kvserver.cli import main as kvserver_main

    return kvserver_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
