"""The node's cards as DRA ResourceSlices (kvgpu.dra.slices): which cards, capacities, policies."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from kvgpu.dra.slices import DRIVER, DevicePolicy, card_device, device_classes, resource_slices


def card(i: int, *, mode: str = "hami-core", allocation: str = "dra", mem: int = 143771, **kw: object) -> Card:
    sl = Slicing(pool="p", split_count=4, memory_scaling=kw.pop("ms", 1.0), core_scaling=kw.pop("cs", 1.0),  # type: ignore[arg-type]
                 mode=mode, allocation=allocation)
    return Card(uuid=f"GPU-{i}", index=i, model="NVIDIA H200", memory_mib=mem, sm_count=132, numa=1,
                slicing=sl, **kw)  # type: ignore[arg-type]


def test_only_healthy_non_mig_cards_of_dra_pools_are_published() -> None:
    inv = NodeInventory("n1", (card(0), card(1, allocation="extender"), card(2, healthy=False),
                               card(3, mig_mode=True), replace(card(4), slicing=None), card(5)))
    (sl,) = resource_slices(inv)
    assert [d["name"] for d in sl["spec"]["devices"]] == ["gpu-0", "gpu-5"]
    assert sl["spec"]["driver"] == DRIVER and sl["spec"]["nodeName"] == "n1"
    assert sl["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert resource_slices(NodeInventory("n1", (card(1, allocation="extender"),))) == []


def test_capacity_follows_the_pool_slicing_and_defaults() -> None:
    d = card_device(card(0, ms=2.0, cs=1.5), DevicePolicy(default_memory_mib=3000, default_cores=20,
                                                          min_memory_mib=512))
    cap = d["capacity"]
    assert cap["memory"]["value"] == "287542Mi"          # scaled total: 2 x 143771
    assert cap["memory"]["requestPolicy"] == {"default": "3000Mi",
                                              "validRange": {"min": "512Mi", "max": "143771Mi", "step": "1Mi"}}
    assert cap["cores"]["value"] == "150"
    assert cap["cores"]["requestPolicy"]["validRange"]["max"] == "100"   # one slice: at most the card
    assert cap["cores"]["requestPolicy"]["default"] == "20"
    assert cap["shares"] == {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}
    assert d["allowMultipleAllocations"] is True
    assert d["attributes"]["uuid"] == {"string": "GPU-0"} and d["attributes"]["numaNode"] == {"int": 1}


def test_without_defaults_a_request_takes_the_whole_card_and_no_compute_limit() -> None:
    pol = card_device(card(0))["capacity"]
    assert pol["memory"]["requestPolicy"]["default"] == "143771Mi"
    assert pol["cores"]["requestPolicy"]["default"] == "0"


def test_an_exclusive_card_is_not_shared() -> None:
    d = card_device(card(0, mode="exclusive"))
    assert "allowMultipleAllocations" not in d
    assert all("requestPolicy" not in c for c in d["capacity"].values())


def test_an_uncovered_card_is_refused() -> None:
    with pytest.raises(ValueError, match="covered by no pool"):
        card_device(replace(card(0), slicing=None))


def test_the_device_class_selects_the_driver_s_shareable_cards() -> None:
    dc, mig = device_classes()
    assert dc["metadata"]["name"] == DRIVER and mig["metadata"]["name"] == "mig.gpu.kvgpu.io"
    assert '.type == "gpu"' in dc["spec"]["selectors"][0]["cel"]["expression"]
    assert '.type == "mig"' in mig["spec"]["selectors"][0]["cel"]["expression"]
    assert f'device.driver == "{DRIVER}"' in dc["spec"]["selectors"][0]["cel"]["expression"]
