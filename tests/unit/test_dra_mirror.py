"""The VGPUClaim that mirrors a DRA ResourceClaim (kvgpu.reconcile.dramirror), from the shapes
kube-scheduler 1.36 writes (as tests/cluster/test_dra_contract.py sees them) and the
ResourceSlices of kvgpu.dra.slices."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.core.inventory import Slicing
from kvgpu.dra.slices import DRIVER, resource_slices
from kvgpu.reconcile import dramirror as M
from kvgpu.reconcile.state import allocation_from_claim

from .allocator_helpers import node


def _cards() -> dict[tuple[str, str], M.Card]:
    inv = node("n1", 2, memory_mib=10000, slicing=Slicing("p", split_count=4, allocation="dra"))
    (rs,) = resource_slices(inv)
    return M.slice_cards(rs)


def _rc(results: list[dict[str, Any]], reserved: bool = True) -> dict[str, Any]:
    st: dict[str, Any] = {"allocation": {"devices": {"results": results}}}
    if reserved:
        st["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": "pod-uid-1"}]
    return {"metadata": {"name": "pod-a-gpu-x7k2p", "namespace": "ns", "uid": "0a1b2c3d-0000-4000-8000-000000000001"},
            "status": st}


def _res(device: str = "gpu-0", **used: str) -> dict[str, Any]:
    r: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device}
    if used:
        r["consumedCapacity"] = used
    return r


POD = {"metadata": {"name": "pod-a", "namespace": "ns", "uid": "pod-uid-1"},
       "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "seed"}],
                "containers": [{"name": "side"}, {"name": "main", "resources": {"claims": [{"name": "gpu"}]}}]},
       "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "pod-a-gpu-x7k2p"}]}}


def test_mirror_records_consumed_capacity_card_and_consumer() -> None:
    rc = _rc([_res(memory="3000Mi", cores="30", shares="1")])
    assert M.wants_mirror(rc)
    body = M.mirror(rc, POD, _cards())
    spec = body["spec"]
    assert body["metadata"]["name"] == "dra-pod-a-gpu-x7k2p-0a1b2c3d"
    assert body["metadata"]["ownerReferences"][0]["kind"] == "ResourceClaim"
    assert body["metadata"]["labels"][M.RESOURCE_CLAIM_UID_LABEL] == rc["metadata"]["uid"]
    assert (spec["podName"], spec["podUID"], spec["container"], spec["node"]) == ("pod-a", "pod-uid-1", "main", "n1")
    (d,) = spec["devices"]
    assert (d["index"], d["memory"], d["cores"]) == (0, 3000, 30) and d["uuid"].startswith("GPU-")
    assert spec["resourceClaim"] == {"name": "pod-a-gpu-x7k2p", "uid": rc["metadata"]["uid"]}
    key, alloc = allocation_from_claim(body)
    assert key == "ns/dra-pod-a-gpu-x7k2p-0a1b2c3d"
    assert alloc.pod_uid == "resourceclaim:" + rc["metadata"]["uid"]  # never a pod's extender holder


def test_two_cards_and_quantities_rounded_up_to_mib() -> None:
    rc = _rc([_res("gpu-0", memory="3Gi", cores="10"), _res("gpu-1", memory="1000000", cores="10")])
    devs = M.mirror(rc, POD, _cards())["spec"]["devices"]
    assert [(d["index"], d["memory"]) for d in devs] == [(0, 3072), (1, 1)]


def test_unshared_card_holds_the_whole_card() -> None:
    (d,) = M.mirror(_rc([_res()]), POD, _cards())["spec"]["devices"]
    assert (d["memory"], d["cores"]) == (10000, 100)


def test_no_mirror_unless_allocated_reserved_and_ours() -> None:
    assert not M.wants_mirror(_rc([]))
    assert not M.wants_mirror(_rc([_res(memory="1Mi")], reserved=False))
    other = _rc([{**_res(memory="1Mi"), "driver": "gpu.nvidia.com"}])
    assert not M.wants_mirror(other)
    gone = _rc([_res(memory="1Mi")])
    gone["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    assert not M.wants_mirror(gone)


def test_pending_until_the_device_and_the_consumer_are_known() -> None:
    with pytest.raises(M.MirrorPending, match="no ResourceSlice"):
        M.mirror(_rc([_res("gpu-7", memory="1Mi")]), POD, _cards())
    other_pod = {**POD, "metadata": {**POD["metadata"], "uid": "another"}}
    with pytest.raises(M.MirrorPending, match="consumer"):
        M.mirror(_rc([_res(memory="1Mi")]), other_pod, _cards())


def test_long_names_fit_and_stay_distinct() -> None:
    a = M.mirror_name("x" * 253, "11111111-aaaa")
    b = M.mirror_name("x" * 253, "22222222-aaaa")
    assert len(a) <= 253 and a != b


def test_bad_quantity_names_the_value() -> None:
    with pytest.raises(ValueError, match="'lots'"):
        M.to_mib("lots")


def test_mig_instances_get_no_mirror() -> None:
    """A MIG instance is a hardware partition, not a kvgpu slice: a claim of MIG devices only has
    no mirror, and a claim mixing both mirrors the card slice alone."""
    assert not M.wants_mirror(_rc([_res("gpu-1-mig-3-0")]))
    mixed = _rc([_res("gpu-1-mig-3-0"), _res("gpu-0", memory="3000Mi", cores="30")])
    assert M.wants_mirror(mixed)
    body = M.mirror(mixed, POD, _cards())
    assert [d["memory"] for d in body["spec"]["devices"]] == [3000]
