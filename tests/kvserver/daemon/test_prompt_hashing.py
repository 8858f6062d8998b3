"""Prompts of more than ``HASH_OFF_LOOP_TOKENS`` tokens hash on a thread (prompt_hashing.py).

Over real gRPC (the front end and the service on their own loop in this process, as in
test_grpc_server.py) and ZMQ (a real daemon): while a long prompt's hashing is held on its
thread, another client's calls complete; its answer is the one the namespace's hash
algorithm gives; Pin and Unpin by long prompts count as by keys; its errors (unknown
namespace, too many tokens or chunks, another tenant's namespace or salt) are the short
prompt's. Then the bound: past a caller's or the daemon's allowance of waiting tokens a prompt
gets CapacityError (RESOURCE_EXHAUSTED) before any hashing, and a cancelled prompt counts
until its thread is done.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvserver.client import KVClient
from kvserver.daemon import prompt_hashing
from kvserver.daemon.metrics import DaemonCollector
from kvserver.daemon.prompt_hashing import HASH_OFF_LOOP_TOKENS, PromptHashing
from kvserver.engine.types import HashedKeys
from kvserver.errors import CapacityError, InvalidArgument, PermissionDenied, UnknownNamespace
from kvserver.grpc_client import GrpcClient
from kvserver.hashing import HASH_ALGOS
from tests.kvserver.builders import make_spec
from tests.kvserver.daemon.test_grpc_server import InProcessServer, chunk_keys
from tests.support.daemon import start_daemon
from tests.support.metrics import Scrape

SPEC = make_spec(model="test/long-prompts", hash_algo="xxhash_cbor")
#: just past the threshold: 4,097 chunks of 16 tokens, and a partial tail
LONG = [(i * 7919) % 50_000 for i in range(HASH_OFF_LOOP_TOKENS + 16 + 5)]


class HashGate:
    """Holds every prompt hashed on a hashing thread until :meth:`open` (hashing on the loop
    is not held): ``started`` is set when one is held. A real synchronisation point."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self._open = threading.Event()
        self.threads: set[str] = set()
        real = prompt_hashing._hash

        def held(*args: Any) -> HashedKeys:
            name = threading.current_thread().name
            if name.startswith("kvs-hash"):
                self.threads.add(name)
                self.started.set()
                assert self._open.wait(30), "the test never opened the gate"
            return real(*args)

        monkeypatch.setattr(prompt_hashing, "_hash", held)

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(tmp_path)
    yield srv
    srv.close()


def test_other_clients_are_served_while_a_long_prompt_hashes(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 65,557-token gRPC Lookup held on its hashing thread: another client's Lookups (by
    keys, by a short prompt), Stats and Pin all complete before it returns; its answer is then
    the Lookup by the keys the namespace's algorithm gives."""
    gate = HashGate(monkeypatch)
    with server.client() as a, server.client() as b, ThreadPoolExecutor(1) as pool:
        ns_id = a.register_namespace(SPEC).namespace_id
        keys = chunk_keys(SPEC, LONG)
        assert len(keys) == 4097
        server.store(ns_id, keys[:3])
        long_lookup = pool.submit(a.lookup_tokens, ns_id, LONG)
        assert gate.started.wait(30)
        assert b.lookup_keys(ns_id, keys[:5]).hit_chunks == 3
        assert b.lookup_tokens(ns_id, LONG[:64]).hit_chunks == 3
        assert b.stats().namespaces[0].namespace_id == ns_id
        assert b.pin(ns_id, ttl_s=60, token_ids=LONG[:32]).chunks == 2
        assert not long_lookup.done()  # held on its thread all along
        assert server.call(lambda: server.service.prompts.tokens_waiting) == len(LONG)
        gate.open()
        reply = long_lookup.result(30)
    assert (reply.hit_chunks, reply.num_chunks, reply.hit_tokens) == (3, 4097, 48)
    with server.client() as c:
        assert c.lookup_keys(ns_id, keys) == reply
    assert gate.threads and all(n.startswith("kvs-hash") for n in gate.threads)
    assert server.call(lambda: server.service.prompts.tokens_waiting) == 0


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_a_long_prompt_gets_the_keys_of_the_namespaces_algorithm(
    server: InProcessServer, algo: str
) -> None:
    """Hashed on a thread, the keys are those of hashing on the loop: Lookup finds the
    stored run, Pin and Unpin count the same chunks as by keys (salt and LoRA included)."""
    spec = make_spec(model=f"test/long-{algo}", hash_algo=algo)
    with server.client() as client:
        ns_id = client.register_namespace(spec).namespace_id
        salted = {"cache_salt": "s", "lora": ("ad", "/p")}
        keys = chunk_keys(spec, LONG, **salted)
        on_loop = server.call(
            lambda: server.service.prompts.chunk_keys_for_tokens(ns_id, LONG, **salted)  # type: ignore[arg-type]
        )
        assert list(on_loop) == keys
        server.store(ns_id, keys[:7])
        assert client.lookup_tokens(ns_id, LONG).hit_chunks == 0  # unsalted: other keys
        assert client.lookup_tokens(ns_id, LONG, **salted).hit_chunks == 7  # type: ignore[arg-type]
        assert client.pin(ns_id, ttl_s=60, token_ids=LONG, **salted).chunks == 7  # type: ignore[arg-type]
        assert client.unpin(ns_id, token_ids=LONG, **salted).chunks == 7  # type: ignore[arg-type]
        assert client.unpin(ns_id, keys=keys).chunks == 0


def _error(call: Any) -> tuple[type[Exception], str]:
    try:
        call()
    except Exception as exc:  # the error is the result
        return type(exc), str(exc).split(" (")[0]
    raise AssertionError("no error")


def test_a_long_prompt_gets_the_short_prompts_errors(server: InProcessServer) -> None:
    """Unknown namespace, too many tokens, more chunks than a request may carry: the same
    errors for a prompt past the threshold as for a short one, and nothing was hashed."""
    with server.client() as client:
        ns_id = client.register_namespace(SPEC).namespace_id
        huge = [1] * ((1 << 21) + 1)
        many_chunks = [1] * ((1 << 16) + 1) * 16  # 65,537 chunks in 1M tokens
        unknown = "0" * 16
        for call in (
            lambda t: client.lookup_tokens(unknown, t),
            lambda t: client.pin(unknown, ttl_s=1, token_ids=t),
            lambda t: client.unpin(unknown, token_ids=t),
        ):
            got = _error(lambda: call(LONG))  # noqa: B023 - called at once
            assert got == _error(lambda: call(LONG[:64])) and got[0] is UnknownNamespace  # noqa: B023
        for t in (huge, many_chunks):
            for refused in (
                lambda: client.lookup_tokens(ns_id, t),  # noqa: B023
                lambda: client.unpin(ns_id, token_ids=t),  # noqa: B023
            ):
                assert _error(refused)[0] is InvalidArgument
        assert _error(lambda: client.lookup_tokens(ns_id, huge))[1] == "too many tokens"
        assert "more chunks" in _error(lambda: client.lookup_tokens(ns_id, many_chunks))[1]
    assert server.call(lambda: server.service.prompts._threads) is None  # none ever hashed


TENANTS = """
[[tenants]]
name = "team-a"
token = "token-of-team-a-0123456789"
models = ["model-a"]
cache_salts = ["salt-a"]
"""


def test_a_tenants_long_prompt_is_refused_as_a_short_one(tmp_path: Path) -> None:
    """A real daemon with a tenant: its long prompt of a namespace it may not use, or with a
    salt it may not use, gets the short prompt's NOT_FOUND / PERMISSION_DENIED, over gRPC
    and ZMQ; the admin's long prompt over ZMQ is answered with the keys of the namespace's
    algorithm."""
    config = tmp_path / "kvserver.toml"
    config.write_text(TENANTS)
    d = start_daemon(tmp_path, "--config", str(config), "--dram", "16MiB")
    try:
        spec_a, spec_b = make_spec(model="model-a"), make_spec(model="model-b")
        with KVClient(d.zmq_address, colocated=False) as admin:
            ns_a = admin.register_namespace(spec_a).ns_id
            ns_b = admin.register_namespace(spec_b).ns_id
            keys = chunk_keys(spec_b, LONG)
            parts = [[bytes(spec_b.part_bytes)] for _ in range(4)]
            assert admin.store(ns_b, keys[:4], parts) == keys[:4]
            assert admin.lookup_tokens(ns_b, LONG).hit_chunks == 4  # hashed on a thread
        token = "token-of-team-a-0123456789"
        with (
            GrpcClient(d.grpc_address, auth_token=token) as g,
            KVClient(d.zmq_address, auth_token=token, colocated=False) as z,
        ):
            for lookup in (g.lookup_tokens, z.lookup_tokens):
                for ns_id, salt, error in (
                    (ns_b, None, UnknownNamespace),  # not hers: as if not registered
                    (ns_a, "salt-b", PermissionDenied),
                ):
                    long = _error(lambda: lookup(ns_id, LONG, cache_salt=salt))  # noqa: B023
                    short = _error(lambda: lookup(ns_id, LONG[:64], cache_salt=salt))  # noqa: B023
                    assert long == short and long[0] is error
            assert g.lookup_tokens(ns_a, LONG, cache_salt="salt-a").num_chunks == 4097
    finally:
        assert d.terminate() == 0


# ----------------------------------------------------------------------------- the bound


def test_past_the_callers_allowance_a_long_prompt_gets_resource_exhausted(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one long prompt's tokens waiting (the allowance), the next long prompt of the same
    caller is refused at once with RESOURCE_EXHAUSTED, a short one is served; once the first
    is done the next is served again."""
    gate = HashGate(monkeypatch)
    server.call(lambda: setattr(server.service.prompts, "max_tokens_per_caller", len(LONG)))
    with server.client() as a, server.client() as b, ThreadPoolExecutor(1) as pool:
        ns_id = a.register_namespace(SPEC).namespace_id
        first = pool.submit(a.lookup_tokens, ns_id, LONG)
        assert gate.started.wait(30)
        with pytest.raises(CapacityError, match="retry later"):
            b.lookup_tokens(ns_id, LONG)
        with pytest.raises(CapacityError):
            b.pin(ns_id, ttl_s=1, token_ids=LONG)
        assert b.lookup_tokens(ns_id, LONG[:64]).num_chunks == 4
        gate.open()
        assert first.result(30).num_chunks == 4097
        assert b.lookup_tokens(ns_id, LONG).num_chunks == 4097
    counts = {"off_loop_prompts": 2, "waited_prompts": 0, "refused_caller": 2}
    stats = server.call(lambda: server.service.stats()["prompt_hashing"])
    assert stats == {**counts, "refused_daemon": 0, "tokens_waiting": 0}
    registry = CollectorRegistry()
    registry.register(DaemonCollector(server.service, server.loop))
    scraped = Scrape(generate_latest(registry).decode())
    assert scraped.value("kvserver_prompts_hashed_off_loop_total") == 2
    assert scraped.value("kvserver_prompts_waited_total") == 0
    assert scraped.value("kvserver_prompts_refused_total", bound="caller") == 2
    assert scraped.value("kvserver_prompts_refused_total", bound="daemon") == 0
    assert scraped.value("kvserver_prompt_tokens_waiting") == 0


def test_the_allowances_per_caller_and_daemon_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """PromptHashing on a loop of its own: one caller's waiting tokens do not spend another's
    allowance until the daemon-wide one is spent; a cancelled prompt's tokens count until its
    thread is done with them; short prompts are hashed at once, never refused."""
    gate = HashGate(monkeypatch)
    n = len(LONG)
    hashing = PromptHashing(
        namespace={SPEC.ns_id: SPEC}.__getitem__,
        max_keys_per_request=1 << 16,
        max_jobs=1,
        max_tokens_per_caller=n,
        max_tokens_waiting=2 * n,
    )

    async def scenario() -> None:
        first = asyncio.ensure_future(hashing.keys(SPEC, LONG, caller="a"))  # type: ignore[arg-type]
        second = asyncio.ensure_future(hashing.keys(SPEC, LONG, caller="b"))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # both started: their tokens are counted
        assert hashing.tokens_waiting == 2 * n
        with pytest.raises(CapacityError):
            await hashing.keys(SPEC, LONG, caller="a")  # type: ignore[misc]
        with pytest.raises(CapacityError):
            await hashing.keys(SPEC, LONG, caller="c")  # type: ignore[misc]  # daemon-wide
        assert type(hashing.keys(SPEC, LONG[:64], caller="a")) is HashedKeys  # short: at once
        second.cancel()  # waiting behind the first: never hashed, released at once
        with pytest.raises(asyncio.CancelledError):
            await second
        await asyncio.sleep(0)
        assert hashing.tokens_waiting == n
        assert gate.started.wait(30)
        first.cancel()  # already hashing on its thread: counted until the thread is done
        with pytest.raises(asyncio.CancelledError):
            await first
        assert hashing.tokens_waiting == n
        gate.open()
        assert hashing._threads is not None  # a job behind the first: its release is queued
        await asyncio.wrap_future(hashing._threads.submit(int))  # on the loop before this
        assert hashing.tokens_waiting == 0
        keys = await hashing.keys(SPEC, LONG, caller="a")  # type: ignore[misc]
        assert list(keys) == chunk_keys(SPEC, LONG)
        # a, b (waited behind a), a again after both: three on the thread; one refusal each
        assert hashing.stats() == {
            "off_loop_prompts": 3,
            "waited_prompts": 1,
            "refused_caller": 1,
            "refused_daemon": 1,
            "tokens_waiting": 0,
        }

    try:
        asyncio.run(scenario())
    finally:
        gate.open()
        hashing.close()
