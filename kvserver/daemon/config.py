"""Daemon configuration: one validated dataclass, built from defaults < config file < environment
< command-line flags.

Defaults work out of the box: loopback only, fixed ports, 256 MiB of DRAM, the ``chain``
eviction policy. The config file is TOML with the same keys as the dataclass fields
(``dram = "8GiB"``); environment variables are ``KVSERVER_<FIELD>`` in upper case
(``KVSERVER_DRAM=8GiB``); both are read by ``kvserver.daemon.config_sources``. Each value,
whatever its source, is coerced to its field's type by ``kvserver.daemon.config_parse``
(sizes, booleans, numbers, tenants, ``keys_dir``) before ``__post_init__`` checks the whole
(the settings that go together: ``kvserver.daemon.config_checks``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvserver.cluster.config import ClusterConfig, parse_weights
from kvserver.cluster.schema import check_host_id
from kvserver.daemon.config_checks import (
    LISTENERS,
    check_access,
    check_leases,
    check_peers,
    check_ports,
)
from kvserver.daemon.config_parse import coerce, fill_from_keys_dir
from kvserver.daemon.config_parse import parse_size as parse_size  # still importable from here
from kvserver.daemon.config_sources import check_keys, env_settings, read_config_file
from kvserver.daemon.tenants import Tenant
from kvserver.engine.types import EngineConfig
from kvserver.errors import InvalidArgument
from kvserver.policies import make_policy
from kvserver.ssd.config import TierConfig
from kvserver.token_file import read_token_file
from kvserver.wire import host_id as wire_host_id

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRPC_PORT = 9470
DEFAULT_ZMQ_PORT = 9471
DEFAULT_PUB_PORT = 9472
DEFAULT_METRICS_PORT = 9473
#: the values of ``log_level`` (the logging module's names)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``peer_stream_window``: its default (the one owner: ``kvserver.daemon.peers.fetch`` takes
#: it as ``STREAM_WINDOW_BYTES``; this module must not import that one, which loads gRPC, since
#: the CLI loads this module before gRPC's engine is chosen); its bounds: ``config_checks``.
DEFAULT_PEER_STREAM_WINDOW = 32 << 20
#: ``max_lease_s``: its default (the engine's; the most it may be: ``config_checks``).
DEFAULT_MAX_LEASE_S = EngineConfig().max_lease_s
#: ``zmq_send_timeout_s`` when not set: this, or half of ``max_lease_s`` when that is less.
DEFAULT_SEND_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    host: str = DEFAULT_HOST
    grpc_port: int = DEFAULT_GRPC_PORT
    zmq_port: int = DEFAULT_ZMQ_PORT
    #: ZMQ PUB socket for KV events (vLLM wire format); 0 = ephemeral, -1 = disabled.
    pub_port: int = DEFAULT_PUB_PORT
    #: Prometheus /metrics over HTTP (docs/metrics.md); 0 = ephemeral, -1 = disabled.
    metrics_port: int = DEFAULT_METRICS_PORT
    dram: int = 256 << 20
    page_size: int = 64 << 10
    policy: str = "chain"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    default_lease_s: float = 30.0
    #: the longest lease a client may ask (seconds; a longer one is refused) and the lease
    #: of the daemon's own pins and reservations (zero-copy sends, stream puts, promotions,
    #: peer placements); at least ``default_lease_s``, at most a day.
    max_lease_s: float = DEFAULT_MAX_LEASE_S
    shm_dir: str = "/dev/shm"
    #: shared secret required on both APIs; "" = a random one made at start (docs/security.md).
    auth_token: str = field(default="", repr=False)
    #: read ``auth_token`` from this file instead (0600; ``kvserver keys token`` makes one).
    auth_token_file: str = ""
    #: require no token at all (any local user may then read and write every chunk).
    no_auth: bool = False
    #: restricted tokens (``[[tenants]]`` tables of the config file, kvserver/daemon/tenants.py).
    tenants: tuple[Tenant, ...] = field(default=(), repr=False)
    #: ZMQ CURVE for the ROUTER and PUB: the daemon's NAME.key_secret (docs/security.md).
    curve_secret_key_file: str = ""
    #: when set, only CURVE clients whose NAME.key is in this directory may connect.
    curve_clients_dir: str = ""
    #: gRPC TLS: certificate chain and private key (PEM).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: when set, gRPC clients must present a certificate signed by this CA (mutual TLS).
    tls_client_ca_file: str = ""
    #: listen beyond loopback without CURVE and TLS (traffic in clear: an explicit choice).
    insecure_remote: bool = False
    #: make what is missing of a key set in this directory at start and use it (CURVE, TLS,
    #: token; kvserver/keyset.py); excludes the settings it fills in.
    keys_dir: str = ""
    event_capacity: int = 100_000
    #: KV-event PUB: messages (events) queued per subscriber before ZMQ drops what follows, for
    #: it alone; a subscriber that fell behind gets them by replay (kvserver/daemon/pub_limit.py).
    pub_hwm: int = 1000
    #: KV-event PUB: most subscriber connections at once (one more is closed at once).
    pub_max_subscribers: int = 64
    #: KV-event PUB: most of those connections from one address (one address opening
    #: connections, no token needed, must not hold every slot); raise it where many
    #: subscribers share an address (behind NAT, or every engine of a host on loopback).
    pub_max_subscribers_per_address: int = 16
    #: gRPC WatchEvents: most streams at once, all callers together (one more is answered
    #: RESOURCE_EXHAUSTED): each event is written to every stream on the loop.
    max_event_watchers: int = 64
    #: gRPC: most connections from one address (the newest past it are shut down within
    #: 0.5 s; kvserver/grpc_limit.py); raise it where many clients share an address (behind
    #: NAT or a proxy).
    grpc_max_connections_per_address: int = 64
    #: largest request accepted, bytes: all frames of a local-channel message (refused at its
    #: size prefix) or of a ROUTER message (refused once ZMQ has received it whole); ZMQ itself
    #: (MAXMSGSIZE, the ROUTER's and the network tier's DEALERs') bounds each frame only.
    max_message_bytes: int = 1 << 30
    #: local channel: bytes of partly received large messages all connections may hold.
    local_inflight_bytes: int = 1 << 30
    #: local channel: most connections at once (one more is closed at once).
    local_max_connections: int = 256
    #: seconds ZMQ may take to send a zero-copy reply (its pages pinned meanwhile) before the
    #: connection it goes to is cut (a client that does not read its socket); at most half
    #: of ``max_lease_s`` (the send pins' lease); 0 = 60 s, or half of ``max_lease_s`` when
    #: that is less (``send_timeout_s``).
    zmq_send_timeout_s: float = 0.0
    #: bytes of zero-copy replies one ZMQ connection may have unsent (pinned pages ZMQ still
    #: holds) before its next ``get``/``read_parts`` is answered ``capacity`` (retry later);
    #: 0 = a quarter of ``dram`` (kvserver/daemon/zmq_send.py).
    zmq_send_max_unsent: int = 0
    #: seconds between lease-expiry sweeps.
    reap_interval_s: float = 0.25
    #: written (JSON: pid, ports, arena path) once every listener is up.
    ready_file: str = ""
    log_level: str = "INFO"
    #: SSD tier directory; "" = no SSD tier.
    ssd_dir: str = ""
    #: SSD tier capacity (bytes of slots).
    ssd: int = 1 << 30
    #: write a DRAM victim down only if it was used (stored, loaded, looked up) this many times.
    ssd_admission: int = 2
    ssd_policy: str = "lru"
    #: threads doing the SSD tier's disk I/O.
    ssd_io_threads: int = 4
    #: bytes of evicted chunks that may wait to be written down (more are not written).
    ssd_staging: int = 64 << 20
    #: seconds between retries of a degraded / unavailable SSD tier.
    ssd_retry_s: float = 5.0
    #: "auto": O_DIRECT when the filesystem allows it; "off": always through the page cache.
    ssd_direct: str = "auto"
    #: promotions (SSD → DRAM batches) reading at once; more wait their turn.
    ssd_promotions: int = 4
    #: seconds shutdown waits for the SSD tier's disk I/O in flight; past it, what has not
    #: finished is abandoned (not on SSD after a restart) and the process exits without it.
    ssd_drain_timeout_s: float = 10.0
    #: fleet state on Redis / Valkey (docs/cluster.md): redis://HOST:PORT/DB, rediss://...,
    #: redis+cluster://H1:P1,H2:P2, valkey://... (the valkey client); "" = this daemon is not
    #: part of a fleet.
    cluster: str = ""
    #: address peers and routers reach this daemon at ("" = host, or this host's name when
    #: host is a wildcard address).
    advertise_addr: str = ""
    #: this daemon's name in the fleet ("" = kvserver.wire.host_id()).
    host_id: str = ""
    #: seconds a fleet member (and its index entries) lives without a heartbeat.
    cluster_ttl_s: float = 10.0
    #: bound on every Redis call, seconds.
    cluster_timeout_s: float = 1.0
    #: a resync that is not urgent (Redis back, restarted empty) waits a random delay below
    #: this many seconds (-1 = the heartbeat interval, cluster_ttl_s / 3; 0 = none).
    cluster_resync_spread_s: float = -1.0
    #: ScoreHosts tier weights, e.g. "dram=1,ssd=0.5".
    cluster_tier_weights: str = "dram=1,ssd=0.5"
    #: the network tier without a fleet index: other daemons' data planes, comma-separated
    #: (``tcp://HOST:PORT,...``); "" = none (docs/cluster.md, "Network tier").
    peers: str = ""
    #: bound on every call to a peer daemon, seconds.
    peer_timeout_s: float = 2.0
    #: seconds a peer that failed or timed out is left out of lookups and fetches.
    peer_suspect_s: float = 10.0
    #: data-plane connections to each peer (concurrent fetches beyond wait their turn).
    peer_connections: int = 4
    #: the peers' CURVE public key file ("" = the public half of ``curve_secret_key_file``:
    #: one key pair for the whole fleet; neither: peers are called without CURVE).
    peer_curve_server_key_file: str = ""
    #: the peer stream port (``docs/wire.md``, "Peer stream"): peers fetch chunks from this
    #: daemon over TCP, received straight into their arena; 0 = an ephemeral port
    #: (announced in ``hello`` and the fleet record), -1 = none (and this daemon fetches from
    #: its peers over ZMQ only). With ``tls_cert_file`` it is a TLS port (the gRPC
    #: certificate, key and client CA); without, a plain one, not opened when
    #: ``curve_secret_key_file`` is set (chunks would cross in clear: peers then use ZMQ).
    peer_stream_port: int = 0
    #: payload bytes this daemon asks of a peer's stream per window (at least one chunk),
    #: the windows of a fetch pipelined on one connection (docs/cluster.md, "Network tier");
    #: between 1 MiB and 1 GiB. Each window is one request, one reservation and one
    #: hand-over to the receiving thread; a peer failing mid-window loses that window's keys,
    #: and reserving ahead can evict up to two windows' worth of DRAM per fetch.
    peer_stream_window: int = DEFAULT_PEER_STREAM_WINDOW
    #: the CA (PEM) the peers' stream certificates must chain to ("" = ``tls_cert_file``: one
    #: certificate for the fleet, as ``kvserver keys tls`` makes it; neither: TLS stream
    #: ports of peers are not used, their chunks come over ZMQ).
    peer_tls_ca_file: str = ""
    #: the name checked against the peers' stream certificates ("" = the host of each
    #: peer's advertised address; set it when the certificate names the service, not the
    #: hosts, as deploy/k8s does).
    peer_tls_server_name: str = ""
    #: apply the glibc allocator settings of ``kvserver/daemon/malloc.py`` at start-up.
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        check_ports({name: getattr(self, name) for name in LISTENERS})
        if not 0 < self.reap_interval_s < math.inf:
            raise InvalidArgument("reap_interval_s must be positive", value=self.reap_interval_s)
        check_leases(self.default_lease_s, self.max_lease_s, self.zmq_send_timeout_s)
        if self.zmq_send_max_unsent < 0:
            raise InvalidArgument(
                "zmq_send_max_unsent must be >= 0 (0: a quarter of dram)",
                value=self.zmq_send_max_unsent,
            )
        for name in ("ssd_promotions", "event_capacity", "max_message_bytes",
                     "local_inflight_bytes", "local_max_connections", "pub_hwm",
                     "pub_max_subscribers", "pub_max_subscribers_per_address",
                     "max_event_watchers", "grpc_max_connections_per_address"):  # fmt: skip
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1", value=getattr(self, name))
        check_access(
            host=self.host, insecure_remote=self.insecure_remote, no_auth=self.no_auth,
            auth_token=self.auth_token, tenants=self.tenants, tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file, tls_client_ca_file=self.tls_client_ca_file,
            peer_tls_server_name=self.peer_tls_server_name, peer_tls_ca=self.peer_tls_ca,
            curve_secret_key_file=self.curve_secret_key_file,
            curve_clients_dir=self.curve_clients_dir,
        )  # fmt: skip
        check_peers(
            peers=self.peers, cluster=self.cluster, peer_addresses=self.peer_addresses,
            peer_timeout_s=self.peer_timeout_s, peer_suspect_s=self.peer_suspect_s,
            peer_connections=self.peer_connections, peer_stream_window=self.peer_stream_window,
        )  # fmt: skip
        if self.log_level.upper() not in LOG_LEVELS:
            raise InvalidArgument(
                f"log_level must be one of {', '.join(LOG_LEVELS)}", value=self.log_level
            )
        if self.dram < self.page_size:  # the engine's own check, in the operator's words
            raise InvalidArgument(
                f"dram ({self.dram} bytes) is smaller than one page (page_size "
                f"{self.page_size} bytes): give a few MiB at least, e.g. --dram 256MiB"
            )
        self.engine_config()  # validates the engine part
        make_policy(self.policy)  # names the valid choices when wrong, before any start-up
        make_policy(self.ssd_policy)
        if self.ssd_dir:
            self.tier_config()
        if self.cluster:
            self.cluster_config()
        if self.host_id:
            check_host_id(self.host_id)

    def cluster_config(self) -> ClusterConfig | None:
        """The fleet settings, or None when no ``cluster`` URL is given."""
        if not self.cluster:
            return None
        spread = self.cluster_resync_spread_s
        return ClusterConfig(
            self.cluster,
            ttl_s=self.cluster_ttl_s,
            timeout_s=self.cluster_timeout_s,
            resync_spread_s=None if spread == -1 else spread,
            tier_weights=parse_weights(self.cluster_tier_weights),
        )

    @property
    def advertised_host(self) -> str:
        """The host part of the addresses this daemon advertises to its fleet."""
        if self.advertise_addr:
            return self.advertise_addr
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.host

    @property
    def member_id(self) -> str:
        """This daemon's name in its fleet and in its KV-event topics: ``host_id``; with a
        ``cluster`` and no ``host_id``, ``kvserver.wire.host_id()``; else "" (standalone:
        topics then name ``<hostname>:<data port>``)."""
        if self.host_id or not self.cluster:
            return self.host_id
        return wire_host_id()

    @property
    def send_timeout_s(self) -> float:
        """``zmq_send_timeout_s``, or when it is 0, 60 s or half of ``max_lease_s`` when that
        is less (the send pins' lease must outlive it)."""
        return self.zmq_send_timeout_s or min(DEFAULT_SEND_TIMEOUT_S, self.max_lease_s / 2)

    @property
    def send_max_unsent(self) -> int:
        """``zmq_send_max_unsent``, or a quarter of ``dram`` when it is 0."""
        return self.zmq_send_max_unsent or max(self.dram // 4, 1)

    @property
    def stream_put_max_reserved(self) -> int:
        """The DRAM that clients' stream puts in flight may hold together (a quarter of
        ``dram``; ``kvserver/daemon/stream_ops.py``), announced in the hello so a client cuts
        a larger put into windows that stay within a share of it."""
        return max(self.dram // 4, 1)

    @property
    def peer_tls_ca(self) -> str:
        """The CA file peers' stream certificates are checked against ("" = none)."""
        return self.peer_tls_ca_file or self.tls_cert_file

    @property
    def peer_addresses(self) -> list[str]:
        """``peers`` as a list (empty when none)."""
        return [a.strip() for a in self.peers.split(",") if a.strip()]

    def tier_config(self) -> TierConfig | None:
        """The SSD tier's settings, or None when no ``ssd_dir`` is given."""
        if not self.ssd_dir:
            return None
        return TierConfig(
            directory=self.ssd_dir,
            capacity_bytes=self.ssd,
            admission=self.ssd_admission,
            policy=self.ssd_policy,
            io_threads=self.ssd_io_threads,
            staging_bytes=self.ssd_staging,
            retry_s=self.ssd_retry_s,
            direct=self.ssd_direct,
            drain_timeout_s=self.ssd_drain_timeout_s,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            dram_bytes=self.dram,
            page_size=self.page_size,
            policy=self.policy,
            store_threshold=self.store_threshold,
            max_tracker_size=self.max_tracker_size,
            default_lease_s=self.default_lease_s,
            max_lease_s=self.max_lease_s,
            shm_dir=self.shm_dir,
        )

    @classmethod
    def settings(cls) -> list[str]:
        """The setting names: the config file's keys, ``KVSERVER_<NAME>`` in upper case."""
        return [f.name for f in fields(cls)]

    @classmethod
    def load(
        cls,
        *,
        config_file: str | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> DaemonConfig:
        """Defaults < ``config_file`` (TOML) < ``env`` (KVSERVER_*; ``os.environ`` when None) <
        ``overrides`` (flags; None values are not given)."""
        booleans = [f.name for f in fields(cls) if f.type == "bool"]
        values: dict[str, Any] = read_config_file(config_file, booleans) if config_file else {}
        values.update(env_settings(os.environ if env is None else env, cls.settings()))
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DaemonConfig:
        """The config of ``values`` (setting name -> a value or its text), each coerced
        (``config_parse.coerce``), then checked as a whole; an unknown name is refused."""
        known = {f.name: f for f in fields(cls)}
        check_keys(values, known)
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            kwargs[name] = coerce(name, known[name], value)
        if kwargs.get("keys_dir"):
            fill_from_keys_dir(kwargs, DEFAULT_HOST)
        if kwargs.get("auth_token_file"):
            if kwargs.get("auth_token") or kwargs.get("no_auth"):
                raise InvalidArgument("auth_token_file excludes auth_token and no_auth")
            kwargs["auth_token"] = read_token_file(kwargs["auth_token_file"], "auth_token_file")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> DaemonConfig:
        return dataclasses.replace(self, **changes)
