"""SIGKILL in the middle of an SSD data-file write (a write-down, the start-up's discards and
moves below a smaller ``--ssd``), and random damage to any file of the directory after a clean
stop, in real daemon processes: the next start serves every chunk it reports byte-exact or
not at all, keeps what the format promises, and keeps serving DRAM.

The kill lands inside the Nth change to a data file (``tests/support/dying_disk.py``: part of
that write lands, then SIGKILL), an instant no outside signal hits on demand. Shared helpers:
``test_ssd_daemon``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver.client import KVClient
from kvserver.errors import KVServerError, UnknownKey
from kvserver.ssd import format as fmt
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.test_ssd_daemon import (
    ENV,
    SLOT,
    SPEC,
    args,
    data_file,
    expected,
    headers,
    registered,
    settled,
    ssd,
    start,
    store_all,
)
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

#: buffered I/O, so a torn write may end inside a block
BUFFERED = {**ENV, "KVSERVER_SSD_DIRECT": "off"}
KEYS = make_keys(200, tag="crash")  # DRAM holds 40: about 160 written down


def dying(tmp_path: Path, ssd_dir: Path, at: int, tear: str, torn: int, *extra: str
          ) -> DaemonProc | None:  # fmt: skip
    """A daemon that dies inside its ``at``-th data-file change; None if it died before it
    was ready."""
    env = {**BUFFERED, "DYING_DISK_AT": str(at), "DYING_DISK_TEAR": tear,
           "DYING_DISK_TORN": str(torn)}  # fmt: skip
    try:
        return start_daemon(
            tmp_path, *args(ssd_dir, *extra), env=env, module="tests.support.dying_disk"
        )
    except RuntimeError as exc:
        assert "exited with -9" in str(exc), exc
        return None


def served(kv: KVClient, keys: list[bytes]) -> list[bytes]:
    """The keys the daemon serves, each loaded alone and checked byte-exact (a key it reports
    held may still be a miss: a damaged chunk, found when read)."""
    out = []
    for key in keys:
        if kv.lookup(SPEC.ns_id, [key]).hit_chunks != 1:
            continue
        try:
            got = kv.load(SPEC.ns_id, [key])
        except UnknownKey:
            continue
        assert [bytes(p) for p in got[0]] == expected(SPEC, key), key.hex()
        out.append(key)
    return out


tears = st.tuples(st.sampled_from(["head", "tail"]), st.sampled_from([0, 100, 4096, 4196, 9000]))


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(at=st.integers(1, 150), tear=tears)
def test_sigkill_inside_a_write_down_then_every_recovered_chunk_is_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, at: int, tear: tuple[str, int]
) -> None:
    """Killed inside its ``at``-th data-file change while DRAM evicts into the tier: the next
    start recovers exactly the chunks whose headers are valid on disk, loads each byte-exact,
    finds none corrupt, and writes down again."""
    tmp_path = tmp_path_factory.mktemp("kill")
    ssd_dir = tmp_path / "ssd"
    d = dying(tmp_path, ssd_dir, at, *tear)
    assert d is not None  # an empty directory: no data-file change before it is ready
    try:
        with KVClient(d.zmq_address, timeout=5) as kv:
            registered(kv, SPEC)
            with contextlib.suppress(KVServerError, OSError):
                store_all(kv, SPEC.ns_id, SPEC, KEYS)
                settled(kv)
        assert d.proc.wait(30) == -9  # it died inside a write (150 < its changes)
    finally:
        d.kill()
    on_disk = headers(data_file(ssd_dir)) if data_file(ssd_dir).exists() else {}
    d = start_daemon(tmp_path, *args(ssd_dir), env=BUFFERED)
    try:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert ssd(kv)["recovered_chunks"] == len(on_disk)
            assert sorted(served(kv, KEYS)) == sorted(on_disk)
            stats = ssd(kv)
            assert stats["corrupt_chunks"] == 0 and stats["condition"] == "ok"
            store_all(kv, SPEC.ns_id, SPEC, make_keys(60, tag="after"))
            assert settled(kv)["stored_chunks"] > 0
    finally:
        assert d.terminate() == 0, d.log()


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SSD directory of about 160 chunks of SPEC, written by a daemon stopped cleanly."""
    tmp_path = tmp_path_factory.mktemp("full")
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            registered(kv, SPEC)
            store_all(kv, SPEC.ns_id, SPEC, KEYS)
            settled(kv)
    finally:
        assert d.terminate() == 0, d.log()
    assert len(headers(data_file(ssd_dir))) > 100
    return ssd_dir


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(at=st.integers(1, 290), tear=tears)
def test_sigkill_inside_the_start_ups_moves_below_a_smaller_capacity_loses_nothing_kept(
    tmp_path_factory: pytest.TempPathFactory, full_dir: Path, at: int, tear: tuple[str, int]
) -> None:
    """A restart with ``--ssd 1MiB`` (64 slots) under about 160 chunks discards the oldest
    and moves the newest 64 below the bound; killed inside any of those changes (or the
    file's cut), the next start with 1 MiB still serves exactly the 64 newest chunks of the
    directory, byte-exact, and its file is cut to the bound."""
    tmp_path = tmp_path_factory.mktemp("shrink")
    ssd_dir = tmp_path / "ssd"
    shutil.copytree(full_dir, ssd_dir)
    before = headers(data_file(ssd_dir))
    newest = sorted(before, key=lambda k: before[k][1].seq)[-(1 << 20) // SLOT :]
    d = dying(tmp_path, ssd_dir, at, *tear, "--ssd", "1MiB")
    if d is not None:  # ``at`` is past the start-up's changes
        d.kill()
    d = start_daemon(tmp_path, *args(ssd_dir, "--ssd", "1MiB"), env=BUFFERED)
    try:
        with KVClient(d.zmq_address) as kv:
            assert sorted(served(kv, KEYS)) == sorted(newest)
            stats = ssd(kv)
            assert stats["corrupt_chunks"] == 0 and stats["condition"] == "ok"
        assert os.path.getsize(data_file(ssd_dir)) <= 1 << 20
    finally:
        assert d.terminate() == 0, d.log()


FILES = ["data", fmt.NAMESPACES_FILE, fmt.FORMAT_FILE, fmt.LOCK_FILE]
damage = st.tuples(
    st.sampled_from(FILES),
    st.sampled_from(["flip", "zero", "truncate"]),
    st.floats(0, 1),  # where, as a fraction of the file
    st.integers(1, 3 * SLOT),  # how many bytes
)


def damaged_range(path: Path, how: str, where: float, length: int) -> tuple[int, int]:
    """Damage ``path`` (flip or zero ``length`` bytes at ``where``, or cut it there); the
    byte range that changed."""
    size = path.stat().st_size
    at = min(int(where * size), max(0, size - 1))
    if how == "truncate":
        os.truncate(path, at)
        return at, size
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(length)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old) if how == "flip" else bytes(len(old)))
    return at, at + len(old)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(hit=damage)
def test_random_damage_to_any_file_after_a_clean_stop_never_serves_a_wrong_byte(
    tmp_path_factory: pytest.TempPathFactory, full_dir: Path, hit: tuple[str, str, float, int]
) -> None:
    """Bytes flipped or zeroed, or the file cut, at a random place of a random file of the
    directory: the restarted daemon serves DRAM, every chunk it serves is byte-exact, every
    chunk of an undamaged slot is still served when the damage is in the data file (or the
    LOCK file), and a directory it cannot use says why."""
    name, how, where, length = hit
    tmp_path = tmp_path_factory.mktemp("damage")
    ssd_dir = tmp_path / "ssd"
    shutil.copytree(full_dir, ssd_dir)
    stored = headers(data_file(ssd_dir))
    path = data_file(ssd_dir) if name == "data" else ssd_dir / name
    lo, hi = damaged_range(path, how, where, length)
    d = start_daemon(tmp_path, *args(ssd_dir), env=ENV)
    try:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            got = served(kv, KEYS)
            stats = ssd(kv)
            if name in ("data", fmt.LOCK_FILE):
                intact = [
                    k for k, (slot, _h) in stored.items()
                    if name != "data" or not (lo < (slot + 1) * SLOT and slot * SLOT < hi)
                ]  # fmt: skip
                assert set(intact) <= set(got)
                assert stats["condition"] == "ok"
            if stats["condition"] != "ok":
                assert stats["condition_detail"], stats
            with pytest.raises(UnknownKey):  # DRAM and the tier keep serving
                kv.load(SPEC.ns_id, [b"\x01" * 32])
            store_all(kv, SPEC.ns_id, SPEC, make_keys(8, tag="later"))
            assert served(kv, make_keys(8, tag="later")) == make_keys(8, tag="later")
    finally:
        assert d.terminate() == 0, d.log()


def test_sigkill_while_promotions_read_then_every_chunk_is_still_there(
    tmp_path: Path, full_dir: Path
) -> None:
    """kill -9 while a client keeps loading chunks that are on SSD only (promotions reading
    and copying into DRAM, evicting DRAM into the inclusive tier): the next start recovers
    every chunk the directory held, byte-exact, none corrupt."""
    ssd_dir = tmp_path / "ssd"
    shutil.copytree(full_dir, ssd_dir)
    before = headers(data_file(ssd_dir))
    d = start(tmp_path, ssd_dir)
    stop = threading.Event()

    def loader(address: str) -> None:
        with contextlib.suppress(KVServerError, OSError), KVClient(address, timeout=5) as kv:
            kv.register_namespace(SPEC)
            while not stop.is_set():
                for i in range(0, len(KEYS), 4):
                    kv.load(SPEC.ns_id, KEYS[i : i + 4])

    thread = threading.Thread(target=loader, args=(d.zmq_address,), daemon=True)
    thread.start()
    try:
        with KVClient(d.zmq_address) as kv:
            wait_until(lambda: ssd(kv)["promoted_chunks"] >= 100, timeout=60)
        d.kill()
    finally:
        stop.set()
        d.kill()
        thread.join(30)
    assert headers(data_file(ssd_dir)) == before  # promotions write nothing
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert ssd(kv)["recovered_chunks"] == len(before)
            assert sorted(served(kv, KEYS)) == sorted(before)
            assert ssd(kv)["corrupt_chunks"] == 0
    finally:
        assert d.terminate() == 0, d.log()
