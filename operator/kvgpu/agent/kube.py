"""The agent's few Kubernetes calls, behind a small interface so unit tests can fake them.

:class:`KubeApi` implements :class:`NodeApi` with a kubernetes_asyncio ``ApiClient``. RBAC the
agent needs: nodes get/patch, events create, vgpupools list, pods list/watch (field selector
``spec.nodeName``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kvgpu import faults
from kvgpu.core import keys
from kvgpu.kube import event_body

log = logging.getLogger(__name__)

COMPONENT = "kvgpu-agent"
EVENT_NAMESPACE = "default"  # where the kubelet also records Node events


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
        self._pools: dict[str, dict[str, Any]] | None = None  # None: not synced
        self.api_calls = 0  # GET/LIST fallbacks made (for tests)
        self.faults = faults.FaultLog(log, every_s=300.0)

    async def get_node(self, name: str) -> dict[str, Any]:
        if name in self._nodes:
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
        if name in self._nodes:  # the watch will say the same soon; do not compare with stale data
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
        changes. Errors are logged and the watch restarts with a fresh list."""
        await asyncio.gather(
            self._watch_node(node, on_change, retry_s), self._watch_pools(on_change, retry_s)
        )

    async def _watch_node(self, node: str, on_change: Callable[[], None], retry_s: float) -> None:
        from kubernetes_asyncio import watch

        sel = f"metadata.name={node}"

        def relevant(d: dict[str, Any]) -> tuple[Any, Any]:
            m = d.get("metadata") or {}
            return (m.get("labels"), (m.get("annotations") or {}).get(keys.NODE_INVENTORY))

        while True:
            try:
                lst = self.api.sanitize_for_serialization(await self.core.list_node(field_selector=sel))
                self.faults.ok("node-watch", "node watch")
                for item in lst.get("items") or []:
                    self._store_node(item)
                rv = (lst.get("metadata") or {}).get("resourceVersion")
                async with watch.Watch().stream(
                    self.core.list_node, field_selector=sel, resource_version=rv, timeout_seconds=300
                ) as stream:
                    async for ev in stream:
                        d = self.api.sanitize_for_serialization(ev["object"])
                        if ev["type"] == "DELETED":
                            self._nodes.pop(node, None)
                            on_change()  # the refresh finds it gone and says so
                            continue
                        before = self._nodes.get(node)
                        self._store_node(d)
                        if before is None or relevant(before) != relevant(self._nodes[node]):
                            on_change()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._nodes.pop(node, None)
                self.faults.fault("node-watch", f"node watch failed; relisting every {retry_s:.0f} s",
                                  faults.expected(e) or repr(e)[:200])
                await asyncio.sleep(retry_s)

    async def _watch_pools(self, on_change: Callable[[], None], retry_s: float) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        args = (keys.GROUP, keys.VERSION, "vgpupools")
        while True:
            try:
                try:
                    lst = await self.custom.list_cluster_custom_object(*args)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    self._pools = {}  # CRD not installed (yet): no pools; look again later
                    await asyncio.sleep(retry_s * 6)
                    continue
                self.faults.ok("pool-watch", "VGPUPool watch")
                pools = {(p.get("metadata") or {}).get("name", ""): p for p in lst.get("items") or []}
                if self._pools != pools:
                    self._pools = pools
                    on_change()
                rv = (lst.get("metadata") or {}).get("resourceVersion")
                async with watch.Watch().stream(
                    self.custom.list_cluster_custom_object, *args, resource_version=rv, timeout_seconds=300
                ) as stream:
                    async for ev in stream:
                        obj = ev["object"]
                        name = (obj.get("metadata") or {}).get("name", "")
                        cur = dict(self._pools or {})
                        if ev["type"] == "DELETED":
                            cur.pop(name, None)
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            cur[name] = obj
                        else:
                            continue
                        self._pools = cur
                        on_change()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._pools = None
                self.faults.fault("pool-watch", f"VGPUPool watch failed; relisting every {retry_s:.0f} s",
                                  faults.expected(e) or repr(e)[:200])
                await asyncio.sleep(retry_s)

    async def list_pools(self) -> list[dict[str, Any]]:
        from kubernetes_asyncio.client.exceptions import ApiException

        if self._pools is not None:
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
            await self.core.create_namespaced_event(namespace, body)  # type: ignore[arg-type]
        except Exception as e:
            log.warning("could not record event %s on pod %s/%s: %s", reason, namespace, pod, e)

    async def node_event(self, node: str, reason: str, message: str, type_: str = "Normal") -> None:
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": self._node_uid.get(node, node)}
        body = event_body(involved, EVENT_NAMESPACE, reason=reason, message=message, type_=type_,
                          component=COMPONENT, instance=node, host=node)
        try:
            await self.core.create_namespaced_event(EVENT_NAMESPACE, body)  # type: ignore[arg-type]
        except Exception as e:  # events are best effort
            log.warning("could not record event %s on node %s: %s", reason, node, e)
