"""The preemption adapter (kvgpu.extender.preemption) against a fake API: an eviction refused by
a PodDisruptionBudget (429) is never worked around: the next plan takes other pods, and the
holds keep pods of no higher priority off the preemptor's cards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from allocator_helpers import c, node, pod
from kubernetes_asyncio.client.exceptions import ApiException
from kvgpu import kube
from kvgpu.extender.preemption import Preemption
from kvgpu.reconcile.state import OperatorState


def _world(monkeypatch: pytest.MonkeyPatch, refuse: set[str]) -> tuple[Preemption, list[str], list[str]]:
    st = OperatorState()
    inv = node("a", 1)
    st.sliced["a"] = inv
    st.ledger.set_node(inv)
    pods = []
    for name, mib, prio in (("low-0", 4500, 10), ("low-1", 4500, 10)):
        st.ledger.bind(pod(c(memory_mib=mib), uid=name, name=name), "a")
        pods.append({"metadata": {"uid": name, "namespace": "ns", "name": name}, "spec": {"priority": prio}})
    evicted: list[str] = []
    events: list[str] = []

    async def list_node_pods(api: Any, n: str) -> list[dict[str, Any]]:
        return pods

    async def list_pdbs(api: Any, ns: str) -> list[dict[str, Any]]:
        return []

    async def evict_pod(api: Any, ns: str, name: str, uid: str) -> None:
        if name in refuse:
            raise ApiException(status=429, reason="Too Many Requests")
        evicted.append(name)

    async def post_event(api: Any, obj: dict[str, Any], *, reason: str, message: str, **kw: Any) -> None:
        events.append(f"{obj['metadata']['name']} {reason}: {message}")

    for name, fn in (("list_node_pods", list_node_pods), ("list_pdbs", list_pdbs), ("evict_pod", evict_pod),
                     ("post_event", post_event)):
        monkeypatch.setattr(kube, name, fn)
    return Preemption(st, api=None), evicted, events


HIGH = {"metadata": {"uid": "hi", "namespace": "ns", "name": "high"}, "spec": {"priority": 1000}}


def test_refused_eviction_moves_to_the_next_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    pre, evicted, events = _world(monkeypatch, refuse={"low-0"})
    asyncio.run(pre._consider(HIGH, pod(c(memory_mib=3000), uid="hi", name="high"), ("a",)))
    assert evicted == ["low-1"]
    assert any("high GPUPreemptionNotPossible: eviction of ns/low-0 on a refused" in e for e in events), events
    assert any(e.startswith("low-1 Preempted: preempted by ns/high (priority 1000)") for e in events), events
    assert list(pre.noms) == ["hi"] and pre.noms["hi"].node == "a"
    # A pod of lower priority is kept off the held card; one of higher priority is not.
    low = {"metadata": {"uid": "x"}, "spec": {"priority": 10}}
    req, feasible, _ = pre.filter(low, pod(c(memory_mib=500), uid="x", name="x"), ["a"])
    assert feasible == [] and req.containers[0].exclude_uuids
    top = {"metadata": {"uid": "y"}, "spec": {"priority": 5000}}
    assert pre.filter(top, pod(c(memory_mib=500), uid="y", name="y"), ["a"])[1] == ["a"]


def test_every_eviction_refused_evicts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pre, evicted, _ = _world(monkeypatch, refuse={"low-0", "low-1"})
    asyncio.run(pre._consider(HIGH, pod(c(memory_mib=3000), uid="hi", name="high"), ("a",)))
    assert evicted == [] and not pre.noms
    assert pre.state.ledger.pod_node("low-0") == "a" and pre.state.ledger.pod_node("low-1") == "a"
