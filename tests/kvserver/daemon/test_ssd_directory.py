"""The SSD directory removed, renamed or replaced by an operator while a real daemon serves from
it, taken by a second daemon once the one holding it is SIGKILLed, and a restart on a full
disk.

The daemon's open files stay usable, so it used to go on writing chunks down into files no
path leads to any more: condition ``ok``, nothing logged, the disk space hidden until the
process exits, and every one of those chunks gone at the next start. Now the tier checks every
``retry_s`` that its path still leads to the directory it locked. Shared helpers:
``test_ssd_daemon``.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from kvserver.client import KVClient
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.test_ssd_daemon import (
    SPEC,
    expected,
    on_ssd_only,
    registered,
    settled,
    ssd,
    start,
    status_text,
    store_all,
)
from tests.support.daemon import wait_until
from tests.support.tmpfs import mount_tmpfs, unmount

pytestmark = pytest.mark.multiprocess

LOST = "was removed, renamed or replaced while in use: write-downs stopped"


def test_a_directory_removed_while_serving_stops_write_downs_and_says_so(tmp_path: Path) -> None:
    """``rm -rf`` of the SSD directory under a running daemon: the tier turns ``unavailable``
    with the reason (Stats, ``kvserver status``, the log once), no chunk is written down any
    more, the chunks already on SSD still load byte-exact (from the open files), DRAM serves;
    the next start begins with an empty directory at that path."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(100, tag="rm")
            store_all(kv, ns_id, SPEC, keys)
            cold = on_ssd_only(kv, ns_id, keys)
            written = settled(kv)["stored_chunks"]
            assert cold and written > 0
            shutil.rmtree(ssd_dir)
            stats = wait_until(lambda: (s := ssd(kv))["condition"] == "unavailable" and s)
            assert LOST in stats["condition_detail"] and str(ssd_dir) in stats["condition_detail"]
            more = make_keys(100, tag="rm-more")
            store_all(kv, ns_id, SPEC, more)
            assert settled(kv)["stored_chunks"] == written  # nothing into the unlinked files
            for key in cold[:10]:
                got = kv.load(ns_id, [key])
                assert [bytes(p) for p in got[0]] == expected(SPEC, key)
            last = more[-2:]
            got = kv.load(ns_id, last)
            assert [[bytes(p) for p in row] for row in got] == [expected(SPEC, k) for k in last]
            assert LOST in status_text(d)
    finally:
        assert d.terminate() == 0, d.log()
    assert d.log().count(LOST) == 1
    d = start(tmp_path, ssd_dir)
    try:
        assert d.info["ssd_condition"] == "ok" and d.info["ssd_recovered_chunks"] == 0
    finally:
        assert d.terminate() == 0, d.log()


def test_a_directory_renamed_and_back_is_ok_again_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    """Renamed away, the tier is ``unavailable`` (reads still served); renamed back, it is
    ``ok``, write-downs resume, and a restart recovers every chunk it held."""
    ssd_dir, away = tmp_path / "ssd", tmp_path / "ssd.away"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            store_all(kv, ns_id, SPEC, make_keys(100, tag="mv"))
            written = settled(kv)["stored_chunks"]
            ssd_dir.rename(away)
            wait_until(lambda: ssd(kv)["condition"] == "unavailable")
            away.rename(ssd_dir)
            wait_until(lambda: ssd(kv)["condition"] == "ok")
            store_all(kv, ns_id, SPEC, make_keys(100, tag="mv-more"))
            stats = settled(kv)
            assert stats["stored_chunks"] > written and stats["condition"] == "ok"
            held = stats["entries"]
    finally:
        assert d.terminate() == 0, d.log()
    assert "ok again (was unavailable)" in d.log()
    d = start(tmp_path, ssd_dir)
    try:
        assert d.info["ssd_recovered_chunks"] == held
    finally:
        assert d.terminate() == 0, d.log()


def test_a_directory_replaced_by_a_copy_of_itself_stops_write_downs(tmp_path: Path) -> None:
    """docs/ssd_format.md, LOCK: the directory replaced while in use (here by a copy of itself,
    as a restore from a backup makes: same names, other files) is ``unavailable`` and stays
    so: a write-down would go to the open files no path leads to any more. A restart serves
    what the copy holds, byte-exact."""
    ssd_dir, copy = tmp_path / "ssd", tmp_path / "ssd.copy"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(100, tag="cp")
            store_all(kv, ns_id, SPEC, keys)
            cold = on_ssd_only(kv, ns_id, keys)
            written = settled(kv)["stored_chunks"]
            shutil.copytree(ssd_dir, copy)
            shutil.rmtree(ssd_dir)
            copy.rename(ssd_dir)
            stats = wait_until(lambda: (s := ssd(kv))["condition"] == "unavailable" and s)
            assert LOST in stats["condition_detail"]
            store_all(kv, ns_id, SPEC, make_keys(100, tag="cp-more"))
            stats = settled(kv)
            assert stats["stored_chunks"] == written and stats["condition"] == "unavailable"
    finally:
        assert d.terminate() == 0, d.log()
    d = start(tmp_path, ssd_dir)
    try:
        assert d.info["ssd_condition"] == "ok" and d.info["ssd_recovered_chunks"] > 0
        with KVClient(d.zmq_address) as kv:
            for key in cold:
                got = kv.load(ns_id, [key])
                assert [bytes(p) for p in got[0]] == expected(SPEC, key), key.hex()
    finally:
        assert d.terminate() == 0, d.log()


def test_a_directory_a_sigkilled_daemon_held_is_taken_by_the_daemon_waiting_for_it(
    tmp_path: Path,
) -> None:
    """docs/ssd_format.md, LOCK: a second daemon on a directory in use has its SSD tier
    ``unavailable`` and retried; the first SIGKILLed (the kernel drops its lock: nothing
    stale), the second's retry opens the directory and recovers every chunk the first held,
    its namespace with it, and serves them byte-exact, without a restart."""
    ssd_dir = tmp_path / "ssd"
    first = start(tmp_path / "a", ssd_dir)
    second = None
    try:
        with KVClient(first.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(100, tag="taken")
            store_all(kv, ns_id, SPEC, keys)
            cold = on_ssd_only(kv, ns_id, keys)
            held = settled(kv)["entries"]
            assert cold and held > 0
        second = start(tmp_path / "b", ssd_dir)
        assert second.info["ssd_condition"] == "unavailable"
        first.kill()
        with KVClient(second.zmq_address) as kv:
            stats = wait_until(lambda: (s := ssd(kv))["condition"] == "ok" and s, timeout=60.0)
            assert stats["recovered_chunks"] == held
            for key in cold:
                got = kv.load(ns_id, [key])
                assert [bytes(p) for p in got[0]] == expected(SPEC, key), key.hex()
    finally:
        first.kill()
        if second is not None:
            assert second.terminate() == 0, second.log()


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_restart_on_a_full_disk_serves_the_chunks_on_it(tmp_path: Path) -> None:
    """A daemon restarted on a full filesystem (a 1 MiB tmpfs filled by the tier, then by
    another file) serves the chunks it recovers: was ``unavailable`` ("cannot write to the SSD
    directory: ENOSPC", the O_DIRECT probe's write), none of them served; now the probe reads
    instead, and the tier turns degraded at its first write-down, ok once space returns."""
    tiny = tmp_path / "tiny"
    if not mount_tmpfs(tiny, "1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        d = start(tmp_path, tiny / "ssd")
        try:
            with KVClient(d.zmq_address) as kv:
                ns_id = registered(kv, SPEC)
                keys = make_keys(200, tag="full")
                store_all(kv, ns_id, SPEC, keys)
                held = settled(kv)["entries"]
                assert held > 0
        finally:
            assert d.terminate() == 0, d.log()
        fill(tiny / "filler")
        d = start(tmp_path, tiny / "ssd")
        try:
            assert d.info["ssd_recovered_chunks"] == held, d.log()
            with KVClient(d.zmq_address) as kv:
                ns_id = kv.register_namespace(SPEC).ns_id
                cold = on_ssd_only(kv, ns_id, keys)
                assert len(cold) == held
                for key in cold[:10]:
                    got = kv.load(ns_id, [key])
                    assert [bytes(p) for p in got[0]] == expected(SPEC, key)
                store_all(kv, ns_id, SPEC, make_keys(100, tag="full-more"))
                stats = settled(kv)
                assert stats["condition"] == "degraded" and "ENOSPC" in stats["condition_detail"]
                (tiny / "filler").unlink()
                n = iter(range(0, 10_000, 8))

                def resumed() -> bool:
                    more = make_keys(8, start=next(n), tag="full-later")
                    kv.store(ns_id, more, [expected(SPEC, k) for k in more])
                    return bool(settled(kv)["condition"] == "ok")

                wait_until(resumed, timeout=30, interval=0.1)
        finally:
            assert d.terminate() == 0, d.log()
    finally:
        unmount(tiny)
