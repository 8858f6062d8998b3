"""``python -m tests.support.bad_reply start ...``: ``kvserver start`` whose ``stats`` result
holds a value msgpack cannot encode once armed (a daemon bug on demand: no real request makes
one since the hostile-input review closed the paths it found; the daemon is otherwise the
real one).

Armed when the file named by ``BAD_REPLY_ARM`` exists: from then on ``KVService.stats`` adds
an integer of 2**64 (msgpack's OverflowError) to its result.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvserver.daemon.service import KVService


def _unencodable(stats: Any) -> Any:
    def wrapper(self: KVService) -> dict[str, Any]:
        result: dict[str, Any] = stats(self)
        if os.path.exists(os.environ["BAD_REPLY_ARM"]):
            result = {**result, "unencodable": 2**64}
        return result

    return wrapper


def main() -> int:
    KVService.stats = _unencodable(KVService.stats)  # type: ignore[method-assign]
    from kvserver.cli import main as kvserver_main

    return kvserver_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
