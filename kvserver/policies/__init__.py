"""Eviction policies by name: the registry a tier consults when it is configured.

Pure in-process code (no I/O, no locks). Adding a policy is one class implementing
:class:`~kvserver.policies.base.EvictionPolicy` plus one line in :data:`POLICIES`; every
registered policy runs the shared test suite (tests/kvserver/test_policies.py).
"""

from __future__ import annotations

from kvserver.errors import InvalidArgument
from kvserver.policies.arc import ARCPolicy
from kvserver.policies.base import EvictionPolicy
from kvserver.policies.chain import ChainPolicy
from kvserver.policies.lru import LRUPolicy
from kvserver.policies.prefix import PrefixPolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "ChainPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixPolicy",
    "make_policy",
    "policy_names",
]

#: registry name → policy class
POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, ARCPolicy, PrefixPolicy, ChainPolicy)
}


def policy_names() -> list[str]:
    """The valid policy names, sorted."""
    return sorted(POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance. Raises :class:`InvalidArgument` naming the valid choices."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(policy_names())}",
            policy=name,
        )
    return cls()
