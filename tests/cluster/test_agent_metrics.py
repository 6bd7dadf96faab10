"""The agent's HAMi scheduler view end to end on the real control plane: a simulated agent
watches its (fake) node, covered by a VGPUPool of its own; the test binds a pod with a claim
annotation to the node; the agent's ``/metrics`` then shows HAMi's per-card and per-container
allocation families, counted from its inventory and pod cache (nothing on the Node says them),
and the pod's deletion takes its share away again. Node, pool and pod are deleted at the end."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from pathlib import Path

import pytest
from exportedmetrics import scrape_text
from kubernetes_asyncio import client
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory, SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.devcluster.system import CRD_DIR

pytestmark = pytest.mark.cluster
MIB = 1 << 20


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CRD_DIR))
    cluster.kubectl("wait", "--for=condition=Established", "crd/vgpupools.kvgpu.io", "--timeout=60s")


def sim_file(tmp_path: Path, node: str) -> Path:
    p = tmp_path / "sim.json"
    cards = [{"model": "NVIDIA H200", "memoryMiB": 143771, "smCount": 132, "numa": 0, "count": 2}]
    p.write_text(json.dumps({"nodes": [{"name": node, "cards": cards}]}))
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return scrape_text(r.read().decode())


async def test_agent_exports_hami_scheduler_view(cluster: Cluster, namespace: str, crds, tmp_path) -> None:
    node = f"gpu-{namespace}"
    port = free_port()
    cfg = AgentConfig(node=node, simulated=str(sim_file(tmp_path, node)), kubeconfig=str(cluster.kubeconfig),
                      interval_s=30.0, device_plugin=False, metrics_port=port, metrics_addr="127.0.0.1",
                      region_root=str(tmp_path / "regions"))
    pool = f"p-{namespace}"
    async with cluster.api() as api:
        core = client.CoreV1Api(api)
        await client.CustomObjectsApi(api).create_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools", {
            "apiVersion": f"{keys.GROUP}/{keys.VERSION}", "kind": "VGPUPool", "metadata": {"name": pool},
            "spec": {"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}}, "splitCount": 4}})
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=2),))], with_inventory=False)
        agent = Agent(cfg, KubeApi(api), api)
        task = asyncio.create_task(agent.run())
        loop = asyncio.get_running_loop()

        async def until(pred, what: str, limit_s: float = 30.0):
            deadline = loop.time() + limit_s
            while True:
                if task.done():
                    task.result()
                got = None
                try:
                    got = await asyncio.to_thread(scrape, port)
                except OSError:
                    pass
                if got is not None and pred(got):
                    return got
                assert loop.time() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.2)

        try:
            async def inventory() -> NodeInventory:
                while True:
                    raw = ((await core.read_node(node)).metadata.annotations or {}).get(keys.NODE_INVENTORY)
                    if raw:
                        return NodeInventory.loads(raw)
                    await asyncio.sleep(0.2)

            inv = await asyncio.wait_for(inventory(), 30)
            u0 = inv.cards[0].uuid

            def card0(s, name: str) -> list[float]:
                return [v for lv, v in s.get(name, []) if lv.get("deviceuuid", lv.get("device_uuid")) == u0]

            s = await until(lambda s: card0(s, "GPUDeviceMemoryLimit"), "the card series")
            assert card0(s, "GPUDeviceMemoryLimit") == [inv.cards[0].memory_mib * MIB]
            assert card0(s, "GPUDeviceMemoryAllocated") == [0] and card0(s, "GPUDeviceSharedNum") == [0]
            claim = f"v1;claim={namespace}/nb-main;priority=0;dev={u0},2048,25"
            await core.create_namespaced_pod(namespace, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nb"},
                "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]}})
            # the claim annotation as the operator's Binding writes it (kvgpu's admission, where the
            # session runs it, lets only the operator set it on an existing pod)
            await asyncio.to_thread(cluster.kubectl, "annotate", "pod", "nb", "-n", namespace,
                                    f"{keys.claim_annotation('main')}={claim}", "--as=kvgpu-operator",
                                    "--as-group=system:masters")

            s = await until(lambda s: card0(s, "GPUDeviceMemoryAllocated") == [2048 * MIB]
                            and s.get("vGPUMemoryAllocated"), "the allocation series")
            assert card0(s, "hami_gpu_core_allocated_ratio") == [25]
            assert card0(s, "GPUDeviceSharedNum") == [1] and card0(s, "GPUDeviceCoreLimit") == [100]
            assert [v for lv, v in s["GPUDeviceSharedNum"] if lv["deviceuuid"] != u0] == [0]
            assert s["vGPUMemoryAllocated"] == [({"podnamespace": namespace, "nodename": node, "podname": "nb",
                                                  "containeridx": "0", "deviceuuid": u0}, 2048 * MIB)]
            assert [v for lv, v in s["vGPU_device_memory_limit_in_bytes"] if lv["podname"] == "nb"] == [2048 * MIB]
            annotations = (await core.read_node(node)).metadata.annotations or {}
            assert keys.NODE_ALLOCATION not in annotations, "nothing per allocation is written on the Node"

            await core.delete_namespaced_pod("nb", namespace, grace_period_seconds=0)
            s = await until(lambda s: card0(s, "GPUDeviceMemoryAllocated") == [0], "the pod's share gone")
            assert card0(s, "GPUDeviceSharedNum") == [0] and not s.get("vGPUMemoryAllocated")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if agent.metrics_server is not None:
                srv = agent.metrics_server[0] if isinstance(agent.metrics_server, tuple) else agent.metrics_server
                srv.shutdown()
            try:
                await core.delete_namespaced_pod("nb", namespace, grace_period_seconds=0)
            except client.ApiException as e:
                if e.status != 404:
                    raise
            await core.delete_node(node)
            await client.CustomObjectsApi(api).delete_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools",
                                                                            pool)
