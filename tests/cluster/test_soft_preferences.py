"""kube-scheduler's soft preferences against kvgpu's node score, on the real kube-scheduler
(issue 22): two fake GPU nodes, one ~43 % and one 90 % used, binpack. A pod that prefers the
emptier node (preferred node affinity, preferred pod anti-affinity, a ``ScheduleAnyway``
spread; with ``--node-choice scheduler``, a ``PreferNoSchedule`` taint on the fuller node)
lands there; a pod without preferences still binpacks onto the fuller one.

Before the fix the extender's prioritize (binpack: 4 vs 9 on kube-scheduler's 0..10 extender
scale, x 10 x weight 5 = 200 vs 450 points) outweighed a whole preference (0..100 x weight 2 =
200 points): every preferring pod below went to the full node."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.conftest import GpuEnv

SMALL = {"kvgpu.io/gpumem": "500", "kvgpu.io/gpucores": "5"}


def _on(gpu: GpuEnv, name: str, node: str, ann: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    pod = gpu.pod(name, ann)
    pod["metadata"]["labels"] = labels or {}
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    return pod


def _busy(gpu: GpuEnv, labels: dict[str, str] | None = None, light_pods: int = 4) -> tuple[str, str]:
    """Two one-card nodes (10 slots, 10000 MiB): ``light`` with 4 pods of 1100 MiB / 11 % (slots
    40 %, memory and cores 44 %: 43 % used), ``full`` with 9 of 1000 MiB / 10 % (90 %). ``labels``
    go on the pods of ``full``."""
    light, full = gpu.nodes(2, cards=1, memory_mib=10000)
    pods = [_on(gpu, f"l{i}", light, {"kvgpu.io/gpumem": "1100", "kvgpu.io/gpucores": "11"})
            for i in range(light_pods)]
    pods += [_on(gpu, f"f{i}", full, {"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "10"}, labels)
             for i in range(9)]
    gpu.create(*pods)
    for p in pods:
        gpu.wait_bound(p["metadata"]["name"])
    return light, full


def _place(gpu: GpuEnv, pod: dict[str, Any]) -> str:
    """Create ``pod``, return its node once bound, and delete it again (its slice freed)."""
    name = pod["metadata"]["name"]
    gpu.create(pod)
    node = str(gpu.wait_bound(name)["spec"]["nodeName"])
    gpu.delete_pod(name)
    gpu.wait(lambda: all(c["spec"]["podName"] != name for c in gpu.claims()), what=f"{name}'s claim gone")
    return node


def test_preferred_node_affinity_beats_binpack(gpu: GpuEnv) -> None:
    light, full = _busy(gpu)
    assert _place(gpu, gpu.pod("plain", SMALL)) == full  # control: binpack as before
    # A preference both nodes meet leaves the choice to binpack.
    assert _place(gpu, _prefer(gpu.pod("both", SMALL), {"matchExpressions": [
        {"key": "kvgpu.io/test", "operator": "In", "values": [gpu.ns]}]})) == full
    assert _place(gpu, _prefer(gpu.pod("picky", SMALL), {"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [light]}]})) == light


def _prefer(pod: dict[str, Any], term: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": term}]}}
    return pod


def test_preferred_pod_anti_affinity_beats_binpack(gpu: GpuEnv) -> None:
    light, _ = _busy(gpu, labels={"app": "busy"})
    away = gpu.pod("away", SMALL)
    away["spec"]["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": {"app": "busy"}},
                                            "topologyKey": "kubernetes.io/hostname"}}]}}
    gpu.create(away)
    assert gpu.wait_bound("away")["spec"]["nodeName"] == light


def test_schedule_anyway_spread_beats_binpack(gpu: GpuEnv) -> None:
    light, _ = _busy(gpu, labels={"app": "busy"})
    spread = gpu.pod("spread", SMALL)
    spread["metadata"]["labels"] = {"app": "busy"}
    spread["spec"]["topologySpreadConstraints"] = [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"app": "busy"}}}]
    gpu.create(spread)
    assert gpu.wait_bound("spread")["spec"]["nodeName"] == light


@pytest.fixture
def scheduler_mode(gpu: GpuEnv) -> Iterator[GpuEnv]:
    """The operator restarted with ``--node-choice scheduler`` (kube-scheduler scores every GPU
    pod), and back to the default afterwards."""
    system, before = gpu.system, gpu.system.operator_args
    system.stop_operator()
    system.operator_args = (*before, "--node-choice=scheduler")
    try:
        system.start_operator()
        yield gpu
    finally:
        system.stop_operator()
        system.operator_args = before
        system.start_operator()


def test_prefer_no_schedule_taint_beats_binpack_with_node_choice_scheduler(scheduler_mode: GpuEnv) -> None:
    """Every GPU pod is scored: binpack still decides for a plain pod, but a ``PreferNoSchedule``
    taint it does not tolerate comes first. ``light`` 21 % used (2 on the 0..10 scale): before,
    binpack's 9 - 2 = 7 steps (350 points) outweighed the taint (100 x weight 3)."""
    gpu = scheduler_mode
    light, full = _busy(gpu, light_pods=2)
    assert _place(gpu, gpu.pod("plain", SMALL)) == full
    gpu.cluster.kubectl("taint", "node", full, "kvgpu.io/test-busy=yes:PreferNoSchedule")
    gpu.create(gpu.pod("tainted", SMALL))
    assert gpu.wait_bound("tainted")["spec"]["nodeName"] == light
