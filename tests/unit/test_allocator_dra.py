"""Cards of ``allocation: dra`` pools in the ledger: the extender never places a slice on them
(kube-scheduler allocates them through ResourceClaims), but the slices mirrored from
ResourceClaims are accounted on them and counted in the pool's usage."""

from __future__ import annotations

import pytest
from kvgpu.allocator.ledger import AllocationError, Ledger
from kvgpu.core.inventory import Slicing
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation
from kvgpu.reconcile.advertise import advertised

from .allocator_helpers import c, node, node_of, pod, uuid

DRA = Slicing("gpus-dra", split_count=4, allocation="dra")
EXT = Slicing("gpus-ext", split_count=4)


def test_dra_node_refused_with_a_reason_naming_dra_pools() -> None:
    led = Ledger()
    led.set_node(node("d", 2, slicing=DRA))
    led.set_node(node("e", 1, slicing=EXT))
    feasible, reasons = led.filter(pod(c(memory_mib=3000)))
    assert feasible == ["e"]
    assert reasons["d"] == "no usable card (2 cards in DRA pools (kube-scheduler allocates them))"
    with pytest.raises(AllocationError, match="DRA pool"):
        led.allocate(pod(c(memory_mib=3000)), "d")


def test_mixed_node_places_extender_slices_on_extender_cards_only() -> None:
    led = Ledger()
    led.set_node(node_of("m", {"slicing": DRA}, {"slicing": EXT}, {"slicing": DRA}))
    got = led.bind(pod(c(memory_mib=3000, cards=1)), "m")
    assert [g.uuid for g in got.containers[0].devices] == [uuid("m", 1)]
    _, reasons = led.filter(pod(c(memory_mib=3000, cards=2), uid="u2"))
    assert "2 cards in DRA pools" in reasons["m"], reasons


def _mirror(card_index: int, mib: int, cores: int, uid: str = "resourceclaim:rc1") -> PodAllocation:
    dev = DeviceGrant(uuid("d", card_index), card_index, "NVIDIA H200", mib, cores)
    return PodAllocation(uid, "d", (ContainerAllocation("main", (dev,)),))


def test_mirrored_slices_count_on_dra_cards_and_in_pool_usage() -> None:
    led = Ledger()
    led.set_node(node("d", 2, slicing=DRA))
    led.reserve("ns/dra-a", _mirror(0, 3000, 30), force=True)
    led.reserve("ns/dra-b", _mirror(0, 3000, 30, uid="resourceclaim:rc2"), force=True)
    use = led.node_usage("d")
    assert (use.cards[0].memory_used_mib, use.cards[0].cores_used, use.cards[0].slots_used) == (6000, 60, 2)
    assert use.cards[0].dra and not use.cards[0].usable
    pu = led.pool_usage()["gpus-dra"]
    assert (pu.cards, pu.slots_used, pu.slots_total, pu.memory_used_mib, pu.memory_total_mib) == (2, 2, 8, 6000, 20000)
    assert led.problems() == []
    # not advertised as HAMi's extender resources: those are for the extender's cards
    assert advertised(use)["nvidia.com/gpumem"] == "0Mi"
    led.release("ns/dra-a")
    assert led.node_usage("d").cards[0].memory_used_mib == 3000
