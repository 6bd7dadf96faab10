"""The operator's flush (Runtime.flush): node allocation annotations at most every
node_annotation_interval_s per node (the first at once), VGPUPool status at once for pool or
inventory changes and at most every pool_status_interval_s for allocations alone (it sums
every node and reservation, in the loop that answers filter)."""

from __future__ import annotations

import asyncio
import json
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
    monkeypatch.setattr("kvgpu.runtime.background.time.monotonic", lambda: clock[0])
    rt = Runtime(OperatorConfig(pool_status_interval_s=5.0, node_annotation_interval_s=0.5))
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


def test_a_node_changing_again_soon_is_written_once_its_interval_passed(writes: Writes,
                                                                      started: Started) -> None:
    rt, clock = started
    rt.cfg = OperatorConfig(pool_status_interval_s=5.0, node_annotation_interval_s=5.0)
    asyncio.run(rt.flush())  # the first write of every node: at once
    assert sorted(writes.nodes) == NODES
    writes.nodes.clear()
    for step in range(4):  # a burst: n0 changes before every flush, n1 once
        _reserve(rt, f"a{step}", "n0")
        if step == 1:
            _reserve(rt, "b", "n1")
        clock[0] += 1.0
        asyncio.run(rt.flush())
    assert writes.nodes == [], "written 4 s ago: not yet"
    clock[0] += 1.0
    asyncio.run(rt.flush())
    assert writes.nodes == ["n0", "n1"], "5 s after the last write: both, with everything since"
    now = json.dumps(rt.state.ledger.node_usage("n0").to_json(), sort_keys=True, separators=(",", ":"))
    assert rt._written_nodes["n0"] == now  # the four reservations
    clock[0] += 10.0
    asyncio.run(rt.flush())
    assert writes.nodes == ["n0", "n1"], "nothing changed since: nothing written"


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


def test_pool_status_recovers_from_a_reservation_released_within_one_flush(
        started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bind's early reservation lands while a node patch is awaited, so the pool total counts
    it; the bind fails and releases it, leaving the node's text as already written. The pool
    status must still come back to the truth (found in review; older than the 5 s interval)."""
    rt, clock = started
    pools: list[dict[str, Any]] = []
    during_patch: list[Any] = []

    async def patch_node(api: Any, name: str, annotations: dict[str, Any]) -> None:
        while during_patch:
            during_patch.pop()()  # a bind's early reservation lands while the patch is awaited

    async def patch_pool(api: Any, name: str, status: dict[str, Any]) -> None:
        pools.append(status)

    monkeypatch.setattr(kube, "patch_node_annotations", patch_node)
    monkeypatch.setattr(kube, "patch_pool_status", patch_pool)

    asyncio.run(rt.flush())
    _reserve(rt, "a", "n0")
    during_patch.append(lambda: _reserve(rt, "b", "n0"))
    clock[0] += 10
    asyncio.run(rt.flush())  # n0 written with a; the pool status summed with a and b
    assert pools[-1]["slotsUsed"] == 2
    rt.state.release_pod("b")  # b's bind failed: n0 is back to what its annotation says
    for _ in range(3):
        clock[0] += 10
        asyncio.run(rt.flush())
    assert rt.state.ledger.pool_usage()["default"].slots_used == 1
    assert pools[-1]["slotsUsed"] == 1, "the pool status still counts the released reservation"


def test_a_node_refused_by_the_api_does_not_hold_up_the_others(started: Started,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A node the API refuses (403/404/422: not a transient error) is skipped; the other
    nodes and the pool status are written in the same flush."""
    from kubernetes_asyncio.client.exceptions import ApiException

    rt, clock = started
    written: list[str] = []
    pools: list[dict[str, Any]] = []

    async def patch_node(api: Any, name: str, annotations: dict[str, Any]) -> None:
        if name == "n0":
            raise ApiException(status=403, reason="Forbidden")
        written.append(name)

    async def patch_pool(api: Any, name: str, status: dict[str, Any]) -> None:
        pools.append(status)

    monkeypatch.setattr(kube, "patch_node_annotations", patch_node)
    monkeypatch.setattr(kube, "patch_pool_status", patch_pool)
    asyncio.run(rt.flush())
    assert written == ["n1", "n2"] and len(pools) == 1
    # A transient error (the API server away) still stops the flush and keeps the rest dirty.
    async def unavailable(api: Any, name: str, annotations: dict[str, Any]) -> None:
        raise ApiException(status=503, reason="Unavailable")

    monkeypatch.setattr(kube, "patch_node_annotations", unavailable)
    _reserve(rt, "a", "n1")
    clock[0] += 1.0  # past n1's interval
    with pytest.raises(ApiException):
        asyncio.run(rt.flush())
    assert "n1" in rt.state.dirty_nodes

