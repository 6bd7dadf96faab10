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

``--parts mps`` (the MPS backend, issue 21): the agent runs with ``--mps-daemons=separate`` and
the daemons' owner runs as a pod, the chart's ``kvgpu-mps`` container (``kvgpu mps-daemons``,
root with only ``SETUID``/``SETGID``, read-only root file system, RuntimeDefault seccomp, the MPS
root hostPath); as a bare Pod bound to the node on the host network, with the machine's Python
folders mounted, and the NVIDIA runtime it names replaced by
:class:`~kvgpu.devcluster.runtimeplugin.RuntimePlugin` (every card's device node and the driver
folders, from a device plugin: the machine has no NVIDIA container toolkit). The node's card
becomes an mps pool; once the owner's ``status.json`` says its daemon answers, two sliced pods
(3000 MiB / 30 %, and 4000 MiB / 50 % whose pod spec sets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=100G`` and ``CUDA_MPS_PIPE_DIRECTORY=/tmp``) run on the card.
Checked: the owner's capabilities (``CapEff`` = SETUID|SETGID) and read-only root, its daemon in
its pod's cgroup; in each pod ``nvidia-smi`` shows the slice's memory total, the three variables
after CUDA started are the claim's (``bench/gpu/mps_env.py``), torch stops at
``torch.OutOfMemoryError`` below the claim; both pods' matmul loops at once, each within 10
points of its thread percentage of the native loop; ``nvidia-smi`` on the host meanwhile lists
``nvidia-cuda-mps-server`` and the two clients as ``M+C``; the owner's status fresh at the end.
The daemons' control and server logs are printed at the end of the part.

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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvgpu.agent import mps as mpsd
from kvgpu.core import keys
from kvgpu.demo import wait
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.cluster import REPO_ROOT
from kvgpu.devcluster.realnode import RealNode, host_node_ip
from kvgpu.devcluster.runtimeplugin import RESOURCE as RUNTIME_RESOURCE
from kvgpu.devcluster.runtimeplugin import RuntimePlugin
from kvgpu.devcluster.system import KvgpuSystem
from kvgpu.dra.slices import DRIVER, device_classes, slice_name

TORCH_PY = "/opt/torch/.venv/bin/python3"
# The machine's /usr folders the pod mounts read-only (not /usr itself: admission refuses host
# paths above kvgpu's own, /usr/local/kvgpu; the driver and the shim come from kvgpu's mounts).
HOST_USR = ("bin", "lib", "lib64", "share")
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"\n=== {text}  (+{time.monotonic() - T0:.1f} s)", flush=True)


def show(c: Cluster, *args: str, timeout: float = 120) -> str:
    p = c.kubectl(*args, check=False, timeout=timeout)
    print(f"$ kubectl {' '.join(args)}\n{(p.stdout + p.stderr).rstrip()}", flush=True)
    return p.stdout


def seed_pod(name: str, mem_mib: int = 3000, cores: int | None = 30, nonroot: bool = False) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": mem_mib}
    if cores is not None:
        limits["nvidia.com/gpucores"] = cores
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "hostNetwork": True,  # the GPU checks need no pod network; the machine has no ip/iptables tools
            "containers": [{
                "name": "cuda", "image": "kvgpu.local/hostroot:1", "imagePullPolicy": "Never",
                "command": ["/usr/bin/sleep", "infinity"],
                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                "resources": {"limits": limits},
                "volumeMounts": [*({"name": f"usr-{d}", "mountPath": f"/usr/{d}", "readOnly": True} for d in HOST_USR),
                                 {"name": "torch", "mountPath": "/opt/torch", "readOnly": True},
                                 {"name": "repo", "mountPath": "/repo", "readOnly": True}],
            }],
            "volumes": [*({"name": f"usr-{d}", "hostPath": {"path": f"/usr/{d}", "type": "Directory"}}
                          for d in HOST_USR),
                        {"name": "torch", "hostPath": {"path": "/opt/torch", "type": "Directory"}},
                        {"name": "repo", "hostPath": {"path": str(REPO_ROOT), "type": "Directory"}}],
        },
    }
    if nonroot:  # as notebook images run: uid 1000, read-only root, a writable /tmp
        ctr = pod["spec"]["containers"][0]  # type: ignore[index]
        ctr["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                                  "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
        ctr["env"].append({"name": "HOME", "value": "/tmp"})
        ctr["volumeMounts"].append({"name": "tmp", "mountPath": "/tmp"})
        pod["spec"]["volumes"].append({"name": "tmp", "emptyDir": {}})  # type: ignore[index]
    return pod


def _memtest(c: Cluster, pod: str, prefix: str = "") -> dict[str, Any]:
    out = show(c, "exec", pod, "--", "/usr/bin/sh", "-c", f"{prefix}{TORCH_PY} /repo/bench/gpu/memtest.py 128",
               timeout=180)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {}


def isolation(c: Cluster, res: dict[str, Any]) -> None:
    """Issue 14 on the GPU: a 1000 MiB slice whose process forges a bigger claim (env and file)
    gets no more than its grant; a non-root tenant (uid 1000, read-only root) runs under its claim."""
    say("a 1000 MiB slice that forges a 100000 MiB claim (KVGPU_CLAIM and KVGPU_CLAIM_FILE)")
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("forger", 1000, None)))
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("nonroot", 1000, None, nonroot=True)))
    for name in ("forger", "nonroot"):
        wait(lambda n=name: json.loads(c.kubectl("get", "pod", n, "-o", "json").stdout)["status"].get("phase")
             in ("Running", "Failed"), 120, f"{name} Running")
    claim = json.loads(c.kubectl("get", "pod", "forger", "-o", "json").stdout)["metadata"]["annotations"]
    real = next(v for k, v in claim.items() if k.startswith("kvgpu.io/claim."))
    forged = re.sub(r",1000,0$", ",100000,0", real).replace("priority=1", "priority=0")
    m = _memtest(c, "forger", f"printf '%s' '{forged}' > /tmp/forged; KVGPU_CLAIM='{forged}' "
                              "KVGPU_CLAIM_FILE=/tmp/forged ")
    res["forged_reachable_mib"], res["forged_error"] = m.get("reachable_mib"), m.get("error")
    res["forged_nvml_peak_mib"] = m.get("nvml_process_peak_mib")
    say("a non-root tenant (uid 1000, runAsNonRoot, readOnlyRootFilesystem) under its 1000 MiB claim")
    show(c, "exec", "nonroot", "--", "/usr/bin/id")
    m = _memtest(c, "nonroot")
    res["nonroot_reachable_mib"], res["nonroot_error"] = m.get("reachable_mib"), m.get("error")
    res["nonroot_mem_get_info_mib"] = m.get("mem_get_info_before_mib")
    c.kubectl("delete", "pod", "forger", "nonroot", "--wait=true", "--timeout=60s", check=False)


def matmul(argv: list[str], timeout: float = 120) -> dict[str, Any]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    print((p.stdout + p.stderr).rstrip()[-2000:], flush=True)
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def seed(c: Cluster, node: RealNode) -> dict[str, Any]:
    res: dict[str, Any] = {}
    say("the node as the kubelet registered it")
    wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu") == "10",
         60, "nvidia.com/gpu: 10 on the node")
    desc = show(c, "describe", "node", node.name)
    res["describe_node_gpu"] = [ln.strip() for ln in desc.splitlines() if "nvidia.com/gpu" in ln]
    say("the seed's pod, HAMi form (1 card, 3000 MiB, 30 %)")
    c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod("gpu-pod")))
    wait(lambda: json.loads(c.kubectl("get", "pod", "gpu-pod", "-o", "json").stdout)["status"].get("phase")
         in ("Running", "Failed"), 120, "gpu-pod Running")
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
    wait(lambda: json.loads(c.kubectl("get", "pod", "dra-pod", "-o", "json").stdout)["status"].get("phase")
         in ("Running", "Failed"), 120, "dra-pod Running")
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


# ----- part mps: the MPS backend with its daemons' owner as a pod (issue 21) -----------------------
MPS_ROOT = Path(keys.HOST_MPS_ROOT)
MPS_OWNER = "kvgpu-mps"
# kube-system: a namespace kvgpu's webhooks never see, as the chart's kvgpu-system is for its operator
MPS_OWNER_NS = "kube-system"
#: the tenants: (pod, MiB, cores); the second sets the MPS variables itself, bigger than its claim
MPS_TENANTS = (("mps-a", 3000, 30), ("mps-b", 4000, 50))
MPS_FORGED_ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=100G",
                  "CUDA_MPS_PIPE_DIRECTORY": "/tmp"}
#: charts/kvgpu/templates/mps.yaml, the kvgpu-mps container's securityContext
MPS_OWNER_SECURITY = {"runAsUser": 0, "privileged": False, "allowPrivilegeEscalation": False,
                      "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID"]},
                      "seccompProfile": {"type": "RuntimeDefault"}}
#: CapEff of a root process with only CAP_SETGID (6) and CAP_SETUID (7)
SETUID_SETGID_CAPS = f"{(1 << 6) | (1 << 7):016x}"


def _python_dirs() -> list[str]:
    """The sys.path folders (besides the standard library's) that ``kvgpu mps-daemons`` imports
    from, asked of a fresh interpreter with this process's environment."""
    code = """if True:
        import sys, sysconfig
        from pathlib import Path
        import kvgpu.cli.main, kvgpu.agent.mps, kvgpu.logs
        std = sysconfig.get_paths()["stdlib"]
        roots = set()
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if "." not in name and f and not f.startswith(std):
                path = Path(f).resolve()
                roots.add(str(path.parents[1] if path.name == "__init__.py" else path.parent))
        print("\\n".join(sorted(roots)))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return [d for d in p.stdout.split() if d]


def _pod_python() -> str:
    exe = str(Path(sys.executable).resolve())
    return exe if any(exe.startswith(f"/usr/{d}/") for d in HOST_USR) else "/usr/bin/python3"


def mps_owner_pod(node: RealNode) -> dict[str, Any]:
    """The chart's kvgpu-mps pod (charts/kvgpu/templates/mps.yaml): its command (``kvgpu mps-daemons
    --root=/var/run/kvgpu/mps --interval=5``), env, securityContext and MPS root hostPath; no API
    access. Differences, for this node: a bare Pod bound to the node (no DaemonSet controller
    here), the host network (no pod network tools on the machine), the hostroot image with the
    machine's /usr and kvgpu's Python folders read-only (the product image is not built there),
    and, for the NVIDIA runtime the chart names (runtimeClassName, NVIDIA_VISIBLE_DEVICES=all),
    one unit of the runtime stand-in's resource: every card's device node and the driver folders."""
    dirs = _python_dirs()
    mounts = [{"name": f"usr-{d}", "mountPath": f"/usr/{d}", "readOnly": True} for d in HOST_USR]
    vols: list[dict[str, Any]] = [{"name": f"usr-{d}", "hostPath": {"path": f"/usr/{d}", "type": "Directory"}}
                                  for d in HOST_USR]
    for i, d in enumerate(dirs):
        mounts.append({"name": f"py-{i}", "mountPath": f"/py/{i}", "readOnly": True})
        vols.append({"name": f"py-{i}", "hostPath": {"path": d, "type": "Directory"}})
    mounts.append({"name": "mps", "mountPath": keys.HOST_MPS_ROOT})
    vols.append({"name": "mps", "hostPath": {"path": keys.HOST_MPS_ROOT, "type": "DirectoryOrCreate"}})
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
           {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
           {"name": "PYTHONPATH", "value": ":".join(f"/py/{i}" for i in range(len(dirs)))},
           {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": MPS_OWNER, "namespace": MPS_OWNER_NS,
                     "labels": {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "mps"}},
        "spec": {
            "nodeName": node.name, "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 30, "hostNetwork": True,
            "containers": [{
                "name": "mps", "image": "kvgpu.local/hostroot:1", "imagePullPolicy": "Never",
                "command": [_pod_python(), "-m", "kvgpu.cli.main"],
                "args": ["mps-daemons", f"--root={keys.HOST_MPS_ROOT}", "--interval=5"],
                "env": env, "resources": {"limits": {RUNTIME_RESOURCE: 1}},
                "securityContext": MPS_OWNER_SECURITY, "volumeMounts": mounts,
            }],
            "volumes": vols,
        },
    }


def _json_tail(out: str) -> dict[str, Any]:
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {}


def _phase(c: Cluster, name: str, ns: str = "default") -> str | None:
    p = c.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(p.stdout)["status"].get("phase") if p.returncode == 0 else None


def _mps_processes() -> list[dict[str, Any]]:
    """The MPS control daemons and servers on the host: pid, argv, cgroup, CapEff."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            caps = next((ln.split()[1] for ln in (proc / "status").read_text().splitlines()
                         if ln.startswith("CapEff:")), "")
            out.append({"pid": int(proc.name), "argv": (proc / "cmdline").read_text().replace("\0", " ").strip(),
                        "cgroup": (proc / "cgroup").read_text().strip(), "capEff": caps})
        except OSError:
            continue
    return out


def _mps_logs(uuid: str | None) -> None:
    if uuid is None:
        return
    for name in ("control.log", "server.log"):
        f = mpsd.log_dir(MPS_ROOT, uuid) / name
        try:
            text = "\n".join(f.read_text(errors="replace").splitlines()[-25:])
        except OSError as e:
            text = str(e)
        print(f"--- {f} (last lines)\n{text}", flush=True)


def mps(c: Cluster, node: RealNode, runtime: RuntimePlugin, res: dict[str, Any]) -> None:
    """The MPS backend on the real node: the owner of the daemons as a pod, two sliced clients.
    Results go into ``res`` as they come (a failed step leaves the earlier ones)."""
    uuid: str | None = None
    say("native matmul on the host (before any MPS daemon runs)")
    native = matmul([TORCH_PY, str(REPO_ROOT / "bench/gpu/matmul.py"), "10", "native"])
    res["mps_matmul_native_its"] = native["its"]
    try:
        say("the agent with --mps-daemons=separate, the NVIDIA runtime's stand-in, the kvgpu-mps pod")
        node.restart_agent(["--mps-daemons=separate"])
        runtime.start()
        wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get(RUNTIME_RESOURCE),
             60, f"{RUNTIME_RESOURCE} on the node")
        owner = mps_owner_pod(node)
        print(json.dumps(owner), flush=True)
        c.kubectl("apply", "-f", "-", input=json.dumps(owner))
        wait(lambda: _phase(c, MPS_OWNER, MPS_OWNER_NS) in ("Running", "Failed"), 120, "the kvgpu-mps pod Running")
        show(c, "get", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "-o", "wide")
        res["mps_owner_phase"] = _phase(c, MPS_OWNER, MPS_OWNER_NS)
        st = show(c, "exec", MPS_OWNER, "-n", MPS_OWNER_NS, "--", "/usr/bin/sh", "-c",
                  "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/1/status; "
                  "grep ' / ' /proc/mounts; ls -l /dev/nvidia* /usr/local/nvidia/bin")
        res["mps_owner_capeff"] = next((ln.split()[1] for ln in st.splitlines() if ln.startswith("CapEff:")), None)
        res["mps_owner_root_ro"] = any(len(f := ln.split()) > 3 and f[1] == "/" and "ro" in f[3].split(",")
                                       for ln in st.splitlines())

        say("the node's card in an mps pool: the agent writes wanted.json, the pod starts its daemon")
        node.apply_pool(mode="mps")
        wanted = wait(lambda: mpsd.parse_wanted((MPS_ROOT / mpsd.WANTED_FILE).read_text())
                      if (MPS_ROOT / mpsd.WANTED_FILE).exists() else None, 60, "the card in wanted.json")
        uuid = wanted[0]
        res["mps_card"] = uuid
        wait(lambda: mpsd.check_ready(MPS_ROOT, uuid) is None, 60,
             "the owner's fresh status with the card's daemon answering")
        show(c, "logs", MPS_OWNER, "-n", MPS_OWNER_NS, "--tail=20")
        procs = _mps_processes()
        print(json.dumps(procs, indent=1), flush=True)
        pod_uid = json.loads(c.kubectl("get", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "-o", "json").stdout)[
            "metadata"]["uid"]
        daemons = [p for p in procs if "mps-control" in p["argv"]]
        res["mps_daemon_in_owner_pod"] = bool(daemons) and all(
            pod_uid in p["cgroup"] or pod_uid.replace("-", "_") in p["cgroup"] for p in daemons)
        res["mps_daemon_capeff"] = sorted({p["capEff"] for p in daemons})

        say("two sliced pods on the card: 3000 MiB / 30 %, and 4000 MiB / 50 % that sets the MPS env itself")
        for name, mib, cores in MPS_TENANTS:
            pod = seed_pod(name, mib, cores)
            if name == "mps-b":
                ctr = pod["spec"]["containers"][0]  # type: ignore[index]
                ctr["env"] += [{"name": k, "value": v} for k, v in MPS_FORGED_ENV.items()]
            c.kubectl("apply", "-f", "-", input=json.dumps(pod))
        for name, _, _ in MPS_TENANTS:
            wait(lambda n=name: _phase(c, n) in ("Running", "Failed"), 120, f"{name} Running")
        show(c, "get", "pods", "-A", "-o", "wide")
        show(c, "get", "vgpuclaims", "-o", "wide")
        for name, mib, cores in MPS_TENANTS:
            say(f"inside {name} ({mib} MiB, {cores} %)")
            show(c, "exec", name, "--", "/usr/bin/sh", "-c", "ls -la /var/run/kvgpu-mps; cat /etc/kvgpu/claim; echo; "
                 "grep -E 'kvgpu|nvidia' /proc/self/mounts; env | grep -E 'KVGPU|NVIDIA|CUDA_MPS|LD_' | sort")
            smi = show(c, "exec", name, "--", "nvidia-smi")
            res[f"{name}_nvidia_smi"] = re.search(rf"\b\d+MiB\s*/\s*{mib}MiB", smi) is not None
            env = _json_tail(show(c, "exec", name, "--", TORCH_PY, "/repo/bench/gpu/mps_env.py", timeout=120))
            res[f"{name}_env_at_start"] = env.get("env_at_start")
            res[f"{name}_env_after_init"] = got = env.get("env_after_init")
            res[f"{name}_env_error"] = env.get("error")
            res[f"{name}_env_ok"] = got == {"CUDA_MPS_PIPE_DIRECTORY": keys.CONTAINER_MPS_DIR,
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(cores),
                                            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mib}M"}
            m = _memtest(c, name)
            res[f"{name}_torch_exception"], res[f"{name}_torch_reachable_mib"] = m.get("error"), m.get("reachable_mib")
            res[f"{name}_mem_get_info_mib"] = m.get("mem_get_info_before_mib")

        say("matmul in both pods at once (MPS runs co-tenants concurrently); nvidia-smi on the host meanwhile")
        kubectl = [str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}"]
        runs = {name: subprocess.Popen([*kubectl, "exec", name, "--", TORCH_PY, "/repo/bench/gpu/matmul.py", "15",
                                        name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for name, _, _ in MPS_TENANTS}
        time.sleep(10)
        host = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60, check=False).stdout
        print(f"$ nvidia-smi (host)\n{host.rstrip()}", flush=True)
        res["mps_host_smi_server"] = "nvidia-cuda-mps-server" in host
        res["mps_host_smi_clients_mc"] = len(re.findall(r"\sM\+C\s", host))
        for name in runs:
            out, _ = runs[name].communicate(timeout=120)
            print(out.rstrip()[-1500:], flush=True)
            its = _json_tail(out).get("its")
            res[f"{name}_matmul_its"] = its
            res[f"{name}_matmul_percent_of_native"] = round(100 * its / native["its"], 1) if its else None
        status = mpsd.read_status(MPS_ROOT)
        res["mps_status"] = (MPS_ROOT / mpsd.STATUS_FILE).read_text().strip() if status else None
        res["mps_status_age_s"] = round(time.time() - status.time, 1) if status else None
        res["mps_status_fresh"] = mpsd.not_ready(status, uuid, time.time()) is None
        show(c, "exec", MPS_OWNER, "-n", MPS_OWNER_NS, "--", "/usr/bin/sh", "-c",
             f"echo get_server_list | CUDA_MPS_PIPE_DIRECTORY={mpsd.pipe_dir(MPS_ROOT, uuid)} "
             "/usr/local/nvidia/bin/nvidia-cuda-mps-control")
        show(c, "get", "events", "-A", "--sort-by=.lastTimestamp")
    finally:
        _mps_logs(uuid)
        show(c, "logs", MPS_OWNER, "-n", MPS_OWNER_NS, "--tail=30")
        c.kubectl("delete", "pod", *(n for n, _, _ in MPS_TENANTS), "--wait=true", "--timeout=60s", check=False)
        c.kubectl("delete", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "--wait=true", "--timeout=60s", check=False)
        left = _mps_processes()
        res["mps_processes_left_after_owner"] = len(left)
        runtime.stop()


def mps_ok(res: dict[str, Any]) -> bool:
    oom = "OutOfMemoryError"
    ok = res.get("mps_owner_phase") == "Running" and res.get("mps_owner_capeff") == SETUID_SETGID_CAPS
    ok = ok and bool(res.get("mps_owner_root_ro") and res.get("mps_daemon_in_owner_pod"))
    ok = ok and bool(res.get("mps_status_fresh") and res.get("mps_host_smi_server"))
    ok = ok and (res.get("mps_host_smi_clients_mc") or 0) >= 2
    for name, mib, cores in MPS_TENANTS:
        ok = ok and bool(res.get(f"{name}_nvidia_smi") and res.get(f"{name}_env_ok"))
        ok = ok and str(res.get(f"{name}_torch_exception")).endswith(oom)
        ok = ok and (res.get(f"{name}_torch_reachable_mib") or 1e9) < mib
        ok = ok and abs((res.get(f"{name}_matmul_percent_of_native") or 0) - cores) <= 10
    return bool(ok)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="seed,isolation", help="comma-separated: seed, isolation, dra, mps")
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
        if "dra" in parts:
            res.update(dra(c, node))
        if "mps" in parts:
            mps(c, node, runtime, res)
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
    ok = "error" not in res
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
    res["ok"] = bool(ok)
    (a.out / "realnode-h200.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
