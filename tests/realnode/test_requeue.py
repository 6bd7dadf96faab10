"""Capacity added on the real node places pending GPU pods at once: the pool's splitCount raised
goes pool → agent → device plugin → the real kubelet's allocatable → kube-scheduler, and a pod
that kube-scheduler or the extender turned away for want of slots is bound within seconds, not at
kube-scheduler's 5-minute flush. The times are printed; the assertion only tells an event-driven
requeue from the flush (timings belong in the benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kvgpu.devcluster.realnode import RealNode
from realnode.conftest import RealPods
from realnode.gpupods import gpu_pod, hami_limits, wait_for

REQUEUED_S = 20.0  # far below the 300 s flush; the kubelet reports allocatable every few seconds
FULL_SPLIT = 10  # the session node's pool (fixtures.real_node)


def _allocatable(node: RealNode) -> int:
    n = node.node() or {}
    return int(n.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0") or 0)


def _pending(rp: RealPods, name: str) -> bool:
    pod = rp.get(name)
    conds = pod.get("status", {}).get("conditions") or []
    return not pod["spec"].get("nodeName") and any(
        c["type"] == "PodScheduled" and c["status"] == "False" for c in conds)


@pytest.fixture
def small_pool(real_pods: RealPods) -> Iterator[RealNode]:
    """The node's pool at one slot per card for the test, then back to the session's."""
    node = real_pods.node
    cards = _allocatable(node) // FULL_SPLIT
    node.apply_pool(split_count=1)
    wait_for(lambda: _allocatable(node) == cards, 60, f"nvidia.com/gpu down to {cards}")
    try:
        yield node
    finally:
        real_pods.cluster.kubectl("delete", "pods", "--all", "-n", real_pods.ns, "--wait=true",
                                  "--timeout=120s", check=False)
        node.apply_pool(split_count=FULL_SPLIT)
        wait_for(lambda: _allocatable(node) == cards * FULL_SPLIT, 60, "nvidia.com/gpu back to the session's")


def test_split_count_raised_places_the_pod_waiting_for_a_slot(real_pods: RealPods, small_pool: RealNode) -> None:
    cards = _allocatable(small_pool)
    real_pods.apply(gpu_pod(real_pods, "all-slots", limits=hami_limits(cards, 1000)))
    real_pods.wait_running("all-slots", timeout=90)
    real_pods.apply(gpu_pod(real_pods, "waiting", limits=hami_limits(1, 1000)))
    wait_for(lambda: _pending(real_pods, "waiting"), 30, "waiting unschedulable (every slot taken)")
    time.sleep(2)  # past kube-scheduler's back-off: only an event can place it now
    assert _pending(real_pods, "waiting")
    t0 = time.monotonic()
    small_pool.apply_pool(split_count=2)
    try:
        wait_for(lambda: real_pods.get("waiting")["spec"].get("nodeName"), 60, "waiting bound")
    except AssertionError as e:
        conds = real_pods.get("waiting").get("status", {}).get("conditions")
        raise AssertionError(f"{e}; allocatable {_allocatable(small_pool)}; conditions {conds}") from None
    took = time.monotonic() - t0
    print(f"requeue on the real node: bound {took:.2f} s after splitCount 1 -> 2 "
          f"(allocatable now {_allocatable(small_pool)})")
    assert took <= REQUEUED_S, took
    real_pods.wait_running("waiting", timeout=90)
