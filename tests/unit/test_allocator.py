"""Example tests for the allocator: one or more per fit rule, policy and API promise."""

from __future__ import annotations

import pytest
from allocator_helpers import c, node, node_of, pod, uuid
from kvgpu.allocator import AllocationError, Ledger, explain, footprint
from kvgpu.core.inventory import Slicing
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation, Policy


def ledger(*invs) -> Ledger:
    led = Ledger()
    for inv in invs:
        led.set_node(inv)
    return led


def cards_of(alloc: PodAllocation, container: str = "main") -> list[int]:
    return [d.index for ca in alloc.containers if ca.container == container for d in ca.devices]


# ---------------------------------------------------------------- capacity and scaling


def test_capacity_follows_slicing_with_scaling() -> None:
    sl = Slicing("p", split_count=4, memory_scaling=1.5, core_scaling=2.0)
    led = ledger(node("a", 1, memory_mib=10000, slicing=sl))
    u = led.node_usage("a").cards[0]
    assert (u.slots_total, u.memory_total_mib, u.cores_total) == (4, 15000, 200)
    # Oversubscribed memory (15000 virtual MiB on a 10000 MiB card) and cores (200 %).
    led.bind(pod(c(memory_mib=9000, cores=80), uid="x"), "a")
    led.bind(pod(c(memory_mib=6000, cores=80), uid="y"), "a")
    u = led.node_usage("a").cards[0]
    assert (u.slots_used, u.memory_used_mib, u.cores_used, u.exclusive) == (2, 15000, 160, False)
    # cores 100 stays exclusive whatever coreScaling is.
    led2 = ledger(node("a", 1, slicing=sl))
    led2.bind(pod(c(memory_mib=100, cores=100), uid="x"), "a")
    assert led2.node_usage("a").cards[0].exclusive
    assert led2.filter(pod(c(memory_mib=100, cores=10), uid="y"))[0] == []


def test_memory_absolute_and_free_memory_reason() -> None:
    led = ledger(node("a", 2, memory_mib=4096))
    led.bind(pod(c(memory_mib=2048), uid="1"), "a")
    led.bind(pod(c(memory_mib=2048), uid="2"), "a")
    feasible, reasons = led.filter(pod(c(memory_mib=3000), uid="3"))
    assert feasible == []
    assert reasons["a"] == "2 cards, most free memory 2048 MiB < 3000 MiB"
    assert led.filter(pod(c(memory_mib=2048), uid="3"))[0] == ["a"]


def test_memory_percent_is_share_of_virtual_memory() -> None:
    led = ledger(node("a", 1, memory_mib=10000, slicing=Slicing("p", memory_scaling=2.0)))
    alloc = led.bind(pod(c(memory_percent=25), uid="1"), "a")
    assert alloc.containers[0].devices[0].memory_mib == 5000
    led.bind(pod(c(memory_percent=50), uid="2"), "a")
    assert led.filter(pod(c(memory_percent=26), uid="3"))[0] == []
    assert led.filter(pod(c(memory_percent=25), uid="3"))[0] == ["a"]


def test_zero_memory_means_whole_card() -> None:
    led = ledger(node("a", 2, memory_mib=8000))
    alloc = led.bind(pod(c(), uid="1"), "a")
    assert alloc.containers[0].devices[0].memory_mib == 8000
    led.bind(pod(c(memory_mib=1), uid="2"), "a")  # lands on the other card
    feasible, reasons = led.filter(pod(c(), uid="3"))
    assert feasible == []
    assert "whole-card" in reasons["a"]


def test_free_slots() -> None:
    led = ledger(node("a", 1, slicing=Slicing("p", split_count=2)))
    led.bind(pod(c(memory_mib=100), uid="1"), "a")
    led.bind(pod(c(memory_mib=100), uid="2"), "a")
    feasible, reasons = led.filter(pod(c(memory_mib=100), uid="3"))
    assert feasible == [] and "free slot" in reasons["a"]


def test_cores_and_compute_full() -> None:
    led = ledger(node("a", 1))
    led.bind(pod(c(memory_mib=100, cores=60), uid="1"), "a")
    assert led.filter(pod(c(memory_mib=100, cores=50), uid="2"))[0] == []
    led.bind(pod(c(memory_mib=100, cores=40), uid="2"), "a")
    # All cores taken: a request without a core limit may not join.
    feasible, reasons = led.filter(pod(c(memory_mib=100, cores=0), uid="3"))
    assert feasible == []
    assert "cores" in reasons["a"]


def test_exclusive_card_rules() -> None:
    led = ledger(node("a", 2))
    led.bind(pod(c(memory_mib=100, cores=100), uid="1"), "a")
    led.bind(pod(c(memory_mib=100), uid="2"), "a")  # must go to the other card
    usage = led.node_usage("a")
    assert [cu.pods for cu in usage.cards] == [1, 1]
    assert [cu.exclusive for cu in usage.cards] == [True, False]
    # No exclusive request fits: one card held exclusively, the other has a slice.
    feasible, reasons = led.filter(pod(c(memory_mib=100, cores=100), uid="3"))
    assert feasible == [] and "exclusive" in reasons["a"]
    # Nor does a small slice (card 0 exclusive, card 1 fine) -> it does fit on card 1.
    alloc = led.allocate(pod(c(memory_mib=100), uid="4"), "a")
    assert cards_of(alloc) == [1]


def test_exclusive_mode_pool_one_slice_per_card() -> None:
    led = ledger(node("a", 1, memory_mib=8000, slicing=Slicing("x", split_count=10, mode="exclusive")))
    alloc = led.bind(pod(c(memory_mib=1000, cores=10), uid="1"), "a")
    d = alloc.containers[0].devices[0]
    assert (d.memory_mib, d.cores) == (8000, 100)
    assert led.node_usage("a").cards[0].slots_total == 1
    assert led.filter(pod(c(memory_mib=1), uid="2"))[0] == []


def test_type_include_exclude_case_insensitive_substring() -> None:
    led = ledger(node_of("a", {"model": "NVIDIA A100-SXM4-40GB"}, {"model": "NVIDIA H200"}))
    a = led.allocate(pod(c(memory_mib=100, types=("a100",))), "a")
    assert cards_of(a) == [0]
    a = led.allocate(pod(c(memory_mib=100, exclude_types=("A100",))), "a")
    assert cards_of(a) == [1]
    feasible, reasons = led.filter(pod(c(memory_mib=100, types=("l4",))))
    assert feasible == [] and "type" in reasons["a"]
    feasible, reasons = led.filter(pod(c(memory_mib=100, exclude_types=("nvidia",))))
    assert feasible == [] and "excluded type" in reasons["a"]


def test_uuid_include_exclude() -> None:
    led = ledger(node("a", 3))
    a = led.allocate(pod(c(memory_mib=100, uuids=(uuid("a", 2),))), "a")
    assert cards_of(a) == [2]
    a = led.allocate(pod(c(cards=2, memory_mib=100, exclude_uuids=(uuid("a", 0),))), "a")
    assert sorted(cards_of(a)) == [1, 2]
    feasible, reasons = led.filter(pod(c(cards=2, memory_mib=100, uuids=(uuid("a", 0),))))
    assert feasible == [] and "not a requested UUID" in reasons["a"]


def test_numa_bind_keeps_cards_on_one_numa_node() -> None:
    inv = node_of("a", {"numa": 0}, {"numa": 0}, {"numa": 1}, {"numa": 1})
    led = ledger(inv)
    led.bind(pod(c(memory_mib=9000), uid="1", gpu_policy=Policy.BINPACK), "a")  # card 0
    a = led.allocate(pod(c(cards=2, memory_mib=5000, numa_bind=True)), "a")
    assert sorted(cards_of(a)) == [2, 3]
    led.bind(pod(c(memory_mib=9000, uuids=(uuid("a", 2),)), uid="2"), "a")
    # Cards 1 and 3 fit, but on different NUMA nodes.
    feasible, reasons = led.filter(pod(c(cards=2, memory_mib=5000, numa_bind=True)))
    assert feasible == []
    assert "at most 1 on one NUMA node" in reasons["a"]
    # Without numa_bind it fits.
    assert led.filter(pod(c(cards=2, memory_mib=5000)))[0] == ["a"]


def test_unusable_cards_are_never_used() -> None:
    inv = node_of(
        "a",
        {"healthy": False},
        {"slicing": None},
        {"mig": True},
        {"slicing": Slicing("p", mode="mig")},
        {},
    )
    led = ledger(inv)
    a = led.allocate(pod(c(memory_mib=100)), "a")
    assert cards_of(a) == [4]
    feasible, reasons = led.filter(pod(c(cards=2, memory_mib=100)))
    assert feasible == [] and reasons["a"] == (
        "1 card usable < 2 requested (1 unhealthy, 1 not covered by a VGPUPool, 1 in MIG mode, "
        "1 in a pool mode not supported yet)")
    led2 = ledger(node_of("b", {"healthy": False}, {"slicing": None}))
    feasible, reasons = led2.filter(pod(c(memory_mib=100)))
    assert reasons["b"] == "no usable card (1 unhealthy, 1 not covered by a VGPUPool)"
    assert [cu.usable for cu in led.node_usage("a").cards] == [False, False, False, False, True]


def test_several_cards_per_container_are_distinct() -> None:
    led = ledger(node("a", 3))
    a = led.allocate(pod(c(cards=3, memory_mib=100)), "a")
    assert sorted(cards_of(a)) == [0, 1, 2]
    assert led.filter(pod(c(cards=4, memory_mib=100)))[0] == []


def test_several_containers_may_share_a_card_each_taking_a_slot() -> None:
    led = ledger(node("a", 1, slicing=Slicing("p", split_count=3)))
    p = pod(c("a", memory_mib=3000), c("b", memory_mib=3000), c("x", memory_mib=3000))
    alloc = led.bind(p, "a")
    assert [len(ca.devices) for ca in alloc.containers] == [1, 1, 1]
    u = led.node_usage("a").cards[0]
    assert (u.slots_used, u.memory_used_mib, u.pods) == (3, 9000, 1)
    # Four containers need 4 slots: reason names the container.
    led2 = ledger(node("a", 1, slicing=Slicing("p", split_count=3)))
    p4 = pod(*(c(str(i), memory_mib=10) for i in range(4)))
    feasible, reasons = led2.filter(p4)
    assert feasible == [] and reasons["a"].startswith("container '3':")


def test_exclusive_container_does_not_share_with_its_own_pod() -> None:
    led = ledger(node("a", 1))
    feasible, _ = led.filter(pod(c("a", memory_mib=10, cores=100), c("b", memory_mib=10)))
    assert feasible == []


# ---------------------------------------------------------------- init containers


def test_init_container_footprint_is_max_of_init_and_sum_of_apps() -> None:
    led = ledger(node("a", 1, memory_mib=10000))
    p = pod(
        c("init", memory_mib=8000, cores=20, init=True),
        c("app1", memory_mib=3000, cores=30),
        c("app2", memory_mib=3000, cores=30),
    )
    alloc = led.bind(p, "a")
    u = led.node_usage("a").cards[0]
    # memory max(8000, 6000), cores max(20, 60), slots max(1, 2)
    assert (u.slots_used, u.memory_used_mib, u.cores_used) == (2, 8000, 60)
    assert [ca.init for ca in alloc.containers] == [True, False, False]
    led.release(p.uid)
    assert led.node_usage("a").cards[0].memory_used_mib == 0


def test_init_container_prefers_a_card_the_apps_already_cover() -> None:
    led = ledger(node("a", 3, memory_mib=10000))
    p = pod(
        c("init", memory_mib=2000, init=True),
        c("app", memory_mib=6000),
        gpu_policy=Policy.SPREAD,
    )
    alloc = led.bind(p, "a")
    assert cards_of(alloc, "init") == cards_of(alloc, "app")
    assert sum(cu.pods for cu in led.node_usage("a").cards) == 1


def test_init_container_larger_than_apps_needs_room_of_its_own() -> None:
    led = ledger(node("a", 1, memory_mib=10000))
    led.bind(pod(c(memory_mib=5000), uid="other"), "a")
    p = pod(c("init", memory_mib=6000, init=True), c("app", memory_mib=1000), uid="u2")
    feasible, reasons = led.filter(p)
    assert feasible == [] and reasons["a"].startswith("container 'init':")
    smaller = pod(c("init", memory_mib=5000, init=True), c("app", memory_mib=1000), uid="u2")
    assert led.filter(smaller)[0] == ["a"]


def test_init_only_pod() -> None:
    led = ledger(node("a", 1))
    alloc = led.bind(pod(c("setup", memory_mib=4000, init=True)), "a")
    assert alloc.containers[0].init
    assert led.node_usage("a").cards[0].slots_used == 1


def test_footprint_collapses_across_keys_of_one_pod() -> None:
    led = ledger(node("a", 1, memory_mib=10000))
    g = uuid("a", 0)
    init = ContainerAllocation("init", (DeviceGrant(g, 0, "NVIDIA H200", 8000, 0),), init=True)
    app = ContainerAllocation("app", (DeviceGrant(g, 0, "NVIDIA H200", 3000, 0),))
    led.reserve("ns/p-init", PodAllocation("u", "a", (init,)))
    led.reserve("ns/p-app", PodAllocation("u", "a", (app,)))
    assert led.node_usage("a").cards[0].memory_used_mib == 8000
    assert footprint([init, app]) == {g: (1, 8000, 0, 0)}
    assert led.release("ns/p-init") == ["ns/p-init"]
    assert led.node_usage("a").cards[0].memory_used_mib == 3000


# ---------------------------------------------------------------- policies


def test_gpu_policy_binpack_and_spread_choose_cards() -> None:
    led = ledger(node("a", 3, memory_mib=10000))
    led.bind(pod(c(memory_mib=4000, uuids=(uuid("a", 1),)), uid="x"), "a")
    bp = led.allocate(pod(c(memory_mib=1000), gpu_policy=Policy.BINPACK), "a")
    sp = led.allocate(pod(c(memory_mib=1000), gpu_policy=Policy.SPREAD), "a")
    assert cards_of(bp) == [1]  # the fullest card
    assert cards_of(sp) == [0]  # an empty card, lowest index first


def test_gpu_policy_accepts_plain_strings() -> None:
    led = ledger(node("a", 2))
    led.bind(pod(c(memory_mib=4000, uuids=(uuid("a", 1),)), uid="x"), "a")
    p = pod(c(memory_mib=1000), gpu_policy="binpack", node_policy="spread")  # type: ignore[arg-type]
    assert cards_of(led.allocate(p, "a")) == [1]


def test_node_policy_binpack_and_spread_score() -> None:
    led = ledger(node("a", 1), node("b", 1))
    led.bind(pod(c(memory_mib=5000, cores=50), uid="x"), "a")
    bp = led.score(pod(c(memory_mib=100), node_policy=Policy.BINPACK), ["a", "b", "zz"])
    sp = led.score(pod(c(memory_mib=100), node_policy=Policy.SPREAD), ["a", "b"])
    assert bp["a"] > bp["b"] and sp["a"] < sp["b"]
    assert bp["zz"] == 0
    assert all(0 <= v <= 100 for v in [*bp.values(), *sp.values()])
    assert bp["b"] == 0 and sp["b"] == 100


# ---------------------------------------------------------------- filter / allocate / bind


def test_filter_returns_every_feasible_node_and_reasons_for_the_rest() -> None:
    led = ledger(node("a", 1, memory_mib=4000), node("b", 1, memory_mib=8000), node("c", 1, memory_mib=8000))
    feasible, reasons = led.filter(pod(c(memory_mib=5000)), ["c", "a", "b", "ghost"])
    assert feasible == ["c", "b"]  # input order
    assert set(reasons) == {"a", "ghost"}
    assert "no kvgpu inventory" in reasons["ghost"]
    assert explain(reasons, limit=1).startswith("a: 1 card, most free memory 4000 MiB < 5000 MiB")
    assert explain(reasons, limit=1).endswith("; and 1 more node")


def test_allocate_raises_when_it_no_longer_fits() -> None:
    led = ledger(node("a", 1, memory_mib=4000))
    with pytest.raises(AllocationError, match="most free memory"):
        led.allocate(pod(c(memory_mib=5000)), "a")
    with pytest.raises(AllocationError, match="no kvgpu inventory"):
        led.allocate(pod(c(memory_mib=5000)), "nope")


def test_invalid_requests_raise_value_error() -> None:
    led = ledger(node("a"))
    for bad in (c(cards=0), c(memory_percent=0), c(cores=101), c(memory_mib=-1)):
        with pytest.raises(ValueError):
            led.filter(pod(bad))
    with pytest.raises(ValueError):
        led.filter(pod())
    with pytest.raises(ValueError):
        led.filter(pod(c("x"), c("x")))
    with pytest.raises(ValueError):
        led.filter(pod(c(), gpu_policy="pack"))  # type: ignore[arg-type]


def test_bind_is_idempotent_and_keys_conflict() -> None:
    led = ledger(node("a", 2), node("b", 2))
    p = pod(c(memory_mib=1000))
    a1 = led.bind(p, "a")
    snap = led.snapshot()
    assert led.bind(p, "a") == a1
    assert led.snapshot() == snap
    with pytest.raises(AllocationError, match="held by pod"):
        led.bind(p, "b")


def test_reserve_same_key_same_allocation_is_noop_different_is_error() -> None:
    led = ledger(node("a", 2))
    a = led.allocate(pod(c(memory_mib=1000)), "a")
    led.reserve("k", a)
    snap = led.snapshot()
    led.reserve("k", a)
    assert led.snapshot() == snap
    other = led.allocate(pod(c(memory_mib=2000), uid="u2"), "a")
    with pytest.raises(AllocationError, match="different allocation"):
        led.reserve("k", other)
    with pytest.raises(AllocationError, match="reserved on a"):
        led.reserve("k2", PodAllocation(a.pod_uid, "b", a.containers))


def test_reserve_checks_capacity_and_leaves_ledger_unchanged() -> None:
    led = ledger(node("a", 1, memory_mib=4000))
    a = led.allocate(pod(c(memory_mib=3000)), "a")
    b = led.allocate(pod(c(memory_mib=3000), uid="u2"), "a")
    led.reserve("a", a)
    snap = led.snapshot()
    with pytest.raises(AllocationError, match="memory 6000 MiB > 4000 MiB"):
        led.reserve("b", b)
    assert led.snapshot() == snap


def test_release_is_idempotent_and_restores_exactly() -> None:
    led = ledger(node("a", 2))
    before = led.snapshot()
    p = pod(c(cards=2, memory_mib=1000, cores=30), uid="u")
    led.bind(p, "a", key="ns/claim")
    assert led.release("u") == ["ns/claim"]
    assert led.release("u") == []
    assert led.release("ns/claim") == []
    assert led.snapshot() == before


def test_rebuild_equals_live_and_forced_overcommit_is_reported() -> None:
    invs = [node("a", 2), node("b", 1)]
    led = ledger(*invs)
    for i in range(5):
        led.bind(pod(c(memory_mib=1500, cores=10), uid=f"u{i}"), "a" if i % 2 else "b")
    again = Ledger.rebuild(invs, led.reservations())
    assert again.snapshot() == led.snapshot()
    assert again.problems() == []
    # Claims say more than the (shrunk) inventory holds: recorded anyway, reported.
    small = [node("a", 2), node("b", 1, slicing=Slicing("default", split_count=2))]
    shrunk = Ledger.rebuild(small, led.reservations())
    assert any("slots 3/2" in p for p in shrunk.problems())


def test_set_node_reapplies_and_remove_node_keeps_reservations() -> None:
    led = ledger(node("a", 2))
    led.bind(pod(c(memory_mib=1000)), "a")
    led.remove_node("a")
    assert led.nodes() == [] and len(led.reservations()) == 1
    assert any("unknown node a" in p for p in led.problems())
    led.set_node(node("a", 2))
    assert led.node_usage("a").memory_used_mib == 1000
    led.set_node(node("a", 0))  # the card went away
    assert any("does not have" in p for p in led.problems())


def test_usage_summaries_and_pool_usage() -> None:
    led = ledger(
        node("a", 2, slicing=Slicing("p1", split_count=4)),
        node_of("b", {"slicing": Slicing("p2")}, {"slicing": None}),
    )
    led.bind(pod(c(memory_mib=1000, cores=25)), "a")
    u = led.node_usage("a")
    assert (u.slots_used, u.slots_total, u.memory_used_mib, u.memory_total_mib) == (1, 8, 1000, 20000)
    assert (u.cores_used, u.cores_total) == (25, 200)
    js = u.to_json()
    assert js["slots"] == [1, 8] and js["cards"][0]["memoryMiB"][1] == 10000
    pools = led.pool_usage()
    assert list(pools) == ["p1", "p2"]
    assert (pools["p1"].nodes, pools["p1"].cards, pools["p1"].slots_used) == (1, 2, 1)
    assert (pools["p2"].cards, pools["p2"].slots_total) == (1, 10)
    assert list(led.usage()) == ["a", "b"]
    assert led.node_usage("b").cards[1].reason == "not covered by a VGPUPool"


def test_rebuild_leaves_out_contradictory_claims_and_says_so() -> None:
    led = ledger(node("a", 2), node("b", 2))
    a = led.allocate(pod(c(memory_mib=1000)), "a")
    b = led.allocate(pod(c(memory_mib=1000)), "b")  # same pod UID, other node
    again = Ledger.rebuild([node("a", 2), node("b", 2)], {"k1": a, "k2": b})
    assert again.reservations() == {"k1": a}
    assert any("'k2' left out" in p for p in again.problems())


def test_set_node_with_equal_inventory_changes_nothing() -> None:
    led = ledger(node("a", 2))
    led.bind(pod(c(memory_mib=1000)), "a")
    snap = led.snapshot()
    led.set_node(node("a", 2))
    assert led.snapshot() == snap


def test_pod_keys_and_pod_node() -> None:
    led = ledger(node("a", 2))
    p = pod(c("x", memory_mib=100), c("y", memory_mib=100), uid="u")
    alloc = led.allocate(p, "a")
    for ca in alloc.containers:
        led.reserve(f"ns/p-{ca.container}", PodAllocation("u", "a", (ca,)))
    assert led.pod_keys("u") == ["ns/p-x", "ns/p-y"] and led.pod_node("u") == "a"
    led.release("ns/p-x")
    assert led.pod_keys("u") == ["ns/p-y"]
    led.release("ns/p-y")
    assert led.pod_keys("u") == [] and led.pod_node("u") is None
