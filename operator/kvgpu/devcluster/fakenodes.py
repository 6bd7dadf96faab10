"""Fake GPU nodes: Node objects with no kubelet behind them, so kube-scheduler can place pods.

A fake node carries what a real GPU node would: labels (hostname, ``kvgpu.io/gpu-node``,
``nvidia.com/gpu.product``), capacity/allocatable (cpu, memory, pods, and the HAMi resource
``nvidia.com/gpu`` = cards × splitCount), a ``Ready`` condition and, when given, the agent's
inventory annotation. Tests play the kubelet: :func:`mark_pod_running` patches pod status.
"""

from __future__ import annotations

import datetime
from typing import Any

from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory, SimulatedNode

HAMI_RESOURCE = "nvidia.com/gpu"


def node_manifest(
    sim: SimulatedNode,
    *,
    split_count: int = 10,
    with_inventory: bool = True,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "250",
) -> dict[str, Any]:
    """The Node object for a simulated GPU node (create it with status: nodes accept status on create)."""
    inv = sim.inventory()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = {
        "kubernetes.io/hostname": keys.label_value(sim.name),  # a node name may be longer than a label
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        keys.NODE_LABEL_GPU: "true",
        "kvgpu.io/fake": "true",
    }
    if inv.cards:
        labels["nvidia.com/gpu.product"] = inv.cards[0].model.replace(" ", "-")
    labels.update(dict(sim.labels))
    res = {"cpu": cpu, "memory": memory, "pods": pods, HAMI_RESOURCE: str(len(inv.cards) * split_count)}
    annotations = {keys.NODE_INVENTORY: inv.dumps()} if with_inventory else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": sim.name, "labels": labels, "annotations": annotations},
        "spec": {},
        "status": {
            "capacity": res,
            "allocatable": res,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "fake GPU node (no kubelet)", "lastHeartbeatTime": now, "lastTransitionTime": now}
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": sim.name}],
            "nodeInfo": {"kubeletVersion": "v1.36.3-fake", "architecture": "amd64", "operatingSystem": "linux",
                         "containerRuntimeVersion": "fake://0", "kernelVersion": "", "osImage": "fake",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
        },
    }


def inventory_of(node: dict[str, Any]) -> NodeInventory | None:
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(keys.NODE_INVENTORY)
    return NodeInventory.loads(raw) if raw else None


async def create_nodes(api: Any, sims: list[SimulatedNode], **kw: Any) -> list[str]:
    """Create (or replace) fake nodes through a kubernetes_asyncio ``ApiClient``. Returns names."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    names = []
    for sim in sims:
        body = node_manifest(sim, **kw)
        try:
            await core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
            await core.delete_node(sim.name)
            await core.create_node(body)
        names.append(sim.name)
    return names


def pod_running_status(pod_ip: str = "10.244.0.10") -> dict[str, Any]:
    """A status patch body that makes a bound pod look Running, as a kubelet would report."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "status": {
            "phase": "Running",
            "podIP": pod_ip,
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }
    }


async def mark_pod_running(api: Any, namespace: str, name: str) -> None:
    from kubernetes_asyncio import client

    await client.CoreV1Api(api).patch_namespaced_pod_status(name, namespace, pod_running_status())
