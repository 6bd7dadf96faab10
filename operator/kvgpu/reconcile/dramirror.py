"""What VGPUClaim mirrors a DRA ResourceClaim allocated for driver ``gpu.kvgpu.io``. Pure, no I/O.

kube-scheduler allocates the cards of ``allocation: dra`` pools (docs/dra.md); the operator keeps
one VGPUClaim per such ResourceClaim so ``kubectl get vgpuclaims``, ``kubectl vgpu`` and the
pools' status show DRA slices like the extender's. A ResourceClaim (``resource.k8s.io/v1``) is
mirrored while it is allocated (``status.allocation``) with at least one result of
:data:`~kvgpu.dra.slices.DRIVER` and is reserved for a pod (``status.reservedFor``); the mirror:

* name ``dra-<claim name>-<first 8 of its UID>`` (cut to fit), in the claim's namespace, owned by
  the ResourceClaim (``ownerReferences``: the garbage collector removes it with the claim even
  when the operator is down), labels ``kvgpu.io/resourceclaim-uid``, ``kvgpu.io/pod-uid``,
  ``kvgpu.io/node``;
* ``spec.resourceClaim`` ``{name, uid}``; ``spec.node``: the result's pool (= the node);
  ``spec.podName``/``podUID``: the first pod of ``reservedFor``; ``spec.container``: that pod's
  first container (init containers after app containers) naming the claim in
  ``resources.claims``; ``spec.devices``: per result, the card (UUID, index, model from the
  ResourceSlice device) with ``memory`` (MiB, ``consumedCapacity.memory`` rounded up) and
  ``cores`` (``consumedCapacity.cores``); a result without consumed capacity (a card not shared:
  ``exclusive`` mode) holds the whole card: its ``memory`` capacity and 100 cores.

No phase is written: a mirror exists exactly while its ResourceClaim holds cards (Bound).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvgpu.api.models import VGPUClaim
from kvgpu.core import keys
from kvgpu.dra.mig import is_mig_device_name
from kvgpu.dra.slices import CAPACITY_CORES, CAPACITY_MEMORY, DRIVER, GROUP_VERSION

RESOURCE_CLAIM_UID_LABEL = f"{keys.GROUP}/resourceclaim-uid"
"""Label of a mirrored VGPUClaim: the UID of the ResourceClaim it stands for."""

MIRROR_PREFIX = "dra-"


class MirrorPending(Exception):
    """The mirror cannot be written yet (a device not seen in any ResourceSlice, the pod not
    readable); ``str(e)`` says why. Try again later."""


@dataclass(frozen=True, slots=True)
class Card:
    """A ResourceSlice device as the mirror needs it: the card and its memory capacity (MiB)."""

    uuid: str
    index: int
    model: str
    memory_mib: int


def to_mib(quantity: str) -> int:
    """A memory quantity (``3000Mi``, ``3Gi``, ``3145728000``) in MiB, rounded up. Raises
    ``ValueError`` for a malformed one."""
    try:
        return math.ceil(parse_quantity(quantity) / (1024 * 1024))
    except (ValueError, TypeError) as e:
        raise ValueError(f"memory quantity {quantity!r}: {e}") from e


def _attr(attrs: Mapping[str, Any], name: str) -> Any:
    """A device attribute's value (its one typed field), by short or driver-qualified name."""
    a = attrs.get(name) or attrs.get(f"{DRIVER}/{name}") or {}
    return next(iter(a.values()), None) if isinstance(a, Mapping) else None


def slice_cards(resource_slice: Mapping[str, Any]) -> dict[tuple[str, str], Card]:
    """``(pool, device name) -> Card`` for the devices of one ResourceSlice of :data:`DRIVER`
    (empty for another driver's; devices without a ``uuid`` attribute are left out)."""
    spec = resource_slice.get("spec") or {}
    if spec.get("driver") != DRIVER:
        return {}
    pool = str((spec.get("pool") or {}).get("name") or "")
    out: dict[tuple[str, str], Card] = {}
    for d in spec.get("devices") or []:
        attrs = d.get("attributes") or {}
        uuid = _attr(attrs, "uuid")
        if not uuid:
            continue
        mem = ((d.get("capacity") or {}).get(CAPACITY_MEMORY) or {}).get("value", "0")
        out[(pool, str(d.get("name")))] = Card(str(uuid), int(_attr(attrs, "index") or 0),
                                               str(_attr(attrs, "model") or "unknown"), to_mib(str(mem)))
    return out


def our_results(resource_claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The allocation results of :data:`DRIVER` in a ResourceClaim that are kvgpu slices of a
    card (empty when not allocated). MIG instances are left out: a hardware partition, not a
    slice the ledger accounts, so a claim of MIG devices only has no mirror."""
    alloc = (resource_claim.get("status") or {}).get("allocation") or {}
    results = (alloc.get("devices") or {}).get("results") or []
    return [r for r in results if r.get("driver") == DRIVER and not is_mig_device_name(str(r.get("device", "")))]


def consumer(resource_claim: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(pod name, pod UID)`` of the first pod the claim is reserved for, or None."""
    for r in (resource_claim.get("status") or {}).get("reservedFor") or []:
        if r.get("resource") == "pods" and not r.get("apiGroup") and r.get("name") and r.get("uid"):
            return str(r["name"]), str(r["uid"])
    return None


def wants_mirror(resource_claim: Mapping[str, Any]) -> bool:
    """Whether the claim should have a mirror now: allocated with a result of ours, reserved for
    a pod, not being deleted."""
    meta = resource_claim.get("metadata") or {}
    return bool(our_results(resource_claim)) and consumer(resource_claim) is not None \
        and not meta.get("deletionTimestamp")


def mirror_name(claim_name: str, claim_uid: str) -> str:
    """The mirror's name: ``dra-<claim name>-<8 hex of its UID>``, at most 253 characters."""
    tag = claim_uid.replace("-", "")[:8] or hashlib.sha256(claim_name.encode()).hexdigest()[:8]
    return f"{MIRROR_PREFIX}{claim_name[:253 - len(MIRROR_PREFIX) - 9].rstrip('-.')}-{tag}"


def container_of(pod: Mapping[str, Any], claim_name: str) -> str:
    """The first container of ``pod`` (app containers, then init containers) that uses the
    ResourceClaim ``claim_name`` (through its ``spec.resourceClaims`` entry, by name or as
    generated from a template: ``status.resourceClaimStatuses``); the first app container when
    none names it. Raises :class:`MirrorPending` for a pod without containers."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    entries = {e.get("name") for e in spec.get("resourceClaims") or [] if e.get("resourceClaimName") == claim_name}
    entries |= {s.get("name") for s in status.get("resourceClaimStatuses") or []
                if s.get("resourceClaimName") == claim_name}
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    for c in containers:
        if any(r.get("name") in entries for r in ((c.get("resources") or {}).get("claims") or [])):
            return str(c["name"])
    if not containers:
        raise MirrorPending("the pod has no containers")
    return str(containers[0]["name"])


def _device(result: Mapping[str, Any], cards: Mapping[tuple[str, str], Card]) -> dict[str, Any]:
    card = cards.get((str(result.get("pool")), str(result.get("device"))))
    if card is None:
        raise MirrorPending(f"device {result.get('pool')}/{result.get('device')} is in no ResourceSlice seen")
    used = result.get("consumedCapacity") or {}
    if CAPACITY_MEMORY in used:
        memory, cores = to_mib(str(used[CAPACITY_MEMORY])), int(parse_quantity(str(used.get(CAPACITY_CORES, "0"))))
    else:  # not shared: the whole card
        memory, cores = card.memory_mib, 100
    return {"uuid": card.uuid, "index": card.index, "model": card.model, "memory": memory, "cores": cores}


def mirror(resource_claim: Mapping[str, Any], pod: Mapping[str, Any],
           cards: Mapping[tuple[str, str], Card]) -> dict[str, Any]:
    """The VGPUClaim body mirroring ``resource_claim`` (which :func:`wants_mirror`), for its
    consumer ``pod``; ``cards``: :func:`slice_cards` of the driver's ResourceSlices. Raises
    :class:`MirrorPending` (a device or the pod not known yet; the pod is not the consumer) or
    ``ValueError`` (the result makes no valid VGPUClaim, e.g. results on two nodes)."""
    meta = resource_claim.get("metadata") or {}
    ns, name, uid = str(meta["namespace"]), str(meta["name"]), str(meta["uid"])
    who = consumer(resource_claim)
    pmeta = pod.get("metadata") or {}
    if who is None or pmeta.get("uid") != who[1]:
        raise MirrorPending("the claim's consumer is not this pod")
    results = our_results(resource_claim)
    nodes = {str(r.get("pool")) for r in results}
    if len(nodes) != 1:
        raise ValueError(f"ResourceClaim {ns}/{name}: results on {len(nodes)} nodes")
    body = {
        "apiVersion": f"{keys.GROUP}/{keys.VERSION}", "kind": "VGPUClaim",
        "metadata": {
            "name": mirror_name(name, uid), "namespace": ns,
            "labels": {RESOURCE_CLAIM_UID_LABEL: keys.label_value(uid), "kvgpu.io/pod-uid": keys.label_value(who[1]),
                       "kvgpu.io/node": keys.label_value(next(iter(nodes)))},
            "ownerReferences": [{"apiVersion": GROUP_VERSION, "kind": "ResourceClaim", "name": name, "uid": uid,
                                 "controller": False, "blockOwnerDeletion": False}],
        },
        "spec": {"podName": who[0], "podUID": who[1], "container": container_of(pod, name),
                 "node": next(iter(nodes)), "devices": [_device(r, cards) for r in results],
                 "resourceClaim": {"name": name, "uid": uid}},
    }
    return VGPUClaim.model_validate(body).to_body()


def spec_of(claim: Mapping[str, Any]) -> dict[str, Any]:
    """A VGPUClaim's spec less the computed columns (what two mirrors are compared by)."""
    spec = dict(claim.get("spec") or {})
    for k in ("gpuSummary", "memorySummary", "coresSummary"):
        spec.pop(k, None)
    return spec
