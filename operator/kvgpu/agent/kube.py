"""The agent's few Kubernetes calls, behind a small interface so unit tests can fake them.

:class:`KubeApi` implements :class:`NodeApi` with a kubernetes_asyncio ``ApiClient``. RBAC the
agent needs: nodes get/patch, events create, vgpupools list, pods list/watch (field selector
``spec.nodeName``).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Protocol

from kvgpu.core import keys

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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeApi:
    """:class:`NodeApi` over a kubernetes_asyncio ``ApiClient``."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes_asyncio import client

        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._node_uid: dict[str, str] = {}

    async def get_node(self, name: str) -> dict[str, Any]:
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
        await self.core.patch_node(name, {"metadata": meta}, _content_type="application/merge-patch+json")  # type: ignore[call-arg]

    async def list_pools(self) -> list[dict[str, Any]]:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            res = await self.custom.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools")
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return list(res.get("items") or [])

    async def node_event(self, node: str, reason: str, message: str, type_: str = "Normal") -> None:
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{node}.kvgpu-", "namespace": EVENT_NAMESPACE},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node,
                "uid": self._node_uid.get(node, node),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": COMPONENT, "host": node},
            "reportingComponent": COMPONENT,
            "reportingInstance": node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.core.create_namespaced_event(EVENT_NAMESPACE, body)  # type: ignore[arg-type]
        except Exception as e:  # events are best effort
            log.warning("could not record event %s on node %s: %s", reason, node, e)
