"""Namespace quotas in the API: the ``VGPUQuota`` kind, and what kvgpu reads from a
Kubernetes ``ResourceQuota``. Pure (no I/O); the arithmetic is :mod:`kvgpu.allocator.quota`.

``VGPUQuota`` (namespaced, group ``kvgpu.io``, version ``v1alpha1``): ``spec.hard`` with any of
``memory`` (MiB), ``cores`` (percent-of-card units), ``cards`` and ``slices``; the operator
writes ``status.hard`` (the limits it enforces) and ``status.used`` (the namespace's usage).
Generated into ``charts/kvgpu/crds/`` and ``docs/api.md`` by :mod:`kvgpu.api.crdgen`, like the other kinds.

``ResourceQuota`` keys kvgpu enforces at bind (HAMi's counting: per card × cards), in the
``limits.`` and ``requests.`` forms: ``nvidia.com/gpumem`` (memory, MiB: a plain number is MiB,
``4Gi`` is 4096), ``nvidia.com/gpucores`` (cores), ``nvidia.com/gpu`` (slices: one per container
per card, the unit the node's ``nvidia.com/gpu`` counts). Other keys are the API server's alone.
Scopes and scope selectors are not evaluated: a quota's GPU keys apply to every GPU pod of its
namespace.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, ClassVar, Literal

from kubernetes.utils.quantity import parse_quantity
from pydantic import Field, computed_field, model_validator

from kvgpu.allocator.quota import DIMENSIONS, Amounts, Limit, Quota
from kvgpu.api.models import _Model, format_mib
from kvgpu.core.keys import API_VERSION

#: Largest limit of any dimension (2^40: a PiB in MiB).
MAX_HARD = 1 << 40

#: ResourceQuota key -> dimension, for both prefixes.
RESOURCE_QUOTA_KEYS: dict[str, str] = {
    f"{prefix}.nvidia.com/{res}": dim
    for prefix in ("limits", "requests")
    for res, dim in (("gpumem", "memory"), ("gpucores", "cores"), ("gpu", "slices"))
}

RESOURCE_QUOTA = "ResourceQuota"
VGPU_QUOTA = "VGPUQuota"


class QuotaAmounts(_Model):
    """GPU amounts of a namespace; a missing field is no limit (in ``spec.hard``) or zero use."""

    memory: int | None = Field(
        default=None, ge=0, le=MAX_HARD,
        description="MiB, summed over cards (a pod with gpu 2 and gpumem 2048 uses 4096).")
    cores: int | None = Field(
        default=None, ge=0, le=MAX_HARD,
        description="Percent-of-card units, summed over cards (gpu 2 and gpucores 30 use 60; a whole card is 100).")
    cards: int | None = Field(default=None, ge=0, le=MAX_HARD, description="Physical cards (each card once per pod).")
    slices: int | None = Field(
        default=None, ge=0, le=MAX_HARD,
        description="Slices: one per container per card (what the node's nvidia.com/gpu counts).")

    @classmethod
    def of(cls, a: Amounts) -> QuotaAmounts:
        return cls(memory=a.memory, cores=a.cores, cards=a.cards, slices=a.slices)


class VGPUQuotaSpec(_Model):
    """What the namespace may hold at most."""

    hard: QuotaAmounts = Field(
        default_factory=QuotaAmounts,
        description="Limits; a pod is refused at bind when it would take the namespace's use past one.")


def _summary(used: int | None, hard: int | None, fmt: Any = str) -> str:
    return f"{fmt(used or 0)}/{fmt(hard) if hard is not None else '-'}"


class VGPUQuotaStatus(_Model):
    """Written by the operator: the limits it enforces and the namespace's usage (its live
    VGPUClaims, counted as in spec.hard), within a second or so of a change."""

    observed_generation: int | None = Field(default=None, ge=0, description="Generation last reconciled.")
    hard: QuotaAmounts = Field(default_factory=QuotaAmounts, description="The limits enforced (spec.hard).")
    used: QuotaAmounts = Field(default_factory=QuotaAmounts, description="The namespace's usage.")

    @computed_field(description="used/hard memory, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def memory_summary(self) -> str:
        return _summary(self.used.memory, self.hard.memory, format_mib)

    @computed_field(description="used/hard cores, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def cores_summary(self) -> str:
        return _summary(self.used.cores, self.hard.cores)

    @computed_field(description="used/hard cards, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def cards_summary(self) -> str:
        return _summary(self.used.cards, self.hard.cards)

    @computed_field(description="used/hard slices, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def slices_summary(self) -> str:
        return _summary(self.used.slices, self.hard.slices)

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        drop = ("memorySummary", "coresSummary", "cardsSummary", "slicesSummary")
        if isinstance(data, dict) and any(k in data for k in drop):
            return {k: v for k, v in data.items() if k not in drop}
        return data


class VGPUQuota(_Model):
    """A namespaced quota on GPU slices its pods hold together; enforced at bind, several all apply."""

    KIND: ClassVar[str] = VGPU_QUOTA
    PLURAL: ClassVar[str] = "vgpuquotas"
    SCOPE: ClassVar[str] = "Namespaced"

    api_version: Literal["kvgpu.io/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    kind: Literal["VGPUQuota"] = "VGPUQuota"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: VGPUQuotaSpec = Field(default_factory=VGPUQuotaSpec)
    status: VGPUQuotaStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    def to_body(self) -> dict[str, Any]:
        """The object as the API server takes it (camelCase, no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------- reading quotas


def _meta(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def quantity_value(dimension: str, raw: Any) -> int:
    """A ResourceQuota value as kvgpu counts it: memory in MiB (a plain or decimal-suffixed
    number counts MiB as in pods, ``4Gi`` is bytes: 4096 MiB, rounded down), the others a whole
    number (rounded down). Raises ``ValueError`` for what is not a non-negative quantity."""
    try:
        q = parse_quantity(str(raw).strip())
    except (ValueError, ArithmeticError, TypeError):
        raise ValueError(f"{raw!r} is not a quantity") from None
    if not isinstance(q, Decimal) or not q.is_finite() or q < 0:
        raise ValueError(f"{raw!r} is not a non-negative quantity")
    if dimension == "memory" and str(raw).strip().endswith("i"):
        q = q / (1 << 20)
    return min(int(q), MAX_HARD)


def from_resource_quota(obj: dict[str, Any]) -> tuple[Quota | None, list[str]]:
    """The GPU limits of a ResourceQuota (its ``spec.hard``; None when it sets none) and the
    problems found (a value that is not a quantity is left out, with a problem)."""
    ns, name = _meta(obj)
    hard = ((obj.get("spec") or {}).get("hard")) or {}
    limits: list[Limit] = []
    problems: list[str] = []
    for key in sorted(hard):
        dim = RESOURCE_QUOTA_KEYS.get(key)
        if dim is None:
            continue
        try:
            limits.append(Limit(dim, key, quantity_value(dim, hard[key])))
        except ValueError as e:
            problems.append(f"{RESOURCE_QUOTA} {ns}/{name} {key}: {e}")
    order = {d: i for i, d in enumerate(DIMENSIONS)}
    limits.sort(key=lambda lim: (order[lim.dimension], lim.key))
    return (Quota(RESOURCE_QUOTA, ns, name, tuple(limits)) if limits else None), problems


def from_vgpu_quota(obj: dict[str, Any]) -> Quota:
    """The limits of a VGPUQuota (``spec.hard``). Raises ``ValueError`` for an invalid object
    (the API server's schema refuses those first)."""
    q = VGPUQuota.model_validate({k: obj[k] for k in ("metadata", "spec") if k in obj})
    ns, name = _meta(obj)
    limits = tuple(Limit(d, f"spec.hard.{d}", v) for d in DIMENSIONS
                   if (v := getattr(q.spec.hard, d)) is not None)
    return Quota(VGPU_QUOTA, ns, name, limits)


def vgpu_quota_status(quota: Quota, used: Amounts, generation: int | None) -> dict[str, Any]:
    """The ``status`` the operator writes on a VGPUQuota (JSON, camelCase)."""
    hard = {lim.dimension: lim.hard for lim in quota.limits}
    st = VGPUQuotaStatus(observed_generation=generation, hard=QuotaAmounts(**hard), used=QuotaAmounts.of(used))
    return st.model_dump(mode="json", by_alias=True, exclude_none=True)
