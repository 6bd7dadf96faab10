"""What a kvgpu pod's claims should become, from the pod alone (pure; no I/O).

=====================  ==========================================
pod                     its claims (``kvgpu.io/claims``)
=====================  ==========================================
pending (no node)       nothing (kept as created: Reserved)
bound to a node         phase Bound
Running                 phase Running
Succeeded / Failed      phase Released (the operator frees the ledger on it)
deleted                 deleted (the ownerReference would too, later)
=====================  ==========================================

Level-based: the answer depends only on the pod's current state, so a pod seen for the first
time already Running goes straight to Running, and replaying an event writes nothing new.
Used by :mod:`kvgpu.reconcile.phaseworker`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    phase, node = status.get("phase"), spec.get("nodeName")
    if phase in TERMINAL:
        return [ClaimAction(c, phase="Released", message=f"pod {phase}") for c in claims]
    if not node:
        return []
    if phase == "Running":
        return [ClaimAction(c, phase="Running", message=f"pod running on {node}") for c in claims]
    return [ClaimAction(c, phase="Bound", message=f"bound to {node}") for c in claims]


def stale_phases(written: Mapping[str, str], claims: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """Claims whose phase in the API differs from ``written`` (``"ns/name"`` → the phase the
    worker wrote), by pod UID → their keys: a bind that re-created a claim under the same name
    (replace, restore) left the new object without the phase the worker thinks it has. Claims
    the worker has not written, and Released/Failed ones, are not stale."""
    out: dict[str, list[str]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        have = (c.get("status") or {}).get("phase")
        want = written.get(key)
        if want is None or have == want or have in ("Released", "Failed"):
            continue
        out.setdefault(str((c.get("spec") or {}).get("podUID", "")), []).append(key)
    return out


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
