"""Events aggregated as client-go's recorder does, on the real kube-apiserver: the operator's
``post_event`` and the agent's ``pod_event`` post the same Event 5 times and one Event object
with ``count`` 5 is left; similar events past the threshold become one combined Event; an Event
deleted under the recorder is created again. Everything lives in the test's namespace (deleted
by the ``namespace`` fixture)."""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes_asyncio import client
from kvgpu import kube
from kvgpu.agent.kube import KubeApi
from kvgpu.core.eventcorrelator import COMBINED_PREFIX, EventCorrelator
from kvgpu.devcluster import Cluster


async def events_of(api: Any, ns: str, name: str) -> list[dict[str, Any]]:
    res = await client.CoreV1Api(api).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name}", _preload_content=False)
    return list((await kube._raw(res)).get("items") or [])


def pod_obj(ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"}}


def test_operator_event_posted_five_times_is_one_event_with_count_5(cluster: Cluster, namespace: str) -> None:
    async def go() -> list[dict[str, Any]]:
        async with cluster.api() as api:
            for _ in range(5):
                await kube.post_event(api, pod_obj(namespace, "nb"), reason="Preempted", message="evicted for p1",
                                      type_="Warning")
            return await events_of(api, namespace, "nb")

    (ev,) = asyncio.run(go())
    assert (ev["count"], ev["reason"], ev["message"]) == (5, "Preempted", "evicted for p1")
    assert ev["firstTimestamp"] <= ev["lastTimestamp"]


def test_agent_pod_event_is_aggregated_and_combined(cluster: Cluster, namespace: str) -> None:
    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with cluster.api() as api:
            agent = KubeApi(api)
            agent.events.correlator = EventCorrelator(max_events=3)
            for _ in range(5):
                await agent.pod_event(namespace, "same", "uid-same", "Unenforced", "pid 42 escaped the shim")
            for i in range(6):
                await agent.pod_event(namespace, "similar", "uid-similar", "Unenforced", f"pid {i} escaped")
            return await events_of(api, namespace, "same"), await events_of(api, namespace, "similar")

    same, similar = asyncio.run(go())
    assert [(e["count"], e["source"]["component"]) for e in same] == [(5, "kvgpu-agent")]
    by_message = sorted((e["message"], e["count"]) for e in similar)
    # Two distinct messages, then one combined Event for the 3rd..6th (its message the latest).
    assert by_message == [(COMBINED_PREFIX + "pid 5 escaped", 4), ("pid 0 escaped", 1), ("pid 1 escaped", 1)]


def test_event_deleted_under_the_recorder_is_created_again(cluster: Cluster, namespace: str) -> None:
    async def go() -> list[dict[str, Any]]:
        async with cluster.api() as api:
            rec = kube.EventRecorder()
            body = kube.event_body({"apiVersion": "v1", "kind": "Pod", "name": "gone", "namespace": namespace,
                                    "uid": "uid-gone"}, namespace, reason="R", message="m")
            await rec.record(api, namespace, body)
            (first,) = await events_of(api, namespace, "gone")
            await client.CoreV1Api(api).delete_namespaced_event(first["metadata"]["name"], namespace)
            d = await rec.record(api, namespace, body)
            assert d.action == "create"
            await rec.record(api, namespace, body)
            return await events_of(api, namespace, "gone")

    (ev,) = asyncio.run(go())
    assert ev["count"] == 2
