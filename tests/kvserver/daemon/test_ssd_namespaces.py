"""The SSD tier's namespaces file against the chunks, in real daemon processes.

docs/ssd_format.md, "Directory": a namespace's chunks are written down only after its spec is
durable in ``namespaces.json``; a chunk whose namespace is not listed there is an orphan and
is discarded at start-up (not merely hidden: listing the namespace again later brings none
back). Shared helpers: ``test_ssd_daemon``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys, make_spec
from tests.kvserver.daemon.test_ssd_daemon import (
    SPEC,
    data_file,
    expected,
    headers,
    on_ssd_only,
    registered,
    settled,
    ssd,
    start,
    store_all,
)
from tests.support.daemon import wait_until

pytestmark = pytest.mark.multiprocess

#: a second namespace of SPEC's geometry (one data file holds both)
OTHER = make_spec(model="test/ssd-other", part_bytes_override=SPEC.part_bytes)


def ns_ids_on_disk(ssd_dir: Path) -> dict[str, int]:
    """Valid chunk headers in the data file, counted per namespace."""
    path = data_file(ssd_dir)
    out: dict[str, int] = {}
    for _slot, h in headers(path).values() if path.exists() else ():
        out[h.ns_id] = out.get(h.ns_id, 0) + 1
    return out


def read_back(kv: KVClient, ns_id: str, keys: list[bytes]) -> None:
    for key in keys:
        got = kv.load(ns_id, [key])
        assert [bytes(p) for p in got[0]] == expected(SPEC, key), key.hex()


def test_a_namespace_not_yet_durable_has_no_chunk_written_down(tmp_path: Path) -> None:
    """The namespaces file cannot be replaced (a directory stands where its temporary file
    goes): OTHER, registered then, is not durable, and none of its chunks evicted from DRAM
    reach the data file (a crash would leave them orphans); SPEC's, durable before, were
    written. Once the file can be written the spec is saved by the tier's retry, the tier
    (degraded by the failed save) is ``ok`` again at its next write-down, OTHER's later
    evictions go down, and a restart serves them with no client registering it."""
    ssd_dir = tmp_path / "ssd"
    blocker = ssd_dir / f"{fmt.NAMESPACES_FILE}.tmp"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            store_all(kv, ns_id, SPEC, make_keys(60, tag="durable-spec"))
            settled(kv)
            assert ns_ids_on_disk(ssd_dir).get(SPEC.ns_id, 0) > 0
            blocker.mkdir()
            other = kv.register_namespace(OTHER).ns_id
            early = make_keys(60, tag="durable-other-early")
            store_all(kv, other, OTHER, early)
            settled(kv)
            wait_until(lambda: ssd(kv)["skipped_chunks"] > 0)
            assert ssd(kv)["unsaved_namespaces"] == 1
            assert OTHER.ns_id not in ns_ids_on_disk(ssd_dir)
            blocker.rmdir()
            wait_until(lambda: ssd(kv)["unsaved_namespaces"] == 0, timeout=60.0)
            probes = iter(range(1 << 20))

            def ok_after_a_batch() -> bool:  # the failed save degraded the tier: a
                # write-down let through every retry_s brings it back
                probe = make_keys(8, tag=f"durable-other-probe-{next(probes)}")
                store_all(kv, other, OTHER, probe)
                return bool(ssd(kv)["condition"] == "ok")

            wait_until(ok_after_a_batch, timeout=60.0)
            late = make_keys(100, tag="durable-other-late")
            store_all(kv, other, OTHER, late)
            settled(kv)
            down = on_ssd_only(kv, other, late)
            assert down and not set(down) & set(early)
    finally:
        assert d.terminate() == 0, d.log()
    assert ns_ids_on_disk(ssd_dir).get(OTHER.ns_id, 0) >= len(down)
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:  # OTHER is not registered by anyone here
            for key in down:
                assert [bytes(p) for p in kv.load(other, [key])[0]] == expected(OTHER, key)
    finally:
        assert d.terminate() == 0, d.log()


def test_chunks_of_a_namespace_no_longer_listed_are_discarded_at_start_up(
    tmp_path: Path,
) -> None:
    """Chunks of SPEC and OTHER on disk; the namespaces file then lists SPEC only: the restart
    recovers SPEC's chunks (byte-exact) and discards OTHER's (no valid header of OTHER left);
    a client registering OTHER finds none of them; listing OTHER again and restarting
    recovers none either."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            other = registered(kv, OTHER)
            keys = make_keys(60, tag="orphan-spec")
            okeys = make_keys(60, tag="orphan-other")
            store_all(kv, ns_id, SPEC, keys)
            store_all(kv, other, OTHER, okeys)
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    on_disk = ns_ids_on_disk(ssd_dir)
    assert on_disk.get(SPEC.ns_id, 0) > 0 and on_disk.get(OTHER.ns_id, 0) > 0, on_disk
    listing = ssd_dir / fmt.NAMESPACES_FILE
    both = listing.read_bytes()
    specs = fmt.decode_namespaces(both)
    assert {s["model"] for s in specs} == {SPEC.model, OTHER.model}
    listing.write_bytes(fmt.encode_namespaces([s for s in specs if s["model"] == SPEC.model]))
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            assert ssd(kv)["recovered_chunks"] == on_disk[SPEC.ns_id]
            # the orphans' slots are discarded by the start-up's background release (unless a
            # compaction needs them first): wait for their headers to go, not a moment after
            wait_until(lambda: ns_ids_on_disk(ssd_dir) == {SPEC.ns_id: on_disk[SPEC.ns_id]},
                       timeout=60.0)  # fmt: skip
            held = on_ssd_only(kv, ns_id, keys)
            assert len(held) == on_disk[SPEC.ns_id]
            read_back(kv, ns_id, held)
            assert kv.register_namespace(OTHER).ns_id == other
            assert kv.lookup(other, okeys).hit_chunks == 0
            assert not [k for k in okeys if kv.lookup(other, [k]).hit_chunks]
    finally:
        assert d.terminate() == 0, d.log()
    listing.write_bytes(both)
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            assert not [k for k in okeys if kv.lookup(other, [k]).hit_chunks]
    finally:
        assert d.terminate() == 0, d.log()
