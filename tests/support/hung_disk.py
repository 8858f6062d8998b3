"""``python -m tests.support.hung_disk start ...``: ``kvserver start`` whose disk writes hang
once armed (a fault no real disk gives on demand; the daemon is otherwise the real one).

Armed when the file named by ``HUNG_DISK_ARM`` exists: from then on every ``pwrite`` and
``pwritev`` of the SSD tier (``kvserver.ssd.fileio.FileIO``, its fault-injection seam) blocks
forever, its thread stuck as in an uninterruptible kernel write; the first one creates the file
named by ``HUNG_DISK_HANGING`` so the test knows a write hangs. Not armed, writes go through
(start-up's rebuild and namespace saves).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from kvserver.ssd.fileio import FileIO

_never = threading.Event()


def _hanging(write: Any) -> Any:
    def wrapper(self: FileIO, *args: Any) -> Any:
        if os.path.exists(os.environ["HUNG_DISK_ARM"]):
            Path(os.environ["HUNG_DISK_HANGING"]).touch()
            _never.wait()
        return write(self, *args)

    return wrapper


def main() -> int:
    FileIO.pwrite = _hanging(FileIO.pwrite)  # type: ignore[method-assign]
    FileIO.pwritev = _hanging(FileIO.pwritev)  # type: ignore[method-assign]
    from kvserver.cli import main as kvserver_main

    return kvserver_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
