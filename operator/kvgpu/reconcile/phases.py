"""What a kvgpu pod's claims should become, from the pod alone (pure; no I/O).

=====================  ==========================================
pod                     its claims (``kvgpu.io/claims``)
=====================  ==========================================
pending (no node)       nothing
bound to a node         nothing (no phase written: Bound, derived)
Running                 nothing (the pod's own phase says it)
Succeeded / Failed      phase Released (the operator frees the ledger on it)
deleted                 deleted (the ownerReference would too, later)
=====================  ==========================================

A claim is written only when what it records changes: it is created by the bind, before the
Binding, holding its cards (a claim without a phase is Bound:
:func:`kvgpu.api.vgpuclaim.claim_phase`), and it is
written again only to be Released or deleted. Writing Bound and Running as well cost the API
server two status writes per pod that told nothing the pod does not already say (issue 17).

Level-based: the answer depends only on the pod's current state, so replaying an event writes
nothing new. Used by :mod:`kvgpu.reconcile.phaseworker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgpu.core import claimstr, keys

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class ClaimAction:
    """For claim ``claim`` (in the pod's namespace): delete it, or set ``phase`` with ``message``."""

    claim: str
    delete: bool = False
    phase: str = ""
    message: str = ""


def pod_claims(pod: dict[str, Any]) -> list[str]:
    """The VGPUClaim names the pod's ``kvgpu.io/claims`` annotation lists."""
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(keys.POD_CLAIMS, "")
    return [c for c in text.split(",") if c]


def actions(event_type: str, pod: dict[str, Any]) -> list[ClaimAction]:
    """What the pod's claims should become after an event of ``event_type`` (ADDED, MODIFIED,
    DELETED) carrying ``pod``."""
    claims = pod_claims(pod)
    if not claims:
        return []
    if event_type == "DELETED":
        return [ClaimAction(c, delete=True) for c in claims]
    phase = (pod.get("status") or {}).get("phase")
    if phase in TERMINAL:
        return [ClaimAction(c, phase="Released", message=f"pod {phase}") for c in claims]
    return []


def slices_message(pod: dict[str, Any]) -> str:
    """``bound to <node>: <container>: <uuid> (<MiB> MiB, <cores>%), ...`` from the pod's claim
    annotations (what the GPUSlicesBound Event says)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    parts = []
    for key, value in sorted((meta.get("annotations") or {}).items()):
        if not key.startswith(keys.CLAIM_PREFIX):
            continue
        try:
            cs = claimstr.decode(value)
        except claimstr.ClaimStringError:
            continue
        name = cs.claim.rpartition("/")[2]
        parts.append(f"{name}: " + ", ".join(f"{d.uuid} ({d.memory_mib} MiB, {d.cores}%)" for d in cs.devices))
    return f"bound to {spec.get('nodeName', '?')}: " + "; ".join(parts)
