"""What ``kvserver start`` checks before it makes the arena: each thing an operator can get
wrong that the daemon would otherwise find only after the pre-fault (which commits ``--dram``
of memory, tens of seconds for a large tier) or once serving.

Runs in the daemon process, called once by ``process.py`` at start-up, before the arena. Each
check raises KVServerError naming the setting and what to do; nothing is left behind (a probe
file is removed, a probe socket closed). The checks are probes: the real binds and writes
later still decide, and say so in their own errors.

- ``--host``: it resolves and is an address of this machine (a probe bound to port 0: with
  ephemeral ports ``check_ports`` binds nothing);
- the fixed ports are free (``listening.check_ports``);
- ``--curve-secret-key-file`` and every ``.key`` of ``--curve-clients-dir`` can be read and
  hold CURVE keys (``kvserver/key_files.py``);
- ``--ready-file`` can be written (was: the daemon started, served, then failed writing it
  with a traceback and stopped);
- ``--cluster``: the client library its scheme picks is installed (was: said once the node was
  built, after the arena's pre-fault and the front ends).
"""

from __future__ import annotations

import socket

from kvserver.cluster.config import check_client_library
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.listening import bind_hint, check_ports
from kvserver.errors import KVServerError
from kvserver.files import check_writable


def preflight(config: DaemonConfig) -> None:
    """Raise KVServerError for the first of the module docstring's checks that fails."""
    check_host(config.host)
    check_ports(config)
    if config.curve_secret_key_file:
        from kvserver.crypto import CurveServer

        CurveServer.from_file(config.curve_secret_key_file, config.curve_clients_dir)
        if config.curve_clients_dir:
            from kvserver.key_files import load_client_keys

            load_client_keys(config.curve_clients_dir)
    if config.ready_file:
        check_writable(config.ready_file, "--ready-file")
    if config.cluster:
        check_client_library(config.cluster)


def check_host(host: str) -> None:
    """Raise KVServerError naming ``--host`` when ``host`` does not resolve, or none of its
    addresses is one of this machine's (``localhost`` may resolve to ``::1`` first on a host
    without IPv6: any address that binds will do, as it does for the listeners)."""
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise KVServerError(
            f"cannot bind {host}: {exc.strerror or exc}{bind_hint('--host', exc.errno)}"
        ) from None
    refused: OSError | None = None
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as probe:  # (no IPv6: EAFNOSUPPORT)
                probe.bind(address)
            return
        except OSError as exc:
            refused = exc
    assert refused is not None  # getaddrinfo returns at least one address or raises
    raise KVServerError(
        f"cannot bind {host}: {refused.strerror}{bind_hint('--host', refused.errno)}"
    )
