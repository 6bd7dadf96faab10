"""The agent's few Kubernetes calls, behind a small interface so unit tests can fake them.

:class:`KubeApi` implements :class:`NodeApi` with a kubernetes_asyncio ``ApiClient``. RBAC the
agent needs: nodes get/list/watch/patch (its own node, field selector ``metadata.name``), events
create, vgpupools list/watch, pods list/watch (field selector ``spec.nodeName``). The watches are
:class:`kvgpu.watch.ListWatch` streams, as in the operator.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from kvgpu.core import keys
from kvgpu.kube import EventRecorder, event_body
from kvgpu.watch import ListWatch

log = logging.getLogger(__name__)

COMPONENT = "kvgpu-agent"
EVENT_NAMESPACE = "default"  # where the kubelet also records Node events


def _relevant(node: dict[str, Any]) -> tuple[Any, Any]:
    """What of a Node the agent acts on: its labels and its inventory annotation."""
    m = node.get("metadata") or {}
    return (m.get("labels"), (m.get("annotations") or {}).get(keys.NODE_INVENTORY))


class NodeApi(Protocol):
    async def get_node(self, name: str) -> dict[str, Any]:
        """The Node as a dict (``metadata.labels``/``annotations``). Raises on API errors."""
        ...

    async def patch_node_metadata(
        self, name: str, annotations: dict[str, str | None], labels: dict[str, str | None] | None = None
    ) -> None:
        """JSON merge-patch of the node's annotations/labels (``None`` deletes a key)."""
        ...

    async def list_pools(self) -> list[dict[str, Any]]:
        """All VGPUPool objects as dicts (``[]`` if the CRD is not installed)."""
        ...

    async def node_event(self, node: str, reason: str, message: str, type_: str = "Normal") -> None:
        """Record a core/v1 Event about the Node (failures are logged, never raised)."""
        ...


class KubeApi:
    """:class:`NodeApi` over a kubernetes_asyncio ``ApiClient``."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes_asyncio import client

        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._node_uid: dict[str, str] = {}
        self._nodes: dict[str, dict[str, Any]] = {}  # watched node(s), by name
        self._pools: dict[str, dict[str, Any]] = {}  # by name; read while pool_watch is current
        self.node_watch: ListWatch | None = None  # set by watch()
        self.pool_watch: ListWatch | None = None
        self.api_calls = 0  # GET/LIST fallbacks made (for tests)
        self.events = EventRecorder()  # client-go's correlation: repeats patch one Event's count

    async def get_node(self, name: str) -> dict[str, Any]:
        if self._node_cached(name):
            return copy.deepcopy(self._nodes[name])
        self.api_calls += 1
        node = await self.core.read_node(name)
        d: dict[str, Any] = self.api.sanitize_for_serialization(node)
        self._node_uid[name] = (d.get("metadata") or {}).get("uid", "")
        return d

    async def patch_node_metadata(
        self, name: str, annotations: dict[str, str | None], labels: dict[str, str | None] | None = None
    ) -> None:
        meta: dict[str, Any] = {"annotations": annotations}
        if labels:
            meta["labels"] = labels
        node = await self.core.patch_node(  # type: ignore[call-arg]
            name, {"metadata": meta}, _content_type="application/merge-patch+json"
        )
        if self._node_cached(name):  # the watch will say the same soon; do not compare with stale data
            self._store_node(self.api.sanitize_for_serialization(node))

    async def patch_node_resource(self, name: str, resource: str, capacity: int, allocatable: int) -> None:
        """Set ``status.capacity``/``allocatable`` of one extended resource (what a kubelet reports
        from a device plugin). For simulated nodes only; needs ``nodes/status`` patch."""
        body = {
            "status": {"capacity": {resource: str(capacity)}, "allocatable": {resource: str(allocatable)}}
        }
        await self.core.patch_node_status(  # type: ignore[call-arg]
            name, body, _content_type="application/merge-patch+json"
        )

    def _store_node(self, d: dict[str, Any]) -> None:
        meta = d.get("metadata") or {}
        old = self._nodes.get(meta.get("name", ""))
        if old is not None:
            old_rv = int((old.get("metadata") or {}).get("resourceVersion") or 0)
            if int(meta.get("resourceVersion") or 0) < old_rv:
                return  # an older event than what we have (e.g. after our own patch)
        self._nodes[meta.get("name", "")] = d
        self._node_uid[meta.get("name", "")] = meta.get("uid", "")

    async def watch(self, node: str, on_change: Callable[[], None], retry_s: float = 5.0) -> None:
        """Keep the node and pool caches current until cancelled; ``on_change()`` after relevant
        changes. Both are :class:`kvgpu.watch.ListWatch` streams (faults logged and retried
        there); while one is broken, :meth:`get_node`/:meth:`list_pools` read the API instead.
        A missing VGPUPool CRD counts as no pools, looked for again every ``6 * retry_s``."""
        self.node_watch = ListWatch(self.api, "/api/v1/nodes", partial(self.on_node_event, node, on_change),
                                    field_selector=f"metadata.name={node}", name=f"node {node}")
        self.pool_watch = ListWatch(self.api, f"/apis/{keys.GROUP}/{keys.VERSION}/vgpupools",
                                    partial(self.on_pool_event, on_change), name="vgpupools",
                                    missing_retry_s=retry_s * 6)
        await asyncio.gather(self.node_watch.run(), self.pool_watch.run())

    def on_node_event(self, node: str, on_change: Callable[[], None], etype: str, d: dict[str, Any]) -> None:
        """One event of the node watch: keep the cache; kick on deletion, re-creation and on a
        change of the labels or the inventory annotation (not on the kubelet's heartbeats)."""
        if etype == "DELETED":
            self._nodes.pop(node, None)
            on_change()  # the refresh finds it gone and says so
            return
        before = self._nodes.get(node)
        self._store_node(d)
        if before is None or _relevant(before) != _relevant(self._nodes[node]):
            on_change()

    def on_pool_event(self, on_change: Callable[[], None], etype: str, obj: dict[str, Any]) -> None:
        """One event of the pool watch: keep the cache (a new dict, never changed in place) and
        kick."""
        name = (obj.get("metadata") or {}).get("name", "")
        cur = dict(self._pools)
        if etype == "DELETED":
            cur.pop(name, None)
        else:
            cur[name] = obj
        self._pools = cur
        on_change()

    def _node_cached(self, name: str) -> bool:
        return name in self._nodes and self.node_watch is not None and self.node_watch.current()

    async def list_pools(self) -> list[dict[str, Any]]:
        from kubernetes_asyncio.client.exceptions import ApiException

        if self.pool_watch is not None and self.pool_watch.current():
            return [copy.deepcopy(p) for p in self._pools.values()]
        self.api_calls += 1
        try:
            res = await self.custom.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools")
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return list(res.get("items") or [])

    async def pod_event(
        self, namespace: str, pod: str, uid: str, reason: str, message: str, type_: str = "Warning"
    ) -> None:
        """Record a core/v1 Event about a Pod (best effort: failures are logged)."""
        involved = {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace, "uid": uid}
        body = event_body(involved, namespace, reason=reason, message=message, type_=type_, component=COMPONENT)
        try:
            await self.events.record(self.api, namespace, body)
        except Exception as e:
            log.warning("could not record event %s on pod %s/%s: %s", reason, namespace, pod, e)

    async def node_event(self, node: str, reason: str, message: str, type_: str = "Normal") -> None:
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": self._node_uid.get(node, node)}
        body = event_body(involved, EVENT_NAMESPACE, reason=reason, message=message, type_=type_,
                          component=COMPONENT, instance=node, host=node)
        try:
            await self.events.record(self.api, EVENT_NAMESPACE, body)
        except Exception as e:  # events are best effort
            log.warning("could not record event %s on node %s: %s", reason, node, e)
