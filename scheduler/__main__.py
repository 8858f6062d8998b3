"""``python3 -m scheduler ARGS...``: ``kvserver scheduler ARGS...`` without the entry point."""

from __future__ import annotations

import sys

from kvserver.cli import run_alone
from scheduler.cli import add_scheduler

if __name__ == "__main__":
    sys.exit(run_alone(add_scheduler, "scheduler"))
