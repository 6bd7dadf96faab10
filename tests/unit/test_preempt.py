"""The victim choice of GPU preemption (kvgpu.allocator.preempt): pure, on ledger what-ifs."""

from __future__ import annotations

from allocator_helpers import c, node, pod
from kvgpu.allocator import Ledger
from kvgpu.allocator.preempt import HOLD_PREFIX, Budget, Holder, NoPlan, Plan, choose
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import PodAllocation


class World:
    """Nodes with pods bound through a real ledger, and each pod's priority."""

    def __init__(self, *invs: NodeInventory) -> None:
        self.led = Ledger()
        self.invs = {i.node: i for i in invs}
        for i in invs:
            self.led.set_node(i)
        self.holders: dict[str, Holder] = {}

    def put(self, name: str, node_name: str, priority: int, terminating: bool = False, **req: int) -> None:
        self.led.bind(pod(c(**req), uid=name, name=name), node_name)
        self.holders[name] = Holder(name, "ns", name, priority, terminating)

    def choose(self, priority: int, budgets: tuple[Budget, ...] = (), **kw: int) -> Plan | NoPlan:
        checks = kw.pop("max_checks", 400)
        return choose(pod(c(**kw), uid="hi", name="hi"), priority, self.invs,
                      self.led.reservations().values(), self.holders, budgets, max_checks=checks)


def victims(p: Plan | NoPlan) -> list[str]:
    assert isinstance(p, Plan), p
    return [v.name for v in p.victims]


def test_one_lower_pod_is_evicted_for_memory() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 0, memory_mib=4000)
    w.put("y", "a", 0, memory_mib=4000)
    p = w.choose(100, memory_mib=5000)
    assert victims(p) == ["x"] and p.node == "a"  # equal sets: by name
    assert isinstance(p, Plan) and p.allocation.node == "a" and p.allocation.pod_uid == "hi"


def test_fewest_victims_first_then_lowest_priority() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 0, memory_mib=2000)
    w.put("y", "a", 0, memory_mib=2000)
    w.put("z", "a", 5, memory_mib=4000)
    assert victims(w.choose(100, memory_mib=6000)) == ["z"]  # one pod, not the two cheaper ones
    w2 = World(node("a", 1))
    w2.put("x", "a", 3, memory_mib=4000)
    w2.put("z", "a", 1, memory_mib=4000)
    assert victims(w2.choose(100, memory_mib=6000)) == ["z"]  # same count: the lower priority


def test_only_strictly_lower_priority_is_evicted() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 10, memory_mib=6000)
    w.put("y", "a", 11, memory_mib=3000)
    p = w.choose(10, memory_mib=5000)
    assert isinstance(p, NoPlan) and not p.wait and "no pod of lower priority (< 10)" in p.reason


def test_no_eviction_when_evicting_every_lower_pod_is_not_enough() -> None:
    w = World(node("a", 1))
    w.put("big", "a", 1000, memory_mib=7000)
    w.put("x", "a", 0, memory_mib=2000)
    p = w.choose(100, memory_mib=5000)
    assert isinstance(p, NoPlan) and "would not fit even with all 1 pods of lower priority gone" in p.reason


def test_terminating_pods_count_as_gone() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 0, terminating=True, memory_mib=6000)
    w.put("y", "a", 0, memory_mib=3000)
    p = w.choose(100, memory_mib=5000)
    assert isinstance(p, NoPlan) and p.wait
    w2 = World(node("a", 1))
    w2.put("x", "a", 0, terminating=True, memory_mib=3000)
    w2.put("y", "a", 1, memory_mib=6000)
    w2.put("z", "a", 0, memory_mib=1000)
    assert victims(w2.choose(100, memory_mib=3500)) == ["z"]  # x is leaving anyway: not a victim


def test_pods_of_unknown_priority_and_holds_are_never_victims() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 0, memory_mib=6000)
    del w.holders["x"]  # not listed: priority unknown
    w.led.reserve("hold", PodAllocation(HOLD_PREFIX + "other", "a", w.led.allocate(
        pod(c(memory_mib=3000), uid="h"), "a").containers))
    w.holders[HOLD_PREFIX + "other"] = Holder(HOLD_PREFIX + "other", "ns", "other", -5)
    p = w.choose(100, memory_mib=5000)
    assert isinstance(p, NoPlan) and "no pod of lower priority" in p.reason


def test_budget_steers_to_another_set_or_blocks() -> None:
    w = World(node("a", 1))
    w.put("x", "a", 0, memory_mib=4000)
    w.put("y", "a", 0, memory_mib=2000)
    w.put("z", "a", 0, memory_mib=2000)
    free = (Budget("ns/pdb", frozenset({"x"}), 1),)
    assert victims(w.choose(100, free, memory_mib=5000)) == ["x"]
    shut = (Budget("ns/pdb", frozenset({"x"}), 0),)
    assert victims(w.choose(100, shut, memory_mib=5000)) == ["y", "z"]
    every = (Budget("ns/all", frozenset({"x", "y", "z"}), 0),)
    p = w.choose(100, every, memory_mib=5000)
    assert isinstance(p, NoPlan) and "PodDisruptionBudget (ns/all)" in p.reason
    one = (Budget("ns/all", frozenset({"x", "y", "z"}), 1),)  # y+z would take two
    assert victims(w.choose(100, one, memory_mib=5000)) == ["x"]


def test_node_with_fewer_victims_wins() -> None:
    w = World(node("a", 1), node("b", 1))
    w.put("a1", "a", 0, memory_mib=3000)
    w.put("a2", "a", 0, memory_mib=3000)
    w.put("a3", "a", 0, memory_mib=3000)
    w.put("b1", "b", 50, memory_mib=9000)
    p = w.choose(100, memory_mib=7000)
    assert isinstance(p, Plan) and p.node == "b" and victims(p) == ["b1"]
    p = w.choose(40, memory_mib=7000)  # b1 is not lower than 40: two on a
    assert isinstance(p, Plan) and p.node == "a" and victims(p) == ["a1", "a2"]


def test_exclusive_request_frees_the_card_with_fewest_pods() -> None:
    w = World(node("a", 2))
    w.put("x", "a", 0, memory_mib=1000)
    w.put("y", "a", 0, memory_mib=1000)  # spread: x and y on different cards
    w.put("z", "a", 0, memory_mib=1000)
    p = w.choose(100, cores=100)
    assert isinstance(p, Plan) and len(p.victims) == 1
    card = p.allocation.containers[0].devices[0].uuid
    held = {a.pod_uid for a in w.led.reservations().values() if a.containers[0].devices[0].uuid == card}
    assert {v.name for v in p.victims} == held


def test_greedy_beyond_the_check_budget_is_minimal() -> None:
    w = World(node("a", 1))
    for i in range(8):
        w.put(f"p{i}", "a", i, memory_mib=1200)
    p = w.choose(100, max_checks=3, memory_mib=3000)  # 400 MiB free: three of them must go
    assert victims(p) == ["p0", "p1", "p2"]  # the most important were put back first
    assert victims(w.choose(100, memory_mib=3000)) == ["p0", "p1", "p2"]  # the exact search agrees


def test_no_nodes() -> None:
    p = choose(pod(c(memory_mib=1)), 1, {}, [], {})
    assert isinstance(p, NoPlan) and p.reason == "no GPU node to consider"


def test_selector_matches_like_a_pdb() -> None:
    from kvgpu.allocator.preempt import selector_matches

    labels = {"app": "low", "tier": "batch"}
    assert not selector_matches(None, labels)
    assert selector_matches({}, labels)
    assert selector_matches({"matchLabels": {"app": "low"}}, labels)
    assert not selector_matches({"matchLabels": {"app": "high"}}, labels)
    assert selector_matches({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["batch"]}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["batch"]}]},
                                labels)
    assert selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]}, labels)
