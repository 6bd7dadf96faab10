"""The foundation: a real kube-apiserver, CRDs applied with the real kubectl, read back with
kubernetes-asyncio; the scheduler places a pod on a fake GPU node."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes_asyncio import client
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import HAMI_RESOURCE, create_nodes, inventory_of

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.foundation.kvgpu.io"},
    "spec": {
        "group": "foundation.kvgpu.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "properties": {"size": {"type": "integer", "minimum": 1}}}}}},
        }],
    },
}


def test_server_version_is_real(cluster: Cluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    print(f"kube-apiserver answered: server {out['serverVersion']['gitVersion']}, "
          f"kubectl {out['clientVersion']['gitVersion']}")
    assert out["serverVersion"]["minor"] == out["clientVersion"]["minor"] == "36"
    assert out["serverVersion"]["gitVersion"].startswith("v1.36.")


async def test_crd_applied_with_kubectl_read_back_with_asyncio(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.foundation.kvgpu.io", "--timeout=60s")
    obj = {"apiVersion": "foundation.kvgpu.io/v1", "kind": "Widget",
           "metadata": {"name": "w1", "namespace": namespace}, "spec": {"size": 3}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    async with cluster.api() as api:
        got = await client.CustomObjectsApi(api).get_namespaced_custom_object(
            "foundation.kvgpu.io", "v1", namespace, "widgets", "w1")
    assert got["spec"] == {"size": 3}
    # The server validates against the schema: a real apiserver, not a mock.
    bad = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps(
        {**obj, "metadata": {"name": "w2", "namespace": namespace}, "spec": {"size": 0}}))
    assert bad.returncode != 0 and "spec.size" in bad.stderr


async def test_scheduler_places_pod_on_fake_gpu_node(cluster: Cluster, namespace: str) -> None:
    sim = SimulatedNode(f"gpu-{namespace}", (SimulatedCardSpec(count=2),))
    # Its own pool: kvgpu's webhook (when the session runs it) sends nvidia.com/gpu pods to the
    # kvgpu scheduler, whose extender needs a pool over the node's cards.
    pool = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": f"pool-{namespace}"},
            "spec": {"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": sim.name}}, "splitCount": 10}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pool), check=False)  # no CRD: no kvgpu either
    try:
        await _place_on(cluster, namespace, sim)
    finally:
        cluster.kubectl("delete", "vgpupool", pool["metadata"]["name"], "--ignore-not-found", check=False)


async def _place_on(cluster: Cluster, namespace: str, sim: SimulatedNode) -> None:
    async with cluster.api() as api:
        await create_nodes(api, [sim], split_count=10)
        core = client.CoreV1Api(api)
        node = await core.read_node(sim.name)
        assert node.status.allocatable[HAMI_RESOURCE] == "20"
        inv = inventory_of(api.sanitize_for_serialization(node))
        assert inv is not None and len(inv.cards) == 2
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
               "spec": {"nodeSelector": {"kubernetes.io/hostname": sim.name},
                        "containers": [{"name": "c", "image": "busybox",
                                        "resources": {"limits": {HAMI_RESOURCE: "1"}}}]}}
        await core.create_namespaced_pod(namespace, pod)
        for _ in range(200):
            p = await core.read_namespaced_pod("p", namespace)
            if p.spec.node_name:
                break
            await asyncio.sleep(0.1)
        assert p.spec.node_name == sim.name
        await core.delete_node(sim.name)


@pytest.mark.parametrize("component", ["etcd", "kube-apiserver", "kube-controller-manager",
                                       "kube-scheduler-default-scheduler"])
def test_components_run_and_log(cluster: Cluster, component: str) -> None:
    assert cluster.alive()[component]
    assert cluster.log(component).exists()
