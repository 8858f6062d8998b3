"""The SSD tier in real daemon processes (``kvserver start --ssd-dir``), on loopback.

Chunks written down and promoted byte-exact over the co-located (shared memory) and the remote
(frames) paths, and served straight from SSD when DRAM is fully pinned; SIGKILL during a
write-heavy load, then a restart on the same directory: the recovered count is reported and
every chunk of the rebuilt index reads back byte-exact; flipped bytes: a counted miss and the
slot reclaimed, a damaged header never recovered; a write failure (the file-size limit of the
daemon process lowered with prlimit: EFBIG on every write that grows a data file) and an
unusable directory: DRAM keeps serving, the condition shows in Stats and ``kvserver status``,
writes resume; namespaces come back with the data.

Child process (the writer): ``python -m tests.kvserver.daemon.test_ssd_daemon writer ...``.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.errors import CapacityError, UnknownKey
from kvserver.files import write_atomic
from kvserver.grpc_client import GrpcClient
from kvserver.namespace import NamespaceSpec
from kvserver.ssd import format as fmt
from kvserver.token_file import token_path
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.stop_signals import wait_past_repeat_window
from tests.support.tmpfs import mount_tmpfs, unmount

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[3]
SPEC = make_spec(part_bytes_override=12_000)  # 3 pages of 4 KiB; slot 16 KiB
TP2 = make_spec(model="test/tp2", tp_world_size=2, part_bytes_override=6_000)
SLOT = fmt.slot_bytes_for(12_000)
#: DRAM holds 40 chunks; retries of a degraded tier every 0.2 s
ENV = {"KVSERVER_SSD_RETRY_S": "0.2"}


def args(ssd_dir: Path, *extra: str) -> list[str]:
    return [
        "--page-size", "4KiB", "--dram", "480KiB", "--ssd-dir", str(ssd_dir),
        "--ssd", "8MiB", "--ssd-admission", "1", *extra,
    ]  # fmt: skip


def start(tmp_path: Path, ssd_dir: Path, *extra: str) -> DaemonProc:
    return start_daemon(tmp_path, *args(ssd_dir, *extra), env=ENV)


def expected(spec: NamespaceSpec, key: bytes) -> list[bytes]:
    return [pattern(key, r, spec.part_bytes) for r in range(spec.tp_world_size)]


def ssd(kv: KVClient) -> dict[str, Any]:
    stats: dict[str, Any] = kv.stats()["ssd"]
    return stats


def registered(kv: KVClient, spec: NamespaceSpec) -> str:
    """Register, then wait until the spec is saved with the data (write-backs need it)."""
    ns_id = kv.register_namespace(spec).ns_id
    wait_until(lambda: ssd(kv)["unsaved_namespaces"] == 0)
    return ns_id


def settled(kv: KVClient) -> dict[str, Any]:
    """SSD stats once no write-down is in flight."""
    stats: dict[str, Any] = wait_until(lambda: (s := ssd(kv))["writes_in_flight"] == 0 and s)
    return stats


def store_all(kv: KVClient, ns_id: str, spec: NamespaceSpec, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 8):
        batch = keys[i : i + 8]
        assert kv.store(ns_id, batch, [expected(spec, k) for k in batch]) == batch


def on_ssd_only(kv: KVClient, ns_id: str, keys: list[bytes]) -> list[bytes]:
    """Keys whose one-key lookup says: on SSD, not in DRAM."""
    out = []
    for key in keys:
        tiers = kv.lookup(ns_id, [key]).tiers
        if tiers.get("ssd") == 1:
            out.append(key)
    return out


def data_file(ssd_dir: Path) -> Path:
    return ssd_dir / fmt.data_file_name(SLOT)


def headers(path: Path) -> dict[bytes, tuple[int, fmt.ChunkHeader]]:
    """Valid chunk headers in a data file: key → (slot, header), newest seq per key."""
    out: dict[bytes, tuple[int, fmt.ChunkHeader]] = {}
    data = path.read_bytes()
    for slot in range(len(data) // SLOT):
        try:
            h = fmt.decode_header(data[slot * SLOT : slot * SLOT + fmt.HEADER_BYTES])
        except fmt.CorruptChunk:
            continue
        if h.key not in out or out[h.key][1].seq < h.seq:
            out[h.key] = (slot, h)
    return out


# ----------------------------------------------------------------------------- data paths


@pytest.mark.parametrize("colocated", [True, False], ids=["shared-memory", "remote"])
def test_write_down_and_promotion_byte_exact(tmp_path: Path, colocated: bool) -> None:
    d = start(tmp_path, tmp_path / "ssd")
    try:
        with KVClient(d.zmq_address, colocated=colocated) as kv:
            for spec in (SPEC, TP2):
                ns_id = registered(kv, spec)
                keys = make_keys(100, tag=f"wd-{spec.tp_world_size}")
                store_all(kv, ns_id, spec, keys)
                assert kv.is_colocated is colocated
                stats = settled(kv)
                assert stats["stored_chunks"] > 0 and stats["condition"] == "ok"
                result = kv.lookup(ns_id, keys)
                assert result.hit_chunks == 100 and result.tiers["ssd"] > 0
                cold = on_ssd_only(kv, ns_id, keys)[:16]
                assert len(cold) == 16
                promoted = ssd(kv)["promoted_chunks"]
                for i in range(0, 16, 4):
                    got = kv.load(ns_id, cold[i : i + 4])
                    assert [[bytes(p) for p in row] for row in got] == [
                        expected(spec, k) for k in cold[i : i + 4]
                    ]
                stats = ssd(kv)
                assert stats["promoted_chunks"] == promoted + 16
                assert stats["corrupt_chunks"] == 0
                assert kv.lookup(ns_id, cold[:4]).tiers["dram"] == 4
        assert "recovered 0 chunks" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


def test_remote_get_is_served_from_ssd_when_dram_is_pinned(tmp_path: Path) -> None:
    d = start(tmp_path, tmp_path / "ssd")
    try:
        with KVClient(d.zmq_address) as kv, KVClient(d.zmq_address, colocated=False) as remote:
            ns_id = registered(kv, SPEC)
            keys = make_keys(80, tag="pin")
            store_all(kv, ns_id, SPEC, keys)
            settled(kv)
            cold = on_ssd_only(kv, ns_id, keys)[:4]
            hot = [k for k in keys if kv.lookup(ns_id, [k]).tiers["dram"] == 1]
            grant = kv.prepare_load(ns_id, hot)  # every DRAM page pinned: nothing can move in
            try:
                remote.register_namespace(SPEC)
                got = remote.get(ns_id, cold)
                assert [[bytes(p) for p in row] for row in got] == [expected(SPEC, k) for k in cold]
                assert ssd(kv)["served_direct_chunks"] == 4
            finally:
                kv.complete_load(grant.lease_id)
    finally:
        assert d.terminate() == 0, d.log()


def test_a_remote_get_served_from_ssd_past_the_daemons_bound_is_refused(tmp_path: Path) -> None:
    """DRAM fully pinned, staging for 6 slots: a remote get of 8 SSD-only chunks would hold 8
    read buffers at once, so it is answered ``capacity`` before any read (counted); a get of 4
    is served byte-exact. Was: one buffer per chunk however many the get named."""
    env = {**ENV, "KVSERVER_SSD_STAGING": str(6 * SLOT)}
    d = start_daemon(tmp_path, *args(tmp_path / "ssd"), env=env)
    try:
        with KVClient(d.zmq_address) as kv, KVClient(d.zmq_address, colocated=False) as remote:
            ns_id = registered(kv, SPEC)
            keys = make_keys(80, tag="bound")
            for i in range(0, len(keys), 4):  # 4 victims at most per store: staging holds 6
                batch = keys[i : i + 4]
                assert kv.store(ns_id, batch, [expected(SPEC, k) for k in batch]) == batch
                settled(kv)
            cold = on_ssd_only(kv, ns_id, keys)
            assert len(cold) >= 8
            hot = [k for k in keys if kv.lookup(ns_id, [k]).tiers["dram"] == 1]
            grant = kv.prepare_load(ns_id, hot)  # every DRAM page pinned: nothing can move in
            try:
                remote.register_namespace(SPEC)
                with pytest.raises(CapacityError, match="straight from SSD"):
                    remote.get(ns_id, cold[:8])
                stats = ssd(kv)
                assert stats["refused_direct_chunks"] == 8 and stats["served_direct_chunks"] == 0
                got = remote.get(ns_id, cold[:4])
                assert [[bytes(p) for p in row] for row in got] == [
                    expected(SPEC, k) for k in cold[:4]
                ]
                assert wait_until(lambda: ssd(kv)["serving_bytes"] == 0)  # the reply was sent
            finally:
                kv.complete_load(grant.lease_id)
    finally:
        assert d.terminate() == 0, d.log()


# ----------------------------------------------------------------------------- kill -9


def child_writer(address: str, progress: str) -> None:
    """Store chunks as fast as possible until killed; ``progress`` gets the next index."""
    with KVClient(address) as kv:
        ns_id = kv.register_namespace(SPEC).ns_id
        i = 0
        while True:
            keys = make_keys(8, start=i, tag="kill")
            kv.store(ns_id, keys, [expected(SPEC, k) for k in keys])
            i += 8
            write_atomic(progress, str(i))  # was write_text: a kill between its truncate
            # and its write left the file empty, and the test failed on int("")


def test_sigkill_during_write_heavy_load_then_restart(tmp_path: Path) -> None:
    """kill -9 while a writer keeps DRAM evicting into the SSD tier: after a restart on the
    same directory the recovered count is reported (> 0), every chunk of the rebuilt index
    reads back byte-exact, nothing is corrupt, and the namespace is back without a client."""
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    progress = tmp_path / "progress"
    writer_args = [d.zmq_address, str(progress)]
    with open(tmp_path / "writer.log", "wb") as log:
        writer = subprocess.Popen(
            [sys.executable, "-m", "tests.kvserver.daemon.test_ssd_daemon", "writer", *writer_args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with KVClient(d.zmq_address) as kv:
            # the namespace is saved once the writer registered it; then write-backs flow
            wait_until(lambda: ssd(kv)["stored_chunks"] >= 150, timeout=60)
            assert writer.poll() is None and ssd(kv)["skipped_chunks"] >= 0
        d.kill()  # SIGKILL: no flush, no close, the lock dies with the process
    finally:
        writer.kill()
        writer.wait(10)
        d.kill()
    attempted = int(progress.read_text()) + 8
    on_disk = headers(data_file(ssd_dir))  # what a header scan finds
    assert len(on_disk) > 0
    d2 = start(tmp_path, ssd_dir)
    try:
        with GrpcClient(d2.grpc_address) as grpc:
            assert SPEC.ns_id in [ns.namespace_id for ns in grpc.list_namespaces()]
            tier = next(t for t in grpc.stats().tiers if t.name == "ssd")
            recovered = tier.recovered_chunks
        assert 0 < recovered == len(on_disk) == d2.info["ssd_recovered_chunks"]
        assert f"recovered {recovered} chunks" in d2.log()
        status = subprocess.run(
            [sys.executable, "-m", "kvserver.cli", "status", "--server", d2.grpc_address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0 and f"recovered {recovered} at start" in status.stdout
        with KVClient(d2.zmq_address) as kv:
            kv.register_namespace(SPEC)
            keys = make_keys(attempted, tag="kill")
            indexed = [k for k in keys if kv.lookup(SPEC.ns_id, [k]).hit_chunks == 1]
            assert sorted(indexed) == sorted(on_disk)
            for i in range(0, len(indexed), 8):
                batch = indexed[i : i + 8]
                got = kv.load(SPEC.ns_id, batch)
                assert [[bytes(p) for p in row] for row in got] == [
                    expected(SPEC, k) for k in batch
                ]
            stats = ssd(kv)
            assert stats["corrupt_chunks"] == 0 and stats["io_errors"] == 0
    finally:
        assert d2.terminate() == 0, d2.log()


# ----------------------------------------------------------------------------- corruption


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def test_flipped_bytes_are_detected_counted_and_reclaimed(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    d = start(tmp_path, ssd_dir)
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            ns_id = registered(kv, SPEC)
            keys = make_keys(80, tag="flip")
            store_all(kv, ns_id, SPEC, keys)
            settled(kv)
            cold = on_ssd_only(kv, ns_id, keys)
            payload_hit, header_hit = cold[0], cold[1]
            disk = headers(data_file(ssd_dir))
            slot, _ = disk[payload_hit]
            flip(data_file(ssd_dir), slot * SLOT + fmt.HEADER_BYTES + 5_000)
            with pytest.raises(UnknownKey):  # served as a miss, never as wrong bytes
                kv.get(ns_id, [payload_hit])
            stats = settled(kv)
            assert stats["corrupt_chunks"] == 1
            assert kv.lookup(ns_id, [payload_hit]).hit_chunks == 0
            wait_until(lambda: payload_hit not in headers(data_file(ssd_dir)))  # reclaimed
            assert stats["used_bytes"] == stats["entries"] * SLOT
            header_slot, _ = disk[header_hit]
        assert d.terminate() == 0, d.log()
        assert "dropped a corrupt chunk" in d.log()
        flip(data_file(ssd_dir), header_slot * SLOT + 60)  # the namespace id in the header
        d = start(tmp_path, ssd_dir)
        with KVClient(d.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert kv.lookup(ns_id, [header_hit]).hit_chunks == 0
            assert ssd(kv)["recovered_chunks"] == len(headers(data_file(ssd_dir))) - 0
        assert "1 invalid headers" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


# ----------------------------------------------------------------------------- write failures


def status_text(d: DaemonProc) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "status", "--server", d.grpc_address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_write_failure_dram_keeps_serving_and_writes_resume(tmp_path: Path) -> None:
    """The daemon may not grow files past 64 KiB (RLIMIT_FSIZE: EFBIG, as a full disk gives
    ENOSPC): write-downs fail, the tier is degraded in Stats, status and the log, DRAM keeps
    storing and loading; once the limit is lifted, write-downs resume by themselves."""
    d = start(tmp_path, tmp_path / "ssd")
    pid = int(d.info["pid"])
    try:
        with KVClient(d.zmq_address) as kv:
            ns_id = registered(kv, SPEC)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (4 * SLOT, resource.RLIM_INFINITY))
            keys = make_keys(120, tag="full")
            store_all(kv, ns_id, SPEC, keys)  # DRAM keeps serving
            stats = settled(kv)
            assert stats["condition"] == "degraded" and "EFBIG" in stats["condition_detail"]
            assert stats["io_errors"] >= 1 and stats["entries"] <= 4
            got = kv.load(ns_id, keys[-4:])
            assert [[bytes(p) for p in row] for row in got] == [
                expected(SPEC, k) for k in keys[-4:]
            ]
            with GrpcClient(d.grpc_address) as grpc:
                tier = next(t for t in grpc.stats().tiers if t.name == "ssd")
                assert tier.condition == "degraded" and "EFBIG" in tier.condition_detail
            text = status_text(d)
            assert "degraded" in text and "DRAM keeps serving" in text
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)

            n = iter(range(0, 10_000, 8))

            def resumed() -> bool:
                more = make_keys(8, start=next(n), tag="more")
                kv.store(ns_id, more, [expected(SPEC, k) for k in more])
                s = settled(kv)
                return bool(s["condition"] == "ok" and s["entries"] > 4)

            wait_until(resumed, timeout=30, interval=0.1)
            rows = [line for line in status_text(d).splitlines() if line.startswith("ssd ")]
            assert len(rows) == 1 and rows[0].split()[-1] == "ok"  # the tier table's ssd row
        log = d.log()
        assert "SSD tier degraded" in log and "EFBIG" in log and "ok again" in log
    finally:
        assert d.terminate() == 0, d.log()


def test_tiny_filesystem_fills_up_then_space_returns(tmp_path: Path) -> None:
    """A real full filesystem (a 1 MiB tmpfs under a 8 MiB tier): ENOSPC, degraded, DRAM
    serves; the filesystem is grown (space returns) and write-downs resume."""
    tiny = tmp_path / "tiny"
    if not mount_tmpfs(tiny, "1m"):
        pytest.skip("mounting a tmpfs needs root; the prlimit test covers write failures")
    try:
        d = start(tmp_path, tiny / "ssd")
        try:
            with KVClient(d.zmq_address) as kv:
                ns_id = registered(kv, SPEC)
                keys = make_keys(200, tag="tiny")
                store_all(kv, ns_id, SPEC, keys)
                stats = settled(kv)
                assert stats["condition"] == "degraded" and "ENOSPC" in stats["condition_detail"]
                assert 0 < stats["entries"] * SLOT < 1 << 20  # what fitted is served
                got = kv.load(ns_id, keys[-2:])
                assert [[bytes(p) for p in row] for row in got] == [
                    expected(SPEC, k) for k in keys[-2:]
                ]
                grown = subprocess.run(
                    ["mount", "-o", "remount,size=64m", str(tiny)], capture_output=True, timeout=30
                )
                assert grown.returncode == 0, grown.stderr
                n = iter(range(0, 10_000, 8))

                def resumed() -> bool:
                    more = make_keys(8, start=next(n), tag="tiny-more")
                    kv.store(ns_id, more, [expected(SPEC, k) for k in more])
                    s = settled(kv)
                    return bool(s["condition"] == "ok" and s["entries"] * SLOT > 1 << 20)

                wait_until(resumed, timeout=30, interval=0.1)
        finally:
            assert d.terminate() == 0, d.log()
    finally:
        unmount(tiny)


def test_unusable_directory_dram_serves_then_the_tier_comes_up(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the SSD directory's parent should be")
    d = start(tmp_path, blocker / "ssd")
    try:
        assert d.info["ssd_condition"] == "unavailable"
        with KVClient(d.zmq_address) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
            keys = make_keys(60, tag="unavail")
            store_all(kv, ns_id, SPEC, keys)
            got = kv.load(ns_id, keys[-2:])
            assert [[bytes(p) for p in row] for row in got] == [
                expected(SPEC, k) for k in keys[-2:]
            ]
            stats = ssd(kv)
            assert stats["condition"] == "unavailable" and "ENOTDIR" in stats["condition_detail"]
            assert "unavailable" in status_text(d)
            blocker.unlink()
            blocker.mkdir()
            wait_until(
                lambda: (s := ssd(kv))["condition"] == "ok" and s["unsaved_namespaces"] == 0,
                timeout=30,
            )
            store_all(kv, ns_id, SPEC, make_keys(60, tag="after"))
            assert settled(kv)["stored_chunks"] > 0
        assert "SSD tier unavailable" in d.log()
    finally:
        assert d.terminate() == 0, d.log()


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        child_writer(*sys.argv[2:4])
    else:
        raise SystemExit(f"unknown child {sys.argv[1]}")


def test_a_second_daemon_on_the_same_ssd_directory_names_the_one_holding_it(
    tmp_path: Path,
) -> None:
    """A second daemon given a directory in use serves DRAM with its SSD tier unavailable,
    and its log and status say which daemon holds the directory and what to do; was "SSD
    directory is in use by another daemon" alone."""
    ssd_dir = tmp_path / "ssd"
    first = start(tmp_path / "a", ssd_dir)
    try:
        second = start(tmp_path / "b", ssd_dir)
        try:
            assert second.info["ssd_condition"] == "unavailable"
            said = f"in use by another daemon (pid {first.info['pid']}): stop it, or give"
            assert said in second.log()
            status = subprocess.run(
                [sys.executable, "-m", "kvserver.cli", "status", "--server",
                 second.grpc_address],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert status.returncode == 0 and said in status.stdout, status.stdout
        finally:
            assert second.terminate() == 0, second.log()
    finally:
        assert first.terminate() == 0, first.log()


def test_a_second_sigterm_during_a_hung_drain_exits_at_once_leaving_nothing_behind(
    tmp_path: Path,
) -> None:
    """SIGTERM while a write-down hangs in the disk, with a 120 s drain timeout: the ordered
    shutdown waits on the drain; a second SIGTERM past the repeat window (a repeat within it is
    the same request) then exits at once (143), the arena, its local-channel socket, the token
    files and the ready file removed, and the SSD directory serves the next start (crash-safe:
    only the hung write is missing). Was: the second signal ignored, the drain waited out."""
    arm, hanging = tmp_path / "arm", tmp_path / "hanging"
    ssd_dir = tmp_path / "ssd"
    d = start_daemon(
        tmp_path,
        *args(ssd_dir, "--ssd-drain-timeout-s", "120"),
        env={**ENV, "HUNG_DISK_ARM": str(arm), "HUNG_DISK_HANGING": str(hanging)},
        module="tests.support.hung_disk",
    )
    shm_dir = Path(d.arena_path).parent
    ours = {Path(d.arena_path).name, Path(d.arena_path).name + ".sock"}
    tokens = [token_path(d.info[p], str(shm_dir)) for p in ("zmq_port", "grpc_port")]
    ready = [a for a in d.args if a.endswith(".json") and "ready" in a]
    try:
        assert ours <= {p.name for p in shm_dir.iterdir()}
        assert all(os.path.exists(t) for t in tokens) and ready and os.path.exists(ready[0])
        with KVClient(d.zmq_address, colocated=False) as kv:
            ns_id = registered(kv, SPEC)
            arm.touch()
            store_all(kv, ns_id, SPEC, make_keys(48, tag="hung2"))  # victims are written down
            wait_until(hanging.exists)
        d.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "shutting down" in d.log())
        wait_past_repeat_window(time.monotonic())  # a repeat sooner is the same request
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 128 + signal.SIGTERM, d.log()
        assert "a second stop signal: exiting now" in d.log()
        assert not ours & {p.name for p in shm_dir.iterdir()}
        assert not any(os.path.exists(t) for t in tokens) and not os.path.exists(ready[0])
    finally:
        d.kill()
    arm.unlink()
    d2 = start(tmp_path, ssd_dir)
    try:
        assert d2.info["ssd_condition"] == "ok"
        with KVClient(d2.zmq_address) as kv:
            assert ssd(kv)["corrupt_chunks"] == 0
    finally:
        assert d2.terminate() == 0, d2.log()


def test_shutdown_leaves_a_hung_disk_write_behind_after_the_drain_timeout(tmp_path: Path) -> None:
    """A write-down hangs in the disk (injected: ``tests/support/hung_disk.py``) when SIGTERM
    comes: the daemon waits ``--ssd-drain-timeout-s`` (0.5 s), abandons the write, removes
    its arena and exits 0 with ``os._exit`` (the interpreter's own exit would join the stuck
    I/O thread forever)."""
    arm, hanging = tmp_path / "arm", tmp_path / "hanging"
    d = start_daemon(
        tmp_path,
        *args(tmp_path / "ssd", "--ssd-drain-timeout-s", "0.5"),
        env={**ENV, "HUNG_DISK_ARM": str(arm), "HUNG_DISK_HANGING": str(hanging)},
        module="tests.support.hung_disk",
    )
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            ns_id = registered(kv, SPEC)
            arm.touch()
            keys = make_keys(48, tag="hung")  # more than DRAM holds: victims are written down
            store_all(kv, ns_id, SPEC, keys)
            wait_until(hanging.exists)
            assert ssd(kv)["writes_in_flight"] > 0
        assert d.terminate(timeout=20) == 0, d.log()
        log = d.log()
        assert "not finished after the drain timeout (0.5 s): abandoned" in log, log
        assert "shared-memory arena removed" in log
        assert not os.path.exists(d.arena_path)
    finally:
        d.kill()
