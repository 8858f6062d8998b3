"""``kvserver status`` and ``kvserver lookup``: operator commands over the gRPC query API.

Runs in the CLI process. Each command: parse flags → one :class:`~kvserver.grpc_client.GrpcClient`
(closed on return) → one or two calls, each bounded by ``--timeout`` → print a readable table
(or JSON with ``--json``; the tables are made by ``kvserver/cli_render.py``). Wired into
``kvserver/cli.py`` with :func:`add_status` and :func:`add_lookup`.

Exit status: 0 ok; 1 the daemon is unreachable or refused the request (message on stderr);
2 bad arguments (unparsable tokens, an ambiguous model without ``--namespace``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any

from kvserver.cli_render import render_fleet, render_lookup, render_status
from kvserver.crypto import ClientSecurity, add_client_security_args
from kvserver.errors import InvalidArgument, KVServerError, Unauthenticated, Unavailable
from kvserver.token_file import client_auth_token, token_dir

DEFAULT_GRPC_PORT = 9470
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_GRPC_PORT}"
#: seconds each call may take unless --timeout says otherwise (kvserver bench's probe too)
DEFAULT_TIMEOUT_S = 5.0


class _UsageError(ValueError):
    """Bad user input: exit status 2."""


# --------------------------------------------------------------------------- parsers


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        type=server_address,
        default=os.environ.get("KVSERVER_SERVER", DEFAULT_SERVER),
        metavar="HOST[:PORT]",
        help=(
            f"the daemon's gRPC address, port {DEFAULT_GRPC_PORT} when not given "
            f"(default: $KVSERVER_SERVER or {DEFAULT_SERVER})"
        ),
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds per call (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--auth-token",
        default=os.environ.get("KVSERVER_AUTH_TOKEN"),
        metavar="TOKEN",
        help="shared secret when the daemon requires one (default: $KVSERVER_AUTH_TOKEN)",
    )
    p.add_argument(
        "--auth-token-file",
        default=os.environ.get("KVSERVER_AUTH_TOKEN_FILE", ""),
        metavar="FILE",
        help="read the token from FILE instead (default: $KVSERVER_AUTH_TOKEN_FILE)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_client_security_args(p, curve=False, tls=True)


def add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvserver status``."""
    p = sub.add_parser(
        "status",
        help="show capacity, usage and hit/miss/eviction counters per tier and namespace",
        description=(
            "Ask a running daemon for its statistics: capacity, usage, entries, hits, misses "
            "and evictions per tier and per namespace."
        ),
        epilog="exit status: 0 ok, 1 daemon unreachable or error, 2 bad arguments",
    )
    _add_common(p)
    p.set_defaults(func=cmd_status)


def add_lookup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvserver lookup``."""
    p = sub.add_parser(
        "lookup",
        help="how much of a prompt (token ids) is cached, and in which tier",
        description=(
            "Find the namespace of --model (ListNamespaces; pass --namespace when several "
            "match), let the daemon hash the token ids exactly as a vLLM replica of that "
            "namespace would, and print the cached prefix (tokens, chunks) and its tier split."
        ),
        epilog=(
            "examples:\n"
            "  kvserver lookup --model meta-llama/Llama-3.1-8B --tokens 1,2,3,4\n"
            "  tokenize prompt.txt | kvserver lookup --model M --tokens-file -\n\n"
            "exit status: 0 ok, 1 daemon unreachable or error, 2 bad arguments"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(p)
    p.add_argument("--model", required=True, help="model name the namespace was registered with")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="IDS", help="token ids, comma- or space-separated")
    src.add_argument("--tokens-file", metavar="FILE", help="file of token ids ('-' = stdin)")
    p.add_argument("--namespace", metavar="NS_ID", help="namespace id (when several match)")
    p.add_argument("--cache-salt", metavar="SALT", help="the request's cache_salt")
    p.add_argument("--lora", metavar="NAME:PATH", help="the request's LoRA adapter")
    p.add_argument(
        "--fleet",
        action="store_true",
        help="score every host of the daemon's fleet (ScoreHosts; --cluster daemons)",
    )
    p.add_argument("--hosts", metavar="IDS", help="with --fleet: only these host ids (comma)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="with --fleet: test every chunk instead of a binary search",
    )
    p.set_defaults(func=cmd_lookup)


# --------------------------------------------------------------------------- commands


def cmd_status(args: argparse.Namespace) -> int:
    return _run("status", args, _status)


def cmd_lookup(args: argparse.Namespace) -> int:
    return _run("lookup", args, _lookup)


def _run(name: str, args: argparse.Namespace, body: Any) -> int:
    # gRPC's C core logs a failed TLS handshake on stderr ("I1206 ... ssl_transport_security
    # .cc] Handshake failed ...") above the command's own error line: errors only
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from kvserver.grpc_client import GrpcClient

    try:
        if args.timeout <= 0:
            raise _UsageError("--timeout must be positive")
        try:
            tls = ClientSecurity.from_mapping(args).tls()
            token = client_auth_token(args)
        except InvalidArgument as exc:
            raise _UsageError(exc.message) from None
        with GrpcClient(args.server, timeout=args.timeout, auth_token=token, tls=tls) as client:
            text: str = body(client, args)
    except _UsageError as exc:
        print(f"kvserver {name}: error: {exc}", file=sys.stderr)
        return 2
    except Unavailable as exc:
        print(f"kvserver {name}: error: {unreachable(args.server, args.timeout, exc.message)}",
              file=sys.stderr)  # fmt: skip
        return 1
    except Unauthenticated as exc:
        print(
            f"kvserver {name}: error: {exc}: the daemon at {args.server} requires its token; "
            "pass --auth-token-file FILE or --auth-token TOKEN (only the user who started it "
            f"finds it by itself, on its host{_token_dir_hint(args)})",
            file=sys.stderr,
        )
        return 1
    except KVServerError as exc:
        print(f"kvserver {name}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


def _status(client: Any, args: argparse.Namespace) -> str:
    stats = client.stats()
    if args.json:
        return json.dumps(stats.to_dict(), indent=2, sort_keys=True) + "\n"
    return render_status(stats, args.server)


def _lookup(client: Any, args: argparse.Namespace) -> str:
    tokens = _read_tokens(args)
    lora = parse_lora(args.lora)
    if args.fleet:
        return _fleet(client, args, tokens)
    ns = _find_namespace(client, args.model, args.namespace)
    reply = client.lookup_tokens(ns.namespace_id, tokens, cache_salt=args.cache_salt, lora=lora)
    if args.json:
        out = {
            "namespace_id": ns.namespace_id,
            "model": ns.spec.model,
            "num_tokens": len(tokens),
            "hit_tokens": reply.hit_tokens,
            "hit_chunks": reply.hit_chunks,
            "num_chunks": reply.num_chunks,
            "chunk_tokens": reply.chunk_tokens,
            "tiers": reply.tiers,
        }
        return json.dumps(out, indent=2) + "\n"
    return render_lookup(ns, reply, len(tokens))


def _fleet(client: Any, args: argparse.Namespace, tokens: list[int]) -> str:
    """``lookup --fleet``: ScoreHosts through the daemon (any namespace of its fleet)."""
    from kvserver.cluster.rpc import call_score_hosts

    if args.cache_salt or args.lora:
        raise _UsageError("--fleet takes no --cache-salt or --lora yet")
    ns_id = args.namespace or _find_namespace(client, args.model, None).namespace_id
    hosts = [h for h in (args.hosts or "").split(",") if h]
    scored = call_score_hosts(
        client, ns_id, token_ids=tokens, candidate_hosts=hosts, exact=args.exact
    )
    if args.json:
        rows = [dataclasses.asdict(h) for h in scored]
        return json.dumps({"namespace_id": ns_id, "hosts": rows}, indent=2) + "\n"
    return render_fleet(ns_id, len(tokens), scored)


# --------------------------------------------------------------------------- helpers


def _find_namespace(client: Any, model: str, ns_id: str | None) -> Any:
    matches = client.list_namespaces(model)
    if ns_id is not None:
        for ns in matches:
            if ns.namespace_id == ns_id:
                return ns
        found = ", ".join(ns.namespace_id for ns in matches) or "none"
        raise KVServerError(
            f"namespace {ns_id} is not registered for model {model!r} (its namespaces: {found})"
        )
    if not matches:
        models = sorted({ns.spec.model for ns in client.list_namespaces()})
        raise KVServerError(
            f"no namespace is registered for model {model!r} "
            f"(registered models: {', '.join(map(repr, models)) or 'none'}; a namespace is "
            "registered by its first client: a vLLM engine with the kvserver connector, "
            "KVClient.register_namespace)"
        )
    if len(matches) > 1:
        lines = "\n".join(
            f"  {ns.namespace_id}  dtype={ns.spec.dtype} block_size={ns.spec.block_size} "
            f"chunk_blocks={ns.spec.chunk_blocks} hash={ns.spec.hash_algo} "
            f"tp={ns.spec.tp_world_size}" + (f" label={ns.spec.label!r}" if ns.spec.label else "")
            for ns in matches
        )
        raise _UsageError(
            f"{len(matches)} namespaces match model {model!r}; pick one with --namespace:\n" + lines
        )
    return matches[0]


def _read_tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        text = args.tokens
    elif args.tokens_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.tokens_file) as f:
                text = f.read()
        except OSError as exc:
            raise _UsageError(f"cannot read {args.tokens_file}: {exc.strerror}") from None
    return parse_tokens(text)


def _token_dir_hint(args: argparse.Namespace) -> str:
    """Where this command looked for the daemon's token file when it was given none: a daemon
    started with another ``--shm-dir`` leaves it there, and only ``KVSERVER_SHM_DIR`` says so
    (was: not a word of it, "only the user who started it finds it" to that very user)."""
    if args.auth_token or args.auth_token_file:
        return ""
    return f", in {token_dir()}: for a daemon started with --shm-dir DIR, set KVSERVER_SHM_DIR=DIR"


def unreachable(server: str, timeout: float, detail: str) -> str:
    """What ``kvserver status``/``lookup`` say when gRPC found no daemon at ``server``:
    TLS on one side only (or the wrong CA), nothing listening, or something that is not an
    HTTP/2 server (a port of the daemon other than its gRPC one: it answers with what gRPC
    cannot parse, or resets the connection), with gRPC's own words after."""
    if "the TLS handshake failed" in detail:  # kvserver.grpc_errors' hints, a TLS client
        said = (
            f"the TLS handshake with {server} failed: does the daemon serve gRPC over TLS "
            "(kvserver start --tls-cert-file or --keys-dir), and is --tls-ca-file the CA of "
            "its certificate (--tls-server-name a name in it)?"
        )
    elif "if it serves gRPC over TLS" in detail:  # a client in clear text, closed at once
        said = (
            f"{server} closed the connection at once: a daemon serving gRPC over TLS "
            "(kvserver start --tls-cert-file or --keys-dir) needs --tls-ca-file FILE (its "
            "certificate, e.g. server.crt of its keys directory)"
        )
    elif "Failed parsing HTTP/2" in detail or "Connection reset by peer" in detail:
        # the daemon's ZMQ port sends its greeting (which gRPC cannot parse) or resets the
        # connection at gRPC's preface, whichever comes first; an HTTP server sends HTTP/1
        said = (
            f"{server} answered, but not as a gRPC server: is that the daemon's gRPC port? "
            f"(`kvserver start --grpc-port`, {DEFAULT_GRPC_PORT} by default; 9471 is its ZMQ "
            "data port, 9473 its metrics)"
        )
    else:
        within = "" if "Connection refused" in detail else f" within {timeout:g}s"
        said = f"cannot reach the daemon at {server}{within}; is `kvserver start` running there?"
    return f"{said}\n  ({detail})"


def server_address(text: str) -> str:
    """``HOST[:PORT]`` as a gRPC target: without a port, the daemon's default gRPC port (gRPC
    itself would dial 443). IPv6 hosts may be bracketed; targets with a scheme pass as they are,
    but ``tcp://`` (a ZMQ endpoint's, which gRPC cannot resolve) is dropped. A port that is
    not 1-65535 is refused (argparse.ArgumentTypeError): gRPC dials it modulo 65536 (``:99999``
    reached port 34463, and the error said the daemon at ``:99999`` was not running). So is an
    ``http(s)://`` URL, which gRPC took for a host name ("Misformatted domain name", "cannot
    reach the daemon").
    """
    if text.startswith(("http://", "https://")):
        tls = "; over TLS, with --tls-ca-file FILE" if text.startswith("https") else ""
        raise argparse.ArgumentTypeError(
            f"{text[:200]!r} is a URL: give the daemon's gRPC address as HOST[:PORT], e.g. "
            f"127.0.0.1:{DEFAULT_GRPC_PORT}{tls}"
        )
    if text.startswith("tcp://"):
        text = text[len("tcp://") :]
    if "://" in text or text.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return text
    if text.startswith("["):  # [v6] or [v6]:port
        target = text if "]:" in text else f"{text}:{DEFAULT_GRPC_PORT}"
    elif text.count(":") > 1:  # a bare IPv6 address
        target = f"[{text}]:{DEFAULT_GRPC_PORT}"
    else:
        target = text if ":" in text else f"{text}:{DEFAULT_GRPC_PORT}"
    port = target.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"{text[:200]!r}: port {port[:20]!r} is not 1-65535")
    return target


def parse_tokens(text: str) -> list[int]:
    """``"1, 2 3\\n4"`` → [1, 2, 3, 4]; raises a usage error (a ValueError) naming the first bad
    token. The one token parser of the CLI (``lookup``, ``hash``): ids are 32-bit, as on the
    wire (gRPC ``uint32``) and in vLLM."""
    tokens: list[int] = []
    for piece in re.split(r"[\s,]+", text):
        if not piece:
            continue
        if not piece.isascii() or not piece.isdigit() or int(piece) >= 1 << 32:
            raise _UsageError(f"bad token {piece[:32]!r}: expected an integer in [0, 2**32)")
        tokens.append(int(piece))
    return tokens


def parse_lora(text: str | None) -> tuple[str, str] | None:
    """``NAME:PATH`` → (name, path); None stays None; a usage error (a ValueError) otherwise."""
    if text is None:
        return None
    name, sep, path = text.partition(":")
    if not sep or not name:
        raise _UsageError(f"bad --lora {text!r}: expected NAME:PATH")
    return name, path
