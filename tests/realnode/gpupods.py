"""GPU pods on the real node, and what a container of theirs really got.

Pods are placed by the kvgpu kube-scheduler (the webhook addresses them to it; a nodeSelector on
the real node's hostname keeps them off the fake nodes), so every pod takes the whole path:
admission, extender filter and bind, VGPUClaim, the real kubelet, the device plugin, runc.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory
from realnode.conftest import RealPods

HAMI = "nvidia.com/gpu"


def hami_limits(cards: int = 1, mem_mib: int = 1000, cores: int | None = None) -> dict[str, Any]:
    lim: dict[str, Any] = {HAMI: cards, "nvidia.com/gpumem": mem_mib}
    if cores is not None:
        lim["nvidia.com/gpucores"] = cores
    return lim


def container(name: str, limits: dict[str, Any] | None = None, image: str = "kvgpu.local/tenant:1",
              command: tuple[str, ...] = ("sleep", "3600")) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": "Never", "command": list(command)}
    if limits:
        c["resources"] = {"limits": limits}
    return c


def gpu_pod(rp: RealPods, name: str, *, limits: dict[str, Any] | None = None,
            annotations: dict[str, str] | None = None, containers: list[dict[str, Any]] | None = None,
            init: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    """A pod for the real node: HAMi form with ``limits``, annotation form with ``annotations``."""
    ctrs = containers if containers is not None else [container("main", limits)]
    body: dict[str, Any] = {"nodeSelector": {"kubernetes.io/hostname": rp.node.name},
                            "terminationGracePeriodSeconds": 1, "containers": ctrs, **spec}
    if init:
        body["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": rp.ns, "annotations": annotations or {}}, "spec": body}


def apply_all(rp: RealPods, pods: list[dict[str, Any]]) -> None:
    rp.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))


def wait_all_running(rp: RealPods, names: list[str], timeout: float = 180) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    pods: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        items = json.loads(rp.cluster.kubectl("get", "pods", "-n", rp.ns, "-o", "json").stdout)["items"]
        pods = {p["metadata"]["name"]: p for p in items}
        if all(pods.get(n, {}).get("status", {}).get("phase") == "Running" for n in names):
            return pods
        time.sleep(0.5)
    bad = {n: pods.get(n, {}).get("status", {}).get("phase") for n in names
           if pods.get(n, {}).get("status", {}).get("phase") != "Running"}
    raise AssertionError(f"{len(bad)} of {len(names)} pods not Running after {timeout} s: {bad}")


def claim_of(pod: dict[str, Any], ctr: str) -> str:
    return str(pod["metadata"]["annotations"][keys.claim_annotation(ctr)])


def uuids_of(pod: dict[str, Any], ctr: str) -> list[str]:
    return str(pod["metadata"]["annotations"][keys.devices_annotation(ctr)]).split(",")


def inventory(rp: RealPods) -> NodeInventory:
    node = rp.node.node()
    assert node is not None
    return NodeInventory.loads(node["metadata"]["annotations"][keys.NODE_INVENTORY])


def minors(rp: RealPods, uuids: list[str]) -> set[str]:
    """The device-node names (``nvidia<minor>``) of cards ``uuids`` on the real node."""
    cards = {c.uuid: c for c in inventory(rp).cards}
    return {f"nvidia{cards[u].minor if cards[u].minor is not None else cards[u].index}" for u in uuids}


def exec_in(rp: RealPods, pod: str, ctr: str, script: str, check: bool = True) -> str:
    p = rp.cluster.kubectl("exec", pod, "-n", rp.ns, "-c", ctr, "--", "sh", "-c", script, check=check)
    return p.stdout


def card_nodes(rp: RealPods, pod: str, ctr: str = "main") -> set[str]:
    """The per-card device nodes the container has (``nvidia0``, ...; control nodes excluded)."""
    out = exec_in(rp, pod, ctr, "ls /dev")
    return {n for n in out.split() if n.startswith("nvidia") and n[6:].isdigit()}


def mount_targets(rp: RealPods, pod: str, ctr: str = "main") -> list[str]:
    """Mount points inside the container under the paths kvgpu or the device plugin use (in order,
    duplicates kept: a target mounted twice appears twice)."""
    out = exec_in(rp, pod, ctr, "cat /proc/self/mountinfo")
    roots = ("/usr/local/kvgpu", "/etc/ld.so.preload", "/etc/kvgpu", "/var/run/kvgpu", "/usr/local/nvidia",
             "/dev/nvidia")
    return [ln.split()[4] for ln in out.splitlines() if ln.split()[4].startswith(roots)]


def claims(rp: RealPods) -> list[dict[str, Any]]:
    return list(json.loads(rp.cluster.kubectl("get", "vgpuclaims", "-n", rp.ns, "-o", "json").stdout)["items"])


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def events(rp: RealPods, name: str) -> list[dict[str, Any]]:
    out = rp.cluster.kubectl("get", "events", "-n", rp.ns, "-o", "json",
                             f"--field-selector=involvedObject.name={name}").stdout
    return list(json.loads(out)["items"])
