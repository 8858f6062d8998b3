"""The storage engine's namespaces: registered specs, their ids and indexes, key validation.

Runs inside the storage engine (``kvserver/engine/core.py``), its only caller: single owner, no
locks. A namespace is registered once (``add``) and never removed; its index (``ids[ns_id]``,
the position in ``specs``) is the first half of every index key and stays fixed for the
engine's life. Its counters are ``EngineCounters``' (``stats.py``), by the same index.

Invariant: ``specs``, ``ns_ids`` and the values of ``ids`` are parallel:
``ids[specs[i].ns_id] == i`` and ``ns_ids[i] == specs[i].ns_id`` for every ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserver.engine.types import CutKeys, HashedKeys
from kvserver.errors import InvalidArgument, UnknownNamespace
from kvserver.namespace import NamespaceSpec

#: most namespaces one engine registers (they are never removed). Past it a registration is
#: ``capacity``: any client could otherwise grow the daemon without bound (a spec per hash
#: seed), and the replies that list them (``namespaces``, ``stats``' per-namespace rows) past
#: what a client decodes.
MAX_NAMESPACES = 4096


class NamespaceTable:
    """Registered namespaces by id and index (see the module docstring)."""

    def __init__(self, max_keys_per_request: int) -> None:
        self.specs: list[NamespaceSpec] = []
        #: the ``ns_id`` of each index (``NamespaceSpec.ns_id`` hashes the spec per call)
        self.ns_ids: list[str] = []
        self.ids: dict[str, int] = {}
        self._max_keys = max_keys_per_request

    def add(self, spec: NamespaceSpec) -> int:
        """Register ``spec``; returns its index. REQUIRES: ``spec.ns_id`` is not registered."""
        ns = len(self.specs)
        self.ids[spec.ns_id] = ns
        self.ns_ids.append(spec.ns_id)
        self.specs.append(spec)
        return ns

    def by_id(self) -> dict[str, NamespaceSpec]:
        """Every registered spec by its ``ns_id``, in registration order."""
        return dict(zip(self.ns_ids, self.specs, strict=True))

    def index_of(self, ns_id: str) -> int:
        """The index of ``ns_id``; UnknownNamespace if it is not registered."""
        try:
            return self.ids[ns_id]
        except (KeyError, TypeError):
            raise UnknownNamespace("namespace not registered", ns=ns_id) from None

    def check_keys(self, ns: int, keys: Sequence[bytes]) -> None:
        """Raise InvalidArgument unless ``keys`` is a list/tuple of at most
        ``max_keys_per_request`` byte strings of the namespace's key size."""
        if not isinstance(keys, list | tuple):
            raise InvalidArgument("keys must be a list of byte strings")
        if len(keys) > self._max_keys:
            raise InvalidArgument(
                "too many keys in one request", count=len(keys), max=self._max_keys
            )
        size = self.specs[ns].key_size
        if (type(keys) is CutKeys or type(keys) is HashedKeys) and keys.key_size == size:
            return  # sized by construction: cut, or digests of the namespace's hasher
        if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {size}:
            return  # the common case, checked without a Python loop; else find the culprit
        for key in keys:
            if type(key) is not bytes or len(key) != size:
                raise InvalidArgument(
                    f"every key must be {size} bytes for this namespace's hash",
                    key=key if isinstance(key, bytes) else type(key).__name__,
                )
