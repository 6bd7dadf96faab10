"""Kopf handlers: level-based reactions to Nodes, VGPUPools, kvgpu Pods and VGPUClaims.

No handler here keeps state on the objects (only ``on.event``): no finalizers or progress
annotations on Pods or Nodes. Claims follow their pod:

=====================  ==========================================
pod                     claim phase
=====================  ==========================================
bound (by the binder)   Bound
Running                 Running
Succeeded / Failed      Released (ledger freed; the claim stays as a record)
deleted                 deleted (and garbage-collected through its ownerReference)
=====================  ==========================================

When capacity frees, every pending kvgpu pod is touched (``kvgpu.io/requeue``) so kube-scheduler
retries it at once instead of after its back-off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kopf

from kvgpu.core import keys

if TYPE_CHECKING:
    from kvgpu.runtime import Runtime

TERMINAL = ("Succeeded", "Failed")


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """Register the reconcilers on ``registry``, bound to the runtime ``rt``.

    (The ``type: ignore`` marks: Kopf's ``WatchingFn`` protocol spells out every keyword it
    passes; these handlers name the ones they use and take the rest as ``**_``.)"""

    @kopf.on.event("", "v1", "nodes", registry=registry)  # type: ignore[arg-type]
    async def node_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        name = body["metadata"]["name"]
        if event.get("type") == "DELETED":
            if name in rt.state.nodes:
                rt.state.remove_node(name)
                rt.claims_on_lost_node(name)
            return
        if rt.state.set_node(dict(body)):
            rt.nudge_pending("node inventory changed")

    @kopf.on.event(keys.GROUP, keys.VERSION, "vgpupools", registry=registry)  # type: ignore[arg-type]
    async def pool_event(event: dict[str, Any], body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        name = body["metadata"]["name"]
        if event.get("type") == "DELETED":
            rt.state.remove_pool(name)
        else:
            try:
                changed = rt.state.set_pool(dict(body))
            except ValueError as e:
                logger.error(f"VGPUPool {name} is invalid: {e}")
                return
            if not changed:
                return
        rt.pools_dirty = True
        rt.nudge_pending("pool changed")

    @kopf.on.event("", "v1", "pods", registry=registry,  # type: ignore[arg-type]
                   labels={keys.POD_MANAGED_LABEL: "true"})
    async def pod_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        await rt.on_pod(event.get("type"), dict(body))

    @kopf.on.event(keys.GROUP, keys.VERSION, "vgpuclaims", registry=registry)  # type: ignore[arg-type]
    async def claim_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":
            rt.on_claim_deleted(dict(body))
