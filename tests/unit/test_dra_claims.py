"""An allocated ResourceClaim as the node prepares it (kvgpu.dra.claims): the claim string the
shim enforces, and a named error for every claim the node must refuse."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from kvgpu.core import claimstr
from kvgpu.core.inventory import Card, MigInstance, Slicing
from kvgpu.dra.claims import DraClaimError, prepare_claim
from kvgpu.dra.slices import DRIVER

NODE = "n1"
UID = "3f2a7c1e-0000-4000-8000-000000000001"


def card(i: int, *, mode: str = "hami-core", allocation: str = "dra", **kw: Any) -> Card:
    return Card(f"GPU-{i}", i, "NVIDIA H200", 143771, 132, 0,
                slicing=Slicing("p", split_count=4, mode=mode, allocation=allocation), **kw)


def result(device: str = "gpu-0", memory: str = "3000Mi", cores: str = "30", **kw: Any) -> dict[str, Any]:
    r = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, "shareID": "s-1",
         "consumedCapacity": {"memory": memory, "cores": cores, "shares": "1"}}
    r.update(kw)
    return r


def claim(*results: dict[str, Any], config: list[dict[str, Any]] | None = None, uid: str = UID) -> dict[str, Any]:
    return {"metadata": {"namespace": "team-a", "name": "seed-gpu-x7k2p", "uid": uid},
            "status": {"allocation": {"devices": {"results": list(results) or [result()], "config": config or []}}}}


def slice_config(priority: Any, requests: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    params = {"apiVersion": "gpu.kvgpu.io/v1alpha1", "kind": "SliceConfig", "priority": priority, **extra}
    entry: dict[str, Any] = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}}
    if requests is not None:
        entry["requests"] = requests
    return entry


CARDS = [card(0), card(1), card(2, allocation="extender"), card(3, healthy=False, reason="XID 79")]


def test_the_seed_claim_becomes_its_claim_string() -> None:
    p = prepare_claim(claim(), UID, NODE, CARDS)
    assert p.claim == "v1;claim=team-a/seed-gpu-x7k2p;priority=1;dev=GPU-0,3000,30"
    (d,) = p.devices
    assert (d.device, d.pool, d.share_id, d.requests, d.card.uuid) == ("gpu-0", NODE, "s-1", ("gpu",), "GPU-0")
    assert claimstr.decode(p.claim).devices[0].memory_mib == 3000


def test_two_devices_and_a_gibibyte_quantity() -> None:
    p = prepare_claim(claim(result(memory="2Gi"), result("gpu-1", cores="0")), UID, NODE, CARDS)
    assert p.claim.endswith(";dev=GPU-0,2048,30;dev=GPU-1,3000,0")


def test_priority_from_the_drivers_opaque_config() -> None:
    other = {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"priority": 7}}}
    assert ";priority=0;" in prepare_claim(claim(config=[other, slice_config(0)]), UID, NODE, CARDS).claim
    # the claim's own config (listed after the class's) wins; a config for another request does not apply
    cfg = [slice_config(0), slice_config(1), slice_config(0, requests=["other"])]
    assert ";priority=1;" in prepare_claim(claim(config=cfg), UID, NODE, CARDS).claim


def test_an_exclusive_card_without_consumed_capacity_is_the_whole_card() -> None:
    r = result()
    del r["consumedCapacity"]
    p = prepare_claim(claim(r), UID, NODE, [card(0, mode="exclusive")])
    assert p.claim.endswith("dev=GPU-0,143771,100")


def test_an_mps_card_writes_mode_mps_and_stays_alone() -> None:
    cards = [card(0, mode="mps"), card(1)]
    assert prepare_claim(claim(), UID, NODE, cards).claim.endswith(";mode=mps")
    with pytest.raises(DraClaimError, match="mps card's slice must be the claim's only device"):
        prepare_claim(claim(result(), result("gpu-1")), UID, NODE, cards)


@pytest.mark.parametrize(("obj", "uid", "match"), [
    (claim(uid="other"), UID, "has UID 'other', the kubelet asked for"),
    ({"metadata": {"namespace": "a", "name": "b", "uid": UID}, "status": {}}, UID, "a/b is not allocated"),
    (claim(result(driver="gpu.nvidia.com")), UID, f"has no device of driver {DRIVER}"),
    (claim(result(pool="n2")), UID, r"devices in pool\(s\) \['n2'\] are not on node n1"),
    (claim(result("gpu-9")), UID, "device 'gpu-9' is not a gpu.kvgpu.io device of node n1"),
    (claim(result("gpu-2")), UID, "device 'gpu-2' is not a gpu.kvgpu.io device"),   # an extender card
    (claim(result("gpu-3")), UID, r"card GPU-3\) is unhealthy: XID 79"),
    (claim(result(memory="3000m")), UID, "consumedCapacity.memory"),
    (claim(result(cores="130")), UID, "consumedCapacity.cores='130' is not a whole percent"),
    (claim(result(), result()), UID, "one card allocated twice"),
    (claim(result(adminAccess=True)), UID, "adminAccess results are not served"),
    (claim({k: v for k, v in result().items() if k != "consumedCapacity"}), UID,
     "gpu-0 is a shared card but the allocation has no consumedCapacity"),
    (claim(config=[slice_config(2)]), UID, "priority must be 0 \\(high\\) or 1 \\(low\\), got 2"),
    (claim(config=[slice_config(True)]), UID, "priority must be 0"),
    (claim(config=[slice_config(0, gpumem=5)]), UID, r"unknown keys \['gpumem'\] in SliceConfig"),
    (claim(config=[{"opaque": {"driver": DRIVER, "parameters": {"kind": "X"}}}]), UID,
     "must have apiVersion gpu.kvgpu.io/v1alpha1 and kind SliceConfig"),
    (claim(config=[{"opaque": {"driver": DRIVER, "parameters": "priority=0"}}]), UID, "must be an object"),
])
def test_claims_the_node_refuses_name_the_reason(obj: dict[str, Any], uid: str, match: str) -> None:
    with pytest.raises(DraClaimError, match=match) as e:
        prepare_claim(obj, uid, NODE, CARDS)
    assert "ResourceClaim " in str(e.value)


def test_memory_is_at_most_the_physical_card() -> None:
    big = replace(card(0), memory_mib=1000)
    assert prepare_claim(claim(result(memory="3000Mi")), UID, NODE, [big]).claim.endswith("dev=GPU-0,1000,30")


# --------------------------------------------------------------------------- MIG devices

GI, CI = 31, 32  # the instance's /dev/nvidia-caps minors


def mig_card(i: int = 4, *, allocation: str = "dra", caps: bool = True, **kw: Any) -> Card:
    inst = MigInstance(f"MIG-{i}-7", 0, "1g.18gb", 16384, 16, 7, 0,
                       GI if caps else None, CI if caps else None)
    return replace(card(i, allocation=allocation, **kw), mig_mode=True, mig_instances=(inst,), minor=9)


def mig_result(device: str = "gpu-4-mig-7-0") -> dict[str, Any]:
    return {"request": "mig", "driver": DRIVER, "pool": NODE, "device": device}


def test_a_mig_device_gets_its_nodes_and_no_claim_string() -> None:
    p = prepare_claim(claim(mig_result()), UID, NODE, [*CARDS, mig_card()])
    assert p.claim == "" and p.devices == ()
    (m,) = p.mig
    assert (m.device, m.pool, m.requests, m.uuid, m.card.uuid) == ("gpu-4-mig-7-0", NODE, ("mig",), "MIG-4-7", "GPU-4")
    assert m.edits.device_nodes == ("/dev/nvidia9", f"/dev/nvidia-caps/nvidia-cap{GI}",
                                    f"/dev/nvidia-caps/nvidia-cap{CI}")
    assert m.edits.env == {"NVIDIA_VISIBLE_DEVICES": "MIG-4-7"}


@pytest.mark.parametrize("cards, obj, match", [
    ([mig_card(caps=False)], claim(mig_result()), r"MIG device MIG-4-7 of card GPU-4: the minors of its "
                                                   r"/dev/nvidia-caps nodes are unknown"),
    ([mig_card(), card(0)], claim(mig_result(), result()),
     r"MIG devices \['gpu-4-mig-7-0'\] and shared-card slices \['gpu-0'\] in one claim"),
    ([mig_card(allocation="extender")], claim(mig_result()), "'gpu-4-mig-7-0' is not a gpu.kvgpu.io device"),
    ([mig_card(healthy=False, reason="XID 48")], claim(mig_result()), "is unhealthy: XID 48"),
    ([mig_card()], claim(mig_result("gpu-4-mig-8-0")), "'gpu-4-mig-8-0' is not a gpu.kvgpu.io device"),
    ([mig_card()], claim(mig_result() | {"adminAccess": True}), "adminAccess results are not served"),
])
def test_mig_claims_the_node_refuses_name_the_reason(cards: list[Card], obj: dict[str, Any], match: str) -> None:
    with pytest.raises(DraClaimError, match=match) as e:
        prepare_claim(obj, UID, NODE, cards)
    assert "ResourceClaim team-a/seed-gpu-x7k2p" in str(e.value)
