"""The operator's flush (Runtime.flush): nothing written per node for allocations (a node's use
is derived from the claims; the per-node metrics follow the ledger), the annotation earlier
versions wrote removed once per node that still has it, VGPUPool status at once for pool or
inventory changes and at most every pool_status_interval_s for allocations alone (it sums
every node and reservation, in the loop that answers filter)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvgpu import kube
from kvgpu.api.requests import parse_pod
from kvgpu.core import keys
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.runtime import OperatorConfig, Runtime

from tests.unit.extender_helpers import make_state


class Writes:
    def __init__(self) -> None:
        self.nodes: list[tuple[str, dict[str, Any]]] = []
        self.pools: list[dict[str, Any]] = []

    async def patch_node_annotations(self, api: Any, name: str, annotations: dict[str, Any]) -> None:
        self.nodes.append((name, annotations))

    async def patch_pool_status(self, api: Any, name: str, status: dict[str, Any]) -> None:
        self.pools.append(status)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Writes:
    w = Writes()
    monkeypatch.setattr(kube, "patch_node_annotations", w.patch_node_annotations)
    monkeypatch.setattr(kube, "patch_pool_status", w.patch_pool_status)
    return w


Started = tuple[Runtime, list[float]]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    """A runtime on the three-node fake state, with a clock the test moves (seconds)."""
    clock = [1000.0]
    monkeypatch.setattr("kvgpu.runtime.background.time.monotonic", lambda: clock[0])
    rt = Runtime(OperatorConfig(pool_status_interval_s=5.0))
    rt.state = make_state()
    return rt, clock


def _reserve(rt: Runtime, uid: str, node: str) -> None:
    pod = {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": {"kvgpu.io/gpumem": "1000"}},
           "spec": {"containers": [{"name": "main", "image": "x"}]}}
    req = parse_pod(pod, rt.state.default_pool_spec())
    assert req is not None
    rt.state.reserve(uid, rt.state.ledger.allocate(req, node))


def test_pool_status_for_allocations_waits_for_its_interval(writes: Writes, started: Started) -> None:
    rt, clock = started
    asyncio.run(rt.flush())  # start: the pool written
    assert len(writes.pools) == 1
    assert writes.pools[-1]["slotsUsed"] == 0

    _reserve(rt, "a", "n0")
    clock[0] += 1.0
    asyncio.run(rt.flush())
    assert len(writes.pools) == 1, "pool status rewritten 1 s after the last write"

    _reserve(rt, "b", "n1")
    clock[0] += 3.0
    asyncio.run(rt.flush())
    assert len(writes.pools) == 1

    clock[0] += 1.5  # 5.5 s after the last pool write; nothing new since the last flush
    asyncio.run(rt.flush())
    assert len(writes.pools) == 2 and writes.pools[-1]["slotsUsed"] == 2

    clock[0] += 10.0  # nothing changed: nothing written
    asyncio.run(rt.flush())
    assert len(writes.pools) == 2


def test_allocations_write_nothing_per_node_and_the_metrics_follow_them(writes: Writes,
                                                                         started: Started) -> None:
    """A burst of reservations on n0 and n1: no Node is written (the per-pod path stays at the
    claim and the Binding); the per-node gauges show the ledger after each flush."""
    rt, clock = started
    asyncio.run(rt.flush())
    for step in range(4):
        _reserve(rt, f"a{step}", "n0")
        if step == 1:
            _reserve(rt, "b", "n1")
        clock[0] += 1.0
        asyncio.run(rt.flush())
        assert rt.metrics.slots_used.labels("n0")._value.get() == step + 1
    assert writes.nodes == []
    assert rt.metrics.slots_used.labels("n1")._value.get() == 1
    assert rt.metrics.memory_used.labels("n0")._value.get() == 4 * 1000 * 1024 * 1024
    rt.state.release_pod("a0")
    asyncio.run(rt.flush())
    assert rt.metrics.slots_used.labels("n0")._value.get() == 3 and writes.nodes == []


def test_the_annotation_of_earlier_versions_is_removed_once(writes: Writes, started: Started) -> None:
    """A node that still carries ``kvgpu.io/allocation`` gets it removed at the next flush, once;
    a node without it, or one deleted before the flush, is not written."""
    rt, _ = started
    old = node_manifest_named("n0")
    old["metadata"]["annotations"][keys.NODE_ALLOCATION] = '{"version":1}'
    rt.on_node("MODIFIED", old)
    rt.on_node("MODIFIED", node_manifest_named("n1"))
    gone = node_manifest_named("n2")
    gone["metadata"]["annotations"][keys.NODE_ALLOCATION] = '{"version":1}'
    rt.on_node("MODIFIED", gone)
    rt.on_node("DELETED", gone)
    asyncio.run(rt.flush())
    assert writes.nodes == [("n0", {keys.NODE_ALLOCATION: None})]
    asyncio.run(rt.flush())
    assert len(writes.nodes) == 1, "removed once"
    fixed = node_manifest_named("n0")  # the node as the removal left it
    rt.on_node("MODIFIED", fixed)
    asyncio.run(rt.flush())
    assert len(writes.nodes) == 1


def node_manifest_named(name: str) -> dict[str, Any]:
    """The fake node ``name`` of :func:`make_state`, as the node watch delivers it."""
    from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode

    return node_manifest(SimulatedNode(name, (SimulatedCardSpec(memory_mib=20000, count=2),)))


def test_pool_status_at_once_when_a_pool_or_inventory_changes(writes: Writes, started: Started) -> None:
    rt, clock = started
    asyncio.run(rt.flush())
    assert len(writes.pools) == 1
    clock[0] += 0.5
    rt.state.remove_node("n2")  # an inventory change: the pool's card count changes
    asyncio.run(rt.flush())
    assert len(writes.pools) == 2 and writes.pools[-1]["cards"] == 4
    clock[0] += 0.5
    rt.pools_dirty = True  # what the VGPUPool handler sets
    _reserve(rt, "a", "n0")
    asyncio.run(rt.flush())
    assert len(writes.pools) == 3 and writes.pools[-1]["slotsUsed"] == 1


def test_a_node_refused_by_the_api_does_not_hold_up_the_others(started: Started,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing the old annotation: a node the API refuses (403/404/422: not a transient error)
    is skipped and not retried; a transient error (the API server away) stops the flush and
    keeps the node for the next round."""
    from kubernetes_asyncio.client.exceptions import ApiException

    rt, _ = started
    pools: list[dict[str, Any]] = []
    status = [403]

    async def patch_node(api: Any, name: str, annotations: dict[str, Any]) -> None:
        raise ApiException(status=status[0], reason="refused")

    async def patch_pool(api: Any, name: str, status: dict[str, Any]) -> None:
        pools.append(status)

    monkeypatch.setattr(kube, "patch_node_annotations", patch_node)
    monkeypatch.setattr(kube, "patch_pool_status", patch_pool)
    rt.stale_allocation_nodes.add("n0")
    asyncio.run(rt.flush())
    assert len(pools) == 1 and not rt.stale_allocation_nodes
    status[0] = 503
    rt.stale_allocation_nodes.add("n1")
    with pytest.raises(ApiException):
        asyncio.run(rt.flush())
    assert rt.stale_allocation_nodes == {"n1"}
