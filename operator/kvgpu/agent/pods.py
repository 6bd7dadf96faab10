"""The pods bound to this node, kept current by a :class:`kvgpu.watch.ListWatch` (field selector
``spec.nodeName``).

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

from kvgpu.watch import ListWatch

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

    def on_event(self, etype: str, pod: dict[str, Any]) -> None:
        """One event of the pod watch: keep the cache, then ``on_change()``."""
        if etype == "DELETED":
            self.delete_pod(pod)
        else:
            self.set_pod(pod)
        if self.on_change is not None:
            self.on_change()

    async def run(self, api_client: Any) -> None:
        """List, then watch (:class:`kvgpu.watch.ListWatch`: relists on expiry, retries on
        errors, hands pods gone meanwhile over as deleted); sets :attr:`synced` after the first
        list. Until cancelled."""
        lw = ListWatch(api_client, "/api/v1/pods", self.on_event, field_selector=f"spec.nodeName={self.node}",
                       project=_uid_only, name=f"pods on {self.node}")

        async def mark_synced() -> None:
            await lw.synced.wait()
            self.synced.set()

        await asyncio.gather(lw.run(), mark_synced())


def _uid_only(pod: dict[str, Any]) -> dict[str, Any]:
    """What the stream keeps of a pod for a synthesized deletion: the cache holds the rest."""
    meta = pod.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}}
