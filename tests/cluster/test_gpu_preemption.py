"""GPU preemption on the real API server and kube-scheduler: a pending pod of higher priority that
fits no node only because pods of lower priority hold the GPU memory gets one of them evicted
(Eviction API) and is bound; preemptionPolicy Never, equal priority and a PodDisruptionBudget
that forbids the eviction evict nothing, and say why in an Event on the pending pod.

Fake nodes have no kubelet: an evicted pod gets its deletionTimestamp and stays Terminating
until a kubelet would confirm the kill. The victims here have a 30 s grace period, and
:func:`_kubelet_finishes` plays the kubelet: it force-deletes the terminating pods once the test
has seen them terminating (so the hold is exercised over the time the victims take to go)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.conftest import GpuEnv

QUIET_S = 8.0  # how long "nothing is evicted" is watched (preemption acts within ~1 s)


@pytest.fixture
def classes(gpu: GpuEnv) -> Iterator[dict[str, str]]:
    """PriorityClasses of this test: low 10, high 1000, high-never 1000 with preemptionPolicy Never."""
    names = {k: f"{gpu.ns}-{k}" for k in ("low", "high", "never")}
    objs = [
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": names["low"]},
         "value": 10},
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": names["high"]},
         "value": 1000},
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": names["never"]},
         "value": 1000, "preemptionPolicy": "Never"},
    ]
    gpu.create(*objs)
    yield names
    gpu.cluster.kubectl("delete", "priorityclass", *names.values(), "--wait=false", check=False)


def _pod(gpu: GpuEnv, name: str, mib: int, klass: str, grace: int = 0, labels: dict[str, str] | None = None
         ) -> dict[str, Any]:
    p = gpu.pod(name, {"kvgpu.io/gpumem": str(mib)})
    p["spec"]["priorityClassName"] = klass
    p["spec"]["terminationGracePeriodSeconds"] = grace
    if labels:
        p["metadata"]["labels"] = labels
    return p


def _running_and_ready(gpu: GpuEnv, name: str) -> None:
    """What the kubelet reports for a started container (a PDB counts Ready pods only)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    gpu.cluster.kubectl("patch", "pod", name, "-n", gpu.ns, "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"phase": "Running", "conditions": [
                            {"type": "Ready", "status": "True", "lastTransitionTime": now},
                            {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]}}))


def _fill(gpu: GpuEnv, klass: str, labels: dict[str, str] | None = None) -> str:
    """One card of 10000 MiB, two low-priority pods of 4500 MiB on it (1000 MiB left)."""
    [node] = gpu.nodes(1, cards=1)
    gpu.create(*(_pod(gpu, f"low-{i}", 4500, klass, grace=30, labels=labels) for i in range(2)))
    for i in range(2):
        gpu.wait_bound(f"low-{i}")
        _running_and_ready(gpu, f"low-{i}")
    return node


def _terminating(gpu: GpuEnv) -> list[str]:
    return sorted(p["metadata"]["name"] for p in gpu.pods() if p["metadata"].get("deletionTimestamp"))


def _kubelet_finishes(gpu: GpuEnv, names: list[str]) -> None:
    for n in names:
        gpu.delete_pod(n)  # --grace-period=0 --force: the kubelet's confirmation


def _pending_event(gpu: GpuEnv, name: str, reason: str, text: str) -> str:
    return gpu.wait(lambda: next((e for e in gpu.events(name) if e.startswith(reason) and text in e), ""),
                    20, f"{reason} event on {name} mentioning {text!r}; events: {gpu.events(name)}")


def _stays_pending(gpu: GpuEnv, name: str) -> None:
    deadline = time.monotonic() + QUIET_S
    while time.monotonic() < deadline:
        assert not _terminating(gpu), f"evicted: {_terminating(gpu)}"
        assert not gpu.get("pod", name)["spec"].get("nodeName")
        time.sleep(0.5)
    assert {p["metadata"]["name"] for p in gpu.pods()} >= {"low-0", "low-1", name}


def test_higher_priority_pod_evicts_one_lower_pod_and_is_bound(gpu: GpuEnv, classes: dict[str, str]) -> None:
    node = _fill(gpu, classes["low"])
    gpu.create(_pod(gpu, "high", 3000, classes["high"]))
    victims = gpu.wait(lambda: _terminating(gpu), 20,
                       f"a low pod evicted; events of high: {gpu.events('high')}")
    assert victims == ["low-0"], victims  # one is enough; equal priorities: by name
    _pending_event(gpu, "low-0", "Preempted", f"preempted by {gpu.ns}/high (priority 1000) for GPU memory "
                                              f"on node {node}")
    _pending_event(gpu, "high", "GPUPreemption", f"evicting {gpu.ns}/low-0 (priority 10) on node {node}")
    # While low-0 terminates its processes still use the card: high is not bound yet, and a
    # lower-priority newcomer is kept off the card kvgpu holds for high.
    gpu.create(_pod(gpu, "late", 3000, classes["low"]))
    time.sleep(2.0)
    assert not gpu.get("pod", "high")["spec"].get("nodeName")
    _kubelet_finishes(gpu, victims)
    bound = gpu.wait_bound("high", timeout=30)
    assert bound["spec"]["nodeName"] == node
    time.sleep(1.0)
    assert not gpu.get("pod", "late")["spec"].get("nodeName")  # 2500 MiB left: it does not fit
    assert gpu.get("pod", "low-1")["metadata"].get("deletionTimestamp") is None
    gpu.wait(lambda: {c["spec"]["podName"]: c["spec"]["devices"][0]["memory"] for c in gpu.claims()}
             == {"low-1": 4500, "high": 3000}, 15, f"claims of low-1 and high only: {gpu.claims()}")


def test_preemption_policy_never_evicts_nothing(gpu: GpuEnv, classes: dict[str, str]) -> None:
    _fill(gpu, classes["low"])
    gpu.create(_pod(gpu, "high", 3000, classes["never"]))
    _pending_event(gpu, "high", "GPUPreemptionNotPossible", "preemptionPolicy is Never")
    _stays_pending(gpu, "high")


def test_equal_priority_evicts_nothing(gpu: GpuEnv, classes: dict[str, str]) -> None:
    _fill(gpu, classes["low"])
    gpu.create(_pod(gpu, "peer", 3000, classes["low"]))
    _pending_event(gpu, "peer", "GPUPreemptionNotPossible", "no pod of lower priority (< 10)")
    _stays_pending(gpu, "peer")


def test_pod_disruption_budget_forbids_the_eviction(gpu: GpuEnv, classes: dict[str, str]) -> None:
    _fill(gpu, classes["low"], labels={"app": "low"})
    gpu.create({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": "keep-low", "namespace": gpu.ns},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "low"}}}})
    gpu.wait(lambda: (s := gpu.get("pdb", "keep-low").get("status") or {}).get("currentHealthy") == 2
             and s.get("observedGeneration") and s.get("disruptionsAllowed") == 0, 30,
             "the disruption controller counted the budget")
    gpu.create(_pod(gpu, "high", 3000, classes["high"]))
    _pending_event(gpu, "high", "GPUPreemptionNotPossible", f"PodDisruptionBudget ({gpu.ns}/keep-low)")
    _stays_pending(gpu, "high")
