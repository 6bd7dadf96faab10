"""The extended resources a GPU node advertises for HAMi's container limits (pure)."""

from __future__ import annotations

import dataclasses

from kubernetes.utils.quantity import parse_quantity
from kvgpu.allocator import Ledger
from kvgpu.core.inventory import Slicing
from kvgpu.reconcile.advertise import ADVERTISED, advertised, status_patch

from tests.unit.allocator_helpers import c, node, node_of, pod

GPUMEM, PCT, CORES, PRIO = ADVERTISED


def _usage(inv, *pods):
    led = Ledger()
    led.set_node(inv)
    for p in pods:
        led.bind(p, inv.node)
    return led, led.node_usage(inv.node)


def test_amounts_follow_the_pool_shape_of_usable_cards() -> None:
    sl = Slicing("p", split_count=4, memory_scaling=2.0, core_scaling=1.5)
    _, u = _usage(node_of("n", {"slicing": sl}, {"slicing": sl}, {"healthy": False, "slicing": sl},
                          {"slicing": None}))
    assert advertised(u) == {GPUMEM: "40000Mi", PCT: "200", CORES: "300", PRIO: "8"}


def test_a_larger_split_count_advertises_more_slots_and_the_same_memory() -> None:
    small = advertised(_usage(node("n", 2, slicing=Slicing("p", split_count=1)))[1])
    big = advertised(_usage(node("n", 2, slicing=Slicing("p", split_count=10)))[1])
    assert (small[PRIO], big[PRIO]) == ("2", "20")
    assert small[GPUMEM] == big[GPUMEM] == "20000Mi"


def test_a_card_gone_unusable_still_counts_what_it_holds() -> None:
    inv = node("n", 2)
    led, _ = _usage(inv, pod(c(cards=1, memory_mib=3000, cores=30), uid="a"))
    held = led.reservation(led.pod_keys("a")[0])
    [card] = {d.uuid for ca in held.containers for d in ca.devices}
    sick = dataclasses.replace(inv, cards=tuple(dataclasses.replace(x, healthy=x.uuid != card) for x in inv.cards))
    led.set_node(sick)
    got = advertised(led.node_usage("n"))
    assert got == {GPUMEM: "13000Mi", PCT: "200", CORES: "130", PRIO: "11"}


def test_requests_within_what_the_extender_sells_never_exceed_the_advertised_amounts() -> None:
    """The kubelet sums the pods' requests against the node's allocatable: what the extender
    placed must always pass, in MiB and in binary-quantity form."""
    inv = node("n", 2, slicing=Slicing("p", split_count=3))
    pods = [pod(c(cards=2, memory_mib=3300, cores=33), uid=f"u{i}", name=f"p{i}") for i in range(3)]
    _, u = _usage(inv, *pods)
    got = {k: parse_quantity(v) for k, v in advertised(u).items()}
    as_mib = sum(3300 for _ in pods)  # nvidia.com/gpumem: "3300" (units) per container
    as_bytes = sum(parse_quantity("3300Mi") for _ in pods)  # nvidia.com/gpumem: 3300Mi
    assert max(as_mib, as_bytes) <= got[GPUMEM]
    assert sum(33 for _ in pods) <= got[CORES] and sum(1 for _ in pods) <= got[PRIO]
    assert sum(100 for _ in pods) <= got[PCT] * 3 / 2  # gpumem-percentage 50 each per card: 150 <= 200


def test_status_patch_only_when_the_amounts_differ() -> None:
    want = {GPUMEM: "2048Mi", PCT: "200"}
    same = {"status": {"capacity": {GPUMEM: "2Gi", PCT: "200", "cpu": "4"},
                       "allocatable": {GPUMEM: "2Gi", PCT: "200"}}}
    assert status_patch(same, want) is None  # the API server writes 2048Mi as 2Gi
    reset = {"status": {"capacity": {GPUMEM: "0", PCT: "200"}, "allocatable": {GPUMEM: "0", PCT: "200"}}}
    assert status_patch(reset, want) == {"status": {"capacity": want, "allocatable": want}}
    assert status_patch({}, want) == {"status": {"capacity": want, "allocatable": want}}
    assert status_patch({"status": {"capacity": {GPUMEM: "junk"}}}, want) is not None
