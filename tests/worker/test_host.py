"""Host memory: the mapped arena as a tensor (shared with the daemon's mapping), staleness
after the daemon removes it, extent checks, and byte views of staging tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvserver.arena import SharedArena  # noqa: E402
from kvserver.errors import InvalidArgument  # noqa: E402
from worker.host import MappedArena, staging_buffer, tensor_memoryview  # noqa: E402


def test_mapped_arena_shares_bytes_with_the_daemon_mapping() -> None:
    arena = SharedArena(64 << 10)
    mapped = MappedArena(arena.path)
    try:
        mapped.tensor[100:104].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        assert arena.read(((100, 4),)) == b"\x01\x02\x03\x04"
        arena.write(((0, 2),), b"zz")
        assert mapped.tensor[:2].tolist() == [ord("z")] * 2
        assert not mapped.is_stale
        mapped.check_extents([(0, 10), (20, 6)], 16)
        for bad in ([(0, 10)], [(64 << 10, 16)], [(-1, 17)]):
            with pytest.raises(InvalidArgument):
                mapped.check_extents(bad, 16)
    finally:
        mapped.close()
        mapped.close()
        arena.close()
    assert mapped.is_stale  # the daemon removed its arena (restart): remap before copying


def test_staging_buffer_memoryview_is_writable_and_shared() -> None:
    t = staging_buffer(32, pinned=False)
    view = tensor_memoryview(t)
    view[:3] = b"abc"
    assert t[:3].tolist() == list(b"abc") and view.nbytes == 32
    assert tensor_memoryview(staging_buffer(0, pinned=False)).nbytes == 0
    with pytest.raises(InvalidArgument):
        tensor_memoryview(torch.zeros(4, 4)[:, :2])


def test_a_worker_maps_only_a_file_named_as_an_arena(tmp_path: Path) -> None:
    """``DaemonSession``: a hello of this host naming a file that is not an arena (one of the
    worker's own, which its stores would then write) is not mapped (payload frames instead;
    ``colocated=True``: InvalidState), the file untouched; an arena is mapped."""
    from kvserver.errors import InvalidState
    from kvserver.wire import host_id
    from tests.kvserver.builders import make_spec
    from worker.config import WorkerConnectorConfig
    from worker.daemon_session import DaemonSession

    other = tmp_path / "config.toml"
    other.write_bytes(bytes(8192))
    arena = SharedArena(64 << 10)
    spec = make_spec(model="worker/arena-name")
    try:
        for path, colocated, mapped in [(str(other), None, False), (arena.path, None, True),
                                        (str(other), True, None)]:  # fmt: skip
            config = WorkerConnectorConfig("tcp://127.0.0.1:1", spec, colocated=colocated)
            session = DaemonSession(config)
            hello = {"host_id": host_id(), "arena_path": path, "sid": "s"}
            session.kv.hello = lambda h=hello: h  # type: ignore[method-assign, misc]
            try:
                if mapped is None:
                    with pytest.raises(InvalidState, match="does not name an arena"):
                        session._map_arena(torch.device("cpu"))
                else:
                    session._map_arena(torch.device("cpu"))
                    assert (session.arena is not None) is mapped
            finally:
                session.close()
        assert other.read_bytes() == bytes(8192)
    finally:
        arena.close()
