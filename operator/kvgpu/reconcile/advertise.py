"""What a GPU node advertises for HAMi's container-limit resources besides ``nvidia.com/gpu``. Pure.

kube-scheduler ignores ``nvidia.com/gpumem``, ``gpumem-percentage``, ``gpucores`` and ``priority``
(``ignoredResources`` of NodeResourcesFit: the extender counts them per card), but its queueing
hint for node changes does not: ``isSchedulableAfterNodeChange`` (``pkg/scheduler/framework/
plugins/noderesources/fit.go``, v1.36) checks the pod against the changed node with ``Fits``,
which passes no ignored resources. On a node that lacks ``nvidia.com/gpumem``, a pod turned away
for ``nvidia.com/gpu`` slots is therefore never woken by the node's slots growing (a splitCount
raised, a card healthy again, a node added): it waits for kube-scheduler's 5-minute flush.

So the operator puts these resources in the node's ``status.capacity`` and ``allocatable`` (the
documented way to advertise an extended resource; the kubelet keeps entries it does not own).
The amounts are upper bounds that never turn away a pod the extender placed — the kubelet's
admission now sums the pods' requests against them:

- ``nvidia.com/gpumem`` in ``Mi``: the virtual MiB the pool sells on the node's usable cards (or
  what is held, if more). A container's request counts once however many cards it has, and a
  request written as MiB (``3000``) is a number of units far below ``3000Mi``, so the sum of the
  requests never exceeds it.
- ``nvidia.com/gpumem-percentage``: 100 per card (a card's percent requests sum to at most 100).
- ``nvidia.com/gpucores``: the cards' core totals (100 x coreScaling each, or what is held).
- ``nvidia.com/priority``: the slots (one container takes at least one slot and asks 0 or 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvgpu.allocator.ledger import NodeUsage
from kvgpu.api.requests import HAMI_GPUCORES, HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE, HAMI_PRIORITY

ADVERTISED = (HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE, HAMI_GPUCORES, HAMI_PRIORITY)


def advertised(usage: NodeUsage) -> dict[str, str]:
    """The ``status.capacity`` entries (quantity strings) for :data:`ADVERTISED` on a node with
    ``usage``. Cards that take no slices (no pool, unhealthy, MIG) count only for what they hold."""
    held = [c for c in usage.cards if not c.usable and c.pods and not c.dra]
    cards = len([c for c in usage.cards if c.usable]) + len(held)
    memory = max(usage.memory_total_mib, usage.memory_used_mib) + sum(c.memory_used_mib for c in held)
    cores = max(usage.cores_total, usage.cores_used) + sum(c.cores_used for c in held)
    slots = max(usage.slots_total, usage.slots_used) + sum(c.slots_used for c in held)
    return {HAMI_GPUMEM: f"{memory}Mi", HAMI_GPUMEM_PERCENTAGE: str(100 * cards),
            HAMI_GPUCORES: str(cores), HAMI_PRIORITY: str(slots)}


def status_patch(node: Mapping[str, Any], want: Mapping[str, str]) -> dict[str, Any] | None:
    """The merge patch that gives ``node`` (a Node dict) ``want`` in both ``status.capacity`` and
    ``status.allocatable``, or ``None`` when it has them already (compared as amounts: the API
    server writes a quantity in its canonical form, ``1024Mi`` as ``1Gi``)."""
    st = node.get("status") or {}
    cap, alloc = st.get("capacity") or {}, st.get("allocatable") or {}
    if all(_same(cap.get(k), v) and _same(alloc.get(k), v) for k, v in want.items()):
        return None
    return {"status": {"capacity": dict(want), "allocatable": dict(want)}}


def _same(have: Any, want: str) -> bool:
    try:
        return have is not None and parse_quantity(have) == parse_quantity(want)
    except ValueError:
        return False
