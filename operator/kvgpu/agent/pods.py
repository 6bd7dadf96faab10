"""The pods bound to this node, kept current by a list+watch (field selector ``spec.nodeName``).

Feeds the exporter (containers with claims, before CUDA starts) and the device plugin's pod
identification (:mod:`kvgpu.agent.podidentity`: the cache, and :meth:`PodCache.list_fresh` while
the watch lags the kubelet). The cache is
a dict replaced atomically, so the exporter's scrape thread can read it without locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .usage import BoundContainer, containers_of_pod, pending_device_sets

log = logging.getLogger(__name__)


class PodCache:
    """Pods of one node, keyed by UID (API dicts)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.pods: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.on_change: Callable[[], None] | None = None

    def set_pod(self, pod: dict[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid", "")
        pods = dict(self.pods)
        pods[uid] = pod
        self.pods = pods

    def delete_pod(self, pod: dict[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid", "")
        pods = dict(self.pods)
        pods.pop(uid, None)
        self.pods = pods

    def containers(self) -> list[BoundContainer]:
        """Bound containers of live pods on this node."""
        return [c for p in list(self.pods.values()) for c in containers_of_pod(p)]

    def live_uids(self) -> set[str]:
        return set(self.pods)

    def hints(self, size: int) -> list[list[str]]:
        """Card lists of not-yet-created containers asking for ``size`` cards (device plugin hint)."""
        return [s for s in pending_device_sets(self.containers()) if len(s) == size]

    def all_pods(self) -> list[dict[str, Any]]:
        """The cached pods (API dicts) now."""
        return list(self.pods.values())

    async def list_fresh(self, api_client: Any) -> list[dict[str, Any]]:
        """This node's pods straight from the API (API dicts); the cache is left to the watch."""
        from kubernetes_asyncio import client

        lst = await client.CoreV1Api(api_client).list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}"
        )
        return list(api_client.sanitize_for_serialization(lst).get("items") or [])

    async def run(self, api_client: Any, retry_s: float = 5.0) -> None:
        """List, then watch from the list's resourceVersion; relist on errors/expiry. Until cancelled."""
        from kubernetes_asyncio import client, watch

        core = client.CoreV1Api(api_client)
        selector = f"spec.nodeName={self.node}"
        while True:
            try:
                lst = await core.list_pod_for_all_namespaces(field_selector=selector)
                items = api_client.sanitize_for_serialization(lst)
                self.pods = {(p.get("metadata") or {}).get("uid", ""): p for p in items.get("items") or []}
                self.synced.set()
                rv = (items.get("metadata") or {}).get("resourceVersion")
                w = watch.Watch()
                async with w.stream(
                    core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=rv,
                    timeout_seconds=300,
                ) as stream:
                    async for ev in stream:
                        obj = api_client.sanitize_for_serialization(ev["object"])
                        if ev["type"] == "DELETED":
                            self.delete_pod(obj)
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            self.set_pod(obj)
                        if self.on_change is not None:
                            self.on_change()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("pod watch on %s failed (%s); relisting in %.0fs", self.node, e, retry_s)
                await asyncio.sleep(retry_s)
