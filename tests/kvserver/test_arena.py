"""Tests of kvserver.arena: the shared-memory file (mode, lifetime), byte access by extents, and
mappings from a second view and a second process."""

from __future__ import annotations

import array
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.arena import (
    ArenaView,
    SharedArena,
    check_room,
    not_in_memory,
    reap_stale_arenas,
    total_length,
)
from kvserver.errors import InvalidArgument, StorageError
from tests.kvserver.builders import PAGE, make_engine, make_keys, make_spec, pattern
from tests.support.tmpfs import mount_tmpfs, unmount

# A second process: map the arena by path, read some extents to stdout, write stdin into others.
CHILD = """
import json, sys
from kvserver.arena import ArenaView
path, read_extents, write_extents = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with ArenaView.attach(path) as view:
    sys.stdout.buffer.write(view.read(tuple(map(tuple, read_extents))))
    view.write(tuple(map(tuple, write_extents)), sys.stdin.buffer.read())
"""


def run_child(path: str, read: object, write: object, data: bytes) -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, json.dumps(read), json.dumps(write)],
        input=data,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


# ---------------------------------------------------------------------------- file lifetime


def test_file_mode_is_0600_whatever_the_umask() -> None:
    old = os.umask(0)
    try:
        arena = SharedArena(4 * PAGE)
    finally:
        os.umask(old)
    with arena:
        st = os.stat(arena.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 4 * PAGE
        assert st.st_uid == os.getuid()


def test_file_removed_on_close_and_close_is_idempotent() -> None:
    arena = SharedArena(PAGE)
    assert os.path.exists(arena.path) and not arena.closed
    arena.close()
    assert arena.closed
    assert not os.path.exists(arena.path)
    arena.close()
    assert arena.closed


def test_close_with_outstanding_view_still_removes_file() -> None:
    arena = SharedArena(2 * PAGE)
    views = arena.views(((0, 16),))
    arena.close()
    assert not os.path.exists(arena.path)
    del views


def test_existing_name_is_not_reused(tmp_path: Path) -> None:
    with SharedArena(PAGE, directory=str(tmp_path), name="arena") as first:
        with pytest.raises(StorageError) as info:
            SharedArena(PAGE, directory=str(tmp_path), name="arena")
        assert info.value.context["path"] == first.path
        assert os.path.exists(first.path)  # the failed create did not remove someone else's file


def test_create_in_missing_directory_is_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        SharedArena(PAGE, directory=str(tmp_path / "missing"))
    assert info.value.context["errno"] is not None


@pytest.mark.parametrize("size", [0, -PAGE])
def test_nonpositive_size_rejected(size: int) -> None:
    with pytest.raises(InvalidArgument):
        SharedArena(size)


# ---------------------------------------------------------------------------- byte access


def test_write_read_round_trip_across_extents() -> None:
    extents = ((PAGE, PAGE), (3 * PAGE, 2 * PAGE), (7 * PAGE, 100))
    data = pattern(b"k", 0, total_length(extents))
    with SharedArena(8 * PAGE) as arena:
        arena.write(extents, data)
        assert arena.read(extents) == data
        assert arena.read(extents[1:2]) == data[PAGE : 3 * PAGE]
        out = bytearray(len(data))
        arena.readinto(extents, out)
        assert out == data
        assert b"".join(bytes(v) for v in arena.views(extents)) == data
        parts = arena.views_of([extents[1:], extents[:1], ()])
        assert [[bytes(v) for v in part] for part in parts] == [
            [bytes(v) for v in arena.views(extents[1:])],
            [data[:PAGE]],
            [],
        ]
        # Nothing outside the extents was touched.
        assert arena.read(((0, PAGE), (2 * PAGE, PAGE))) == bytes(2 * PAGE)
        assert arena.read(((7 * PAGE + 100, PAGE - 100),)) == bytes(PAGE - 100)


@pytest.mark.parametrize("delta", [-1, 1])
def test_payload_size_mismatch_rejected(delta: int) -> None:
    extents = ((0, PAGE), (2 * PAGE, 10))
    with SharedArena(4 * PAGE) as arena:
        with pytest.raises(InvalidArgument):
            arena.write(extents, b"\x01" * (PAGE + 10 + delta))
        assert arena.read(extents) == bytes(PAGE + 10)


def test_one_extent_takes_any_buffer_of_its_size_and_refuses_others_writing_nothing() -> None:
    """One extent is one slice assignment: bytes, a zmq-like byte view, a strided view and a
    buffer of another item size (cast to bytes) land whole; a size off by one, a buffer of
    another shape and a non-buffer are refused with nothing written."""
    extent = ((PAGE, 64),)
    data = pattern(b"one", 0, 64)
    ints = array.array("i", range(16))  # 64 bytes of 4-byte items
    strided = memoryview(data * 2)[::2]  # non-contiguous, 64 bytes
    with SharedArena(4 * PAGE) as arena:
        for given, expect in [
            (data, data),
            (bytearray(data), data),
            (memoryview(data), data),
            (strided, bytes(strided)),
            (ints, ints.tobytes()),
            (memoryview(bytes(data)).cast("B", (8, 8)), data),
        ]:
            arena.write(extent, given)
            assert arena.read(extent) == expect
        arena.write(extent, bytes(64))
        for bad in (data[:63], data + b"x", memoryview(data * 2).cast("B", (2, 64))):
            with pytest.raises(InvalidArgument):
                arena.write(extent, bad)
            assert arena.read(extent) == bytes(64)
        with pytest.raises(TypeError):
            arena.write(extent, "not a buffer")  # type: ignore[arg-type]
        assert arena.read(((0, 4 * PAGE),)) == bytes(4 * PAGE)


def test_attach_sees_the_same_bytes_both_ways() -> None:
    with SharedArena(4 * PAGE) as arena, ArenaView.attach(arena.path) as view:
        assert view.size == arena.size
        arena.write(((PAGE, 9),), b"fromowner")
        assert view.read(((PAGE, 9),)) == b"fromowner"
        view.write(((3 * PAGE, 10),), b"fromclient")
        assert arena.read(((3 * PAGE, 10),)) == b"fromclient"
    assert view.closed


def test_view_close_does_not_remove_file() -> None:
    with SharedArena(PAGE) as arena:
        ArenaView.attach(arena.path).close()
        assert os.path.exists(arena.path)


def test_attach_missing_path_is_storage_error(tmp_path: Path) -> None:
    path = str(tmp_path / "nope")
    with pytest.raises(StorageError) as info:
        ArenaView.attach(path)
    assert info.value.context["path"] == path
    assert info.value.context["errno"] is not None


def test_attach_empty_file_is_storage_error(tmp_path: Path) -> None:
    """Attaching to an empty file leaked mmap's ValueError instead of a StorageError."""
    path = tmp_path / "empty"
    path.touch()
    with pytest.raises(StorageError) as info:
        ArenaView.attach(str(path))
    assert info.value.context["path"] == str(path)


@pytest.mark.multiprocess
def test_second_process_writes_bytes_the_engine_reads_back() -> None:
    spec = make_spec(part_bytes_override=PAGE + 100, tp_world_size=2, num_kv_heads=2)
    with make_engine(num_pages=8) as engine:
        ns = engine.register_namespace(spec)
        old, new = make_keys(2)
        # ``old`` is written by the engine and read by the child.
        first = engine.prepare_store(ns, [old])
        assert first is not None
        for rank in range(2):
            engine.write_part(first.lease_id, old, rank, pattern(old, rank, spec.part_bytes))
        engine.complete_store(first.lease_id)
        load = engine.prepare_load(ns, [old])
        # ``new`` is reserved here and written by the child (rank 1's part).
        grant = engine.prepare_store(ns, [new])
        assert grant is not None
        payload = pattern(new, 1, spec.part_bytes)
        seen = run_child(engine.arena.path, load.locations[0][0], grant.locations[0][1], payload)
        assert seen == pattern(old, 0, spec.part_bytes)
        engine.complete_load(load.lease_id)
        engine.write_part(grant.lease_id, new, 0, pattern(new, 0, spec.part_bytes))
        assert engine.complete_store(grant.lease_id) == [new]
        again = engine.prepare_load(ns, [new])
        parts = [b"".join(map(bytes, engine.read_part(again.lease_id, new, r))) for r in (0, 1)]
        assert parts == [pattern(new, 0, spec.part_bytes), payload]
        engine.complete_load(again.lease_id)


def test_reap_stale_arenas_removes_only_unlocked_arenas(tmp_path: Path) -> None:
    """A daemon killed with -9 leaves its arena (and its socket); the next start removes them,
    never a live daemon's. The lock decides, not the pid in the name: a stale arena whose pid
    is running again (pid reuse: a daemon that is pid 1 in its container) is removed, and a
    live one whose pid is not running here (another pid namespace) is kept."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"kvserver-{dead_pid}-deadbeef"
    reused = tmp_path / f"kvserver-{os.getpid()}-cafe"
    other = tmp_path / "kvserver-notapid-x"
    for p in (stale, reused, other):
        p.write_bytes(b"x")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(f"{stale}.sock")
    sock.close()
    live = SharedArena(4096, directory=str(tmp_path), name=f"kvserver-{dead_pid}-abcd")
    try:
        removed = reap_stale_arenas(str(tmp_path))
        assert sorted(removed) == sorted([str(stale), f"{stale}.sock", str(reused)])
        assert not stale.exists() and not reused.exists() and other.exists()
        assert Path(live.path).exists()
    finally:
        live.close()
    assert reap_stale_arenas(str(tmp_path)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


@pytest.mark.parametrize("advice", ["madvise", "touch"])
def test_the_arena_is_prefaulted_in_steps_with_progress(
    monkeypatch: pytest.MonkeyPatch, advice: str
) -> None:
    """Progress after every step up to the size; an older kernel (madvise refused: an invalid
    advice stands in for MADV_POPULATE_WRITE) falls back to touching each page."""
    import kvserver.arena as arena_mod

    monkeypatch.setattr(arena_mod, "PREFAULT_STEP", 1 << 20)
    if advice == "touch":
        monkeypatch.setattr(arena_mod, "_MADV_POPULATE_WRITE", 12345)
    seen: list[tuple[int, int]] = []
    size = (5 << 20) + 4096
    arena = SharedArena(size, progress=lambda done, total: seen.append((done, total)))
    try:
        assert seen == [(min((i + 1) << 20, size), size) for i in range(6)]
        assert bytes(arena.buf[:4096]) == bytes(4096) and bytes(arena.buf[-4096:]) == bytes(4096)
        arena.write([(size - 3, 3)], b"abc")
        assert arena.read([(size - 3, 3)]) == b"abc"
    finally:
        arena.close()


def test_an_arena_larger_than_its_filesystem_is_a_clear_error_not_sigbus(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs (a container's /dev/shm left at its default) under an 8 MiB arena:
    a StorageError that says how much is free, and no file left; was: the pre-fault touched
    pages the filesystem could not back and the process died of SIGBUS, leaving the file.
    Run in a child process, so that SIGBUS before the fix fails the test, not pytest. The
    up-front check (:func:`check_room`) is bypassed: this is the filesystem another process
    fills between that check and the pre-fault."""
    tiny = tmp_path / "tiny"
    if not mount_tmpfs(tiny, "1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        code = (
            "import sys; import kvserver.arena as a; from kvserver.errors import StorageError\n"
            "a.check_room = lambda size, directory: None\ntry:\n"
            "    a.SharedArena(8 << 20, directory=sys.argv[1])\n"
            "except StorageError as exc:\n    print(exc)"
        )
        child = subprocess.run([sys.executable, "-c", code, str(tiny)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert child.returncode == 0, (child.returncode, child.stderr)
        assert "cannot commit the arena's memory: No space left on device" in child.stdout
        assert "8 MiB asked" in child.stdout and str(tiny) in child.stdout
        assert list(tiny.iterdir()) == []
    finally:
        unmount(tiny)


def test_an_arena_its_filesystem_cannot_hold_is_refused_before_anything_is_committed(
    tmp_path: Path,
) -> None:
    """check_room: more than the filesystem has free is refused naming the sizes and the fix;
    what fits passes. (It reads statvfs only: nothing is allocated either way.)"""
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(StorageError, match=r"it does not fit \(\d+ MiB asked, \d+ MiB free in "):
        check_room(free + (1 << 30), str(tmp_path))
    check_room(min(free, 1 << 20), str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StorageError, match=r"directory .*/gone does not exist: create it"):
        check_room(1, str(tmp_path / "gone"))


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
24 23 0:20 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
25 22 0:30 / /mnt/my\\040disk rw shared:4 - xfs /dev/sdb1 rw
26 22 0:31 / /mnt rw shared:5 - ext4 /dev/sdc1 rw
27 22 0:32 / /mnt rw shared:6 - tmpfs none rw
"""


@pytest.mark.parametrize(
    ("directory", "kind"),
    [
        ("/dev/shm", None),
        ("/dev/shm/kvserver-tests", None),
        ("/var/lib/kvserver", "ext4"),
        ("/dev/shmem", "devtmpfs"),  # /dev, not /dev/shm: a prefix of the name is no parent
        ("/mnt/my disk/arena", "xfs"),  # the mount point as mountinfo escapes it
        ("/mnt/other", None),  # the last filesystem mounted on /mnt is the one seen there
    ],
)
def test_an_arena_directory_not_in_memory_is_named_with_its_filesystem(
    tmp_path: Path, directory: str, kind: str | None
) -> None:
    """--shm-dir given a data directory: the "DRAM" tier was a disk file, said nowhere."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    said = not_in_memory(directory, str(mountinfo))
    if kind is None:
        assert said is None
    else:
        assert said == (
            f"the arena's directory {directory} is on {kind}, not in memory: the DRAM tier's "
            "pages go to that disk; give a tmpfs with --shm-dir (the default, /dev/shm, is one)"
        )
    assert not_in_memory(directory, str(tmp_path / "none")) is None  # not Linux: nothing said
