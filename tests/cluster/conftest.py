"""Cluster-test fixtures: the whole kvgpu system (CRDs, the operator process, the kvgpu
kube-scheduler) on the session's control plane, and helpers that play the kubelet."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.devcluster.system import KvgpuSystem

# The session fixture ``kvgpu_system`` lives in tests/conftest.py (tests/realnode uses it too).


class GpuEnv:
    """A test's own fake GPU nodes (labelled with the test namespace) and pod helpers."""

    def __init__(self, cluster: Cluster, system: KvgpuSystem, namespace: str) -> None:
        self.cluster, self.system, self.ns = cluster, system, namespace
        self.node_names: list[str] = []

    def nodes(self, count: int, cards: int = 2, memory_mib: int = 10000, sm: int = 132,
              model: str = "NVIDIA H200") -> list[str]:
        sims = [
            SimulatedNode(f"{self.ns}-n{i}", (SimulatedCardSpec(model=model, memory_mib=memory_mib, sm_count=sm,
                                                                 count=cards),),
                          labels=(("kvgpu.io/test", self.ns),))
            for i in range(len(self.node_names), len(self.node_names) + count)
        ]

        async def mk() -> None:
            async with self.cluster.api() as api:
                await create_nodes(api, sims)

        asyncio.run(mk())
        self.node_names += [s.name for s in sims]
        return [s.name for s in sims]

    def pod(self, name: str, annotations: dict[str, str] | None = None,
            limits: dict[str, str] | None = None, containers: int = 1) -> dict[str, Any]:
        ctrs = [{"name": "main" if i == 0 else f"c{i}", "image": "cuda", "command": ["sleep", "inf"],
                 **({"resources": {"limits": limits}} if limits else {})} for i in range(containers)]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.ns, "annotations": annotations or {}},
                "spec": {"nodeSelector": {"kvgpu.io/test": self.ns}, "containers": ctrs,
                         "terminationGracePeriodSeconds": 0}}

    def apply(self, *objs: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": list(objs)}))

    def create(self, *objs: dict[str, Any]) -> None:
        self.cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                     "items": list(objs)}))

    def get(self, kind: str, name: str | None = None) -> Any:
        args = ["get", kind, "-n", self.ns, "-o", "json"] + ([name] if name else [])
        return json.loads(self.cluster.kubectl(*args).stdout)

    def pods(self) -> list[dict[str, Any]]:
        return list(self.get("pods")["items"])

    def claims(self) -> list[dict[str, Any]]:
        return list(self.get("vgpuclaims")["items"])

    def wait(self, cond: Any, timeout: float = 30, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return v
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def wait_bound(self, name: str, timeout: float = 30) -> dict[str, Any]:
        try:
            return self.wait(lambda: (p := self.get("pod", name))["spec"].get("nodeName") and p,
                             timeout, f"pod {name} bound")
        except AssertionError as e:
            raise AssertionError(f"{e}; events of {name}: {self.events(name)}") from None

    def delete_pod(self, name: str) -> None:
        self.cluster.kubectl("delete", "pod", name, "-n", self.ns, "--grace-period=0", "--force", "--wait=false")

    def mark_running(self, name: str) -> None:
        self.cluster.kubectl("patch", "pod", name, "-n", self.ns, "--subresource=status", "--type=merge",
                             "-p", json.dumps({"status": {"phase": "Running"}}))

    def events(self, name: str) -> list[str]:
        ev = json.loads(self.cluster.kubectl("get", "events", "-n", self.ns, "-o", "json",
                                             f"--field-selector=involvedObject.name={name}").stdout)
        return [f"{e['reason']}: {e['message']}" for e in ev["items"]]


def pool_body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A VGPUPool object named ``name`` with ``spec``."""
    return {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": name}, "spec": spec}


def pool_conditions(gpu: GpuEnv, pool: str) -> dict[str, dict[str, Any]]:
    """A pool's status conditions by type ({} when the pool is gone)."""
    p = gpu.cluster.kubectl("get", "vgpupool", pool, "-o", "json", check=False)
    if p.returncode != 0:
        return {}
    return {c["type"]: c for c in (json.loads(p.stdout).get("status") or {}).get("conditions") or []}


@pytest.fixture
def gpu(cluster: Cluster, kvgpu_system: KvgpuSystem, namespace: str) -> Iterator[GpuEnv]:
    env = GpuEnv(cluster, kvgpu_system, namespace)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
        "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true"}}, "splitCount": 10}}))
    yield env
    if env.node_names:
        cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", "--wait=false",
                        check=False)
        cluster.kubectl("delete", "node", *env.node_names, "--wait=false", check=False)
    # The pool covers every kvgpu.io/gpu-node: left behind, it would slice other tests' nodes. Waited
    # for, so that the next test's apply does not land on an object about to disappear.
    cluster.kubectl("delete", "vgpupool", "default", "--ignore-not-found", "--wait=true", "--timeout=60s",
                    check=False)
