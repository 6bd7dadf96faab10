"""MIG in extender mode against the real control plane with kvgpu's webhook and scheduler running:
the simulated agent of a fake node with an H200 in MIG mode reports ``nvidia.com/mig-<profile>``
as a kubelet would from the MIG device plugins (and no ``nvidia.com/gpu`` for that card), and
kube-scheduler places ``nvidia.com/mig-1g.18gb`` pods by counting the resource; kvgpu's webhook
leaves them alone (default scheduler, no VGPUClaim). Fake node: no kubelet, so the plugins'
``Allocate`` is exercised by tests/unit/test_migplugin.py, not here; no real MIG card is used."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.core.inventory import parse_simulated
from kvgpu.devcluster.fakenodes import create_nodes

from .conftest import GpuEnv

pytestmark = pytest.mark.cluster


def _sim(node: str) -> dict[str, Any]:
    mig = [{"profile": "3g.71gb"}, {"profile": "1g.18gb", "count": 2}]
    return {"nodes": [{"name": node, "cards": [
        {"model": "NVIDIA H200", "numa": 0}, {"model": "NVIDIA H200", "numa": 0, "migInstances": mig}]}]}


def _mig_pod(gpu: GpuEnv, name: str, node: str) -> dict[str, Any]:
    p = gpu.pod(name, limits={"nvidia.com/mig-1g.18gb": "1"})
    p["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return p


async def test_mig_profiles_are_plain_extended_resources(gpu: GpuEnv, tmp_path: Path) -> None:
    node = f"{gpu.ns}-mig"
    doc = _sim(node)
    sim = tmp_path / "sim.json"
    await asyncio.to_thread(sim.write_text, json.dumps(doc))
    cfg = AgentConfig(node=node, simulated=str(sim), kubeconfig=str(gpu.cluster.kubeconfig), health=False,
                      device_plugin=False, metrics_port=0, region_root=str(tmp_path / "regions"))
    (spec,) = parse_simulated(doc)
    async with gpu.cluster.api() as api:
        await create_nodes(api, [spec], with_inventory=False)
        gpu.node_names.append(node)  # the fixture deletes it
        task = asyncio.create_task(Agent(cfg, KubeApi(api), api).run())
        try:
            def allocatable() -> dict[str, str]:
                n = json.loads(gpu.cluster.kubectl("get", "node", node, "-o", "json").stdout)
                return dict(n["status"].get("allocatable") or {})

            async def wait(pred: Any, what: str, limit_s: float = 30) -> Any:
                deadline = asyncio.get_running_loop().time() + limit_s
                while asyncio.get_running_loop().time() < deadline:
                    v = await asyncio.to_thread(pred)
                    if v:
                        return v
                    await asyncio.sleep(0.3)
                raise AssertionError(f"timed out waiting for {what}")

            # The agent writes each resource of the node with a patch of its own (as each device
            # plugin registers with a kubelet): wait until all three are there, then check them.
            names = ("nvidia.com/mig-1g.18gb", "nvidia.com/mig-3g.71gb", "nvidia.com/gpu")
            alloc = await wait(lambda: (a := allocatable()).get("nvidia.com/mig-1g.18gb") == "2"
                               and all(r in a for r in names) and a, "the MIG resources on the node")
            assert alloc["nvidia.com/mig-3g.71gb"] == "1"
            assert alloc["nvidia.com/gpu"] == "10"  # the whole card's splitCount only: no slices of the MIG card

            await asyncio.to_thread(gpu.apply, *(_mig_pod(gpu, n, node) for n in ("a", "b", "c")))
            def bound_pods() -> list[str]:
                return [n for n in "abc" if gpu.get("pod", n)["spec"].get("nodeName")]

            await wait(lambda: len(bound_pods()) == 2, "two pods bound")
            bound = await asyncio.to_thread(bound_pods)
            pending = next(n for n in "abc" if not gpu.get("pod", n)["spec"].get("nodeName"))
            reasons = await wait(lambda: [e for e in gpu.events(pending) if "FailedScheduling" in e],
                                 "FailedScheduling of the third pod")
            assert any("nvidia.com/mig-1g.18gb" in r for r in reasons), reasons  # kube-scheduler's own count
            for n in bound:
                p = gpu.get("pod", n)
                assert p["spec"]["schedulerName"] == "default-scheduler"
                ann = p["metadata"].get("annotations", {})
                assert ann.get("kvgpu.io/admitted", "") == ""  # admitted with no sliced container
                assert not [k for k in ann if k.startswith("kvgpu.io/") and k != "kvgpu.io/admitted"]
                assert not [v for v in p["spec"].get("volumes", []) if "kvgpu" in v["name"]]
            assert gpu.claims() == []  # kvgpu accounts no MIG pod
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
