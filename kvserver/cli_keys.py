"""``kvserver keys``: make the key files of docs/security.md.

``kvserver keys curve DIR [--name NAME]`` writes a ZMQ CURVE pair (``NAME.key``,
``NAME.key_secret`` 0600); ``kvserver keys tls DIR --host H [--host H ...] [--name NAME]`` a
self-signed TLS certificate for those host names / addresses (``NAME.crt``, ``NAME.pem``
0600; needs the ``cryptography`` package, extra ``tls``); ``kvserver keys token DIR [--name NAME]``
a random token (``NAME.token``, 0600) for ``--auth-token-file``. Never overwrites a file.
"""

from __future__ import annotations

import argparse
import sys

from kvserver.errors import KVServerError


def add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keys",
        help="make CURVE keys, a TLS certificate or a token (docs/security.md)",
        description="Make the key files of docs/security.md; an existing file is never "
        "overwritten.\n'kvserver start --keys-dir DIR' makes a whole set at start instead.",
        epilog=(
            "examples:\n"
            "  kvserver keys token keys                  # keys/auth.token: --auth-token-file\n"
            "  kvserver keys curve keys --name server    # server.key, server.key_secret\n"
            "  kvserver keys tls keys --host kv1.example.com --host 10.0.0.5\n\n"
            "exit status: 0 made (the files are printed), 2 bad arguments or a file exists"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    curve = kinds.add_parser("curve", help="a ZMQ CURVE key pair")
    curve.add_argument(
        "directory", help="where to write NAME.key and NAME.key_secret (made if missing)"
    )
    curve.add_argument("--name", default="server", help="file name stem (default: server)")
    tls = kinds.add_parser("tls", help="a self-signed TLS certificate and key")
    tls.add_argument("directory", help="where to write NAME.crt and NAME.pem (made if missing)")
    tls.add_argument("--name", default="server", help="file name stem (default: server)")
    tls.add_argument(
        "--host",
        action="append",
        required=True,
        help="a DNS name or IP address the certificate is valid for (repeat)",
    )
    tls.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    token = kinds.add_parser("token", help="a random token for --auth-token-file")
    token.add_argument("directory", help="where to write NAME.token (0600) (made if missing)")
    token.add_argument("--name", default="auth", help="file name stem (default: auth)")
    p.set_defaults(func=_cmd_keys)


def _cmd_keys(args: argparse.Namespace) -> int:
    from kvserver.crypto import make_curve_keys, make_tls_cert
    from kvserver.token_file import make_token_file

    paths: tuple[str, ...]
    try:
        if args.kind == "curve":
            paths = make_curve_keys(args.directory, args.name)
        elif args.kind == "token":
            paths = (make_token_file(args.directory, args.name),)
        else:
            try:
                paths = make_tls_cert(args.directory, args.name, args.host, days=args.days)
            except ImportError:
                print(
                    "kvserver keys tls: error: needs the 'cryptography' package "
                    "(pip install 'kvserver[tls]'), or make one with openssl "
                    "(docs/security.md)",
                    file=sys.stderr,
                )
                return 2
    except KVServerError as exc:
        print(f"kvserver keys: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # DIR under a file, not writable: was a traceback
        where = exc.filename or args.directory
        why = f"cannot write in {where}: {exc.strerror or exc}"
        if isinstance(exc, FileExistsError):  # os.makedirs of a path that is a file
            why = f"{where} is a file, not a directory"
        print(f"kvserver keys: error: {why}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
