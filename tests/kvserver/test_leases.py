"""Tests of kvserver.leases: ids, kinds, expiry order, and the errors for gone leases."""

from __future__ import annotations

import pytest

from kvserver import leases as leases_module
from kvserver.errors import LeaseError, LeaseExpired
from kvserver.leases import LeaseKind, LeaseTable


def make_table(*deadlines: float, client: str = "c") -> LeaseTable:
    table = LeaseTable()
    for i, deadline in enumerate(deadlines):
        table.new(LeaseKind.STORE, client, 0, [bytes([i])], deadline)
    return table


def test_ids_unique_increasing_and_get() -> None:
    table = LeaseTable()
    a = table.new(LeaseKind.STORE, "x", 0, [b"k"], 10.0)
    b = table.new(LeaseKind.LOAD, "y", 1, [b"k", b"k"], 5.0)
    assert 0 < a.lease_id < b.lease_id
    assert table.get(a.lease_id, LeaseKind.STORE) is a
    assert table.get(b.lease_id, LeaseKind.LOAD) is b
    assert len(table) == 2
    assert set(table) == {a, b}


def test_wrong_kind_is_lease_error_not_expired() -> None:
    table = LeaseTable()
    lease = table.new(LeaseKind.STORE, "x", 0, [], 10.0)
    with pytest.raises(LeaseError, match="store lease, not load") as info:
        table.get(lease.lease_id, LeaseKind.LOAD)
    assert type(info.value) is LeaseError
    assert len(table) == 1


def test_unknown_lease() -> None:
    with pytest.raises(LeaseError, match="unknown lease") as info:
        LeaseTable().get(42, LeaseKind.STORE)
    assert type(info.value) is LeaseError
    assert info.value.context == {"lease": 42}


def test_pop_expired_in_deadline_order_and_only_due() -> None:
    table = make_table(30.0, 10.0, 20.0, 40.0)
    assert table.pop_expired(9.99) == []
    expired = table.pop_expired(30.0)  # a deadline equal to now has passed
    assert [lease.deadline for lease in expired] == [10.0, 20.0, 30.0]
    assert len(table) == 1
    assert [lease.deadline for lease in table.pop_expired(1e9)] == [40.0]
    assert table.pop_expired(1e9) == []


def test_expired_lease_raises_lease_expired() -> None:
    table = make_table(10.0)
    (lease,) = table.pop_expired(10.0)
    with pytest.raises(LeaseExpired, match="expired"):
        table.get(lease.lease_id, LeaseKind.STORE)


@pytest.mark.parametrize("why", ["completed", "released"])
def test_ended_lease_is_lease_error_naming_why(why: str) -> None:
    table = make_table(10.0)
    (lease,) = list(table)
    table.end(lease, why)
    with pytest.raises(LeaseError, match=f"already {why}") as info:
        table.get(lease.lease_id, LeaseKind.STORE)
    assert type(info.value) is LeaseError
    # An ended lease never expires later (its heap item is dropped lazily).
    assert table.pop_expired(1e9) == []
    assert len(table) == 0


def test_by_client() -> None:
    table = LeaseTable()
    mine = [
        table.new(LeaseKind.STORE, "me", 0, [], 1.0),
        table.new(LeaseKind.LOAD, "me", 0, [], 1.0),
    ]
    table.new(LeaseKind.STORE, "other", 0, [], 1.0)
    assert table.by_client("me") == mine
    assert table.by_client("nobody") == []


def test_gone_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases_module, "EXPIRED_MEMORY", 2)
    table = make_table(1.0, 2.0, 3.0)
    first, second, third = table.pop_expired(5.0)
    assert len(table._gone) == 2
    with pytest.raises(LeaseError, match="unknown lease"):
        table.get(first.lease_id, LeaseKind.STORE)  # forgotten: no longer "expired"
    for lease in (second, third):
        with pytest.raises(LeaseExpired):
            table.get(lease.lease_id, LeaseKind.STORE)


def test_each_table_numbers_its_leases_from_a_random_first_id() -> None:
    """Two daemon incarnations (two tables) never hand out the same ids in practice: a late
    completion for a lease of a killed daemon gets "unknown lease" from its successor."""
    firsts = {LeaseTable().new(LeaseKind.LOAD, "c", 0, [b"k"], 1.0).lease_id for _ in range(8)}
    assert len(firsts) == 8
    assert all(0 < first <= leases_module.FIRST_ID_SPAN for first in firsts)
    table = LeaseTable(first_id=7)
    assert [table.new(LeaseKind.LOAD, "c", 0, [], 1.0).lease_id for _ in range(2)] == [7, 8]
