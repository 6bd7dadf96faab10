"""Both allocation modes in one cluster, against the real kube-apiserver, kube-scheduler (its
DynamicResources plugin), kube-controller-manager (the resourceclaim controller) and the kvgpu
operator: an ``allocation: extender`` node and an ``allocation: dra`` node.

The nodes are fake (no kubelet, no node agent: the DRA publisher is the agent's, tested on the
real node), so the test publishes the dra node's ResourceSlice itself with :mod:`kvgpu.dra.slices`
from the node's inventory, as the agent does."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvgpu.core.inventory import NodeInventory, Slicing
from kvgpu.dra.slices import DRIVER, resource_slices, slice_name
from kvgpu.reconcile.dramirror import RESOURCE_CLAIM_UID_LABEL

from .conftest import GpuEnv, pool_body
from .test_kubectl_vgpu import vgpu_json

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "dra"


@dataclass
class TwoModes:
    gpu: GpuEnv
    ext: str  # node of the default (extender) pool
    dra: str  # node of a dra pool
    pool: str
    template: str


def _slicing_of(gpu: GpuEnv, node: str, pool: str, split: int) -> NodeInventory:
    """The node's inventory with the dra pool's slicing, as the agent computes it."""
    raw = json.loads(gpu.cluster.kubectl("get", "node", node, "-o", "json").stdout)
    inv = NodeInventory.loads(raw["metadata"]["annotations"]["kvgpu.io/inventory"])
    return inv.with_slicing({c.uuid: Slicing(pool=pool, split_count=split, allocation="dra") for c in inv.cards})


def dra_pool(gpu: GpuEnv, node: str, pool: str, cards: int, split: int) -> str:
    """A dra VGPUPool over ``node`` (more specific than the ``default`` pool), seen by the
    operator, and the node's ResourceSlice as the agent would publish it. Returns the pool."""
    gpu.cluster.kubectl("label", "node", node, f"kvgpu.io/dra={gpu.ns}")
    sel = {"kvgpu.io/gpu-node": "true", "kvgpu.io/dra": gpu.ns}
    gpu.apply(pool_body(pool, {"nodeSelector": {"matchLabels": sel}, "splitCount": split, "allocation": "dra"}))
    gpu.wait(lambda: pool_status(gpu, pool).get("cards") == cards, 30, f"pool {pool} covering {cards} cards")
    gpu.apply(*resource_slices(_slicing_of(gpu, node, pool, split)))
    return pool


def _template(ns: str, name: str, memory: str, cores: str, count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": memory, "cores": cores}}}
    if count > 1:
        exactly.update(allocationMode="ExactCount", count=count)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}


def _dra_pod(gpu: GpuEnv, name: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": gpu.ns},
            "spec": {"nodeSelector": {"kvgpu.io/test": gpu.ns}, "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "cuda", "command": ["sleep", "inf"],
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


@pytest.fixture
def modes(gpu: GpuEnv) -> Iterator[TwoModes]:
    ext, dra = gpu.nodes(2, cards=1, memory_mib=10000)
    pool = dra_pool(gpu, dra, f"{gpu.ns}-dra", cards=1, split=2)
    t = f"seed-{uuid.uuid4().hex[:6]}"
    gpu.apply(_template(gpu.ns, t, "3000Mi", "30"))
    try:
        yield TwoModes(gpu, ext, dra, pool, t)
    finally:
        gpu.cluster.kubectl("delete", "pods", "--all", "-n", gpu.ns, "--grace-period=0", "--force", check=False)
        gpu.cluster.kubectl("delete", "resourceslice", slice_name(dra), "--ignore-not-found", check=False)
        gpu.cluster.kubectl("delete", "vgpupool", pool, "--ignore-not-found", check=False)


def mirrors(gpu: GpuEnv) -> list[dict[str, Any]]:
    return [c for c in gpu.claims() if (c.get("spec") or {}).get("resourceClaim")]


def allocated(gpu: GpuEnv) -> dict[str, dict[str, Any]]:
    """The namespace's ResourceClaims that hold a device, by UID."""
    return {c["metadata"]["uid"]: c for c in gpu.get("resourceclaims")["items"]
            if (c.get("status") or {}).get("allocation")}


def wait_mirrors(gpu: GpuEnv, n: int, timeout: float = 30) -> list[dict[str, Any]]:
    """Exactly one mirror per allocated ResourceClaim, ``n`` of them."""
    def ok() -> list[dict[str, Any]] | None:
        ms, rcs = mirrors(gpu), allocated(gpu)
        uids = sorted(m["spec"]["resourceClaim"]["uid"] for m in ms)
        return ms if len(ms) == n and uids == sorted(rcs) else None
    return gpu.wait(ok, timeout, f"{n} mirrors, one per allocated ResourceClaim")


def pool_status(gpu: GpuEnv, pool: str) -> dict[str, Any]:
    return json.loads(gpu.cluster.kubectl("get", "vgpupool", pool, "-o", "json").stdout).get("status") or {}


def test_each_form_lands_on_its_mode_and_dra_slices_are_mirrored(modes: TwoModes) -> None:
    gpu = modes.gpu
    gpu.create(gpu.pod("ext", {"kvgpu.io/gpumem": "3000"}),
               {**gpu.pod("ext-on-dra", {"kvgpu.io/gpumem": "3000"}),
                "spec": {**gpu.pod("x")["spec"], "nodeSelector": {"kubernetes.io/hostname": modes.dra}}},
               _dra_pod(gpu, "d1", modes.template))
    assert gpu.wait_bound("ext")["spec"]["nodeName"] == modes.ext
    d1 = gpu.wait_bound("d1")
    assert d1["spec"]["nodeName"] == modes.dra
    # a DRA-only pod is not a kvgpu GPU pod: the webhooks leave it to the default scheduler
    assert d1["spec"]["schedulerName"] == "default-scheduler"
    assert "kvgpu.io/managed" not in (d1["metadata"].get("labels") or {})
    # an annotation-form pod never gets a dra card: the extender names why
    gpu.wait(lambda: any("DRA pool" in e for e in gpu.events("ext-on-dra")), 30, "the extender's DRA reason")
    assert not gpu.get("pod", "ext-on-dra")["spec"].get("nodeName")

    (m,) = wait_mirrors(gpu, 1)
    (rc,) = allocated(gpu).values()
    spec = m["spec"]
    assert (spec["podName"], spec["podUID"], spec["container"], spec["node"]) == (
        "d1", d1["metadata"]["uid"], "main", modes.dra)
    assert spec["resourceClaim"] == {"name": rc["metadata"]["name"], "uid": rc["metadata"]["uid"]}
    assert m["metadata"]["labels"][RESOURCE_CLAIM_UID_LABEL] == rc["metadata"]["uid"]
    (dev,) = spec["devices"]
    (res,) = rc["status"]["allocation"]["devices"]["results"]
    assert (dev["memory"], dev["cores"], f"gpu-{dev['index']}") == (3000, 30, res["device"])

    rows = vgpu_json(gpu, "claims", "-n", gpu.ns)
    assert any(r.get("pod") == "d1" and r.get("node") == modes.dra for r in rows), rows
    gpu.wait(lambda: pool_status(gpu, modes.pool).get("memoryUsedMiB") == 3000
             and pool_status(gpu, modes.pool).get("claims") == 1, 30, "the dra pool counting the slice")

    # splitCount 2: the third DRA pod finds no share and stays Pending with kube-scheduler's reason
    gpu.create(_dra_pod(gpu, "d2", modes.template), _dra_pod(gpu, "d3", modes.template))
    gpu.wait(lambda: sum(bool(gpu.get("pod", p)["spec"].get("nodeName")) for p in ("d2", "d3")) == 1, 30,
             "one of d2, d3 bound")
    waiting = next(p for p in ("d2", "d3") if not gpu.get("pod", p)["spec"].get("nodeName"))
    gpu.wait(lambda: any(e.startswith("FailedScheduling") and "claim" in e for e in gpu.events(waiting)), 30,
             f"FailedScheduling of {waiting}")
    wait_mirrors(gpu, 2)

    # the pod deleted: its claim goes (resourceclaim controller), and so does its mirror; the
    # waiting pod gets the share
    gpu.delete_pod("d1")
    gpu.wait_bound(waiting, 60)
    ms = wait_mirrors(gpu, 2)
    assert "d1" not in {x["spec"]["podName"] for x in ms}
    gpu.wait(lambda: pool_status(gpu, modes.pool).get("memoryUsedMiB") == 6000, 30, "6000 MiB in the pool")


def _example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def test_examples_seed_two_cards_and_typed_card(gpu: GpuEnv) -> None:
    """examples/dra/: the pool is valid, the seed's template is 3000 MiB / 30 %, the two-card one is
    one mirror of two devices, the typed one (CEL on ``model``) takes an H200."""
    (dra,) = gpu.nodes(1, cards=2, memory_mib=30000)
    pool = dra_pool(gpu, dra, f"{gpu.ns}-dra2", cards=2, split=10)
    try:
        gpu.cluster.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLES / "pool-dra.yaml"))
        for f in ("claim-seed.yaml", "claim-two-cards.yaml", "claim-typed.yaml"):
            template, pod = _example(f)
            template["metadata"]["namespace"] = pod["metadata"]["namespace"] = gpu.ns
            pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": dra}
            gpu.apply(template, pod)
        for pod_name in ("dra-seed", "dra-two-cards", "dra-h200"):
            gpu.wait_bound(pod_name)
        by_pod = {m["spec"]["podName"]: m for m in wait_mirrors(gpu, 3)}
        assert [(d["memory"], d["cores"]) for d in by_pod["dra-seed"]["spec"]["devices"]] == [(3000, 30)]
        assert sorted((d["index"], d["memory"], d["cores"]) for d in by_pod["dra-two-cards"]["spec"]["devices"]) == [
            (0, 8192, 50), (1, 8192, 50)]
        (typed,) = by_pod["dra-h200"]["spec"]["devices"]
        assert (typed["model"], typed["memory"], typed["cores"]) == ("NVIDIA H200", 20480, 25)
    finally:
        gpu.cluster.kubectl("delete", "pods", "--all", "-n", gpu.ns, "--grace-period=0", "--force", check=False)
        gpu.cluster.kubectl("delete", "resourceslice", slice_name(dra), "--ignore-not-found", check=False)
        gpu.cluster.kubectl("delete", "vgpupool", pool, "--ignore-not-found", check=False)


def test_operator_restart_keeps_mirrors_without_duplicates(modes: TwoModes) -> None:
    gpu = modes.gpu
    # one after the other: what is tested is the mirrors across a restart. Created at once on a
    # loaded CI machine, kube-scheduler's DRA plugin once found no room for b's claim beside a's
    # in-flight allocation ("cannot allocate all claims") and did not retry it within 30 s;
    # two claims sharing one card at once are test_dra_contract's subject.
    for name in ("a", "b"):
        gpu.create(_dra_pod(gpu, name, modes.template))
        gpu.wait_bound(name)
    before = {m["metadata"]["uid"] for m in wait_mirrors(gpu, 2)}
    gpu.system.kill_operator()
    try:
        # while the operator is down: one pod goes (its claim with it), one comes
        gpu.delete_pod("a")
        gpu.wait(lambda: len(allocated(gpu)) == 1, 60, "a's claim deallocated")
        gpu.create(_dra_pod(gpu, "c", modes.template))
        gpu.wait_bound("c")
        time.sleep(1)
    finally:
        gpu.system.start_operator()
    ms = wait_mirrors(gpu, 2, timeout=60)
    assert {m["spec"]["podName"] for m in ms} == {"b", "c"}
    kept = {m["metadata"]["uid"] for m in ms} & before
    assert len(kept) == 1, "b's mirror is the same object, not written again"
    gpu.wait(lambda: pool_status(gpu, modes.pool).get("claims") == 2
             and pool_status(gpu, modes.pool).get("memoryUsedMiB") == 6000, 30, "the rebuilt ledger's count")


def test_the_mirror_finds_the_device_class(gpu: GpuEnv) -> None:
    """The dev system installs the DeviceClass as the chart does; the operator's mirror checks it
    at start and warns only when it is missing."""
    import asyncio

    from kvgpu.reconcile.draworker import DraMirror

    async def check() -> bool:
        async with gpu.cluster.api() as api:
            return await DraMirror(api).check_device_class()

    assert asyncio.run(check())
    assert "DeviceClass missing" not in gpu.system.operator_log().read_text()
