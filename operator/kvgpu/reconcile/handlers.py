"""The Kopf handler for VGPUPools (few, user-authored): :func:`register`.

Nodes and VGPUClaims change at the rate pods are scheduled, so the runtime watches them with
plain list-and-watch streams (:mod:`kvgpu.watch`) and handles them in ``Runtime.on_node`` and
``Runtime.on_claim`` (a claim deleted, or Released/Failed, frees its reservation): Kopf's
per-event machinery cost a quarter to a third of the operator's CPU there. kvgpu Pods are
watched by the claim-phase worker process (:mod:`kvgpu.reconcile.phaseworker`), which makes the
claims follow their pod (:mod:`kvgpu.reconcile.phases`). Nothing keeps state on the objects: no
finalizers or progress annotations on Pods or Nodes.

When capacity frees, every pending kvgpu pod is touched (``kvgpu.io/requeue``) so kube-scheduler
retries it at once instead of after its back-off.
"""

from __future__ import annotations

from typing import Any, Protocol

import kopf
import structlog

from kvgpu import kube
from kvgpu.core import keys
from kvgpu.reconcile import poolstatus
from kvgpu.reconcile.state import OperatorState

log = structlog.get_logger("kvgpu.operator")


class PoolHost(Protocol):
    """What the pool handler needs of the operator's main process (``kvgpu.runtime.Runtime``
    satisfies it): named here so that this module never imports the runtime, which imports it."""

    state: OperatorState
    api: Any
    active: bool  # False on a standby replica
    pools_dirty: bool  # set: write pool status at the next flush

    def nudge_pending(self, why: str) -> None:
        """Ask for the pending kvgpu pods to be requeued."""


def register(registry: kopf.OperatorRegistry, rt: PoolHost) -> None:
    """Register the Kopf reconcilers (VGPUPools) on ``registry``, bound to the runtime ``rt``.

    (The ``type: ignore`` marks: Kopf's ``WatchingFn`` protocol spells out every keyword it
    passes; these handlers name the ones they use and take the rest as ``**_``.)"""

    @kopf.on.event(keys.GROUP, keys.VERSION, "vgpupools", registry=registry)  # type: ignore[arg-type]
    async def pool_event(event: dict[str, Any], body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        name = body["metadata"]["name"]
        if event.get("type") == "DELETED":
            pods, nodes = poolstatus.in_use(name, rt.state.ledger.usage().values())
            rt.state.remove_pool(name)
            if pods and rt.active:  # the claims keep their cards: say so, once, where people look
                msg = poolstatus.deleted_in_use_message(name, pods, nodes)
                log.warning("pool deleted under live claims", pool=name, detail=msg)
                await kube.post_event(rt.api, {"apiVersion": f"{keys.GROUP}/{keys.VERSION}", "kind": "VGPUPool",
                                               "metadata": dict(body["metadata"])},
                                      reason="PoolDeletedInUse", message=msg, type_="Warning")
        else:
            before = rt.state.invalid_pools.get(name)
            try:
                changed = rt.state.set_pool(dict(body))
            except ValueError as e:
                # Valid for the CRD's schema, not for the model: Ready=False, reason InvalidSpec
                # on its status (written by the flush), and it slices no cards until fixed.
                if before is None or before[1] != str(e):
                    log.warning("VGPUPool is invalid: it slices no cards", pool=name, reason=str(e))
                    rt.pools_dirty = True
                return
            if not changed:
                return
        rt.pools_dirty = True
        rt.nudge_pending("pool changed")
