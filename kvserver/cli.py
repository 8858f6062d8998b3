"""The ``kvserver`` command line: one console script, one subcommand per task.

Each subcommand is a ``_cmd_<name>(args) -> int`` function registered in :func:`build_parser`.
Subcommands that need heavy imports (grpc, zmq, torch) import them inside the function so
``kvserver hash`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserver",
        description="KV-cache service for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_hash(sub)
    return parser


# --------------------------------------------------------------------------- hash


def _add_hash(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Owned by the hashing work: ``kvserver hash`` (see kvserver/hashing.py)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    rc: int = func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
