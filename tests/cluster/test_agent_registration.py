"""The agent in simulated mode against the real control plane: inventory annotation on a fake
node, slicing from a real VGPUPool, patched only on change, health round trip with Node Events."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kvgpu.agent.discovery import SimulatedDiscovery
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.agent.registration import Registrar
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory, SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "charts" / "kvgpu" / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/vgpupools.kvgpu.io", "--timeout=60s")


def sim_file(tmp_path: Path, node: str) -> Path:
    p = tmp_path / "sim.json"
    p.write_text(
        json.dumps(
            {
                "nodes": [
                    {
                        "name": node,
                        "cards": [
                            {
                                "model": "NVIDIA H200",
                                "memoryMiB": 143771,
                                "smCount": 132,
                                "numa": 0,
                                "count": 2,
                            }
                        ],
                    }
                ]
            }
        )
    )
    return p


async def first_refresh(r: Registrar, limit_s: float = 30.0):
    """A just-created CRD answers 429 'storage is (re)initializing' for a moment; the agent's loop
    retries, so does this helper."""
    from kubernetes_asyncio.client.exceptions import ApiException

    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        try:
            return await r.refresh()
        except ApiException as e:
            if e.status != 429 or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def node_of(api, name):
    return await client.CoreV1Api(api).read_node(name)


async def test_registration_patches_only_on_change(cluster: Cluster, namespace: str, crds, tmp_path) -> None:
    node = f"gpu-{namespace}"
    sim = sim_file(tmp_path, node)
    pool = {
        "apiVersion": "kvgpu.io/v1alpha1",
        "kind": "VGPUPool",
        "metadata": {"name": f"pool-{namespace}"},
        "spec": {"splitCount": 4, "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}}},
    }
    async with cluster.api() as api:
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=2),))], with_inventory=False)
        r = Registrar(node, KubeApi(api), SimulatedDiscovery(node, str(sim)))
        inv, patched = await first_refresh(r)
        assert patched
        n = await node_of(api, node)
        published = NodeInventory.loads(n.metadata.annotations[keys.NODE_INVENTORY])
        assert published == inv and len(published.cards) == 2 and published.source == "simulated"
        assert all(c.slicing is None for c in published.cards)
        rv = n.metadata.resource_version

        # Unchanged: no write at all (the Node's resourceVersion stays), also from a new agent.
        assert (await r.refresh())[1] is False
        assert (await Registrar(node, KubeApi(api), SimulatedDiscovery(node, str(sim))).refresh())[1] is False
        assert (await node_of(api, node)).metadata.resource_version == rv

        # A real VGPUPool covering the node: the slicing lands in the annotation.
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pool))
        try:
            inv, patched = await r.refresh()
            assert patched and {c.slicing.split_count for c in inv.cards} == {4}
            n = await node_of(api, node)
            assert (
                NodeInventory.loads(n.metadata.annotations[keys.NODE_INVENTORY]).cards[0].slicing.pool
                == pool["metadata"]["name"]
            )
            assert r.patches == 2
        finally:
            cluster.kubectl("delete", "vgpupool", pool["metadata"]["name"], "--wait=false", check=False)
            await client.CoreV1Api(api).delete_node(node)


async def test_agent_health_round_trip(cluster: Cluster, namespace: str, crds, tmp_path) -> None:
    node = f"gpu-{namespace}"
    sim = sim_file(tmp_path, node)
    health = tmp_path / "health.json"
    health.write_text("{}")
    pool = {
        "apiVersion": "kvgpu.io/v1alpha1",
        "kind": "VGPUPool",
        "metadata": {"name": f"pool-{namespace}"},
        "spec": {"splitCount": 2, "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}}},
    }
    cfg = AgentConfig(
        node=node,
        simulated=str(sim),
        kubeconfig=str(cluster.kubeconfig),
        interval_s=30.0,
        simulated_health=str(health),
        health_probe_s=0.2,
        recovery_s=0.0,
        device_plugin=False,
        metrics_port=0,
        region_root=str(tmp_path / "regions"),
    )
    async with cluster.api() as api:
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=2),))], with_inventory=False)
        agent = Agent(cfg, KubeApi(api), api)
        task = asyncio.create_task(agent.run())

        async def wait_inventory(pred, limit_s=20.0):
            deadline = asyncio.get_running_loop().time() + limit_s
            while True:
                n = await node_of(api, node)
                raw = (n.metadata.annotations or {}).get(keys.NODE_INVENTORY)
                if raw and pred(NodeInventory.loads(raw)):
                    return NodeInventory.loads(raw)
                assert asyncio.get_running_loop().time() < deadline, f"timed out; last {raw}"
                if task.done():
                    task.result()
                await asyncio.sleep(0.1)

        try:
            inv = await wait_inventory(lambda i: len(i.cards) == 2 and all(c.healthy for c in i.cards))
            health.write_text(json.dumps({"1": "simulated: ECC storm"}))
            bad = await wait_inventory(lambda i: not i.cards[1].healthy)
            assert bad.cards[1].reason == "simulated: ECC storm" and bad.cards[0].healthy
            health.write_text("{}")
            await wait_inventory(lambda i: all(c.healthy for c in i.cards))
            evs = await client.CoreV1Api(api).list_namespaced_event(
                "default", field_selector=f"involvedObject.name={node}"
            )
            reasons = [e.reason for e in evs.items]
            assert "GPUUnhealthy" in reasons and "GPUHealthy" in reasons and "GPUInventoryChanged" in reasons
            warn = next(e for e in evs.items if e.reason == "GPUUnhealthy")
            assert warn.type == "Warning" and inv.cards[1].uuid in warn.message

            # A pool appears: the pool watch kicks a refresh; the slicing lands without the agent
            # reading nodes or pools from the API server (it answers from its watch caches).
            calls = agent.api.api_calls
            cluster.kubectl("apply", "-f", "-", input=json.dumps(pool))
            sliced = await wait_inventory(lambda i: all(c.slicing for c in i.cards))
            assert {c.slicing.split_count for c in sliced.cards} == {2}
            assert agent.api.api_calls == calls

            # No kubelet on a fake node: the simulated agent reports nvidia.com/gpu as the kubelet
            # would from the device plugin (2 cards x splitCount 2; healthy replicas allocatable).
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                st = (await node_of(api, node)).status
                if st.capacity.get("nvidia.com/gpu") == "4" and st.allocatable.get("nvidia.com/gpu") == "4":
                    break
                assert asyncio.get_running_loop().time() < deadline, (st.capacity, st.allocatable)
                await asyncio.sleep(0.1)
            health.write_text(json.dumps({"0": "simulated: fallen off the bus"}))
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                st = (await node_of(api, node)).status
                if st.allocatable.get("nvidia.com/gpu") == "2":
                    break
                assert asyncio.get_running_loop().time() < deadline, (st.capacity, st.allocatable)
                await asyncio.sleep(0.1)
            assert st.capacity["nvidia.com/gpu"] == "4"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            cluster.kubectl("delete", "vgpupool", pool["metadata"]["name"], "--wait=false", check=False)
            await client.CoreV1Api(api).delete_node(node)


async def test_simulated_fleet_annotates_every_node(cluster: Cluster, namespace: str, crds, tmp_path) -> None:
    from kvgpu.agent.main import run_simulated_fleet

    names = [f"gpu-{namespace}-a", f"gpu-{namespace}-b"]
    sim = tmp_path / "fleet.json"
    sim.write_text(
        json.dumps({"nodes": [{"name": n, "cards": [{"count": i + 1}]} for i, n in enumerate(names)]})
    )
    async with cluster.api() as api:
        await create_nodes(
            api, [SimulatedNode(n, (SimulatedCardSpec(count=1),)) for n in names], with_inventory=False
        )
        task = asyncio.create_task(run_simulated_fleet(str(sim), str(cluster.kubeconfig)))
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                got = {}
                for n in names:
                    raw = ((await node_of(api, n)).metadata.annotations or {}).get(keys.NODE_INVENTORY)
                    if raw:
                        got[n] = len(NodeInventory.loads(raw).cards)
                if got == {names[0]: 1, names[1]: 2}:
                    break
                assert asyncio.get_running_loop().time() < deadline, got
                if task.done():
                    task.result()
                await asyncio.sleep(0.2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for n in names:
                await client.CoreV1Api(api).delete_node(n)
