"""MIG instances as DRA partitionable devices (kvgpu.dra.mig, kvgpu.dra.slices) from a simulated H200
in MIG mode, and what a container given one gets."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvgpu.core.inventory import NodeInventory, Slicing, parse_simulated
from kvgpu.dra.mig import (
    MigCapsUnknown,
    dra_mig_cards,
    find_mig_device,
    mig_container_edits,
)
from kvgpu.dra.slices import DRIVER, resource_slices

DRA = Slicing(pool="p", split_count=4, allocation="dra")


def node(*cards: dict, name: str = "n1", slicing: Slicing | None = DRA) -> NodeInventory:
    (sim,) = parse_simulated({"nodes": [{"name": name, "cards": list(cards)}]})
    inv = sim.inventory()
    return inv.with_slicing({c.uuid: slicing for c in inv.cards})


SEVEN = {"model": "NVIDIA H200", "numa": 0, "migInstances": [{"profile": "1g.18gb", "count": 7}]}
MIXED = {"model": "NVIDIA H200", "migInstances": [{"profile": "3g.71gb"}, {"profile": "2g.35gb"},
                                                  {"profile": "1g.18gb", "count": 2}]}


def test_a_mig_card_is_a_counter_set_and_its_instances_consume_it() -> None:
    inv = node({"model": "NVIDIA H200"}, SEVEN)
    devices, counters = resource_slices(inv)
    assert devices["metadata"]["name"] == f"n1-{DRIVER}" and counters["metadata"]["name"] == f"n1-counters-{DRIVER}"
    for sl in (devices, counters):
        assert sl["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 2}
        assert sl["spec"]["nodeName"] == "n1" and sl["spec"]["driver"] == DRIVER
    assert "devices" not in counters["spec"] and "sharedCounters" not in devices["spec"]
    (cs,) = counters["spec"]["sharedCounters"]
    assert cs == {"name": "gpu-1-counters",
                  "counters": {"memory": {"value": "143771Mi"}, "multiprocessors": {"value": "132"}}}
    names = [d["name"] for d in devices["spec"]["devices"]]
    assert names == ["gpu-0"] + [f"gpu-1-mig-{gi}-0" for gi in range(1, 8)]
    mig = devices["spec"]["devices"][1]
    parent = inv.cards[1]
    attrs = {k: next(iter(v.values())) for k, v in mig["attributes"].items()}
    assert attrs == {"type": "mig", "profile": "1g.18gb", "uuid": parent.mig_instances[0].uuid,
                     "parentUUID": parent.uuid, "index": 1, "model": "NVIDIA H200", "smCount": 16, "numaNode": 0}
    assert mig["consumesCounters"] == [{"counterSet": "gpu-1-counters", "counters": {
        "memory": {"value": "16384Mi"}, "multiprocessors": {"value": "16"}}}]
    assert "allowMultipleAllocations" not in mig  # a MIG device is one whole device


def test_the_instances_never_consume_more_than_the_card() -> None:
    for layout in (SEVEN, MIXED, {"model": "NVIDIA H200", "migInstances": [{"profile": "7g.141gb"}]}):
        devices, counters = resource_slices(node(layout))
        (cs,) = counters["spec"]["sharedCounters"]
        for key in ("memory", "multiprocessors"):
            total = int(cs["counters"][key]["value"].removesuffix("Mi"))
            used = sum(int(d["consumesCounters"][0]["counters"][key]["value"].removesuffix("Mi"))
                       for d in devices["spec"]["devices"])
            assert used <= total, (layout, key)


def test_which_mig_cards_are_published() -> None:
    inv = node(SEVEN, SEVEN, SEVEN, {"model": "NVIDIA H200", "migMode": True})
    c = inv.cards
    ext = replace(DRA, allocation="extender")
    inv = replace(inv, cards=(c[0], replace(c[1], healthy=False), replace(c[2], slicing=ext), c[3]))
    assert [x.index for x in dra_mig_cards(inv)] == [0]  # unhealthy, extender pool, no instances: not
    assert resource_slices(node(SEVEN, slicing=replace(DRA, allocation="extender"))) == []


def test_many_mig_cards_split_into_slices_within_the_api_limits() -> None:
    inv = node(*([SEVEN] * 10))  # 70 MIG devices, 10 counter sets
    slices = resource_slices(inv)
    names = [s["metadata"]["name"] for s in slices]
    assert names == [f"n1-{DRIVER}", f"n1-1-{DRIVER}", f"n1-counters-{DRIVER}", f"n1-counters-1-{DRIVER}"]
    assert [len(s["spec"].get("devices", s["spec"].get("sharedCounters"))) for s in slices] == [64, 6, 8, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {4}


def test_container_edits_of_a_mig_device() -> None:
    inv = node({"model": "NVIDIA H200"}, MIXED)
    card, inst = find_mig_device(inv, "gpu-1-mig-2-0") or (None, None)
    assert card is not None and inst is not None and inst.profile == "2g.35gb"
    edits = mig_container_edits(card, inst)
    assert edits.device_nodes == ("/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{inst.gi_cap_minor}",
                                  f"/dev/nvidia-caps/nvidia-cap{inst.ci_cap_minor}")
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": inst.uuid}
    assert find_mig_device(inv, "gpu-1-mig-9-0") is None
    with pytest.raises(MigCapsUnknown, match="mig-minors"):
        mig_container_edits(card, replace(inst, gi_cap_minor=None))
