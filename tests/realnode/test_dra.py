"""DRA mode on a real kubelet + containerd: kube-scheduler allocates slices of a card from the
agent's ResourceSlice, the real kubelet calls the agent's DRA plugin (NodePrepareResources), and
containerd applies the plugin's CDI spec; the container is limited by the same shim as on the
device-plugin path.

The real node's pool covers its four cards (device plugin); this module adds a more specific
pool with ``allocation: dra`` over card 3 (``devices.indexes``), and the DeviceClass; both are
deleted at the end. Pods use the default kube-scheduler (no kvgpu webhook, extender or
VGPUClaim on this path).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvgpu.core import keys
from kvgpu.devcluster.realnode import RealNode
from kvgpu.dra.slices import DRIVER, device_classes, slice_name
from realnode.conftest import RealPods
from realnode.gpupods import card_nodes, events, exec_in, inventory, wait_for

MIB = 1 << 20
DRA_CARD = 3
STATE_DIR = Path("/var/lib/kvgpu/dra/claims")
NVML_VIEW = ("import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); "
             "m = n.nvmlDeviceGetMemoryInfo(h); print(f'{m.used >> 20}MiB / {m.total >> 20}MiB')")


def _get(node: RealNode, *args: str) -> dict[str, Any]:
    return dict(json.loads(node.cluster.kubectl("get", *args, "-o", "json").stdout))


def _dra_slice(node: RealNode) -> dict[str, Any] | None:
    p = node.cluster.kubectl("get", "resourceslice", slice_name(node.name), "-o", "json", check=False)
    return json.loads(p.stdout) if p.returncode == 0 else None


def _allocatable(node: RealNode) -> int:
    return int(((node.node() or {}).get("status", {}).get("allocatable", {})).get("nvidia.com/gpu", "0") or 0)


@pytest.fixture(scope="module")
def dra_node(real_node: RealNode) -> Iterator[RealNode]:
    pool = f"{real_node.pool_name}-dra"
    labels = {"kvgpu.io/gpu-node": "true", "kubernetes.io/hostname": real_node.name}
    # the DeviceClass is ours to delete only if we create it (the system may install it)
    own_class = real_node.cluster.kubectl("get", "deviceclass", DRIVER, check=False).returncode != 0
    objs = [*(device_classes() if own_class else []), {
        "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": pool},
        "spec": {"nodeSelector": {"matchLabels": labels}, "devices": {"indexes": [DRA_CARD]},
                 "splitCount": 4, "allocation": "dra"}}]
    real_node.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    try:
        wait_for(lambda: [d["name"] for d in ((_dra_slice(real_node) or {}).get("spec") or {}).get("devices", [])]
                 == [f"gpu-{DRA_CARD}"], 60, "the node's ResourceSlice with the dra card")
        # the device plugin no longer offers the dra card: 3 cards x 10 replicas
        wait_for(lambda: _allocatable(real_node) == 30, 60, "nvidia.com/gpu without the dra card")
        yield real_node
    finally:
        real_node.cluster.kubectl("delete", "vgpupool", pool, "--ignore-not-found")
        wait_for(lambda: _dra_slice(real_node) is None, 60, "the ResourceSlice deleted with the dra pool")
        if own_class:
            real_node.cluster.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found")
        wait_for(lambda: _allocatable(real_node) == 40, 60, "the card back in the device plugin")


@pytest.fixture
def dra(dra_node: RealNode, real_pods: RealPods) -> RealPods:
    return real_pods


def _template(rp: RealPods, name: str, memory: str = "3000Mi", cores: str = "30") -> dict[str, Any]:
    req = {"name": "gpu", "exactly": {"deviceClassName": DRIVER,
                                      "capacity": {"requests": {"memory": memory, "cores": cores}}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": rp.ns}, "spec": {"spec": {"devices": {"requests": [req]}}}}


def _dra_pod(rp: RealPods, name: str, template: str) -> dict[str, Any]:
    pod = rp.pod(name)
    pod["spec"].pop("nodeName")  # placed by kube-scheduler, which allocates the claim
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": rp.node.name}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def _apply(rp: RealPods, *objs: dict[str, Any]) -> None:
    rp.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def _claim_of(rp: RealPods, pod: str) -> dict[str, Any]:
    p = rp.get(pod)
    (st,) = p["status"]["resourceClaimStatuses"]
    return _get(rp.node, "resourceclaim", st["resourceClaimName"], "-n", rp.ns)


def _card_uuid(rp: RealPods, index: int = DRA_CARD) -> str:
    return next(c.uuid for c in inventory(rp).cards if c.index == index)


def _node_files(uid: str, node: RealNode) -> list[Path]:
    return [p for p in (STATE_DIR / uid, node.cdi_dir / f"{DRIVER}-{uid}.json") if p.exists()]


def test_seed_claim_template_runs_with_its_limit(dra: RealPods) -> None:
    _apply(dra, _template(dra, "seed"), _dra_pod(dra, "seed", "seed"))
    dra.wait_running("seed", timeout=90)
    claim = _claim_of(dra, "seed")
    (res,) = claim["status"]["allocation"]["devices"]["results"]
    assert res["device"] == f"gpu-{DRA_CARD}" and res["consumedCapacity"]["memory"] == "3000Mi", res
    uid, name, card = claim["metadata"]["uid"], claim["metadata"]["name"], _card_uuid(dra)
    want = f"v1;claim={dra.ns}/{name};priority=1;dev={card},3000,30"
    assert exec_in(dra, "seed", "main", f"cat {keys.CONTAINER_CLAIM_FILE}") == want
    write = f"echo x 2>/dev/null > {keys.CONTAINER_CLAIM_FILE} && echo writable || echo read-only"
    assert exec_in(dra, "seed", "main", write).strip() == "read-only"
    assert exec_in(dra, "seed", "main", f"cat {keys.CONTAINER_CLAIM_FILE}") == want
    info = json.loads(exec_in(dra, "seed", "main", "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == 3000 * MIB, info
    assert exec_in(dra, "seed", "main", f'python3 -c "{NVML_VIEW}"').strip() == "0MiB / 3000MiB"
    # a forged claim in the environment changes nothing: the shim reads the file
    forged = f"KVGPU_CLAIM='v1;claim={dra.ns}/x;priority=0;dev={card},100000,100' cuprog info"
    assert json.loads(exec_in(dra, "seed", "main", forged).splitlines()[0])["total"] == 3000 * MIB
    fill = json.loads(exec_in(dra, "seed", "main", f"cuprog fill alloc {256 * MIB}").splitlines()[0])
    assert fill["rc"] == 2 and 2000 * MIB <= fill["bytes"] <= 3000 * MIB, fill  # out of memory at the limit
    assert card_nodes(dra, "seed") == {f"nvidia{DRA_CARD}"}  # its card's node only
    assert "libvgpu" in exec_in(dra, "seed", "main", "python3 -c \"print(open('/proc/self/maps').read())\"")
    assert "vgpu.region" in exec_in(dra, "seed", "main", f"ls {keys.CONTAINER_REGION_DIR}")
    assert len(_node_files(uid, dra.node)) == 2


def test_two_pods_share_one_card_and_a_third_stays_pending(dra: RealPods) -> None:
    _apply(dra, _template(dra, "seed"), _template(dra, "big", cores="50"),
           _dra_pod(dra, "a", "seed"), _dra_pod(dra, "b", "seed"))
    dra.wait_running("a", timeout=90)
    dra.wait_running("b", timeout=90)
    card = _card_uuid(dra)
    shares = set()
    for pod in ("a", "b"):
        (res,) = _claim_of(dra, pod)["status"]["allocation"]["devices"]["results"]
        assert res["device"] == f"gpu-{DRA_CARD}", res
        shares.add(res["shareID"])
        assert re.fullmatch(rf"v1;claim={dra.ns}/[^;]+;priority=1;dev={card},3000,30",
                            exec_in(dra, pod, "main", f"cat {keys.CONTAINER_CLAIM_FILE}"))
    assert len(shares) == 2
    # 30 + 30 of the card's 100 cores are taken: 50 more do not fit
    _apply(dra, _dra_pod(dra, "nofit", "big"))

    def failed() -> list[str]:
        return [e["message"] for e in events(dra, "nofit") if e["reason"] == "FailedScheduling"]

    msgs = wait_for(failed, 60, "kube-scheduler's FailedScheduling of nofit")
    assert any("cannot allocate all claims" in m for m in msgs), msgs
    assert dra.get("nofit")["status"].get("phase") == "Pending" and not dra.get("nofit")["spec"].get("nodeName")


def test_pod_deletion_deallocates_the_claim_and_removes_the_files(dra: RealPods) -> None:
    _apply(dra, _template(dra, "seed"), _dra_pod(dra, "gone", "seed"))
    dra.wait_running("gone", timeout=90)
    claim = _claim_of(dra, "gone")
    uid = claim["metadata"]["uid"]
    assert len(_node_files(uid, dra.node)) == 2
    dra.cluster.kubectl("delete", "pod", "gone", "-n", dra.ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: dra.cluster.kubectl("get", "resourceclaim", claim["metadata"]["name"], "-n", dra.ns,
                                         check=False).returncode != 0, 60, "the claim deleted with its pod")
    wait_for(lambda: _node_files(uid, dra.node) == [], 30, "the claim's files removed from the node")


def test_kubelet_restart_keeps_the_pod_and_prepares_new_ones(dra: RealPods) -> None:
    _apply(dra, _template(dra, "seed"), _dra_pod(dra, "old", "seed"))
    before = dra.wait_running("old", timeout=90)
    dra.node.restart_kubelet()
    _apply(dra, _dra_pod(dra, "new", "seed"))
    dra.wait_running("new", timeout=120)
    after = dra.get("old")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    assert (after["status"]["containerStatuses"][0]["containerID"]
            == before["status"]["containerStatuses"][0]["containerID"])
    for pod in ("old", "new"):
        assert exec_in(dra, pod, "main", f"cat {keys.CONTAINER_CLAIM_FILE}").endswith(",3000,30")


def test_containers_of_one_claim_share_its_region(dra: RealPods) -> None:
    """Two containers of one pod (sharing its process namespace) on one ResourceClaim: one claim
    file, one region, one quota. Separate PID namespaces: test_pods_sharing_one_claim_share_its_quota."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "shared", "namespace": dra.ns},
             "spec": _template(dra, "x")["spec"]["spec"]}
    pod = _dra_pod(dra, "two", "x")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared"}]
    pod["spec"]["shareProcessNamespace"] = True
    second = json.loads(json.dumps(pod["spec"]["containers"][0]))
    second["name"] = "side"
    pod["spec"]["containers"].append(second)
    _apply(dra, claim, pod)
    dra.wait_running("two", timeout=90)
    files = {c: exec_in(dra, "two", c, f"cat {keys.CONTAINER_CLAIM_FILE}") for c in ("main", "side")}
    assert files["main"] == files["side"] and files["main"].startswith(f"v1;claim={dra.ns}/shared;"), files
    # 2 GiB held in one container count against the other: one quota of 3000 MiB
    holder = subprocess.Popen([str(dra.cluster.bin_dir / "kubectl"), f"--kubeconfig={dra.cluster.kubeconfig}",
                               "exec", "two", "-n", dra.ns, "-c", "main", "--", "cuprog", "fill", "alloc",
                               str(1024 * MIB), "2", "15"], stdout=subprocess.PIPE, text=True)
    try:
        def held() -> dict[str, Any] | None:
            info = json.loads(exec_in(dra, "two", "side", "cuprog info").splitlines()[0])
            return info if info["free"] <= 1000 * MIB + 1 else None

        info = wait_for(held, 12, "the other container's 2 GiB in this one's free memory")
        assert info["total"] == 3000 * MIB, info
    finally:
        holder.wait(30)


def _fill_mib(rp: RealPods, pod: str) -> int:
    """What ``cuprog fill`` gets in ``pod`` (256 MiB chunks until refused), in MiB."""
    fill = json.loads(exec_in(rp, pod, "main", f"cuprog fill alloc {256 * MIB}").splitlines()[0])
    assert fill["rc"] == 2, fill  # stopped by a refusal, not by an error
    return int(fill["bytes"]) // MIB


def test_pods_sharing_one_claim_share_its_quota(dra: RealPods) -> None:
    """Two pods (two PID namespaces, both processes PID 1-ish there) on ONE ResourceClaim: what
    both hold stays within the claim's 3000 MiB; once one pod is gone the agent marks its slots
    dead and the other gets the room back within the agent's interval (5 s). On main's shim each
    pod reaped the other's slots (a PID of another namespace looked dead) and got 3000 MiB."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "pair", "namespace": dra.ns}, "spec": _template(dra, "x")["spec"]["spec"]}
    pods = [_dra_pod(dra, n, "x") for n in ("p1", "p2")]
    for pod in pods:
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "pair"}]
    _apply(dra, claim, *pods)
    dra.wait_running("p1", timeout=90)
    dra.wait_running("p2", timeout=90)
    holder = subprocess.Popen([str(dra.cluster.bin_dir / "kubectl"), f"--kubeconfig={dra.cluster.kubeconfig}",
                               "exec", "p1", "-n", dra.ns, "-c", "main", "--", "cuprog", "fill", "alloc",
                               str(1024 * MIB), "2", "600"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())  # printed once the 2 GiB are held
        assert held["bytes"] == 2048 * MIB, held
        got = _fill_mib(dra, "p2")
        assert got <= 1000, f"p2 got {got} MiB beside p1's 2048 MiB of a 3000 MiB claim"
        dra.cluster.kubectl("delete", "pod", "p1", "-n", dra.ns, "--grace-period=0", "--wait=true",
                            "--timeout=60s")
        gone = time.monotonic()
        back = wait_for(lambda: (lambda m: m if m >= 2000 else 0)(_fill_mib(dra, "p2")), 20,
                        "p1's 2 GiB back in p2's quota")
        print(f"shared claim: p2 got {got} MiB beside p1's 2048 MiB; {back} MiB "
              f"{time.monotonic() - gone:.1f} s after p1 was deleted")
    finally:
        holder.kill()
        holder.wait(30)


def test_agent_restart_then_unprepare_removes_the_files(dra: RealPods) -> None:
    _apply(dra, _template(dra, "seed"), _dra_pod(dra, "kept", "seed"))
    dra.wait_running("kept", timeout=90)
    uid = _claim_of(dra, "kept")["metadata"]["uid"]
    dra.node.restart_agent()
    assert exec_in(dra, "kept", "main", f"cat {keys.CONTAINER_CLAIM_FILE}").endswith(",3000,30")
    dra.cluster.kubectl("delete", "pod", "kept", "-n", dra.ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: _node_files(uid, dra.node) == [], 30, "the files removed by the restarted agent")
