"""Transport security of the step channel: CURVE between the scheduler (DEALER, the client) and
each worker (ROUTER, the server), configured from files (docs/security.md, "The engine").

Runs in the scheduler and the worker processes while their arguments are read; pure functions
over argparse namespaces and key files (``kvserver/crypto.py`` reads them). The options are
the daemon's and its clients' (``kvserver.crypto.CLIENT_OPTIONS``) with the prefix ``step_``:

- a worker: ``--step-curve-secret-key-file`` (its pair, ``kvserver keys curve``) and
  optionally ``--step-curve-clients-dir`` (only the schedulers whose public key is there);
- the scheduler: ``--step-curve-server-key-file`` (the workers' public key) and
  ``--step-curve-secret-key-file`` (its own pair, listed in the workers' clients directory).

The daemon's rule holds here too: a worker binding beyond loopback, or a scheduler connecting
to a worker beyond it, without CURVE is refused unless ``--insecure-remote`` says clear text
is intended (:func:`check_worker_listen`, :func:`check_worker_addresses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserver.crypto import CurveClient, CurveServer, endpoint_is_local
from kvserver.errors import InvalidArgument

#: the step channel's option prefix
PREFIX = "step_"


def add_insecure_remote_arg(parser: Any, what: str) -> None:
    """``--insecure-remote``: ``what`` may be in clear text beyond loopback."""
    parser.add_argument(
        "--insecure-remote", action="store_true", help=f"allow {what} in clear text beyond "
        "loopback (an explicit choice; docs/security.md)",
    )  # fmt: skip


def add_worker_args(parser: Any) -> None:
    """The worker's step-channel options (the server side)."""
    parser.add_argument(
        "--step-curve-secret-key-file", metavar="FILE", default="",
        help="CURVE on the step channel: this worker's NAME.key_secret (docs/security.md)",
    )  # fmt: skip
    parser.add_argument(
        "--step-curve-clients-dir", metavar="DIR", default="",
        help="CURVE on the step channel: admit only schedulers whose NAME.key is in DIR",
    )  # fmt: skip
    parser.add_argument(
        "--step-no-auth", action="store_true",
        help="without CURVE, a tcp:// step channel takes no token (default: a random one, left "
        "for this user's scheduler in a 0600 file; any local user could drive this worker)",
    )  # fmt: skip


def add_scheduler_args(parser: Any) -> None:
    """The scheduler's step-channel options (the client side)."""
    parser.add_argument(
        "--step-curve-server-key-file", metavar="FILE", default="",
        help="CURVE on the step channel: the workers' public key (NAME.key; docs/security.md)",
    )  # fmt: skip
    parser.add_argument(
        "--step-curve-secret-key-file", metavar="FILE", default="",
        help="CURVE on the step channel: this scheduler's NAME.key_secret, when the workers "
        "list their clients (default: a fresh pair per process)",
    )  # fmt: skip


def worker_curve(args: Any) -> CurveServer | None:
    """The worker's CURVE server settings from its options (files read now); None without
    ``step_curve_secret_key_file``. InvalidArgument names the option."""
    secret = getattr(args, "step_curve_secret_key_file", "") or ""
    clients = getattr(args, "step_curve_clients_dir", "") or ""
    if not secret:
        if clients:
            raise InvalidArgument("step_curve_clients_dir needs step_curve_secret_key_file")
        return None
    try:
        return CurveServer.from_file(secret, clients)
    except InvalidArgument as exc:
        raise InvalidArgument(f"step_curve_secret_key_file: {exc.message}") from None


def scheduler_curve(args: Any) -> CurveClient | None:
    """The scheduler's CURVE client settings for its workers (files read now); None without
    ``step_curve_server_key_file``. InvalidArgument names the option."""
    server = getattr(args, "step_curve_server_key_file", "") or ""
    secret = getattr(args, "step_curve_secret_key_file", "") or ""
    if not server:
        if secret:
            raise InvalidArgument("step_curve_secret_key_file needs step_curve_server_key_file")
        return None
    try:
        return CurveClient.from_files(server, secret)
    except InvalidArgument as exc:
        raise InvalidArgument(f"step_curve_*: {exc.message}") from None


def check_worker_listen(endpoint: str, curve: CurveServer | None, insecure_remote: bool) -> None:
    """A worker may bind ``endpoint`` beyond loopback only with CURVE or ``insecure_remote``."""
    if curve is None and not insecure_remote and not endpoint_is_local(endpoint):
        raise InvalidArgument(
            f"--listen {endpoint} is beyond loopback: set step_curve_secret_key_file (CURVE, "
            "docs/security.md; make a key pair with 'kvserver keys curve'), or pass "
            "--insecure-remote to serve the step channel in clear"
        )


def check_worker_addresses(
    addresses: Sequence[str], curve: CurveClient | None, insecure_remote: bool
) -> None:
    """A scheduler may reach workers beyond loopback only with CURVE or ``insecure_remote``."""
    remote = [a for a in addresses if not endpoint_is_local(a)]
    if remote and curve is None and not insecure_remote:
        raise InvalidArgument(
            f"worker {remote[0]} is beyond loopback: set step_curve_server_key_file (the "
            "workers' CURVE public key, docs/security.md), or pass --insecure-remote to send "
            "the step channel in clear"
        )
