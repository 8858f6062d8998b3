"""The fleet of ``benchmarks/bench_peers.py``: its namespaces and keys, the secure fleet's
flags, and the check that the bench is a co-located client of the daemon it times. Plain
functions (no processes of their own)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.harness.raw_zmq import payload
from kvserver import wire
from kvserver.arena import ArenaView
from kvserver.client import KVClient
from kvserver.crypto import CurveClient, make_curve_keys, make_tls_cert
from kvserver.errors import KVServerError
from kvserver.namespace import NamespaceSpec


def spec_for(part_bytes: int) -> NamespaceSpec:
    return NamespaceSpec(
        model=f"bench/peers-{part_bytes}",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        part_bytes_override=part_bytes,
    )


def batch_keys(part_bytes: int, batch: int, n: int) -> list[bytes]:
    return [f"{part_bytes}-{batch}-{i}".encode().ljust(32, b".")[:32] for i in range(n)]


def fill_holder(
    address: str,
    spec: NamespaceSpec,
    batches: list[list[bytes]],
    part_bytes: int,
    curve: CurveClient | None = None,
) -> str:
    """Store every key of ``batches`` in the holder daemon at ``address`` (8 per put, each
    part the key's :func:`~benchmarks.harness.raw_zmq.payload`); AssertionError when it is
    full. Returns the namespace id."""
    with KVClient(address, colocated=False, timeout=60, curve=curve) as kv:
        ns_id = kv.register_namespace(spec).ns_id
        for keys in batches:
            for i in range(0, len(keys), 8):
                chunk = keys[i : i + 8]
                data = [payload(k, part_bytes) for k in chunk]
                assert kv.put(ns_id, chunk, data).stored == chunk, "A is full"
    return ns_id


def require_colocated(client: KVClient) -> None:
    """The fetches are timed as a co-located worker's loads: ``client`` must have mapped its
    daemon's arena. When its first hello did not, a second one tries again (once, noted on
    stderr); when that fails too, the error says why: the daemon's host id and ours (a
    client maps the arena only of a daemon with its own), and what mapping the arena
    raises. (Session 9 saw "the bench must run on B's host" in 5 of 31 runs within ten
    minutes, in both trees, with no cause recorded.)"""
    if client.is_colocated:
        return
    info = client.hello()  # maps the arena when it can
    ours, theirs, path = wire.host_id(), info.get("host_id"), info.get("arena_path")
    if _colocated(client):
        print(f"note: a hello did not map {path}; the next did", file=sys.stderr)
        return
    try:
        ArenaView.attach(str(path)).close()
        mapping = "maps now"
    except KVServerError as exc:
        mapping = f"cannot be mapped: {exc}"
    raise AssertionError(
        f"the bench must run on B's host: B's host id {theirs!r}, ours {ours!r}; "
        f"its arena {path!r} {mapping}"
    )


def _colocated(client: KVClient) -> bool:
    """``client.is_colocated``, read again (a call: not narrowed by an earlier test)."""
    return client.is_colocated


def secure_args(workdir: Path) -> tuple[tuple[str, ...], CurveClient]:
    """Flags of the secure fleet (one CURVE pair and one TLS certificate for it, as
    ``kvserver keys`` makes them) and the CURVE client settings of its clients."""
    keys = workdir / "keys"
    if not (keys / "server.key_secret").exists():
        make_curve_keys(str(keys), "server")
        make_tls_cert(str(keys), "server", ["127.0.0.1"])
    args = ("--curve-secret-key-file", str(keys / "server.key_secret"),
            "--tls-cert-file", str(keys / "server.crt"),
            "--tls-key-file", str(keys / "server.pem"))  # fmt: skip
    return args, CurveClient.from_files(str(keys / "server.key"))
