"""Pools that change safely, on the real control plane (issue 16, item 3): a change applies to new
placements only (the claims keep their cards and limits, the pods their allocation annotations,
nothing is evicted); a card left over the pool's new shape shows on the pool (Overcommitted) and
in `kubectl vgpu nodes` (STATE), new pods wait with FailedScheduling naming the overcommit, and are
placed once it clears; a pool the API server stores but the model refuses gets Ready=False,
reason InvalidSpec. Plus `kubectl vgpu simulate` against the live cluster (item 4)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from kvgpu.core import keys

from tests.cluster.conftest import GpuEnv, pool_body, pool_conditions
from tests.cluster.test_kubectl_vgpu import PLUGIN, vgpu_json

pytestmark = pytest.mark.cluster


def _live_claims(gpu: GpuEnv) -> dict[str, Any]:
    return {c["metadata"]["name"]: c["spec"] for c in gpu.claims()
            if (c.get("status") or {}).get("phase") != "Released"}


def _alloc_annotations(gpu: GpuEnv) -> dict[str, dict[str, str]]:
    return {p["metadata"]["name"]: {k: v for k, v in (p["metadata"].get("annotations") or {}).items()
                                    if k.startswith(keys.ALLOCATION_ANNOTATION_PREFIXES)}
            for p in gpu.pods()}


def test_shrunk_pool_keeps_claims_refuses_new_pods_by_name_until_it_clears(gpu: GpuEnv) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=20000)
    name = f"shape-{gpu.ns}"
    sel = {"matchLabels": {"kvgpu.io/test": gpu.ns, keys.NODE_LABEL_GPU: "true"}}  # beats "default"
    gpu.apply(pool_body(name, {"nodeSelector": sel, "splitCount": 4}))
    try:
        gpu.wait(lambda: pool_conditions(gpu, name).get("Ready", {}).get("status") == "True", 30, "pool ready")
        gpu.create(*[gpu.pod(f"s{i}", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "20"}) for i in range(3)])
        for i in range(3):
            gpu.wait_bound(f"s{i}")
        claims, annotations = _live_claims(gpu), _alloc_annotations(gpu)
        assert len(claims) == 3

        gpu.apply(pool_body(name, {"nodeSelector": sel, "splitCount": 2, "memoryScaling": 0.4}))
        over = gpu.wait(lambda: (c := pool_conditions(gpu, name).get("Overcommitted")) and c["status"] == "True" and c,
                        30, "Overcommitted=True")
        assert "slots 3/2" in over["message"] and "memory 9000/8000 MiB" in over["message"], over
        # running claims keep their cards and limits; the pods their allocation; nothing is evicted
        assert _live_claims(gpu) == claims and _alloc_annotations(gpu) == annotations
        assert all(p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")
                   for p in gpu.pods())
        # kubectl vgpu nodes marks the card
        rows = gpu.wait(lambda: (r := vgpu_json(gpu, "nodes", node)) and r[0]["state"].startswith("Overcommitted")
                        and r, 20, "STATE Overcommitted in kubectl vgpu nodes")
        assert rows[0]["state"] == "Overcommitted (slots 3/2, memory 9000/8000)" and rows[0]["physical_mib"] == 20000

        # a new pod is not placed; its FailedScheduling names the pool's overcommit
        gpu.create(gpu.pod("late", {"kvgpu.io/gpumem": "1000"}))
        ev = gpu.wait(lambda: [e for e in gpu.events("late") if e.startswith("FailedScheduling")
                               and "Overcommitted" in e], 30, "FailedScheduling naming the overcommit")
        assert f"VGPUPool {name}" in ev[0], ev
        assert not gpu.get("pod", "late")["spec"].get("nodeName")

        # two pods end: 1 slot of 2 and 3000 of 8000 MiB -> within the shape, the pod is placed
        gpu.delete_pod("s0")
        gpu.delete_pod("s1")
        assert gpu.wait_bound("late", timeout=60)["spec"]["nodeName"] == node
        gpu.wait(lambda: pool_conditions(gpu, name).get("Overcommitted", {}).get("status") == "False", 30,
                 "Overcommitted=False")
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", name, "--wait=false", check=False)


def test_selector_change_applies_to_new_pods_only(gpu: GpuEnv) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=20000)
    name = f"sel-{gpu.ns}"
    gpu.apply(pool_body(name, {"nodeSelector": {"matchLabels": {"kvgpu.io/test": gpu.ns, keys.NODE_LABEL_GPU: "true"}},
                           "splitCount": 1}))
    try:
        gpu.wait(lambda: pool_conditions(gpu, name).get("Ready", {}).get("status") == "True", 30, "pool ready")
        gpu.create(gpu.pod("a", {"kvgpu.io/gpumem": "3000"}))
        gpu.wait_bound("a")
        claims = _live_claims(gpu)
        assert [c["pool"] for c in claims.values()] == [name]
        gpu.create(gpu.pod("b", {"kvgpu.io/gpumem": "3000"}))
        gpu.wait(lambda: any(e.startswith("FailedScheduling") for e in gpu.events("b")), 30, "b waits (1 slot)")
        # the pool moves away: the card falls to the "default" pool (splitCount 10); a's claim stays
        gpu.apply(pool_body(name, {"nodeSelector": {"matchLabels": {"kvgpu.io/test": "elsewhere"}}, "splitCount": 1}))
        assert gpu.wait_bound("b", timeout=60)["spec"]["nodeName"] == node
        now = _live_claims(gpu)
        assert {k: v for k, v in now.items() if k in claims} == claims
        assert [v["pool"] for k, v in now.items() if k not in claims] == ["default"]
        assert all(not p["metadata"].get("deletionTimestamp") for p in gpu.pods())
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", name, "--wait=false", check=False)


def test_pool_refused_by_the_model_gets_invalid_spec(gpu: GpuEnv) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=20000)
    name = f"bad-{gpu.ns}"
    sel = {"matchLabels": {"kvgpu.io/test": gpu.ns, keys.NODE_LABEL_GPU: "true"}}
    gpu.apply(pool_body(name, {"nodeSelector": sel, "defaults": {"gpumem": 100}}))  # the API server stores it
    try:
        ready = gpu.wait(lambda: (c := pool_conditions(gpu, name).get("Ready")) and c.get("reason") == "InvalidSpec"
                         and c, 30, "Ready=False, reason InvalidSpec")
        assert ready["status"] == "False"
        assert "defaults.gpumem 100 MiB is below minSliceMemory 256 MiB" in ready["message"], ready
        ev = json.loads(gpu.cluster.kubectl("get", "events", "-n", "default", "-o", "json",
                                            f"--field-selector=involvedObject.name={name}").stdout)["items"]
        assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in ev), ev
        # it slices nothing: the node's card falls to the "default" pool
        rows = gpu.wait(lambda: (r := vgpu_json(gpu, "nodes", node)) and r[0]["pool"] == "default" and r, 20,
                        "the card under the default pool")
        assert rows[0]["slots"][1] == 10
        # fixed: valid again
        gpu.apply(pool_body(name, {"nodeSelector": sel, "defaults": {"gpumem": 300}}))
        gpu.wait(lambda: pool_conditions(gpu, name).get("Ready", {}).get("status") == "True", 30, "Ready=True")
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", name, "--wait=false", check=False)


def test_simulate_against_the_live_cluster(gpu: GpuEnv, tmp_path: Any) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=10000)
    gpu.create(gpu.pod("held", {"kvgpu.io/gpumem": "6000"}))
    gpu.wait_bound("held")
    tpl = gpu.pod("x", {"kvgpu.io/gpumem": "3000"})
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": gpu.ns},
              "spec": {"replicas": 2, "selector": {"matchLabels": {"a": "b"}},
                       "template": {"metadata": {"labels": {"a": "b"}, "annotations": tpl["metadata"]["annotations"]},
                                    "spec": tpl["spec"]}}}
    f = tmp_path / "deploy.json"
    f.write_text(json.dumps(deploy))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(PLUGIN), f"--kubeconfig={gpu.cluster.kubeconfig}", "simulate", "-f", str(f),
                               *args], capture_output=True, text=True, timeout=60, check=False)

    p = gpu.wait(lambda: (r := run("-o", "json")).returncode == 1 and r, 20, "simulate sees the held pod")
    pods = json.loads(p.stdout)["pods"]
    assert [(v["pod"], v["fits"], v["node"]) for v in pods] == [
        (f"{gpu.ns}/web-0", True, node), (f"{gpu.ns}/web-1", False, "")]
    assert pods[0]["cards"] == {"main": ["0:3000MiB/0%"]}
    assert pods[1]["constraint"] == "memory" and pods[1]["constraints"] == {node: "memory"}
    assert pods[1]["free_up"] == f"1 pod(s) on {node} ending: {gpu.ns}/held"
    text = run().stdout
    assert "1 of 2 pod(s) would fit now." in text and "binding constraint: memory" in text
    # nothing was created or reserved by simulating
    assert sorted(p["metadata"]["name"] for p in gpu.pods()) == ["held"] and len(gpu.claims()) == 1


def test_simulate_names_the_quota_that_refuses_a_pod(gpu: GpuEnv, tmp_path: Any) -> None:
    gpu.nodes(1, cards=2, memory_mib=10000)
    gpu.cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu-quota", "namespace": gpu.ns},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "4096"}}}))
    f = tmp_path / "pod.json"
    f.write_text(json.dumps(gpu.pod("big", {"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "3000"})))
    p = subprocess.run([str(PLUGIN), f"--kubeconfig={gpu.cluster.kubeconfig}", "simulate", "-f", str(f), "-o", "json"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 1, (p.stdout, p.stderr)
    [v] = json.loads(p.stdout)["pods"]
    assert v["fits"] is False and v["constraint"] == "quota", v
    assert "gpu-quota" in v["note"] and "4096" in v["note"], v
