"""MixRegistry: ids never collide, the registry stays bounded, and held mixes are never evicted."""

from __future__ import annotations

import pytest

from vllm_lora_ext.errors import MixCapacityError
from vllm_lora_ext.mixing import MixComponent, MixSpec
from vllm_lora_ext.registry import MIX_ID_BASE, MIX_ID_BLOCK, MixRegistry


def _spec(i: int, w: float = 0.5) -> MixSpec:
    return MixSpec((MixComponent("a", "/a", w), MixComponent("b", f"/b{i}", 0.25)))


def test_a_million_canonical_mixes_get_a_million_distinct_ids_under_eviction() -> None:
    # 1,000,000 distinct canonical mixes through a registry bounded at 1,000: every id handed out is
    # unique (the id of an evicted mix is not reused until the whole block has been used once).
    reg = MixRegistry(capacity=1000)
    keys: set[str] = set()
    ids: set[int] = set()
    for i in range(1_000_000):
        spec = MixSpec((MixComponent("a", "/a", (i % 1000) / 1000), MixComponent("b", f"/b{i // 1000}", 0.5)))
        keys.add(spec.key)
        entry, _ = reg.register(spec)
        ids.add(entry.lora_int_id)
    assert len(keys) == 1_000_000 and len(ids) == 1_000_000
    assert min(ids) == MIX_ID_BASE and max(ids) < MIX_ID_BASE + MIX_ID_BLOCK
    assert len(reg) == 1000


def test_forced_collision_with_a_user_adapter_id_is_detected_and_skipped() -> None:
    reg = MixRegistry(capacity=8)
    user_ids = {MIX_ID_BASE, MIX_ID_BASE + 1}  # a user picked ids inside the mix range
    entry, _ = reg.register(_spec(0), taken=user_ids.__contains__)
    assert entry.lora_int_id == MIX_ID_BASE + 2


def test_wrapping_id_allocator_skips_every_live_id() -> None:
    reg = MixRegistry(capacity=3, span=4)
    live = [reg.register(_spec(i))[0] for i in range(3)]  # ids lo, lo+1, lo+2
    reg.remove(live[0].spec)
    e4, _ = reg.register(_spec(3))  # lo+3
    e5, _ = reg.register(_spec(4))  # wraps: lo is free again (its mix was removed), lo+1.. are live
    assert e4.lora_int_id == reg._lo + 3 and e5.lora_int_id == reg._lo
    assert len({e.lora_int_id for e in (live[1], live[2], e4, e5)}) == 4


def test_registry_is_bounded_and_evicts_least_recently_used() -> None:
    reg = MixRegistry(capacity=3)
    entries = [reg.register(_spec(i))[0] for i in range(3)]
    reg.get(entries[0].spec)  # touch: 1 is now the oldest
    new, evicted = reg.register(_spec(9))
    assert evicted == [entries[1]] and len(reg) == 3
    assert reg.by_id(entries[1].lora_int_id) is None and reg.by_id(new.lora_int_id) is new
    for i in range(10_000):
        reg.register(_spec(100 + i))
    assert len(reg) == 3  # memory stays flat under 10,000 distinct mixes


def test_held_mixes_are_never_evicted_and_a_full_registry_says_so() -> None:
    reg = MixRegistry(capacity=2)
    a, _ = reg.register(_spec(0))
    b, _ = reg.register(_spec(1))
    lease_a = reg.lease(a)  # a request being routed
    lease_b = reg.claim(b.lora_int_id)  # a generation
    with pytest.raises(MixCapacityError, match="All 2 mix slots are held by requests in flight"):
        reg.register(_spec(2))
    assert lease_b is not None and lease_b.held
    lease_b.release()
    lease_b.release()  # idempotent
    assert not lease_b.held and b.active == 0
    _, evicted = reg.register(_spec(2))
    assert evicted == [b]  # a is still held
    lease_a.release()  # nothing expires: a is free once its lease is released, and only then
    _, evicted = reg.register(_spec(3))
    assert evicted == [a] and reg.in_use() == 0


def test_claim_of_an_unknown_id_holds_nothing() -> None:
    reg = MixRegistry(capacity=2)
    assert reg.claim(12345) is None


def test_registries_of_different_api_servers_use_disjoint_ids() -> None:
    r0, r1 = MixRegistry(capacity=2, block=0), MixRegistry(capacity=2, block=1)
    assert r0.register(_spec(0))[0].lora_int_id != r1.register(_spec(0))[0].lora_int_id
    with pytest.raises(ValueError):
        MixRegistry(capacity=2, block=64)  # would pass 2**31
