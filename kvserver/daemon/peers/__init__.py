"""The network tier: chunks other daemons of the fleet hold, fetched daemon to daemon.

Runs in the daemon process, on its event loop. The lowest tier: below DRAM and SSD. Modules,
one concept each (imports go one way, from the tier down):

- ``tier.py``: :class:`PeerTier`, what the service sees (lookup of a leading run held by
  peers, fetch into DRAM, stats and condition; it accepts no write-down);
- ``fetch.py``: :class:`PeerFetches`, fetches under way (one per key however many loads want
  it) and placing fetched chunks in DRAM as an SSD promotion does;
- ``book.py``: :class:`PeerBook`, the peers known, their links, which are suspect, counters;
- ``link.py``: :class:`PeerLink`, the data-plane connections to one peer and the checks on
  what it sends, and which transport a fetch from it takes;
- ``zmq_windows.py``: a fetch's windows over a peer's ZMQ data plane, flow-controlled under
  the peer's cap on unsent replies;
- ``stream.py``: :class:`PeerStream`, the connections to one peer's stream port (TCP, plain
  or TLS, received straight into the arena; ``kvserver/wire_stream.py``), used instead of ZMQ
  when the peer advertises one this daemon may dial (``link.py``);
- ``directory.py``: :class:`PeerDirectory`, who the peers are and which of them hold which
  chunk: ``fleet.py`` reads the fleet index (over ``kvserver.cluster.ClusterNode``),
  ``static.py`` asks a configured list of peers instead.

The directory may lag the truth and is never trusted for bytes: what a peer sends is checked
against the namespace (one part per rank, each ``part_bytes`` long, the keys asked for, in
order) and a peer that does not answer within its timeout is a miss and is suspect for a while.
"""
