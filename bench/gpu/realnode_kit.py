"""What the real-node parts on the GPU machine share (bench/gpu/realnode_run.py and
bench/gpu/realnode_mps.py): the tenant image's host mounts, the seed-form pod, kubectl with its
output shown, torch's memory test and the matmul loop in a pod."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from kvgpu.demo import wait
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.cluster import REPO_ROOT

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


def running(c: Cluster, *names: str, timeout: float = 120) -> None:
    """Waits until each pod in ``default`` is Running (or Failed: its checks then say why)."""
    for name in names:
        wait(lambda n=name: json.loads(c.kubectl("get", "pod", n, "-o", "json").stdout)["status"].get("phase")
             in ("Running", "Failed"), timeout, f"{name} Running")


def memtest(c: Cluster, pod: str, prefix: str = "") -> dict[str, Any]:
    out = show(c, "exec", pod, "--", "/usr/bin/sh", "-c", f"{prefix}{TORCH_PY} /repo/bench/gpu/memtest.py 128",
               timeout=180)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {}



def matmul(argv: list[str], timeout: float = 120) -> dict[str, Any]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    print((p.stdout + p.stderr).rstrip()[-2000:], flush=True)
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


