"""``python3 -m worker ARGS...``: ``kvserver worker ARGS...`` without the entry point."""

from __future__ import annotations

import sys

from kvserver.cli import run_alone
from worker.cli import add_worker

if __name__ == "__main__":
    sys.exit(run_alone(add_worker, "worker"))
