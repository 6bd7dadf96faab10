"""Level-based reactions to Nodes, VGPUPools, kvgpu Pods and VGPUClaims.

VGPUPools (few, user-authored) are watched by Kopf (:func:`register`). Nodes, kvgpu Pods and
VGPUClaims change at the rate pods are scheduled, so the runtime watches them with plain
list-and-watch streams (:mod:`kvgpu.watch`) and handles them in ``Runtime.on_node``,
``Runtime.on_pod`` and ``Runtime.on_claim``: Kopf's per-event machinery cost a quarter to a
third of the operator's CPU there. Nothing keeps state on the objects: no finalizers or
progress annotations on Pods or Nodes. Claims follow their pod:

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
    """Register the Kopf reconcilers (VGPUPools) on ``registry``, bound to the runtime ``rt``.

    (The ``type: ignore`` marks: Kopf's ``WatchingFn`` protocol spells out every keyword it
    passes; these handlers name the ones they use and take the rest as ``**_``.)"""

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
