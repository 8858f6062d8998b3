"""Hashing prompts (token ids) into chunk keys for every token path of the daemon, big ones on
a thread so that the event loop keeps serving the other clients.

Runs in the daemon process. :class:`PromptHashing` is owned by
:class:`~kvserver.daemon.service.KVService` and called on its event loop, for ZMQ and
local-channel ``lookup_tokens`` and gRPC Lookup / Pin / Unpin by token ids (the front ends
call ``service.prompts.prompt_keys``), and ScoreHosts (``kvserver/cluster/rpc.py``, through
the service's ``hash_prompt``). Not thread-safe: loop only, except the hashing it hands to its
threads.

Call order: first what is cheap is checked on the loop (the caller's authorization by the
caller; the number of tokens, the namespace and the number of chunks by
:meth:`PromptHashing.prompt_keys`, against this daemon's namespaces), so a request's error
does not depend on its size; then :meth:`PromptHashing.keys`:

- a prompt of at most :data:`HASH_OFF_LOOP_TOKENS` tokens is hashed at once, on the loop: it
  holds the loop for at most a few ms (~60 ms per 1M tokens of a new prompt), and a short
  prompt, the common case, pays no hand-over to a thread and back;
- a longer one is hashed on the :data:`MAX_HASH_JOBS` hashing thread, the loop serving other
  requests meanwhile (the engine is never touched there: the thread runs the namespace's
  :class:`~kvserver.hashing.BlockHasher`, thread-safe, over the caller's token ids, which
  nothing changes while it waits); the caller goes on with the keys on the loop. The thread
  shares the GIL with the loop, which then runs at least every ``sys.getswitchinterval()``
  (5 ms) instead of waiting for the whole hash.

Bounds: one caller (a principal: a tenant, or the admin) may have at most
:data:`MAX_TOKENS_PER_CALLER` tokens hashing or waiting for a thread, all callers together
:data:`MAX_TOKENS_WAITING`; a prompt beyond either is refused at once, before any hashing, with
``CapacityError`` (gRPC RESOURCE_EXHAUSTED, ZMQ ``capacity``; retry later): a flood of huge
prompts gets errors instead of an ever longer queue holding every request's token ids, and
cannot crowd out another tenant's. A prompt's tokens count until its thread is done with them
(a cancelled request's too). Under the allowance nothing is refused: up to 4 prompts of the
largest size (2M tokens) a caller, or 64 of 128k, wait their turn.

Counters (``stats()``, in the daemon's ``stats`` as ``prompt_hashing`` and on ``/metrics``):
prompts hashed on a thread, those of them that waited for it (another prompt's tokens were
hashing or queued when they arrived), those refused by the caller's and by the daemon's
allowance, and the tokens waiting now.

Hashers: one :class:`BlockHasher` per (algorithm, block size, seed), the
:data:`MAX_HASHERS` most recently used: what a hasher returns depends on those only, so the
namespaces (and the fleet's specs that ScoreHosts scores) sharing them share one and its cache
of already-hashed prompt segments.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from kvserver.engine.types import HashedKeys
from kvserver.errors import CapacityError, InvalidArgument
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from kvserver.prompts import MAX_PROMPT_TOKENS, check_prompt_size

#: prompts of more tokens than this hash on a thread (what is done with the keys: on the loop).
HASH_OFF_LOOP_TOKENS = 1 << 16
#: threads hashing prompts at once. One: the hashing holds the GIL nearly all the time, so a
#: second thread would add little but another contender for the GIL with the loop.
MAX_HASH_JOBS = 1
#: tokens one caller may have hashing or waiting for a thread (4 prompts of 2M tokens).
MAX_TOKENS_PER_CALLER = 1 << 23
#: tokens all callers together may have hashing or waiting for a thread.
MAX_TOKENS_WAITING = 1 << 25
#: hashers kept (one per algorithm, block size and seed).
MAX_HASHERS = 64


def _hash(
    hasher: BlockHasher,
    spec: NamespaceSpec,
    token_ids: Sequence[int],
    cache_salt: str | None,
    lora: tuple[str, str] | None,
) -> HashedKeys:
    blocks = hasher.hash_blocks(token_ids, cache_salt=cache_salt, lora=lora)
    # block hashes are bytes already (a NewType): no copy per key (2,048: ~0.1 ms)
    return HashedKeys(hasher.chunk_keys(blocks, spec.chunk_blocks), spec.key_size)


class OffLoopKeys:
    """Chunk keys that are hashed on a thread once awaited: nothing starts (and nothing is
    left behind) until then, so a request dropped before its turn costs nothing."""

    __slots__ = ("_start",)

    def __init__(self, start: Callable[[], Coroutine[Any, Any, HashedKeys]]) -> None:
        self._start = start

    def __await__(self) -> Generator[Any, None, HashedKeys]:
        return self._start().__await__()


class PromptHashing:
    """The chunk keys of prompts, hashed as a vLLM replica of the namespace would; see the
    module docstring. Invariant: ``_waiting`` is the sum of ``_by_caller``, each > 0."""

    def __init__(
        self,
        *,
        namespace: Callable[[str], NamespaceSpec],
        max_keys_per_request: int,
        max_jobs: int = MAX_HASH_JOBS,
        max_tokens_per_caller: int = MAX_TOKENS_PER_CALLER,
        max_tokens_waiting: int = MAX_TOKENS_WAITING,
    ) -> None:
        """``namespace(ns_id)``: the spec of a namespace registered with the daemon
        (``StorageEngine.namespace``: UnknownNamespace otherwise); ``max_keys_per_request``:
        the most chunks a prompt may make (the engine's limit on keys)."""
        self._namespace = namespace
        self._max_keys = max_keys_per_request
        self._max_jobs = max_jobs
        self.max_tokens_per_caller = max_tokens_per_caller
        self.max_tokens_waiting = max_tokens_waiting
        self._hashers: OrderedDict[tuple[str, int, str], BlockHasher] = OrderedDict()
        self._threads: ThreadPoolExecutor | None = None  # made for the first long prompt
        self._by_caller: dict[str, int] = {}
        self._waiting = 0
        self._counts = dict.fromkeys(
            ("off_loop_prompts", "waited_prompts", "refused_caller", "refused_daemon"), 0
        )

    def hasher(self, spec: NamespaceSpec) -> BlockHasher:
        """The hasher of ``spec``'s hash parameters (building one computes its NONE_HASH)."""
        params = (spec.hash_algo, spec.block_size, spec.hash_seed)
        hasher = self._hashers.get(params)
        if hasher is None:
            hasher = BlockHasher(*params)
            self._hashers[params] = hasher
            if len(self._hashers) > MAX_HASHERS:
                self._hashers.popitem(last=False)
        elif len(self._hashers) > 1:
            self._hashers.move_to_end(params)
        return hasher

    def chunk_keys_for_tokens(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> HashedKeys:
        """The chunk keys of a prompt, hashed now as a vLLM replica of this namespace would:
        digests of ``key_size`` bytes, which the engine's key check takes without looking at
        each. The front ends use :meth:`prompt_keys`."""
        spec = self._check_prompt(ns_id, len(token_ids))
        return self.keys_now(spec, token_ids, cache_salt=cache_salt, lora=lora)

    def prompt_keys(
        self,
        ns_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        caller: str = "",
    ) -> HashedKeys | Awaitable[HashedKeys]:
        """The chunk keys of a prompt, or for more than ``HASH_OFF_LOOP_TOKENS`` tokens an
        awaitable hashing them on a thread for ``caller``: :meth:`keys`, after the
        namespace and sizes are checked, now, whatever the size."""
        spec = self._check_prompt(ns_id, len(token_ids))
        return self.keys(spec, token_ids, cache_salt=cache_salt, lora=lora, caller=caller)

    def _check_prompt(self, ns_id: str, num_tokens: int) -> NamespaceSpec:
        """The spec of ``ns_id``, after the checks of a prompt's size, which refuse it before
        any hashing (InvalidArgument, UnknownNamespace)."""
        if num_tokens > MAX_PROMPT_TOKENS:  # before the namespace: the same error for all
            raise InvalidArgument("too many tokens", count=num_tokens, max=MAX_PROMPT_TOKENS)
        spec = self._namespace(ns_id)
        check_prompt_size(num_tokens, spec.chunk_tokens, self._max_keys)
        return spec

    def keys_now(
        self,
        spec: NamespaceSpec,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> HashedKeys:
        """The chunk keys of ``token_ids`` in ``spec``, hashed now, whatever their number."""
        return _hash(self.hasher(spec), spec, token_ids, cache_salt, lora)

    def keys(
        self,
        spec: NamespaceSpec,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        caller: str = "",
    ) -> HashedKeys | Awaitable[HashedKeys]:
        """The chunk keys of ``token_ids`` in ``spec``: hashed now when at most
        :data:`HASH_OFF_LOOP_TOKENS` tokens, else an awaitable hashing them on a thread for
        ``caller`` (CapacityError, raised when awaited, before any hashing, if the caller's or
        the daemon's allowance of waiting tokens is spent). InvalidArgument for bad token ids
        or ``cache_salt``, as ``BlockHasher.hash_blocks``."""
        hasher = self.hasher(spec)
        if len(token_ids) <= HASH_OFF_LOOP_TOKENS:
            return _hash(hasher, spec, token_ids, cache_salt, lora)
        job = partial(self._off_loop, hasher, spec, token_ids, cache_salt, lora, caller)
        return OffLoopKeys(job)

    async def _off_loop(
        self,
        hasher: BlockHasher,
        spec: NamespaceSpec,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lora: tuple[str, str] | None,
        caller: str,
    ) -> HashedKeys:
        count = len(token_ids)
        mine = self._by_caller.get(caller, 0)
        over_caller = mine + count > self.max_tokens_per_caller
        if over_caller or self._waiting + count > self.max_tokens_waiting:
            self._counts["refused_caller" if over_caller else "refused_daemon"] += 1
            raise CapacityError(
                "too many prompt tokens waiting to be hashed; retry later",
                tokens=count,
                caller_waiting=mine,
                caller_max=self.max_tokens_per_caller,
                daemon_waiting=self._waiting,
                daemon_max=self.max_tokens_waiting,
            )
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self._max_jobs, thread_name_prefix="kvs-hash")
        loop = asyncio.get_running_loop()
        job = self._threads.submit(_hash, hasher, spec, token_ids, cache_salt, lora)
        self._counts["off_loop_prompts"] += 1
        if self._waiting:  # another prompt is hashing or queued: this one waits its turn
            self._counts["waited_prompts"] += 1
        self._by_caller[caller] = mine + count
        self._waiting += count

        def done(_: Future[HashedKeys]) -> None:  # on the thread, or here if cancelled
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to count
                loop.call_soon_threadsafe(self._release, caller, count)

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _release(self, caller: str, count: int) -> None:
        left = self._by_caller[caller] - count
        if left:
            self._by_caller[caller] = left
        else:
            del self._by_caller[caller]
        self._waiting -= count

    @property
    def tokens_waiting(self) -> int:
        """Tokens of long prompts hashing or waiting for a thread."""
        return self._waiting

    def stats(self) -> dict[str, int]:
        """``off_loop_prompts``, ``waited_prompts``, ``refused_caller``, ``refused_daemon``
        (since start) and ``tokens_waiting`` (now); see the module docstring."""
        return {**self._counts, "tokens_waiting": self._waiting}

    def close(self) -> None:
        """Stop the threads: prompts not started are cancelled; one hashing finishes."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
