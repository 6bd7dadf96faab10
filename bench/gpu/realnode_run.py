"""The seed walk-through as a real pod on a GPU machine (run by bench/gpu/realnode.sh).

    python3 bench/gpu/realnode_run.py --run-dir DIR --out DIR

Starts the local control plane and kvgpu (operator, kvgpu-scheduler), a real kubelet +
containerd node (``RealNode(gpu=True)``: the host's /dev/nvidia* and driver folder, the agent
with real NVML), applies the default pool, then the seed's pod (HAMi form: 1 card, 3000 MiB,
30 % of the SMs) and checks it from inside the container:

- ``kubectl describe node`` shows ``nvidia.com/gpu: 10`` (1 card x splitCount 10);
- ``kubectl exec gpu-pod -- nvidia-smi`` shows ``… / 3000MiB``;
- torch in the pod allocates 256 MiB blocks until ``torch.OutOfMemoryError``;
- a saturating matmul in the pod runs at about 30 % of the same loop run natively on the host.

``--parts dra`` (DRA mode, issue 18): the node's pool gets ``allocation: dra``, the card becomes
device ``gpu-0`` of the node's ResourceSlice, and the seed's slice is asked for with a
ResourceClaimTemplate (memory 3000Mi, cores 30) by a pod placed by the default kube-scheduler;
the real kubelet calls the agent's DRA plugin, containerd applies its CDI spec, and the same
checks run in the pod: ``nvidia-smi`` shows ``… / 3000MiB``, torch stops at
``torch.OutOfMemoryError`` below 3000 MiB, and the claim file holds the claim string.

``--parts mps``: bench/gpu/realnode_mps.py. ``--parts backstop``: bench/gpu/realnode_backstop.py
(a tenant that bypasses the shim, one that zeroes its region: both killed by the agent).
``--parts workloads``: bench/gpu/realnode_workloads.py (the GPU suite's training, inference and
co-tenant workloads as pods, under the agent's schedule, judged as the suite judges). Every
run checks at its end that no other pod's process was killed by the agent or the shim.

The pod's image is ``kvgpu.local/hostroot:1`` (an empty root whose ``/usr/{bin,lib,lib64,share}``
are the host's, mounted read-only, and torch's venv at /opt/torch): no registry can be reached from the
machine, and torch with its CUDA libraries is several GB. Everything else is what a tenant gets.
Prints a JSON summary as the last line; exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from kvgpu.demo import wait
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.cluster import REPO_ROOT
from kvgpu.devcluster.realnode import RealNode, host_node_ip
from kvgpu.devcluster.runtimeplugin import RuntimePlugin
from kvgpu.devcluster.system import KvgpuSystem
from kvgpu.dra.slices import DRIVER, device_classes, slice_name
from realnode_backstop import TENANTS, backstop, backstop_ok, kill_events
from realnode_kit import TORCH_PY, matmul, memtest, running, say, seed_pod, show
from realnode_mps import MPS_ROOT, mps, mps_ok
from realnode_workloads import workloads, workloads_ok


def isolation(c: Cluster, res: dict[str, Any]) -> None:
    """Issue 14 on the GPU: a 1000 MiB slice whose process forges a bigger claim (env and file)
    gets no more than its grant; a non-root tenant (uid 1000, read-only root) runs under its claim."""
    say("a 1000 MiB slice that forges a 100000 MiB claim (KVGPU_CLAIM and KVGPU_CLAIM_FILE)")
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("forger", 1000, None)))
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("nonroot", 1000, None, nonroot=True)))
    running(c, "forger", "nonroot")
    claim = json.loads(c.kubectl("get", "pod", "forger", "-o", "json").stdout)["metadata"]["annotations"]
    real = next(v for k, v in claim.items() if k.startswith("kvgpu.io/claim."))
    forged = re.sub(r",1000,0$", ",100000,0", real).replace("priority=1", "priority=0")
    m = memtest(c, "forger", f"printf '%s' '{forged}' > /tmp/forged; KVGPU_CLAIM='{forged}' "
                              "KVGPU_CLAIM_FILE=/tmp/forged ")
    res["forged_reachable_mib"], res["forged_error"] = m.get("reachable_mib"), m.get("error")
    res["forged_nvml_peak_mib"] = m.get("nvml_process_peak_mib")
    say("a non-root tenant (uid 1000, runAsNonRoot, readOnlyRootFilesystem) under its 1000 MiB claim")
    show(c, "exec", "nonroot", "--", "/usr/bin/id")
    m = memtest(c, "nonroot")
    res["nonroot_reachable_mib"], res["nonroot_error"] = m.get("reachable_mib"), m.get("error")
    res["nonroot_mem_get_info_mib"] = m.get("mem_get_info_before_mib")
    c.kubectl("delete", "pod", "forger", "nonroot", "--wait=true", "--timeout=60s", check=False)


def seed(c: Cluster, node: RealNode) -> dict[str, Any]:
    res: dict[str, Any] = {}
    say("the node as the kubelet registered it")
    wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu") == "10",
         60, "nvidia.com/gpu: 10 on the node")
    desc = show(c, "describe", "node", node.name)
    res["describe_node_gpu"] = [ln.strip() for ln in desc.splitlines() if "nvidia.com/gpu" in ln]
    say("the seed's pod, HAMi form (1 card, 3000 MiB, 30 %)")
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("gpu-pod")))
    running(c, "gpu-pod")
    show(c, "get", "pods", "-o", "wide")
    show(c, "get", "vgpuclaims", "-o", "wide")
    say("inside the pod")
    show(c, "exec", "gpu-pod", "--", "/usr/bin/sh", "-c", "ls -l /dev/nvidia* /usr/local/nvidia/bin; "
         "cat /proc/self/mounts | grep -E 'kvgpu|nvidia|ld.so' ; env | grep -E 'KVGPU|NVIDIA|LD_' | sort")
    smi = show(c, "exec", "gpu-pod", "--", "nvidia-smi")
    res["nvidia_smi_3000"] = re.search(r"\b0MiB\s*/\s*3000MiB", smi) is not None
    q = show(c, "exec", "gpu-pod", "--", "nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv")
    res["nvidia_smi_query"] = q.strip().splitlines()[-1] if q.strip() else ""
    say("torch in the pod: 256 MiB blocks until the limit")
    mem = show(c, "exec", "gpu-pod", "--", TORCH_PY, "/repo/bench/gpu/memtest.py", "256", timeout=180)
    try:
        m = json.loads(mem.strip().splitlines()[-1])
        res["torch_exception"] = m.get("error")
        res["torch_reachable_mib"] = m.get("reachable_mib")
        res["torch_mem_get_info_mib"] = m.get("mem_get_info_before_mib")
    except (ValueError, IndexError):
        res["torch_exception"] = None
    say("matmul: native on the host, then in the pod under the 30 % claim")
    native = matmul([TORCH_PY, str(REPO_ROOT / "bench/gpu/matmul.py"), "10", "native"])
    pod = matmul([str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}", "exec", "gpu-pod", "--",
                  TORCH_PY, "/repo/bench/gpu/matmul.py", "10", "pod30"])
    res["matmul_native_its"], res["matmul_pod_its"] = native["its"], pod["its"]
    res["matmul_percent_of_native"] = round(100 * pod["its"] / native["its"], 1)
    show(c, "get", "events", "--sort-by=.lastTimestamp")
    c.kubectl("delete", "pod", "gpu-pod", "--wait=true", "--timeout=60s", check=False)
    return res


def dra_seed_objects(name: str) -> list[dict[str, Any]]:
    """The seed's slice in DRA mode: a ResourceClaimTemplate (3000Mi, 30 %) and the pod using it."""
    req = {"name": "gpu", "exactly": {"deviceClassName": DRIVER,
                                      "capacity": {"requests": {"memory": "3000Mi", "cores": "30"}}}}
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "seed", "namespace": "default"},
                "spec": {"spec": {"devices": {"requests": [req]}}}}
    pod = seed_pod(name)
    ctr = pod["spec"]["containers"][0]  # type: ignore[index]
    ctr["resources"] = {"claims": [{"name": "gpu"}]}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "seed"}]  # type: ignore[index]
    return [template, pod]


def dra(c: Cluster, node: RealNode) -> dict[str, Any]:
    """The seed's slice through DRA: the pool switched to allocation dra, a claim template."""
    res: dict[str, Any] = {}
    say("DRA mode: the node's pool with allocation: dra, the DeviceClass gpu.kvgpu.io")
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": device_classes()}))
    node.apply_pool(allocation="dra")

    def slice_devices() -> list[str]:
        p = c.kubectl("get", "resourceslice", slice_name(node.name), "-o", "json", check=False)
        return [d["name"] for d in json.loads(p.stdout)["spec"]["devices"]] if p.returncode == 0 else []

    res["dra_slice_devices"] = wait(slice_devices, 60, "the node's ResourceSlice")
    show(c, "get", "resourceslice", slice_name(node.name), "-o", "yaml")
    wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu") in ("0", None),
         60, "nvidia.com/gpu: 0 (the card is a DRA device now)")
    say("the seed's pod with a ResourceClaimTemplate (3000Mi, 30 %)")
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                     "items": dra_seed_objects("dra-pod")}))
    running(c, "dra-pod")
    show(c, "get", "pods", "-o", "wide")
    show(c, "get", "resourceclaims", "-o", "yaml")
    say("inside the DRA pod")
    show(c, "exec", "dra-pod", "--", "/usr/bin/sh", "-c", "ls -l /dev/nvidia*; cat /etc/kvgpu/claim; echo; "
         "cat /proc/self/mounts | grep -E 'kvgpu|nvidia|ld.so' ; env | grep -E 'KVGPU|NVIDIA|LD_' | sort")
    res["dra_claim_file"] = show(c, "exec", "dra-pod", "--", "/usr/bin/cat", "/etc/kvgpu/claim").strip()
    smi = show(c, "exec", "dra-pod", "--", "nvidia-smi")
    res["dra_nvidia_smi_3000"] = re.search(r"\b0MiB\s*/\s*3000MiB", smi) is not None
    mem = show(c, "exec", "dra-pod", "--", TORCH_PY, "/repo/bench/gpu/memtest.py", "256", timeout=180)
    try:
        m = json.loads(mem.strip().splitlines()[-1])
        res["dra_torch_exception"], res["dra_torch_reachable_mib"] = m.get("error"), m.get("reachable_mib")
    except (ValueError, IndexError):
        res["dra_torch_exception"] = None
    show(c, "get", "events", "--sort-by=.lastTimestamp")
    c.kubectl("delete", "pod", "dra-pod", "--wait=true", "--timeout=60s", check=False)
    c.kubectl("delete", "resourceclaimtemplate", "seed", "--ignore-not-found", check=False)
    c.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found", check=False)
    return res



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="seed,isolation",
                    help="comma-separated: seed, isolation, backstop, dra, mps, workloads")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    a.out.mkdir(parents=True, exist_ok=True)
    # DRA needs the controller manager: its resourceclaim controller makes a pod's claim from the template
    c = Cluster(run_dir=a.run_dir, with_controller_manager="dra" in parts)
    system = KvgpuSystem(c)
    node = RealNode(c, name="h200-node", node_ip=host_node_ip(), gpu=True,
                    containerd_bin=Path(os.environ["KVGPU_CONTAINERD_BIN"]))
    runtime = RuntimePlugin(dev_root=str(node.dev_root), driver_root=str(node.driver_root))
    res: dict[str, Any] = {}
    try:
        say("control plane, kvgpu, the real node")
        c.start()
        system.start()
        node.start()
        node.apply_pool()  # splitCount 10 over this node's card
        node.start_agent()
        if "seed" in parts:
            res.update(seed(c, node))
        if "isolation" in parts:
            wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu"),
                 60, "nvidia.com/gpu on the node")
            isolation(c, res)
        if "backstop" in parts:
            backstop(c, res)
        if "dra" in parts:
            res.update(dra(c, node))
        if "mps" in parts:
            mps(c, node, runtime, res)
        if "workloads" in parts:
            workloads(c, res)
        res["kill_events"] = kill_events(c)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        for log in (node.kubelet_log, node.agent_log, node.containerd_log, system.operator_log()):
            print(f"--- tail of {log}")
            try:
                print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
            except OSError as err:
                print(err)
    finally:
        runtime.stop()
        node.stop(check=False)
        system.stop()
        c.stop()
        if "mps" in parts:
            shutil.rmtree(MPS_ROOT, ignore_errors=True)
    oom = "OutOfMemoryError"
    ok = "error" not in res and not [e for e in res.get("kill_events", []) if e["pod"] not in TENANTS]
    if "seed" in parts:
        ok = ok and bool(res.get("nvidia_smi_3000") and str(res.get("torch_exception")).endswith(oom)
                         and abs(res.get("matmul_percent_of_native", 0) - 30) <= 3)
    if "isolation" in parts:
        ok = ok and str(res.get("forged_error")).endswith(oom) and (res.get("forged_reachable_mib") or 1e9) < 1000
        ok = ok and (res.get("forged_nvml_peak_mib") or 1e9) <= 1000
        ok = ok and str(res.get("nonroot_error")).endswith(oom) and (res.get("nonroot_reachable_mib") or 1e9) < 1000
    if "dra" in parts:
        ok = ok and bool(res.get("dra_nvidia_smi_3000") and str(res.get("dra_torch_exception")).endswith(oom)
                         and (res.get("dra_torch_reachable_mib") or 1e9) <= 3000
                         and str(res.get("dra_claim_file", "")).endswith(",3000,30"))
    if "mps" in parts:
        ok = ok and mps_ok(res)
    if "backstop" in parts:
        ok = ok and backstop_ok(res)
    if "workloads" in parts:
        ok = ok and workloads_ok(res)
    res["ok"] = bool(ok)
    (a.out / "realnode-h200.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

