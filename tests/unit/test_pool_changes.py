"""Pools that change under live claims (issue 16, item 3), without a cluster: a pool change
re-slices the cards for new placements and never touches the reservations (cards and limits of
running claims stay); a card left over the pool's new shape refuses new pods with a reason that
names the pool's overcommit; a pool valid for the CRD but refused by the model is recorded with
its reason (the status writer turns it into Ready=False, reason InvalidSpec)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from kvgpu.allocator import fit as F
from kvgpu.allocator.ledger import AllocationError, Ledger
from kvgpu.api.requests import parse_pod
from kvgpu.cli.vgpu import views
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.reconcile import poolstatus
from kvgpu.reconcile.state import OperatorState

from tests.unit.allocator_helpers import DEFAULT, c, node, pod


def _pool(name: str = "default", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": name, "generation": 2},
            "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true"}}, **spec}}


def _pod(name: str, ann: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "annotations": ann},
            "spec": {"containers": [{"name": "main", "image": "cuda"}]}}


def _state(**spec: Any) -> OperatorState:
    st = OperatorState()
    st.set_pool(_pool(**spec))
    st.set_node(node_manifest(SimulatedNode("n0", (SimulatedCardSpec(memory_mib=10000, count=1),))))
    return st


def _bind(st: OperatorState, name: str, ann: dict[str, str]) -> None:
    req = parse_pod(_pod(name, ann), st.default_pool_spec())
    assert req is not None
    st.reserve(name, st.ledger.allocate(req, "n0"))


def test_shrinking_a_pool_keeps_running_claims_and_names_the_overcommit() -> None:
    st = _state(splitCount=4)
    for i in range(3):
        _bind(st, f"p{i}", {"kvgpu.io/gpumem": "2000", "kvgpu.io/gpucores": "20"})
    before = st.ledger.reservations()
    assert st.set_pool(_pool(splitCount=2))
    # the reservations (what the claims record: cards, memory and cores limits) are untouched
    assert st.ledger.reservations() == before
    card = st.ledger.node_usage("n0").cards[0]
    assert (card.slots_used, card.slots_total, card.memory_used_mib, card.cores_used) == (3, 2, 6000, 60)
    assert poolstatus.excess(st.ledger.usage().values())["default"]
    # the pool status reads the over-full cards from those nodes alone: the same answer
    assert st.ledger.over_nodes() == ["n0"]
    assert poolstatus.excess(st.ledger.usage(st.ledger.over_nodes()).values()) == poolstatus.excess(
        st.ledger.usage().values())
    req = parse_pod(_pod("new", {"kvgpu.io/gpumem": "1000"}), st.default_pool_spec())
    assert req is not None
    feasible, reasons = st.ledger.filter(req)
    assert feasible == []
    assert "VGPUPool default" in reasons["n0"] and "Overcommitted" in reasons["n0"], reasons
    with pytest.raises(AllocationError, match="Overcommitted"):
        st.ledger.allocate(req, "n0")
    # one pod ends: still 2/2 -> full but no longer over: the reason is a plain "no free slot"
    st.release_key("p0")
    _, reasons = st.ledger.filter(req)
    assert "Overcommitted" not in reasons["n0"] and "free slot" in reasons["n0"], reasons
    assert st.ledger.over_nodes() == [] and poolstatus.excess(st.ledger.usage().values()) == {}
    st.release_key("p1")
    assert st.ledger.filter(req)[0] == ["n0"]


@pytest.mark.parametrize("change", [{"memoryScaling": 0.5}, {"coreScaling": 0.5}])
def test_lowered_scaling_refuses_with_the_overcommit_on_every_path(change: dict[str, Any]) -> None:
    st = _state(splitCount=10)
    for i in range(2):
        _bind(st, f"p{i}", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "40"})
    before = st.ledger.reservations()
    st.set_pool(_pool(splitCount=10, **change))
    assert st.ledger.reservations() == before
    for ann in ({"kvgpu.io/gpumem": "10"}, {"kvgpu.io/gpumem": "300", "kvgpu.io/gpucores": "1"},
                {"kvgpu.io/gpumem-percentage": "1"}):
        req = parse_pod(_pod("new", ann), st.default_pool_spec())
        assert req is not None
        _, reasons = st.ledger.filter(req)
        assert "over the current shape of VGPUPool default (Overcommitted" in reasons["n0"], (ann, reasons)


def test_fit_names_an_over_card_before_any_other_rule() -> None:
    led = Ledger()
    led.set_node(node("n0", 2))
    led.reserve("a", led.allocate(pod(c(memory_mib=6000), uid="a"), "n0"))
    led.set_node(node("n0", 2, slicing=replace(DEFAULT, memory_scaling=0.5)))
    over = next(x for x in led._nodes["n0"].cards if x.pods)
    assert over.over()
    assert F.fit(over, F.need(c(memory_mib=1)), None) == F.OVERCOMMITTED
    free = next(x for x in led._nodes["n0"].cards if not x.pods)
    _, reasons = led.filter(pod(c(memory_mib=1, exclude_uuids=(free.uuid,)), uid="b"))
    assert "1 an excluded UUID, 1 over its VGPUPool's current shape" in reasons["n0"], reasons
    assert reasons["n0"].endswith("1 card over the current shape of VGPUPool default "
                                  "(Overcommitted: no new slices there until enough pods end)")
    # the prefilter's aggregate reason never shows a negative free amount
    led.set_node(node("n0", 1, slicing=replace(DEFAULT, memory_scaling=0.5)))
    _, reasons = led.filter(pod(c(memory_mib=1), uid="b"))
    assert "-" not in reasons["n0"].split(";")[0], reasons


def test_selector_change_uncovers_cards_but_keeps_claims() -> None:
    st = _state(splitCount=4)
    _bind(st, "p0", {"kvgpu.io/gpumem": "2000"})
    before = st.ledger.reservations()
    st.set_pool(_pool(splitCount=4, nodeSelector={"matchLabels": {"elsewhere": "yes"}}))
    assert st.ledger.reservations() == before
    req = parse_pod(_pod("new", {"kvgpu.io/gpumem": "1000"}), st.default_pool_spec())
    assert req is not None
    _, reasons = st.ledger.filter(req)
    assert "not covered by a VGPUPool" in reasons["n0"]
    assert any("has slices but is not covered" in p for p in st.ledger.problems())


def test_invalid_pool_is_recorded_with_its_reason_and_slices_nothing() -> None:
    st = _state(splitCount=4)
    _bind(st, "p0", {"kvgpu.io/gpumem": "2000"})
    before = st.ledger.reservations()
    with pytest.raises(ValueError, match="minSliceMemory"):
        st.set_pool(_pool(splitCount=4, defaults={"gpumem": 100}))
    meta, why = st.invalid_pools["default"]
    assert meta["generation"] == 2
    assert why.startswith("spec: defaults.gpumem 100 MiB is below minSliceMemory 256 MiB"), why
    assert "default" not in st.pools and st.ledger.reservations() == before
    assert st.ledger.node_usage("n0").cards[0].usable is False  # covered by no valid pool now
    conds = poolstatus.invalid_conditions(why, generation=2, now="2026-12-01T00:00:00Z")
    assert [(x.type, x.status.value, x.reason) for x in conds] == [("Ready", "False", "InvalidSpec")]
    assert why in conds[0].message and "keep them" in conds[0].message
    # fixed: valid again, the record goes
    st.set_pool(_pool(splitCount=4, defaults={"gpumem": 300}))
    assert "default" in st.pools and not st.invalid_pools
    # the same at start-up
    st.rebuild([node_manifest(SimulatedNode("n0", (SimulatedCardSpec(memory_mib=10000, count=1),)))],
               [_pool(splitCount=4, defaults={"gpumem": 100})], [])
    assert "default" in st.invalid_pools and not st.pools


def test_nodes_view_marks_overcommitted_and_oversubscribed_cards() -> None:
    assert views.card_state((5, 2), (1000, 10000), (0, 100), 10000) == "Overcommitted (slots 5/2)"
    assert views.card_state((2, 10), (12000, 15000), (0, 100), 10000) == \
        "Oversubscribed (12000/10000 MiB physical)"
    assert views.card_state((2, 10), (9000, 15000), (0, 100), 10000) == ""
    assert views.card_state((None, 4), (None, 15000), (None, 100), None) == ""
