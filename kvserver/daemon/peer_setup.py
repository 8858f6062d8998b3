"""The network tier's construction from the daemon's config: how this daemon calls its peers
(:func:`peer_settings`) and the tier over a fixed peer list (``--peers``) or over the fleet
index (``--cluster``). Runs in the daemon process, at start-up (``process.py``), on the loop."""

from __future__ import annotations

from kvserver.cluster.node import ClusterNode
from kvserver.crypto import CurveClient, TlsClient
from kvserver.daemon.config import DaemonConfig
from kvserver.daemon.peers.book import PeerBook, PeerSettings
from kvserver.daemon.peers.fleet import FleetDirectory
from kvserver.daemon.peers.static import StaticDirectory
from kvserver.daemon.peers.tier import PeerTier
from kvserver.daemon.service import KVService


def peer_settings(config: DaemonConfig) -> PeerSettings:
    """How this daemon calls its peers: the fleet's auth token, and CURVE when configured
    (the peers' public key: ``peer_curve_server_key_file``, else the public half of this
    daemon's own ``curve_secret_key_file`` (one key pair for the fleet); this daemon's pair
    as the client's, so a ``curve_clients_dir`` can admit it). Their TLS stream ports with a
    CA (``peer_tls_ca_file``, else this daemon's own certificate: one for the fleet), this
    daemon's certificate presented when a peer requires one (mutual TLS)."""
    options: tuple[tuple[str, object], ...] = ()
    server_key = config.peer_curve_server_key_file or config.curve_secret_key_file
    if server_key:
        curve = CurveClient.from_files(server_key, config.curve_secret_key_file)
        options = (("curve", curve),)
    stream_tls = None
    if config.peer_tls_ca and config.peer_stream_port >= 0:
        tls = TlsClient(config.peer_tls_ca, config.tls_cert_file, config.tls_key_file)
        stream_tls = tls.ssl_context()
    return PeerSettings(
        timeout_s=config.peer_timeout_s,
        suspect_s=config.peer_suspect_s,
        connections=config.peer_connections,
        auth_token=config.auth_token,
        client_options=options,
        # never chunks in clear when CURVE is on; -1 turns the stream off both ways
        stream=not options and config.peer_stream_port >= 0,
        stream_tls=stream_tls,
        tls_server_name=config.peer_tls_server_name,
        # what a peer's reply may make this daemon receive: its own bound on inbound frames
        max_frame_bytes=config.max_message_bytes,
    )


def static_peer_tier(config: DaemonConfig, service: KVService) -> PeerTier:
    """The network tier over a configured peer list (``--peers``)."""
    book = PeerBook(peer_settings(config))
    directory = StaticDirectory(config.peer_addresses, book)
    return PeerTier(service.engine, directory, book, publish=service.publish,
                    stream_window_bytes=config.peer_stream_window)  # fmt: skip


def fleet_peer_tier(config: DaemonConfig, service: KVService, node: ClusterNode) -> PeerTier:
    """The network tier over the fleet index (``--cluster``)."""
    book = PeerBook(peer_settings(config))
    return PeerTier(service.engine, FleetDirectory(node), book, publish=service.publish,
                    stream_window_bytes=config.peer_stream_window)  # fmt: skip
