"""Cluster settings and the Redis / Valkey connection.

``ClusterConfig.parse(url, ...)`` validates everything up front (a bad URL is an
``InvalidArgument`` at start-up, not a failure later); ``connect()`` builds the asyncio
client, which connects lazily (so a daemon starts while Redis is down).

URLs:

- ``redis://[USER:PASSWORD@]HOST:PORT[/DB]``: one Redis / Valkey server;
- ``rediss://...``: the same over TLS (query parameters ``ssl_ca_certs``, ``ssl_certfile``,
  ``ssl_keyfile``, ``ssl_cert_reqs=none|optional|required``);
- ``redis+cluster://[USER:PASSWORD@]H1:P1,H2:P2,...`` (and ``rediss+cluster://``): a Redis
  Cluster; the listed nodes are seeds, the client discovers the others (DB must be 0).
- ``valkey://``, ``valkeys://``, ``valkey+cluster://``, ``valkeys+cluster://``: the same
  forms, through the ``valkey`` client instead of ``redis-py``.

The scheme picks the client library, never the server: both speak one protocol to Redis and
Valkey alike. ``redis*`` → ``redis-py`` (extra ``cluster``), ``valkey*`` → ``valkey``
(extra ``valkey``); only the named one is imported, and a missing one is an
``InvalidArgument`` at start-up naming its extra (no silent fall-back to the other: a
deployment that installs only one of them gets exactly that one).

Every Redis call is bounded by ``timeout_s`` (socket connect and read timeouts).
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kvserver.cluster.schema import TIERS
from kvserver.crypto import is_loopback
from kvserver.errors import InvalidArgument

#: the client libraries, by URL scheme prefix (module docstring)
CLIENTS = ("redis", "valkey")
SCHEMES = tuple(
    f"{client}{tls}{cluster}"
    for client in CLIENTS
    for tls in ("", "s")
    for cluster in ("", "+cluster")
)
DEFAULT_TTL_S = 10.0
DEFAULT_TIMEOUT_S = 1.0
#: score weight per tier (a token in DRAM counts 1, on SSD 0.5); overridable per request.
DEFAULT_TIER_WEIGHTS = {"dram": 1.0, "ssd": 0.5}
_TLS_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
#: the values of ``ssl_cert_reqs`` both client libraries take
CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    url: str
    #: seconds a member (and its index) lives without a heartbeat.
    ttl_s: float = DEFAULT_TTL_S
    #: seconds between heartbeats; default ttl_s / 3.
    heartbeat_s: float = 0.0
    #: bound on every Redis call (connect, read).
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: readers cache the member list this long (seconds).
    members_max_age_s: float = 0.5
    #: seconds pending index changes wait to join one batch (fewer, larger pipelines: the
    #: index lags the daemon by about this much more).
    batch_linger_s: float = 0.01
    #: most events buffered while a batch is in flight; beyond, they are dropped and the
    #: index is resynchronised from the daemon's own tiers.
    max_pending_keys: int = 1_000_000
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    #: seconds over which a resync that is not urgent is spread: every one but an
    #: incarnation's first (after Redis returns or restarts empty, after lost entries) waits
    #: a random delay in [0, this) once Redis answers its fence ``SET``, so that a fleet does
    #: not send every index at once (100 hosts x 8 MB per 1 M chunks). None: the heartbeat
    #: interval (ttl_s / 3); 0: no delay.
    resync_spread_s: float | None = None
    #: most seconds between two retries of a failing registration (the pause doubles from
    #: min(1 s, heartbeat interval) per failure in a row, each drawn in [half, whole]).
    #: None: ttl_s.
    retry_max_s: float | None = None

    def __post_init__(self) -> None:
        check_tls_options(self.target().tls_options)  # validates the URL and its TLS files
        # each message names the daemon's setting (cluster_ttl_s, cluster_timeout_s) or,
        # for those it has none of, this class's field; "not x > 0" refuses NaN too
        if not 0 < self.ttl_s < math.inf:
            raise InvalidArgument("cluster_ttl_s must be a positive number", value=self.ttl_s)
        if not 0 < self.timeout_s < math.inf:
            raise InvalidArgument(
                "cluster_timeout_s must be a positive number", value=self.timeout_s
            )
        if not 0 <= self.members_max_age_s < math.inf:
            raise InvalidArgument(
                "cluster members_max_age_s must be >= 0", value=self.members_max_age_s
            )
        if not 0 <= self.batch_linger_s < self.ttl_s:
            raise InvalidArgument(
                "cluster batch_linger_s must be in [0, cluster_ttl_s)",
                value=self.batch_linger_s, cluster_ttl_s=self.ttl_s,
            )  # fmt: skip
        if not 0 <= self.heartbeat_s < self.ttl_s:
            raise InvalidArgument(
                "cluster heartbeat_s must be in [0, cluster_ttl_s)",
                value=self.heartbeat_s, cluster_ttl_s=self.ttl_s,
            )  # fmt: skip
        for name, value in (("cluster_resync_spread_s", self.resync_spread_s),
                            ("cluster retry_max_s", self.retry_max_s)):  # fmt: skip
            if value is not None and not 0 <= value < math.inf:
                raise InvalidArgument(f"{name} must be a number >= 0", value=value)
        if self.max_pending_keys < 1:
            raise InvalidArgument(
                "cluster max_pending_keys must be >= 1", value=self.max_pending_keys
            )
        check_weights(self.tier_weights)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s or self.ttl_s / 3

    @property
    def resync_window_s(self) -> float:
        """The spread of a resync that is not urgent (``resync_spread_s``)."""
        return self.heartbeat_interval_s if self.resync_spread_s is None else self.resync_spread_s

    @property
    def retry_cap_s(self) -> float:
        """The longest pause between two retries (``retry_max_s``)."""
        return self.ttl_s if self.retry_max_s is None else self.retry_max_s

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def target(self) -> RedisTarget:
        return parse_url(self.url)


def check_weights(weights: dict[str, float]) -> dict[str, float]:
    for tier, w in weights.items():
        if tier not in TIERS:
            raise InvalidArgument(f"unknown tier {tier!r} in weights; valid: {', '.join(TIERS)}")
        if not 0.0 <= w <= 1e6:
            raise InvalidArgument("tier weight must be in [0, 1e6]", tier=tier, weight=w)
    return weights


def parse_weights(text: str) -> dict[str, float]:
    """``"dram=1,ssd=0.5"`` → ``{"dram": 1.0, "ssd": 0.5}`` (unnamed tiers keep defaults)."""
    out = dict(DEFAULT_TIER_WEIGHTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise InvalidArgument(f"bad tier weight {part!r}; example: dram=1,ssd=0.5") from None
    return check_weights(out)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed cluster URL."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    db: int = 0
    #: the client library (``CLIENTS``): ``redis`` (redis-py) or ``valkey``
    client: str = "redis"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_options: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The URL without credentials (for logs and status)."""
        scheme = self.client + ("s" if self.tls else "") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_url(url: str) -> RedisTarget:
    """Validate and split a cluster URL (module docstring); InvalidArgument names the forms."""
    forms = (
        "redis://HOST:PORT/DB, rediss://..., redis+cluster://H1:P1,H2:P2 "
        "(valkey://, valkeys://, valkey+cluster://: the same through the valkey client)"
    )
    try:
        parts = urlsplit(url)
    except ValueError:
        raise InvalidArgument(f"bad cluster URL; forms: {forms}", url=url) from None
    if parts.scheme not in SCHEMES:
        raise InvalidArgument(f"bad cluster URL scheme; forms: {forms}", url=url)
    cluster = parts.scheme.endswith("+cluster")
    base = parts.scheme.removesuffix("+cluster")
    client = next(c for c in CLIENTS if base in (c, c + "s"))
    tls = base == client + "s"
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) or None)
    nodes: list[tuple[str, int]] = []
    for item in filter(None, hostlist.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "6379"
        try:
            port_no = int(port)
        except ValueError:
            raise InvalidArgument(f"bad port in cluster URL; forms: {forms}", url=url) from None
        if not host or not 0 < port_no < 65536:
            raise InvalidArgument(f"bad host:port in cluster URL; forms: {forms}", url=url)
        nodes.append((host.strip("[]"), port_no))
    if not nodes or (len(nodes) > 1 and not cluster):
        raise InvalidArgument(f"cluster URL needs one host (several with +cluster); {forms}")
    path = parts.path.strip("/")
    try:
        db = int(path) if path else 0
    except ValueError:
        raise InvalidArgument("cluster URL database must be a number", url=url) from None
    if cluster and db:
        raise InvalidArgument("a Redis Cluster has only database 0", url=url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - set(_TLS_PARAMS)
    if unknown or (query and not tls):
        raise InvalidArgument(
            f"cluster URL parameters allowed (rediss/valkeys only): {', '.join(_TLS_PARAMS)}",
            url=url,
        )
    return RedisTarget(tuple(nodes), cluster, tls, db, client, username, password, query)


def advertised_beyond_reach(advertised_host: str, target: RedisTarget) -> str:
    """Why peers on other hosts cannot reach a daemon that advertises ``advertised_host``
    while its fleet's Redis is ``target`` ("" when nothing says so): a loopback address with
    a Redis beyond loopback (the fleet spans hosts) is this daemon's only from this host;
    every other host reaching it reaches its own loopback instead."""
    if not is_loopback(advertised_host):
        return ""
    remote = [h for h, _ in target.nodes if not is_loopback(h)]
    if not remote:
        return ""
    return (
        f"this daemon advertises {advertised_host} to its fleet, a loopback address, while "
        f"the fleet's Redis is at {remote[0]}: daemons on other hosts cannot reach it there "
        "(and do not ask it: an address that is their own is left out); set "
        "--advertise-addr to an address they reach (and --host to bind it)"
    )


def check_tls_options(options: dict[str, str]) -> None:
    """InvalidArgument naming the URL parameter unless ``ssl_cert_reqs`` is one of
    :data:`CERT_REQS` and the files of ``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile``
    load (read now, at start-up: a missing CA file was found only by the first connection,
    as "Error 2 connecting to HOST:PORT. No such file or directory.", the daemon running
    ``unavailable`` for ever)."""
    reqs = options.get("ssl_cert_reqs")
    if reqs is not None and reqs not in CERT_REQS:
        raise InvalidArgument(
            f"cluster URL ssl_cert_reqs must be one of {', '.join(CERT_REQS)}", value=reqs
        )
    ca, cert, key = (options.get(k) for k in _TLS_PARAMS[:3])
    param, path = "ssl_ca_certs", ca
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert:
            param, path = "ssl_certfile", cert
            context.load_cert_chain(cert, key)
        elif key:
            raise InvalidArgument("cluster URL ssl_keyfile needs ssl_certfile", file=key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(
            f"cluster URL {param}: cannot load {path!r}: {exc.strerror or exc}", file=path
        ) from None


def connect(config: ClusterConfig) -> Any:
    """The asyncio client of the URL's library (``redis-py`` or ``valkey``: ``Redis`` /
    ``RedisCluster`` or ``Valkey`` / ``ValkeyCluster``, one API) for ``config``; connects
    lazily, every call bounded by ``config.timeout_s``."""
    t = config.target()
    lib = _client_library(t.client)
    common: dict[str, Any] = {
        "username": t.username,
        "password": t.password,
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "decode_responses": False,
        # one immediate retry (a pooled connection found closed after a Redis restart); every
        # call stays bounded by the caller's timeout.
        "retry": lib.retry(lib.no_backoff(), 1),
        **lib.options,
    }
    if t.tls:
        common["ssl"] = True
        common.update({k: v for k, v in t.tls_options.items()})
    if t.cluster:
        return lib.cluster(
            startup_nodes=[lib.cluster_node(h, p) for h, p in t.nodes],
            require_full_coverage=False,
            **common,
        )
    host, port = t.nodes[0]
    return lib.single(host=host, port=port, db=t.db, **common)


def client_errors(client: Any) -> tuple[type[BaseException], ...]:
    """What a call on ``client`` (from :func:`connect`, either library) raises when the
    server is unreachable or refuses: its library's base error, and ``OSError``."""
    name = type(client).__module__.partition(".")[0]
    if name == "valkey":
        from valkey.exceptions import ValkeyError

        return (ValkeyError, OSError)
    if name == "redis":
        from redis.exceptions import RedisError

        return (RedisError, OSError)
    return (OSError,)


@dataclass(frozen=True, slots=True)
class _Library:
    single: Any
    cluster: Any
    cluster_node: Any
    retry: Any
    no_backoff: Any
    #: more client options, the same for both (below)
    options: dict[str, Any] = field(default_factory=dict)


def check_client_library(url: str) -> None:
    """Raise InvalidArgument naming the extra when the library ``url``'s scheme picks is not
    installed (``kvserver start`` asks before it makes anything: ``daemon/preflight.py``)."""
    _client_library(parse_url(url).client)


def _client_library(client: str) -> _Library:
    """The classes of ``client``'s asyncio API, imported only now (a standalone daemon never
    imports either library); InvalidArgument naming the extra when it is not installed."""
    try:
        if client == "valkey":
            import valkey.asyncio as aiovalkey
            from valkey.asyncio.cluster import ClusterNode as VClusterNode
            from valkey.asyncio.cluster import ValkeyCluster
            from valkey.asyncio.retry import Retry as VRetry
            from valkey.backoff import NoBackoff as VNoBackoff
            from valkey.exceptions import ConnectionError as VConnectionError

            # valkey (forked from redis-py 5) retries only the errors named here; redis-py 6+
            # retries a connection error by default. Named, a pooled connection the server
            # closed (it restarted) is retried once on both, not failed.
            retry_on = {"retry_on_error": [VConnectionError]}
            return _Library(
                aiovalkey.Valkey, ValkeyCluster, VClusterNode, VRetry, VNoBackoff, retry_on
            )
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return _Library(aioredis.Redis, RedisCluster, ClusterNode, Retry, NoBackoff)
    except ImportError:
        extra, scheme = ("valkey", "valkey://") if client == "valkey" else ("cluster", "redis://")
        raise InvalidArgument(
            f"--cluster {scheme} needs the {client} package: pip install 'kvserver[{extra}]'"
        ) from None
