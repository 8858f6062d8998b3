"""The ``kvserver`` command line: one console script, one subcommand per task.

Each subcommand is a ``_cmd_<name>(args) -> int`` function registered in :func:`build_parser`.
Subcommands that need heavy imports (grpc, zmq, torch) import them inside the function so
``kvserver hash`` stays fast.

The library's own subcommands (``hash``, ``start``, ``status``, ``lookup``, ``keys``) are registered
here. The packages above the library (``scheduler``, ``worker``, ``benchmarks``) add theirs
through the ``kvserver.commands`` entry-point group (declared in pyproject.toml): each entry
point is a function ``add(sub)`` that registers one subparser, so this module never imports
them (the library imports nothing above it). Where the installed metadata does not declare a
command this tree knows of (an old install, or the source tree on PYTHONPATH only), the command
still parses and says how to get it (:data:`PROVIDED_ELSEWHERE`), exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import NoReturn, cast

#: the entry-point group through which packages above the library add subcommands
COMMANDS_GROUP = "kvserver.commands"

#: subcommands this project's other packages provide:
#: name -> (package, the module that runs it alone, help, extra to install)
PROVIDED_ELSEWHERE: dict[str, tuple[str, str, str, str]] = {
    "scheduler": ("scheduler", "scheduler", "run the scheduler process", ""),
    "worker": ("worker", "worker", "run a worker process (one per GPU)", "[torch]"),
    "bench": (
        "benchmarks",
        "benchmarks.bench_daemon",
        "benchmark the data paths and Lookup latency",
        "[bench]",
    ),
}

Adder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


class CommandParser(argparse.ArgumentParser):
    """``kvserver``'s parser and, through ``add_subparsers``, every subcommand's (the packages
    above the library's too): a usage error is two lines, a short usage and the error with
    where the options are listed::

        usage: kvserver lookup [options]
        kvserver lookup: error: the following arguments are required: --model; kvserver
        lookup --help lists its options

    (argparse's own error prints the whole synopsis first: 8 to 28 lines for a subcommand,
    the error under them). ``--help`` keeps the whole synopsis."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            2, f"usage: {self.short_usage()}\n{self.prog}: error: {message}; {self.help_hint}\n"
        )

    @property
    def help_hint(self) -> str:
        return f"{self.prog} --help lists its options"

    def short_usage(self) -> str:
        """``PROG [options] POSITIONAL...``: the positionals as the whole synopsis shows them."""
        positionals = [
            a for a in self._actions if not a.option_strings and a.help != argparse.SUPPRESS
        ]
        formatter = self._get_formatter()
        formatter.add_usage(None, positionals, [], prefix="")
        shown = " ".join(formatter.format_help().split())  # "PROG POSITIONAL..."
        return f"{self.prog} [options]{shown[len(self.prog) :]}"


def _subcommands(parser: CommandParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """``parser``'s subcommands, each parser a CommandParser (typed as the adders take it)."""
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    return cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``kvserver`` parser: the library's subcommands and those of the
    ``kvserver.commands`` entry points (stand-ins for the missing ones)."""
    parser = CommandParser(
        prog="kvserver",
        description="KV-cache service for LLM inference.",
    )
    from kvserver import __version__

    parser.add_argument("--version", action="version", version=f"kvserver {__version__}")
    sub = _subcommands(parser)
    _add_hash(sub)
    from kvserver.daemon.cli import add_start

    add_start(sub)
    from kvserver.cli_ops import add_lookup, add_status

    add_status(sub)
    add_lookup(sub)
    from kvserver.cli_keys import add_keys

    add_keys(sub)
    for add in _entry_point_commands():
        add(sub)
    for name, (package, module, help_text, install_extra) in PROVIDED_ELSEWHERE.items():
        if name not in sub.choices:
            _add_missing(sub, name, help_text, _how_to_get(name, package, module, install_extra))
    return parser


def _entry_point_commands() -> list[Adder]:
    """The ``add(sub)`` functions the installed distributions declare, once per name."""
    adders: dict[str, Adder] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        adders.setdefault(ep.name, ep.load())
    return list(adders.values())


def _how_to_get(name: str, package: str, module: str, install_extra: str) -> str:
    return (
        f"kvserver {name}: error: not available: this subcommand comes from the "
        f"'{package}' package through the '{COMMANDS_GROUP}' entry point, which this "
        f"installation does not declare. Install kvserver with its entry points (in a source tree: "
        f"pip install -e '.{install_extra}'), or run the command from the source tree as "
        f"'python3 -m {module} ARGS...' (the same arguments as 'kvserver {name}')."
    )


def _add_missing(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_text: str,
    message: str,
) -> None:
    """A stand-in for a subcommand whose entry point is not installed: it takes any arguments
    and prints ``message`` (how to get the real one), exit status 2."""
    p = sub.add_parser(name, help=f"{help_text} (not installed: run it for how to get it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def missing(_args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return 2

    p.set_defaults(func=missing, accepts_unknown=True)


def run_alone(add: Adder, name: str, argv: Sequence[str] | None = None) -> int:
    """Run one subcommand registered by ``add`` as if it were ``kvserver NAME ARGV...``
    without the entry points: what ``python3 -m scheduler`` (and the like) run."""
    parser = CommandParser(prog="kvserver")
    add(_subcommands(parser))
    args = parser.parse_args([name, *(sys.argv[1:] if argv is None else argv)])
    rc: int = args.func(args)
    return rc


# --------------------------------------------------------------------------- hash


def _add_hash(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Owned by the hashing work: ``kvserver hash`` (see kvserver/hashing.py)."""
    from kvserver.hashing import DEFAULT_SEED, HASH_ALGOS

    p = sub.add_parser(
        "hash",
        help="print the block hashes (cache keys) of a token sequence",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Print the chained block hash of every FULL block of TOKEN..., one lowercase hex\n"
            "digest per line (a partial last block has no hash). With --chunk-blocks K, print\n"
            "one key per full chunk of K blocks instead: the hash of its last block.\n\n"
            "Use it to debug a prefix that unexpectedly misses: hash the prompt here and\n"
            "compare with the block hashes vLLM reports (or the keys in kvserver's events).\n"
            "The first differing line is the first block that differs. Keys agree only if\n"
            "vLLM runs with PYTHONHASHSEED=<seed> and the same --algo (vLLM's\n"
            "--prefix-caching-hash-algo), --block-size, cache_salt and LoRA."
        ),
        epilog=(
            "examples:\n"
            "  kvserver hash --algo sha256_cbor --block-size 16 $(seq 0 31)\n"
            "  kvserver hash --algo xxhash_cbor --block-size 16 1,2,3,4\n"
            "  tokenize prompt.txt | kvserver hash --algo sha256 --block-size 16 -\n\n"
            "exit status: 0 ok, 2 bad arguments or tokens"
        ),
    )
    p.add_argument(
        "--algo",
        required=True,
        metavar="ALGO",
        help=f"hash algorithm, one of: {', '.join(HASH_ALGOS)}",
    )
    p.add_argument("--block-size", type=int, required=True, metavar="N", help="tokens per block")
    p.add_argument(
        "--seed",
        default=DEFAULT_SEED,
        help=f"NONE_HASH seed = vLLM's PYTHONHASHSEED (default: {DEFAULT_SEED!r})",
    )
    p.add_argument("--cache-salt", metavar="SALT", help="the request's cache_salt (block 0 only)")
    p.add_argument("--lora", metavar="NAME:PATH", help="the request's LoRA adapter")
    p.add_argument(
        "--chunk-blocks",
        type=int,
        default=1,
        metavar="K",
        help="print one key per full chunk of K blocks (default: 1, every block)",
    )
    p.add_argument(
        "tokens",
        nargs="+",
        metavar="TOKEN",
        help="token ids, space- or comma-separated; '-' reads them from stdin",
    )
    p.set_defaults(func=_cmd_hash)


def _cmd_hash(args: argparse.Namespace) -> int:
    from kvserver.cli_ops import parse_lora, parse_tokens
    from kvserver.errors import KVServerError
    from kvserver.hashing import BlockHasher

    try:
        text = " ".join(sys.stdin.read() if arg == "-" else arg for arg in args.tokens)
        tokens = parse_tokens(text)
        lora = parse_lora(args.lora)
        hasher = BlockHasher(args.algo, args.block_size, args.seed)
        hashes = hasher.hash_blocks(tokens, cache_salt=args.cache_salt, lora=lora)
        keys = hasher.chunk_keys(hashes, args.chunk_blocks)
    except (KVServerError, ValueError) as exc:
        print(f"kvserver hash: error: {exc}", file=sys.stderr)
        return 2
    tail = len(tokens) % args.block_size
    if tail:
        print(f"kvserver hash: note: last {tail} token(s) form no full block", file=sys.stderr)
    if len(hashes) % args.chunk_blocks:
        left = len(hashes) % args.chunk_blocks
        print(f"kvserver hash: note: last {left} block(s) form no full chunk", file=sys.stderr)
    sys.stdout.write("".join(f"{key.hex()}\n" for key in keys))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvserver ARGV...``; returns its exit status. Ctrl-C (a KeyboardInterrupt: a
    command waiting on its input or a daemon's answer) ends it as SIGINT does, without a
    traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["start"]:  # a stop signal from here on stops start-up cleanly
            from kvserver.daemon.signals import pause_point, recording

            with recording():
                pause_point("start")
                return _main(argv)
        return _main(argv)
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)  # exit as killed by SIGINT (a shell's
        os.kill(os.getpid(), signal.SIGINT)  # loop stops), as Python does after its traceback
        return 128 + signal.SIGINT


def _main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown", False):
        _unrecognized(parser, args.command, unknown)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    rc: int = func(args)
    return rc


def _unrecognized(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> NoReturn:
    """Exit 2 saying which of ``unknown`` ``kvserver COMMAND`` does not take, with the closest
    of its options for each misspelt one (was: the top-level usage, no hint), as its other
    usage errors are said (:class:`CommandParser`)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command_parser: argparse.ArgumentParser = sub.choices[command]
    options = [o for a in command_parser._actions for o in a.option_strings]
    hints = []
    for word in unknown:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.75)
            hints += [f"{word} (did you mean {close[0]}?)" if close else word]
        else:
            hints.append(word)
    command_parser.error(f"unrecognized arguments: {' '.join(hints)}")


if __name__ == "__main__":
    sys.exit(main())
