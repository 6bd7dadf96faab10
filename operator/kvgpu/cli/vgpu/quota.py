"""``kubectl vgpu quota``: per namespace, each GPU quota's limits with the namespace's usage, as
pure functions of API objects (plain dicts).

Usage is computed from the namespace's live VGPUClaims (not Released or Failed) with the
operator's own rule (:func:`kvgpu.allocator.quota.usage_by_namespace`), so a ResourceQuota's GPU
keys show what kvgpu counts at bind (HAMi's per card × cards), not the API server's raw count in
its ``status.used``; a VGPUQuota's ``status.used`` (written by the operator) is the same number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvgpu.allocator.quota import Amounts, Quota, usage_by_namespace
from kvgpu.api.models import format_mib
from kvgpu.api.quotas import from_resource_quota, from_vgpu_quota
from kvgpu.core.requests import ContainerAllocation
from kvgpu.reconcile.state import allocation_from_claim

HEADERS = ["QUOTA", "RESOURCE", "USED", "HARD"]


@dataclass(frozen=True)
class QuotaRow:
    """One limit of one quota: ``used`` and ``hard`` in the dimension's unit (memory MiB, cores
    percent-of-card units, cards, slices)."""

    namespace: str
    quota: str  # ResourceQuota/gpu, VGPUQuota/team
    resource: str  # the key as written: limits.nvidia.com/gpumem, spec.hard.memory
    dimension: str
    used: int
    hard: int

    def cells(self, all_namespaces: bool) -> list[str]:
        fmt = format_mib if self.dimension == "memory" else str
        row = [self.quota, self.resource, fmt(self.used), fmt(self.hard)]
        return [self.namespace, *row] if all_namespaces else row

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def headers(all_namespaces: bool) -> list[str]:
    return ["NAMESPACE", *HEADERS] if all_namespaces else list(HEADERS)


def _live_grants(claims: Iterable[Mapping[str, Any]]) -> Iterable[tuple[str, str, ContainerAllocation]]:
    for c in claims:
        if (c.get("status") or {}).get("phase") in ("Released", "Failed"):
            continue
        try:
            key, alloc = allocation_from_claim(dict(c))
        except (KeyError, ValueError, TypeError):
            continue
        for ca in alloc.containers:
            yield key.partition("/")[0], alloc.pod_uid, ca


def quota_rows(resource_quotas: Iterable[Mapping[str, Any]], vgpu_quotas: Iterable[Mapping[str, Any]],
               claims: Iterable[Mapping[str, Any]]) -> list[QuotaRow]:
    """Rows sorted by namespace, quota and key. ResourceQuotas without a GPU key and VGPUQuotas
    the model refuses are left out."""
    quotas: list[Quota] = []
    for rq in resource_quotas:
        q, _ = from_resource_quota(dict(rq))
        if q is not None:
            quotas.append(q)
    for vq in vgpu_quotas:
        try:
            quotas.append(from_vgpu_quota(dict(vq)))
        except ValueError:
            continue
    used = usage_by_namespace(_live_grants(claims))
    rows = [QuotaRow(q.namespace, f"{q.kind}/{q.name}", lim.key, lim.dimension,
                     used.get(q.namespace, Amounts()).get(lim.dimension), lim.hard)
            for q in quotas for lim in q.limits]
    return sorted(rows, key=lambda r: (r.namespace, r.quota, r.resource))
