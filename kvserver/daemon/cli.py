"""``kvserver start``: parse flags into a DaemonConfig and run the daemon process."""

from __future__ import annotations

import argparse
import re
import sys

from kvserver.errors import KVServerError


def add_start(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "start",
        help="run the kvserver daemon (DRAM tier, ZMQ data plane, gRPC query API)",
        usage="%(prog)s [options]",  # --help: the options are listed under it, not 28 lines
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run the kvserver daemon in the foreground until SIGTERM, SIGINT (Ctrl-C) or\n"
            "SIGHUP. Settings come from defaults < --config FILE (TOML) < KVSERVER_*\n"
            "environment variables < flags. Binds to loopback unless --host says otherwise.\n"
            "Sizes take IEC or SI units (256MiB, 8GiB, 1GB) or bytes; durations are seconds."
        ),
        epilog=(
            "examples:\n"
            "  kvserver start                          # loopback, 256 MiB DRAM, ports 9470-9473\n"
            "  kvserver start --dram 8GiB --ssd-dir /mnt/nvme/kvserver --ssd 500GiB\n"
            "  kvserver start --config kvserver.toml   # keys: the flags' names, '_' for '-'\n"
            "  KVSERVER_DRAM=8GiB kvserver start       # any setting: KVSERVER_<NAME>\n"
            "  kvserver start --host 0.0.0.0 --keys-dir /var/lib/kvserver/keys   # CURVE, TLS\n"
            "  kvserver start --cluster redis://redis-host:6379/0   # join a fleet\n\n"
            "exit status: 0 stopped in order, 1 could not start (why on stderr), 2 bad\n"
            "settings; 128 + N when a second signal N cut the shutdown short"
        ),
    )
    # "--dram -5GiB" is a bad value, not a missing one: a word that starts with a minus and a
    # digit is a value here (argparse's own test takes plain negative numbers only)
    p._negative_number_matcher = re.compile(r"^-\d")
    # the options as a table, one or two lines each
    # fmt: off
    p.add_argument("--config", metavar="FILE", help="TOML config file (keys = long flag names)")
    p.add_argument("--host", metavar="HOST", help="address to bind (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, metavar="PORT",
                   help="gRPC query API port (default 9470, 0=any)")
    p.add_argument("--zmq-port", type=int, metavar="PORT",
                   help="ZMQ data-plane port (default 9471, 0=any)")
    p.add_argument("--pub-port", type=int, metavar="PORT",
                   help="ZMQ KV-event PUB port (default 9472, -1=off)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="Prometheus /metrics HTTP port (default 9473, 0=any, -1=off)")
    p.add_argument("--dram", metavar="SIZE",
                   help="DRAM tier size, e.g. 256MiB, 8GiB (default 256MiB)")
    p.add_argument("--page-size", metavar="SIZE", help="arena page size (default 64KiB)")
    p.add_argument("--policy", metavar="NAME",
                   help="eviction policy: chain, prefix, lru or arc (default chain)")
    p.add_argument("--store-threshold", type=int, metavar="N",
                   help="reuse gating: store a chunk only after N sightings (default 0; 0/1 = off)")
    p.add_argument("--default-lease-s", type=float, metavar="S",
                   help="seconds a reservation or load pin lives without completion (default 30)")
    p.add_argument("--max-lease-s", type=float, metavar="S",
                   help="the longest lease a client may ask, seconds (a longer one is refused), "
                        "and the daemon's own pins' (default 600; at most 86400)")
    p.add_argument("--shm-dir", metavar="DIR",
                   help="tmpfs directory for the arena (default /dev/shm)")
    p.add_argument("--auth-token", metavar="TOKEN",
                   help="shared secret required on both APIs (default: a random one, left for "
                        "this user's clients in a 0600 file; docs/security.md)")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help="read the token from FILE (0600; 'kvserver keys token' makes one)")
    p.add_argument("--no-auth", action="store_true", default=None,
                   help="require no token: any local user may read and write every chunk")
    p.add_argument("--curve-secret-key-file", metavar="FILE",
                   help="ZMQ CURVE: the daemon's NAME.key_secret (see docs/security.md)")
    p.add_argument("--curve-clients-dir", metavar="DIR",
                   help="ZMQ CURVE: admit only clients whose NAME.key is in DIR")
    p.add_argument("--tls-cert-file", metavar="PEM", help="gRPC TLS certificate chain")
    p.add_argument("--tls-key-file", metavar="PEM", help="gRPC TLS private key")
    p.add_argument("--tls-client-ca-file", metavar="PEM",
                   help="gRPC mutual TLS: client certificates must be signed by this CA")
    p.add_argument("--insecure-remote", action="store_true", default=None,
                   help="allow a host beyond loopback without CURVE and TLS (clear text)")
    p.add_argument("--keys-dir", metavar="DIR",
                   help="make what is missing of a key set in DIR (CURVE, TLS, token) and use "
                        "it (docs/security.md)")
    p.add_argument("--ssd-dir", metavar="DIR", help="SSD tier directory (default: no SSD tier)")
    p.add_argument("--ssd", metavar="SIZE", help="SSD tier capacity, e.g. 100GiB (default 1GiB)")
    p.add_argument("--ssd-admission", type=int, metavar="N",
                   help="write a DRAM victim down only if used N times (default 2)")
    p.add_argument("--ssd-policy", metavar="NAME",
                   help="SSD tier eviction policy: lru, arc, prefix, chain (default lru)")
    p.add_argument("--ssd-io-threads", type=int, metavar="N",
                   help="threads for SSD I/O (default 4)")
    p.add_argument("--ssd-promotions", type=int, metavar="N",
                   help="SSD-to-DRAM promotions reading at once (default 4)")
    p.add_argument("--ssd-drain-timeout-s", type=float, metavar="S",
                   help="seconds shutdown waits for SSD I/O in flight before abandoning it "
                        "(default 10)")
    p.add_argument("--tune-malloc", action=argparse.BooleanOptionalAction, default=None,
                   help="glibc allocator settings for large messages (default on; no-op "
                        "without glibc)")
    p.add_argument("--cluster", metavar="URL",
                   help="join a fleet on Redis/Valkey: redis://HOST:PORT/DB, rediss://..., "
                        "redis+cluster://H1:P1,H2:P2; valkey://... the same through the valkey "
                        "client (docs/cluster.md; default: standalone)")
    p.add_argument("--advertise-addr", metavar="HOST",
                   help="address peers and routers reach this daemon at (default: --host)")
    p.add_argument("--host-id", metavar="ID",
                   help="this daemon's name in the fleet (default: hostname/boot id)")
    p.add_argument("--cluster-ttl-s", type=float, metavar="S",
                   help="seconds a member lives without a heartbeat (default 10)")
    p.add_argument("--cluster-timeout-s", type=float, metavar="S",
                   help="bound on Redis calls (default 1)")
    p.add_argument("--cluster-resync-spread-s", type=float, metavar="S",
                   help="a resync after Redis returns waits a random delay below S "
                        "(default: the heartbeat interval, TTL / 3; 0: none)")
    p.add_argument("--cluster-tier-weights", metavar="W",
                   help="ScoreHosts tier weights (default dram=1,ssd=0.5)")
    p.add_argument("--peers", metavar="ADDRS",
                   help="network tier without a fleet index: the data-plane addresses of the "
                        "other daemons, comma-separated (tcp://HOST:PORT,...)")
    p.add_argument("--peer-timeout-s", type=float, metavar="S",
                   help="bound on every call to a peer daemon (default 2)")
    p.add_argument("--peer-suspect-s", type=float, metavar="S",
                   help="seconds a peer that failed is left alone (default 10)")
    p.add_argument("--peer-curve-server-key-file", metavar="FILE",
                   help="the peers' CURVE public key (default: the public half of "
                        "--curve-secret-key-file, one key pair for the fleet)")
    p.add_argument("--peer-stream-port", type=int, metavar="PORT",
                   help="port peers fetch chunks from (default 0: ephemeral; -1: none, and "
                        "fetch from peers over ZMQ only); TLS with --tls-cert-file, else plain "
                        "TCP, not opened with CURVE (docs/cluster.md)")
    p.add_argument("--peer-stream-window", metavar="SIZE",
                   help="payload a fetch asks of a peer's stream per window, pipelined on one "
                        "connection, e.g. 8MiB (default 32MiB; 1MiB to 1GiB)")
    p.add_argument("--peer-tls-ca-file", metavar="PEM",
                   help="the CA the peers' stream certificates must chain to (default: "
                        "--tls-cert-file, one certificate for the fleet)")
    p.add_argument("--peer-tls-server-name", metavar="NAME",
                   help="the name checked against the peers' stream certificates (default: "
                        "the host of each peer's address)")
    p.add_argument("--zmq-send-max-unsent", metavar="SIZE",
                   help="bytes of zero-copy replies one ZMQ connection may leave unsent before "
                        "its next get is answered 'capacity' (retry later), e.g. 1GiB "
                        "(default: a quarter of --dram)")
    p.add_argument("--ready-file", metavar="FILE",
                   help="write JSON {pid, ports, arena_path} here once serving")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR")
    # fmt: on
    p.set_defaults(func=_cmd_start)


def _cmd_start(args: argparse.Namespace) -> int:
    import os

    from kvserver.daemon.config import DaemonConfig
    from kvserver.daemon.config_sources import unknown_env

    for warning in unknown_env(os.environ, DaemonConfig.settings()):
        print(f"kvserver start: warning: {warning}", file=sys.stderr)
    overrides = {
        k: getattr(args, k)
        for k in ("host", "grpc_port", "zmq_port", "pub_port", "metrics_port",
                  "dram", "page_size", "policy",
                  "store_threshold", "default_lease_s", "max_lease_s", "shm_dir", "auth_token",
                  "auth_token_file", "ready_file",
                  "log_level", "ssd_dir", "ssd", "ssd_admission", "ssd_policy", "ssd_io_threads",
                  "ssd_promotions", "ssd_drain_timeout_s", "tune_malloc", "cluster",
                  "advertise_addr", "host_id",
                  "cluster_ttl_s", "cluster_timeout_s", "cluster_tier_weights",
                  "cluster_resync_spread_s",
                  "curve_secret_key_file", "curve_clients_dir", "tls_cert_file", "tls_key_file",
                  "tls_client_ca_file", "insecure_remote", "keys_dir", "peers", "peer_timeout_s",
                  "peer_suspect_s", "peer_curve_server_key_file", "peer_stream_port",
                  "peer_stream_window", "peer_tls_ca_file", "peer_tls_server_name",
                  "no_auth", "zmq_send_max_unsent")
    }  # fmt: skip
    try:
        config = DaemonConfig.load(config_file=args.config, overrides=overrides)
    except KVServerError as exc:
        print(f"kvserver start: error: {exc}", file=sys.stderr)
        return 2
    from kvserver.grpc_engine import use_polling_engine

    use_polling_engine()  # before grpc is imported: fewer thread wake-ups per call
    from kvserver.daemon.process import main

    try:
        return main(config)
    except KVServerError as exc:
        print(f"kvserver start: error: {exc}", file=sys.stderr)
        return 1
