"""The VGPUPool model: which nodes and cards a pool covers and how it slices them
(:class:`VGPUPoolSpec`), and what it reports (:class:`VGPUPoolStatus`). Re-exported by
:mod:`kvgpu.api.models`."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, computed_field, model_validator

from kvgpu.api.modelbase import (
    _CONDITIONS_EXTRA,
    DEFAULT_MIN_SLICE_MIB,
    MAX_CARD_MEMORY_MIB,
    MAX_SPLIT_COUNT,
    Allocation,
    Condition,
    DeviceFilter,
    Mode,
    NodeSelector,
    RequestDefaults,
    SchedulingPolicy,
    _Model,
    _without,
)
from kvgpu.core.keys import API_VERSION


class VGPUPoolSpec(_Model):
    """Which nodes and cards the pool covers, and how each covered card is sliced."""

    node_selector: NodeSelector = Field(
        default_factory=NodeSelector, description="Nodes covered (empty = every GPU node)."
    )
    devices: DeviceFilter = Field(
        default_factory=DeviceFilter, description="Cards covered on those nodes (empty = all)."
    )
    split_count: int = Field(
        default=10,
        ge=1,
        le=MAX_SPLIT_COUNT,
        description="Most slices (containers) sharing one card at a time. Ignored in exclusive mode (1).",
    )
    memory_scaling: float = Field(
        default=1.0,
        gt=0,
        le=16,
        description=(
            "Virtual memory / physical memory per card; above 1 oversubscribes memory: the slices' "
            "limits may sum past the card. Each limit is then a ceiling, not a promise: while the card "
            "has physical memory left a container allocates up to its limit; once the card is "
            "physically full its next allocation fails with CUDA's out-of-memory error below its "
            "limit (the driver's own), it never gets another container's memory, and free memory "
            "(cuMemGetInfo, NVML, nvidia-smi) shows min(limit left, physical free). No spill to host "
            "memory (docs/user-guide.md)."
        ),
    )
    core_scaling: float = Field(
        default=1.0,
        gt=0,
        le=16,
        description="Virtual cores / physical cores per card; above 1 lets gpucores sum past 100.",
    )
    mode: Mode = Field(
        default=Mode.HAMI_CORE,
        description=(
            "hami-core: shared cards with shim limits (memory and a time share of the SMs); "
            "exclusive: one container per card; mps: shared cards whose containers are clients of "
            "the card's MPS server, which partitions the SMs (gpucores = the client's active thread "
            "percentage) so co-tenants run at once, the shim still limits memory; one card per "
            "container; a faulting client can end its co-tenants' work (docs/agent.md, MPS)."
        ),
    )
    allocation: Allocation = Field(
        default=Allocation.EXTENDER,
        description=(
            "extender: pods ask with kvgpu.io/* annotations or HAMi's nvidia.com/* limits, placed by the "
            "kvgpu scheduler's extender, served by the device plugin; dra: the cards are DRA devices of "
            "driver gpu.kvgpu.io with consumable memory, cores and shares, allocated by kube-scheduler "
            "for ResourceClaims (docs/dra.md). Pools of both kinds coexist on different nodes."
        ),
    )
    defaults: RequestDefaults = Field(
        default_factory=RequestDefaults, description="Values for the request keys a pod leaves out."
    )
    min_slice_memory: int = Field(
        default=DEFAULT_MIN_SLICE_MIB,
        ge=0,
        le=MAX_CARD_MEMORY_MIB,
        description=(
            "Smallest memory (MiB per card) a request may name in gpumem; 0 = no minimum. Checked at "
            "admission against the smallest minimum of all pools. The default catches unit mistakes "
            "(a limit of 3000m is 3 MiB); a CUDA context alone takes about 300-500 MiB on recent cards. "
            "A non-zero defaults.gpumem below it makes the pool invalid: checked by the operator, not the "
            "API server, so the pool is stored, slices no cards until fixed (pods holding slices keep "
            "them) and its Ready condition is False with reason InvalidSpec naming the field."
        ),
    )
    scheduling: SchedulingPolicy = Field(
        default_factory=SchedulingPolicy, description="Default placement policies."
    )

    @model_validator(mode="after")
    def _defaults_within_minimum(self) -> VGPUPoolSpec:
        # Not a CEL rule: the operator reports a pool its model refuses on the pool's status
        # (InvalidSpec), as it must for any such pool (e.g. one stored before a CRD rule existed).
        if 0 < self.defaults.gpumem < self.min_slice_memory:
            raise ValueError(f"defaults.gpumem {self.defaults.gpumem} MiB is below minSliceMemory "
                             f"{self.min_slice_memory} MiB: pods taking the default would get a slice "
                             "too small to use")
        return self


def format_mib(mib: int) -> str:
    """Short human form of a MiB amount for printer columns: ``3000Mi``, ``80Gi``, ``1.4Ti``."""
    if mib < 0:
        return f"-{format_mib(-mib)}"
    if mib < 1024 or (mib < 10 * 1024 and mib % 1024):
        return f"{mib}Mi"
    for unit, div in (("Gi", 1 << 10), ("Ti", 1 << 20), ("Pi", 1 << 30)):
        v = mib / div
        if v < 1024 or unit == "Pi":
            text = f"{v:.1f}".removesuffix(".0") if v < 100 else f"{v:.0f}"
            return text + unit
    raise AssertionError("unreachable")


class VGPUPoolStatus(_Model):
    """Aggregate state of the pool (counts only, so its size does not grow with the cluster). The
    usage counts follow allocations within 5 s; inventory and pool changes show at once."""

    observed_generation: int | None = Field(default=None, ge=0, description="Generation last reconciled.")
    nodes: int = Field(default=0, ge=0, description="Nodes with at least one covered card.")
    cards: int = Field(default=0, ge=0, description="Covered cards.")
    unhealthy_cards: int = Field(default=0, ge=0, description="Covered cards the agent reports unhealthy.")
    slots_used: int = Field(default=0, ge=0, description="Slices in use (one per container per card).")
    slots_total: int = Field(default=0, ge=0, description="cards x splitCount.")
    memory_used_mib: int = Field(
        default=0,
        ge=0,
        description="MiB promised to slices.",
        validation_alias=AliasChoices("memoryUsedMiB", "memory_used_mib"),
        serialization_alias="memoryUsedMiB",
    )
    memory_total_mib: int = Field(
        default=0,
        ge=0,
        description="Virtual MiB of covered cards (physical x memoryScaling).",
        validation_alias=AliasChoices("memoryTotalMiB", "memory_total_mib"),
        serialization_alias="memoryTotalMiB",
    )
    cores_used: int = Field(default=0, ge=0, description="Sum of the slices' core percents.")
    cores_total: int = Field(default=0, ge=0, description="cards x 100 x coreScaling.")
    claims: int = Field(default=0, ge=0, description="Live claims (not Released) on covered cards.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description=("Ready (covers a healthy card; reason InvalidSpec when the spec breaks a rule the "
                     "operator checks), Conflict (ties with another pool on some cards) and "
                     "Overcommitted (cards hold more than the pool allows now)."),
        json_schema_extra=_CONDITIONS_EXTRA,
    )

    # Preformatted for printer columns (kubectl cannot compute "used/total").
    @computed_field(description="used/total slots, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def slots_summary(self) -> str:
        return f"{self.slots_used}/{self.slots_total}"

    @computed_field(description="used/total memory, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def memory_summary(self) -> str:
        return f"{format_mib(self.memory_used_mib)}/{format_mib(self.memory_total_mib)}"

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        return _without(data, ("slotsSummary", "memorySummary", "slots_summary", "memory_summary"))


class VGPUPool(_Model):
    """A cluster-scoped pool: covered nodes/cards and how each card is sliced."""

    KIND: ClassVar[str] = "VGPUPool"
    PLURAL: ClassVar[str] = "vgpupools"
    SCOPE: ClassVar[str] = "Cluster"

    api_version: Literal["kvgpu.io/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    kind: Literal["VGPUPool"] = "VGPUPool"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: VGPUPoolSpec = Field(default_factory=VGPUPoolSpec)
    status: VGPUPoolStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    def to_body(self) -> dict[str, Any]:
        """The object as the API server takes it (camelCase, enums as strings, no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
