"""Namespace quotas on GPU slices (issue 16) on the real API server, pods bound by the real
kube-scheduler through the extender: a ResourceQuota's GPU keys counted HAMi's way (per card ×
cards), a VGPUQuota with its status written by the operator, init containers counted, 50 pods
created at once never passing a quota, a pending pod placed once usage frees, ``kubectl vgpu
quota``, and tenants that may read their quotas but not write them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.cluster.conftest import GpuEnv
from tests.helmkit import render

PLUGIN = Path(sys.executable).with_name("kubectl-vgpu")


def hami(cards: int, mib: int) -> dict[str, str]:
    return {"nvidia.com/gpu": str(cards), "nvidia.com/gpumem": str(mib)}


def resource_quota(gpu: GpuEnv, name: str, hard: dict[str, str]) -> None:
    gpu.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": gpu.ns},
               "spec": {"hard": hard}})


def vgpu_quota(gpu: GpuEnv, name: str, hard: dict[str, int]) -> None:
    gpu.apply({"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUQuota",
               "metadata": {"name": name, "namespace": gpu.ns}, "spec": {"hard": hard}})


def refused_with(gpu: GpuEnv, pod: str, text: str, timeout: float = 30) -> str:
    """The FailedScheduling event of ``pod`` whose message has ``text``."""
    def find() -> str | None:
        return next((e for e in gpu.events(pod) if e.startswith("FailedScheduling") and text in e), None)

    try:
        return str(gpu.wait(find, timeout, f"FailedScheduling of {pod} naming {text!r}"))
    except AssertionError as e:
        raise AssertionError(f"{e}; events: {gpu.events(pod)}") from None


def bound(gpu: GpuEnv) -> list[dict[str, Any]]:
    return [p for p in gpu.pods() if p["spec"].get("nodeName")]


def live_claims(gpu: GpuEnv) -> list[dict[str, Any]]:
    return [c for c in gpu.claims() if (c.get("status") or {}).get("phase") not in ("Released", "Failed")]


def claims_memory(gpu: GpuEnv) -> int:
    return sum(d["memory"] for c in live_claims(gpu) for d in c["spec"]["devices"])


def test_resource_quota_counts_per_card_times_cards_and_frees_on_release(gpu: GpuEnv) -> None:
    """limits.nvidia.com/gpumem 4096: `gpu: 2, gpumem: 2048` uses it all (the API server itself
    would count 2048, and not at all for the limits. form); the next pod, in HAMi's form or
    kvgpu's annotations, is refused naming the quota; deleting the first places the second."""
    gpu.nodes(1, cards=2)
    resource_quota(gpu, "gpu-quota", {"limits.nvidia.com/gpumem": "4096", "pods": "20"})
    gpu.create(gpu.pod("first", limits=hami(2, 2048)))
    gpu.wait_bound("first")
    gpu.create(gpu.pod("second", limits=hami(2, 2048)), gpu.pod("third", {"kvgpu.io/gpumem": "1000"}))
    quota = f"ResourceQuota {gpu.ns}/gpu-quota limits.nvidia.com/gpumem"
    refused_with(gpu, "second", f"{quota}: used 4096 + requested 4096 > hard 4096 (MiB)")
    refused_with(gpu, "third", f"{quota}: used 4096 + requested 1000 > hard 4096 (MiB)")
    assert any(e.startswith("GPUQuotaExceeded") for e in gpu.events("second"))
    assert [p["metadata"]["name"] for p in bound(gpu)] == ["first"]
    assert claims_memory(gpu) == 4096
    # The API server's own count: the limits. key is not tracked at all.
    status = gpu.get("resourcequota", "gpu-quota")["status"]
    assert "limits.nvidia.com/gpumem" not in (status.get("used") or {})

    gpu.delete_pod("first")
    placed = gpu.wait(lambda: [p["metadata"]["name"] for p in bound(gpu) if p["metadata"]["name"] != "first"],
                      30, "a pending pod placed once the quota's usage freed")
    time.sleep(2)
    names = sorted(p["metadata"]["name"] for p in bound(gpu))
    assert placed and claims_memory(gpu) <= 4096, names
    assert names in (["second"], ["third"]), names


def test_init_container_only_gpu_pod_over_the_quota_is_refused(gpu: GpuEnv) -> None:
    """A pod's need is max(any init container, sum of the app containers): an init container of
    5000 MiB alone passes a 4096 MiB VGPUQuota; one of 3000 MiB before an app container of 1000
    MiB uses 3000, which status.used shows."""
    gpu.nodes(1, cards=2)
    vgpu_quota(gpu, "team", {"memory": 4096})

    def with_init(name: str, init_mib: int, app_mib: int | None) -> dict[str, Any]:
        pod = gpu.pod(name)
        if app_mib is not None:
            pod["spec"]["containers"][0]["resources"] = {"limits": hami(1, app_mib)}
        pod["spec"]["initContainers"] = [{"name": "prep", "image": "cuda", "command": ["true"],
                                          "resources": {"limits": hami(1, init_mib)}}]
        return pod

    gpu.create(with_init("big-init", 5000, None))
    refused_with(gpu, "big-init", f"VGPUQuota {gpu.ns}/team spec.hard.memory: used 0 + requested 5000 > "
                                  "hard 4096 (MiB)")
    gpu.create(with_init("small-init", 3000, 1000))
    gpu.wait_bound("small-init")
    assert claims_memory(gpu) == 4000  # both containers' claims: the ledger holds both
    st = gpu.wait(lambda: (s := gpu.get("vgpuquota", "team").get("status") or {}).get("used", {}).get("memory")
                  == 3000 and s, 30, "status.used of the VGPUQuota")
    assert st["hard"] == {"memory": 4096} and st["used"]["slices"] == 1 and st["memorySummary"] == "3000Mi/4Gi"
    assert not gpu.get("pod", "big-init")["spec"].get("nodeName")


def test_fifty_pods_at_once_never_pass_the_quota(gpu: GpuEnv) -> None:
    """50 pods of 1 x 1024 MiB created in one request against 10 x 1024 MiB: exactly 10 bound,
    the claims hold 10240 MiB, status.used matches; pods deleted free room for as many others."""
    gpu.nodes(2, cards=4)
    vgpu_quota(gpu, "team", {"memory": 10240, "slices": 40})
    gpu.create(*(gpu.pod(f"p{i:02d}", limits=hami(1, 1024)) for i in range(50)))

    def settled() -> list[dict[str, Any]] | None:
        b = bound(gpu)
        assert len(b) <= 10, f"{len(b)} pods bound past the quota"
        return b if len(b) == 10 else None

    gpu.wait(settled, 120, "10 pods bound")
    time.sleep(3)  # the rest keep being refused; nothing more is bound
    b = bound(gpu)
    assert len(b) == 10 and claims_memory(gpu) == 10240 and len(live_claims(gpu)) == 10
    waiting = next(p["metadata"]["name"] for p in gpu.pods() if not p["spec"].get("nodeName"))
    refused_with(gpu, waiting, f"VGPUQuota {gpu.ns}/team spec.hard.memory: used 10240 + requested 1024 > "
                               "hard 10240 (MiB)")

    def status_used() -> Any:
        used = (gpu.get("vgpuquota", "team").get("status") or {}).get("used") or {}
        return used if used.get("memory") == 10240 else None

    assert gpu.wait(status_used, 30, "status.used") == {"memory": 10240, "cores": 0, "cards": 10, "slices": 10}
    table = gpu.cluster.kubectl("get", "vgpuquotas", "-n", gpu.ns).stdout.split()
    assert "10Gi/10Gi" in table and "10/40" in table

    for p in b[:3]:
        gpu.delete_pod(p["metadata"]["name"])
    gone = {p["metadata"]["name"] for p in b[:3]}

    def replaced() -> bool:
        now = [p for p in bound(gpu) if p["metadata"]["name"] not in gone]
        assert len(now) <= 10
        return len(now) == 10

    gpu.wait(replaced, 60, "3 pending pods placed after 3 were deleted")
    gpu.wait(lambda: claims_memory(gpu) == 10240, 30, "claims of the deleted pods gone")
    time.sleep(2)
    assert len([p for p in bound(gpu) if p["metadata"]["name"] not in gone]) == 10

    out = subprocess.run([str(PLUGIN), f"--kubeconfig={gpu.cluster.kubeconfig}", "quota", "-n", gpu.ns, "-o",
                          "json"], capture_output=True, text=True, timeout=60, check=True).stdout
    rows = {r["resource"]: (r["used"], r["hard"]) for r in json.loads(out)}
    assert rows == {"spec.hard.memory": (10240, 10240), "spec.hard.slices": (10, 40)}
    text = subprocess.run([str(PLUGIN), f"--kubeconfig={gpu.cluster.kubeconfig}", "quota", "-n", gpu.ns],
                          capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert text[0].split() == ["QUOTA", "RESOURCE", "USED", "HARD"]
    assert text[1].split() == ["VGPUQuota/team", "spec.hard.memory", "10Gi", "10Gi"]


def test_tenants_read_their_quotas_but_cannot_write_them(gpu: GpuEnv) -> None:
    """With the chart's tenant roles aggregated into `edit`, a user with `edit` in the
    namespace gets and lists VGPUQuotas and cannot create, change or delete them, nor their
    status."""
    k = gpu.cluster.kubectl
    tenant_roles = [d for d in render() if d["kind"] == "ClusterRole" and d["metadata"]["name"] in
                    ("kvgpu-view", "kvgpu-edit")]
    assert len(tenant_roles) == 2
    k("apply", "--server-side", "--force-conflicts", "-f", "-",
      input=json.dumps({"apiVersion": "v1", "kind": "List", "items": tenant_roles}))
    try:
        k("create", "rolebinding", "tenant-edit", "-n", gpu.ns, "--clusterrole=edit", "--user=tenant")

        def can(verb: str, sub: str = "") -> bool:
            args = ["auth", "can-i", verb, "vgpuquotas.kvgpu.io" + (f"/{sub}" if sub else ""), "-n", gpu.ns,
                    "--as=tenant"]
            return k(*args, check=False).stdout.strip() == "yes"

        gpu.wait(lambda: can("list"), 30, "the kvgpu-edit rules aggregated into edit")
        assert can("get") and can("watch")
        assert not any(can(v) for v in ("create", "update", "patch", "delete"))
        assert not can("patch", "status") and not can("update", "status")
    finally:
        # cluster-scoped: a later helm install of the chart could not adopt them
        k("delete", "clusterrole", "kvgpu-view", "kvgpu-edit", "--ignore-not-found", check=False)
