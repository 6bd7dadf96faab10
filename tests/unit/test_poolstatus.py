"""VGPUPool status beyond counts (kvgpu.reconcile.poolstatus): a pool shrunk under live claims
(Overcommitted), conflicts naming the other pool and the nodes, the loser's Ready reason, the
note a pod's scheduling failure gets, the pool deleted in use."""

from __future__ import annotations

from typing import Any

from kvgpu.allocator.ledger import CardUsage, NodeUsage
from kvgpu.api.models import VGPUPool
from kvgpu.api.pools import pool_conditions
from kvgpu.core.inventory import Card
from kvgpu.reconcile import poolstatus

T0, T1 = "2026-12-01T06:00:00Z", "2026-12-01T07:00:00Z"


def card(i: int, *, pool: str = "p", slots: tuple[int, int] = (0, 10), mem: tuple[int, int] = (0, 10000),
         cores: tuple[int, int] = (0, 100), pods: int = 0) -> CardUsage:
    return CardUsage(uuid=f"GPU-{i}", index=i, model="NVIDIA H200", pool=pool, mode="hami-core", usable=True,
                     reason="", slots_used=slots[0], slots_total=slots[1], memory_used_mib=mem[0],
                     memory_total_mib=mem[1], cores_used=cores[0], cores_total=cores[1], pods=pods,
                     exclusive=False)


def node(name: str, *cards: CardUsage) -> NodeUsage:
    return NodeUsage(name, tuple(cards), 0, 0, 0, 0, 0, 0)


def pool(name: str, **spec: Any) -> VGPUPool:
    return VGPUPool.model_validate({"metadata": {"name": name}, "spec": spec})


def test_shrunk_pool_is_overcommitted_with_nodes_and_pods() -> None:
    usages = [node("n0", card(0, slots=(5, 2), pods=5), card(1, slots=(1, 2), pods=1)),
              node("n1", card(0, mem=(12000, 8000), pods=2)), node("n2", card(0, pool="other", slots=(3, 1)))]
    over = poolstatus.excess(usages)
    assert sorted(over) == ["other", "p"] and len(over["p"]) == 2
    conds = poolstatus.conditions("p", [], clash={}, over=over["p"], generation=3, now=T0)
    oc = conds[-1]
    assert (oc.type, oc.status.value, oc.reason) == ("Overcommitted", "True", "ShapeBelowUse")
    assert "2 card(s) on 2 node(s) (n0, n1)" in oc.message
    assert "n0 card 0 (slots 5/2)" in oc.message and "n1 card 0 (memory 12000/8000 MiB)" in oc.message
    assert "7 pod(s) keep running" in oc.message
    assert poolstatus.became_overcommitted([], conds) == oc
    assert poolstatus.became_overcommitted(conds, conds) is None  # told once
    fine = poolstatus.conditions("p", [], clash={}, over=[], generation=4, now=T1, previous=conds)
    assert (fine[-1].status.value, fine[-1].last_transition_time) == ("False", T1)


def test_conflict_names_the_other_pool_and_the_nodes() -> None:
    a, b = pool("a", nodeSelector={"matchLabels": {"x": "1"}}), pool("b", nodeSelector={"matchLabels": {"y": "1"}})
    cards = [Card(uuid="GPU-0", index=0, model="NVIDIA H200", memory_mib=10000, sm_count=132)]
    nodes = [("n0", {"x": "1", "y": "1"}, cards), ("n1", {"x": "1", "y": "1"}, cards), ("n2", {"x": "1"}, cards)]
    clash = poolstatus.conflict_nodes([a, b], nodes)
    assert clash == {"a": {"b": {"n0", "n1"}}, "b": {"a": {"n0", "n1"}}}
    # b lost every card it matches: Ready must say so, not "no card of any node matches"
    base = pool_conditions(cards=0, healthy_cards=0, conflicts_with=["a"], generation=1, now=T0)
    conds = {c.type: c for c in poolstatus.conditions("b", base, clash=clash["b"], over=[], generation=1, now=T0)}
    assert conds["Ready"].reason == "LostConflict" and "no card of any node matches" not in conds["Ready"].message
    assert "pool a" in conds["Ready"].message and "n0, n1" in conds["Ready"].message
    assert "a on n0, n1" in conds["Conflict"].message and "a takes them" in conds["Conflict"].message
    base_a = pool_conditions(cards=3, healthy_cards=3, conflicts_with=["b"], generation=1, now=T0)
    conds_a = {c.type: c for c in poolstatus.conditions("a", base_a, clash=clash["a"], over=[], generation=1,
                                                        now=T0)}
    assert conds_a["Ready"].reason == "CardsCovered" and "b on n0, n1" in conds_a["Conflict"].message
    note = poolstatus.conflict_note("n0", clash)
    assert "a, b conflict" in note and "a applies" in note
    assert poolstatus.conflict_note("n2", clash) == ""


def test_pool_deleted_in_use() -> None:
    usages = [node("n0", card(0, pods=2), card(1, pool="other", pods=1)), node("n1", card(0)),
              node("n2", card(0, pods=1))]
    pods, nodes = poolstatus.in_use("p", usages)
    assert (pods, nodes) == (3, ["n0", "n2"])
    msg = poolstatus.deleted_in_use_message("p", pods, nodes)
    assert "3 pod(s)" in msg and "n0, n2" in msg and "keep running" in msg
