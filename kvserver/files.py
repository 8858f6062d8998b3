"""Small file helpers shared by the processes (no project state, no I/O beyond the call).

``write_atomic`` replaces a file all at once: readers see the old content or the new, never a
part (ready files, announcement files). It does not fsync: for data that must survive a power
loss use the SSD tier's ``FileIO.write_file_atomic`` (through its fault-injection seam).
"""

from __future__ import annotations

import contextlib
import os


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (unique to this process), then rename
    it over ``path``. Raises OSError; the temporary file is removed on failure."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
