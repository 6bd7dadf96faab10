"""``kubectl vgpu doctor`` (the real executable) against the real control plane with the whole
kvgpu system: the cluster-wide checks (webhooks with caBundle, the admission dry run) pass, and
on fake nodes it names what each lacks — the agent pod, the inventory, the device plugin — while
a node whose inventory, capacity and shim report come from the real agent code (an in-process
simulated agent that installed the built shim in a temporary directory) passes those checks.

Fake nodes have no kubelet: no agent pod can run there and no sample pod (``--no-sample``); the
real-node test (tests/realnode/test_doctor_top.py) runs both."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode, Slicing
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.devcluster.system import KvgpuSystem

pytestmark = pytest.mark.cluster
PLUGIN = Path(sys.executable).with_name("kubectl-vgpu")
SHIM = Path(__file__).resolve().parents[2] / "shim" / "_build" / "libvgpu.so"


async def doctor(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(str(PLUGIN), f"--kubeconfig={cluster.kubeconfig}", "doctor", *args,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 120)
    return p.returncode or 0, out.decode(), err.decode()


async def _wait(cond: Any, what: str, limit_s: float = 30) -> Any:
    deadline = asyncio.get_running_loop().time() + limit_s
    while asyncio.get_running_loop().time() < deadline:
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out after {limit_s} s waiting for {what}")


async def test_doctor_names_what_each_fake_node_lacks(cluster: Cluster, kvgpu_system: KvgpuSystem, namespace: str,
                                                      tmp_path: Path) -> None:
    assert SHIM.exists(), "make shim builds shim/_build/libvgpu.so"
    names = [f"{namespace}-d{i}" for i in range(3)]
    sims = [SimulatedNode(n, (SimulatedCardSpec(count=2),), labels=(("kvgpu.io/test", namespace),)) for n in names]
    (tmp_path / "sim.json").write_text(json.dumps({"nodes": [{"name": names[0], "cards": [{"count": 2}]}]}))
    pool = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": f"doctor-{namespace}"},
            "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/test": namespace}}, "splitCount": 5}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pool))
    async with cluster.api() as api:
        core = client.CoreV1Api(api)
        await create_nodes(api, sims, with_inventory=False)
        cfg = AgentConfig(node=names[0], simulated=str(tmp_path / "sim.json"), interval_s=1, device_plugin=False,
                          metrics_port=0, shim_source=str(SHIM), shim_version="0.0.0-doctor",
                          host_shim_dir=str(tmp_path / "lib"), host_preload_file=str(tmp_path / "ld.so.preload"),
                          region_root=str(tmp_path / "regions"), health=False)
        agent = asyncio.create_task(Agent(cfg, KubeApi(api), api).run())
        try:
            async def reported() -> bool:
                n = api.sanitize_for_serialization(await core.read_node(names[0]))
                ann = n["metadata"].get("annotations") or {}
                return keys.NODE_SHIM in ann and int(n["status"]["allocatable"].get("nvidia.com/gpu", "0")) == 10

            await _wait(reported, "the agent's inventory, shim report and capacity on the node")
            # node d1: an inventory, but no device plugin capacity; node d2: no inventory at all
            inv = sims[1].inventory()
            inv = inv.with_slicing({c.uuid: Slicing(pool["metadata"]["name"], split_count=5) for c in inv.cards})
            await core.patch_node(names[1], {"metadata": {"annotations": {keys.NODE_INVENTORY: inv.dumps()}}})
            await core.patch_node_status(names[1], {"status": {"capacity": {"nvidia.com/gpu": None},
                                                               "allocatable": {"nvidia.com/gpu": None}}})

            rc, out, err = await doctor(cluster, *names, "--no-sample", "-n", namespace)
            assert rc == 1, (out, err)
            lines = {ln.split()[0]: ln for ln in out.splitlines()}
            assert lines["cluster"] == "cluster  OK", out
            d0, d1, d2 = (lines[n] for n in names)
            # d0: everything the agent reports is fine; only its pod is missing (it ran in-process)
            assert d0.startswith(f"{names[0]}  FAIL  agent: no kvgpu agent pod on the node"), d0
            assert d0.count(" -> fix: ") == 1, d0
            assert "kubectl -n kvgpu-system describe daemonset kvgpu-agent" in d0
            assert "device-plugin: no nvidia.com/gpu in the node's capacity" in d1 and "inventory:" not in d1
            assert "inventory: no kvgpu.io/inventory annotation" in d2 and "shim: the agent does not report" in d2

            rc, out, _ = await doctor(cluster, *names, "--no-sample", "-n", namespace, "-o", "json")
            report = json.loads(out)
            by_check = {f["check"]: f for f in report["nodes"][names[0]]}
            assert {k: f["status"] for k, f in by_check.items()} == {
                "agent": "fail", "inventory": "ok", "device-plugin": "ok", "nvidia-plugin": "ok", "shim": "ok",
                "sample": "skip"}, by_check
            assert by_check["inventory"]["message"] == "2 card(s), 2 sliced, 2 healthy"
            assert by_check["shim"]["message"] == "libvgpu.so.0.0.0-doctor loadable"
            assert {f["check"]: f["status"] for f in report["cluster"]}["admission"] == "ok"

            # the shim removed from the "host": the agent's next check says so, and doctor repeats it
            (tmp_path / "lib" / "libvgpu.so.0.0.0-doctor").unlink()

            async def gone() -> bool:
                n = api.sanitize_for_serialization(await core.read_node(names[0]))
                return '"loadable":false' in n["metadata"]["annotations"][keys.NODE_SHIM]

            await _wait(gone, "the agent reporting the shim gone")
            rc, out, _ = await doctor(cluster, names[0], "--no-sample", "-n", namespace)
            assert "shim: the shim is not usable on the node: " in out and "libvgpu.so is missing" in out, out
            assert "-> fix: kubectl -n kvgpu-system rollout restart daemonset kvgpu-agent" in out
        finally:
            agent.cancel()
            with contextlib.suppress(BaseException):
                await agent
            for n in names:
                with contextlib.suppress(Exception):
                    await core.delete_node(n)
            cluster.kubectl("delete", "vgpupool", pool["metadata"]["name"], "--wait=false", check=False)


async def test_doctor_refuses_unknown_nodes_and_an_excluded_namespace(cluster: Cluster,
                                                                      kvgpu_system: KvgpuSystem) -> None:
    rc, _, err = await doctor(cluster, "no-such-node", "--no-sample")
    assert rc == 1 and "node(s) not found: no-such-node" in err
    # kube-system is excluded by the webhooks' namespaceSelector: no GPU pod is admitted there
    async with cluster.api() as api:
        node = f"dr-{id(api) % 100000}"
        await create_nodes(api, [SimulatedNode(node, (SimulatedCardSpec(count=1),))])
        try:
            rc, out, _ = await doctor(cluster, node, "--no-sample", "-n", "kube-system")
            cluster_line = out.splitlines()[0]
            assert rc == 1 and cluster_line.startswith("cluster  FAIL  admission: the kvgpu webhook did not mutate")
            assert "pass --namespace with a tenant namespace" in cluster_line
        finally:
            await client.CoreV1Api(api).delete_node(node)
