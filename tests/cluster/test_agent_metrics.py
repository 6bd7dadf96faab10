"""The agent's HAMi scheduler view end to end on the real control plane: a simulated agent
watches its (fake) node; the test writes the node's ``kvgpu.io/allocation`` annotation as the
operator does (``NodeUsage.to_json`` of the operator's ledger) and binds a pod with a claim
annotation to the node; the agent's ``/metrics`` then shows HAMi's per-card and per-container
allocation families from its node watch and pod cache. Node and pod are deleted at the end."""

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
from kvgpu.allocator.usage import CardUsage, NodeUsage
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
    async with cluster.api() as api:
        core = client.CoreV1Api(api)
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
            s = await until(lambda s: "kvgpu_card_info" in s, "the exporter")
            assert "GPUDeviceMemoryLimit" not in s, "no allocation annotation yet: no card series"
            cards = tuple(CardUsage(c.uuid, c.index, c.model, "p", "shim", True, "", 1 if c.index == 0 else 0, 4,
                                    2048 if c.index == 0 else 0, c.memory_mib, 25 if c.index == 0 else 0, 100,
                                    1 if c.index == 0 else 0, False) for c in inv.cards)
            alloc = NodeUsage(node, cards, 1, 8, 2048, sum(c.memory_mib for c in inv.cards), 25, 200).to_json()
            await core.patch_node(node, {"metadata": {"annotations": {keys.NODE_ALLOCATION: json.dumps(alloc)}}})
            claim = f"v1;claim={namespace}/nb-main;priority=0;dev={u0},2048,25"
            await core.create_namespaced_pod(namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "nb", "annotations": {keys.claim_annotation("main"): claim}},
                "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]}})

            s = await until(lambda s: "GPUDeviceMemoryAllocated" in s and s.get("vGPUMemoryAllocated"),
                            "the allocation series")
            card0 = [v for lv, v in s["GPUDeviceMemoryAllocated"] if lv["deviceuuid"] == u0 and lv["nodeid"] == node]
            assert card0 == [2048 * MIB]
            assert [v for lv, v in s["hami_gpu_core_allocated_ratio"] if lv["device_uuid"] == u0] == [25]
            assert [v for lv, v in s["GPUDeviceSharedNum"] if lv["deviceuuid"] == u0] == [1]
            assert s["vGPUMemoryAllocated"] == [({"podnamespace": namespace, "nodename": node, "podname": "nb",
                                                  "containeridx": "0", "deviceuuid": u0}, 2048 * MIB)]
            assert [v for lv, v in s["vGPU_device_memory_limit_in_bytes"] if lv["podname"] == "nb"] == [2048 * MIB]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if agent.metrics_server is not None:
                srv = agent.metrics_server[0] if isinstance(agent.metrics_server, tuple) else agent.metrics_server
                srv.shutdown()
            await core.delete_namespaced_pod("nb", namespace, grace_period_seconds=0)
            await core.delete_node(node)
