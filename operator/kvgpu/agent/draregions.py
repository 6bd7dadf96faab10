"""The prepared DRA claims as tenants of the agent's compute schedule, usage exporter and OOM
reporter (the device plugin's containers come from pod annotations, :mod:`kvgpu.agent.usage`).

A claim the DRA plugin prepared (:class:`~kvgpu.agent.draclaimfiles.ClaimFiles`) has one region
for every container that references it: ``<state_dir>/claims/<claim UID>/region/vgpu.region``.
Its claim string comes from the agent's own checkpoint (``prepared.json``, mode 0600: written by
the agent, never by a tenant), so the cores and priority it lists are trusted. A MIG claim has no
region (hardware isolation) and is no tenant.

Who consumes a claim comes from the pods of this node (the pod cache): a pod of the claim's
namespace whose ``status.resourceClaimStatuses`` (a claim made from a template) or
``spec.resourceClaims`` (a claim by name) name it, and of that pod the containers whose
``resources.claims`` reference that entry. The exporter and the OOM reporter see one
:class:`~kvgpu.agent.usage.BoundContainer` per (claim, consuming pod), its ``container`` the
consuming containers joined by ``,``, its ``region_dir`` the claim's region; a prepared claim no
pod on the node consumes yet is one entry with empty ``pod``/``pod_uid``/``container``. The
enforcement check and its backstop see one entry per consuming container, with its runtime ID
(:func:`enforced_containers`): a process is judged by its own container, and the claim's limit
by everything the claim's region holds (:func:`kvgpu.agent.usage.limit_holder`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgpu.core import claimstr

from .draclaimfiles import REGION_DIR, ClaimFiles
from .schedule import TenantSource
from .usage import REGION_FILE, BoundContainer, BoundDevice, container_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraTenant:
    """One prepared DRA claim with a region: its UID, decoded claim string and region directory."""

    uid: str
    claim: claimstr.ClaimString
    region_dir: Path

    @property
    def namespace(self) -> str:
        return self.claim.claim.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.claim.claim.split("/", 1)[-1]


def prepared_tenants(files: ClaimFiles) -> list[DraTenant]:
    """The prepared claims of ``files`` that have a region (MIG claims have none), in UID order.
    A checkpoint that cannot be read or decoded is logged and skipped (never raises)."""
    out = []
    for uid in files.prepared_uids():
        try:
            p = files.load(uid)
            if p is None or not p.claim:
                continue
            cs = claimstr.decode(p.claim)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("prepared DRA claim %s unreadable: %s", uid, e)
            continue
        out.append(DraTenant(uid, cs, files.dir(uid) / REGION_DIR))
    return out


def schedule_sources(tenants: Iterable[DraTenant]) -> list[TenantSource]:
    """The compute schedule's sources of ``tenants``: key = the claim name (what the shim looks
    itself up by), cores per card UUID (percent), the region file."""
    return [TenantSource(t.claim.claim, t.claim.priority, {d.uuid: d.cores for d in t.claim.devices},
                         t.region_dir / REGION_FILE) for t in tenants]


def _claim_refs(pod: Mapping[str, Any], name: str) -> set[str]:
    """The names of ``pod``'s ``spec.resourceClaims`` entries that stand for ResourceClaim ``name``."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    refs = {str(e.get("name")) for e in spec.get("resourceClaims") or [] if e.get("resourceClaimName") == name}
    refs |= {str(e.get("name")) for e in status.get("resourceClaimStatuses") or []
             if e.get("resourceClaimName") == name}
    return refs


def consuming_containers(pod: Mapping[str, Any], namespace: str, name: str) -> list[str]:
    """The containers (init containers first) of ``pod`` that use ResourceClaim
    ``namespace/name``; ``[]`` for a pod of another namespace or one that ended."""
    meta = pod.get("metadata") or {}
    if meta.get("namespace") != namespace or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return []
    refs = _claim_refs(pod, name)
    if not refs:
        return []
    spec = pod.get("spec") or {}
    return [str(c.get("name")) for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])
            if any(r.get("name") in refs for r in (c.get("resources") or {}).get("claims") or [])]


def bound_containers(tenants: Iterable[DraTenant], pods: Iterable[Mapping[str, Any]]) -> list[BoundContainer]:
    """One :class:`BoundContainer` per (tenant, consuming pod) (module docstring), or one without
    a pod for a tenant nobody consumes yet."""
    pods = list(pods)
    out = []
    for t in tenants:
        devices = tuple(BoundDevice(d.uuid, d.memory_mib, d.cores) for d in t.claim.devices)
        found = False
        for pod in pods:
            names = consuming_containers(pod, t.namespace, t.name)
            if not names:
                continue
            found = True
            meta = pod.get("metadata") or {}
            out.append(BoundContainer(t.namespace, str(meta.get("name", "")), str(meta.get("uid", "")),
                                      ",".join(names), t.claim.claim, t.claim.priority, devices, started=True,
                                      region_dir=str(t.region_dir)))
        if not found:
            out.append(BoundContainer(t.namespace, "", "", "", t.claim.claim, t.claim.priority, devices,
                                      region_dir=str(t.region_dir)))
    return out


def enforced_containers(tenants: Iterable[DraTenant], pods: Iterable[Mapping[str, Any]]
                        ) -> list[BoundContainer]:
    """One :class:`BoundContainer` per container that consumes a tenant, with its runtime ID from
    the pod's status (``""`` before the kubelet created it) and the claim's ``region_dir``."""
    pods = list(pods)
    out = []
    for t in tenants:
        devices = tuple(BoundDevice(d.uuid, d.memory_mib, d.cores) for d in t.claim.devices)
        for pod in pods:
            names = consuming_containers(pod, t.namespace, t.name)
            if not names:
                continue
            meta, ids = pod.get("metadata") or {}, container_ids(pod)
            out += [BoundContainer(t.namespace, str(meta.get("name", "")), str(meta.get("uid", "")), name,
                                   t.claim.claim, t.claim.priority, devices, started=name in ids,
                                   container_id=ids.get(name, ""), region_dir=str(t.region_dir)) for name in names]
    return out


class DraTenants:
    """The node's prepared DRA claims for the agent's loops. ``files()``: the DRA plugin's
    :class:`ClaimFiles` (``None`` without DRA); ``pods()``: the node's pods (API dicts)."""

    def __init__(self, files: Callable[[], ClaimFiles | None], pods: Callable[[], Iterable[Mapping[str, Any]]]):
        self.files = files
        self.pods = pods

    def tenants(self) -> list[DraTenant]:
        f = self.files()
        return prepared_tenants(f) if f is not None else []

    def sources(self) -> list[TenantSource]:
        """The compute schedule's DRA sources now."""
        return schedule_sources(self.tenants())

    def containers(self) -> list[BoundContainer]:
        """The exporter's and OOM reporter's DRA entries now."""
        ts = self.tenants()
        return bound_containers(ts, self.pods()) if ts else []

    def enforced(self) -> list[BoundContainer]:
        """The enforcement check's DRA entries now: one per consuming container."""
        ts = self.tenants()
        return enforced_containers(ts, self.pods()) if ts else []


__all__ = ["DraTenant", "DraTenants", "bound_containers", "consuming_containers", "enforced_containers",
           "prepared_tenants", "schedule_sources"]
