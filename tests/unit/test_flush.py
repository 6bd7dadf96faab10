"""The operator's flush (Runtime.flush): node allocation annotations every flush, VGPUPool
status at once for pool or inventory changes and at most every pool_status_interval_s for
allocations alone (it sums every node and reservation, in the loop that answers filter)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvgpu import kube
from kvgpu.api.requests import parse_pod
from kvgpu.runtime import OperatorConfig, Runtime

from tests.unit.extender_helpers import NODES, make_state


class Writes:
    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.pools: list[dict[str, Any]] = []

    async def patch_node_annotations(self, api: Any, name: str, annotations: dict[str, Any]) -> None:
        self.nodes.append(name)

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
    monkeypatch.setattr("kvgpu.runtime.time.monotonic", lambda: clock[0])
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
    asyncio.run(rt.flush())  # start: every node and the pool written
    assert sorted(writes.nodes) == NODES and len(writes.pools) == 1
    assert writes.pools[-1]["slotsUsed"] == 0

    _reserve(rt, "a", "n0")
    clock[0] += 1.0
    asyncio.run(rt.flush())
    assert writes.nodes[-1] == "n0", "node annotations are written every flush"
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
