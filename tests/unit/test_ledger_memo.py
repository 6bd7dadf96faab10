"""The filter memo's node-state classes (Ledger.filter): verdicts shared between nodes whose
cards are alike and equally used. Regressions from a review: the class table must stay
bounded when no new request shape arrives (it grows with usage changes), and a node whose
inventory repeats a UUID (malformed, not validated) must not share its verdict with a twin.
The general equivalence with the memo off is property-tested in test_allocator_props.py."""

from __future__ import annotations

import pytest
from kvgpu.allocator import Ledger
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from kvgpu.core.requests import ContainerRequest, PodRequest

SL = Slicing(pool="p", split_count=10, memory_scaling=1.0, core_scaling=1.0, mode="hami-core")


def _inv(name: str, uuids: list[str]) -> NodeInventory:
    return NodeInventory(name, tuple(Card(u, i, "NVIDIA H200", 8000, 100, 0, False, True, "", SL)
                                     for i, u in enumerate(uuids)), "sim")


def _pod(uid: str, *containers: ContainerRequest) -> PodRequest:
    return PodRequest("ns", uid, uid, containers, "binpack", "binpack")


def test_class_table_stays_bounded_with_a_fixed_set_of_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Ledger, "_CLASSES_MAX", 8)
    led = Ledger()
    led.set_node(_inv("n0", [f"GPU-{i}" for i in range(4)]))
    probe = _pod("probe", ContainerRequest("m", cards=1, memory_mib=100))
    led.filter(probe)  # the only shape ever filtered
    for i in range(40):  # binds (allocate+reserve, as the binder does) give the node new states
        led.bind(_pod(f"u{i}", ContainerRequest("m", cards=1, memory_mib=10 + i % 7)), "n0")
        if i % 3 == 0:
            led.release(f"u{i}")
        led.filter(probe)
    assert len(led._classes) <= Ledger._CLASSES_MAX, f"{len(led._classes)} classes kept"


def test_a_node_repeating_a_uuid_does_not_change_its_twins_verdict() -> None:
    pod = _pod("p", ContainerRequest("a", cards=1, memory_mib=6000, numa_bind=True),
               ContainerRequest("b", cards=1, memory_mib=6000, numa_bind=True))
    answers = []
    for cache in (True, False):
        led = Ledger(cache=cache)
        led.set_node(_inv("a-bad", ["GPU-DUP", "GPU-DUP"]))
        led.set_node(_inv("b-good", ["GPU-B0", "GPU-B1"]))
        answers.append(led.filter(pod)[0])
    assert answers[0] == answers[1], f"cache {answers[0]} vs no cache {answers[1]}"


def test_spread_one_pod_at_a_time_goes_to_a_new_node_each_time() -> None:
    """Picking by the unrounded rank: one small slice on an 8-card node (split 10) leaves its
    whole-percent score at 0, yet the next spread pod must go to an untouched node."""
    from kvgpu.extender.choice import best_node

    sl = Slicing(pool="p", split_count=10, memory_scaling=1.0, core_scaling=1.0, mode="hami-core")
    led = Ledger()
    names = [f"n{i}" for i in range(5)]
    for n in names:
        led.set_node(NodeInventory(n, tuple(Card(f"{n}-GPU-{i}", i, "NVIDIA H200", 143771, 132, 0, False, True, "",
                                                 sl) for i in range(8)), "sim"))
    placed = []
    for i in range(5):
        pod = PodRequest("ns", f"p{i}", f"p{i}", (ContainerRequest("m", cards=1, memory_mib=1000),), "spread", "spread")
        feasible, _ = led.filter(pod, names)
        assert set(led.score(pod, feasible).values()) == {100}, "the rounded score cannot tell them apart"
        node = best_node(led.rank(pod, feasible))
        led.bind(pod, node)
        placed.append(node)
    assert placed == names
