"""Which of gRPC core's I/O engines kvserver's own processes run: the polling engine.

Runs at the start of ``kvserver`` commands (``kvserver.cli.main``: the daemon's ``start``, the
CLI clients, ``kvserver bench``; ``kvserver scheduler``, ``scheduler/cli.py``) and of the
benchmarks' own clients, before anything imports ``grpc``. Imports nothing but the standard
library; never imports ``grpc`` itself.

Why. grpcio >= 1.6x serves and dials through the EventEngine by default: a socket's bytes are
read by an EventEngine poller thread, handed to a thread-pool thread, completed onto the
completion queue that grpc.aio's own poller thread waits on, which then wakes the event loop
(the sync client: the calling thread). A unary call there wakes the daemon's threads 10-11
times and the client's 4 times; with the EventEngine off for listeners and client channels
(gRPC core's ``iomgr`` polling engine, where the thread that waits on the completion queue
reads the socket itself) 5-6 and 1 (docs/benchmarks.md, "Fifth pass"). A wake-up is, on idle
cores, an exit from a sleep state, on busy ones a turn in a run queue: what a Lookup's p99 is
suspected to be made of.

Contract: :func:`use_polling_engine` sets ``GRPC_EXPERIMENTS`` to :data:`POLLING_EXPERIMENTS`
unless it is set already (any value, the empty string included: the operator's choice wins;
``GRPC_EXPERIMENTS=`` keeps gRPC's defaults) or ``grpc`` was imported already (gRPC core reads
the variable when the module loads, so setting it later would be a silent no-op). Child
processes inherit the variable. A gRPC release without these experiments logs "Unknown
experiment" once and runs its defaults; nothing else changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

#: the EventEngine off for client channels and for listeners (servers): gRPC's polling engine
POLLING_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
ENV = "GRPC_EXPERIMENTS"


def use_polling_engine(environ: MutableMapping[str, str] | None = None) -> bool:
    """Select the polling engine for this process and its children (see the module
    docstring); True when it set :data:`ENV`, False when it left it as it was."""
    env = os.environ if environ is None else environ
    if ENV in env or "grpc" in sys.modules:
        return False
    env[ENV] = POLLING_EXPERIMENTS
    return True
