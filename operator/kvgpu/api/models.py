"""The kvgpu API: VGPUPool and VGPUClaim (group ``kvgpu.io``, version ``v1alpha1``).

Pydantic v2 models, frozen, with camelCase aliases: ``Model.model_validate(body)`` reads an
object as the API server returns it, ``model.model_dump(by_alias=True, exclude_none=True)``
writes it. The CRDs in ``crds/`` and the reference in ``docs/api.md`` are generated from these
classes by :mod:`kvgpu.api.crdgen`; field descriptions, ranges and defaults live here only.

Units everywhere: memory in MiB (integers), cores in percent of a card's SMs (0..100).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, computed_field, model_validator
from pydantic.alias_generators import to_camel

from kvgpu.core.keys import API_VERSION

#: Largest memory per card a request, default or claim may name (1 TiB in MiB).
MAX_CARD_MEMORY_MIB = 1 << 20
#: Default smallest slice (VGPUPoolSpec.minSliceMemory), MiB: below a CUDA context, catches unit mistakes.
DEFAULT_MIN_SLICE_MIB = 256
#: Most physical cards one container may ask for.
MAX_CARDS = 64
#: Most slices (concurrent containers) one card may be split into.
MAX_SPLIT_COUNT = 100
UUID_PATTERN = r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        populate_by_name=True,
        alias_generator=to_camel,
        extra="forbid",
        use_enum_values=False,
    )


# --------------------------------------------------------------------------- enums


class Mode(StrEnum):
    """How a covered card is shared."""

    HAMI_CORE = "hami-core"  #: slices enforced by the shim (memory and SM limits)
    EXCLUSIVE = "exclusive"  #: one container per card, no shim limits
    MPS = "mps"  #: shared cards, SMs partitioned by the MPS server; memory limited by the shim


class PolicyName(StrEnum):
    """Placement policy: ``binpack`` fills used nodes/cards first, ``spread`` prefers empty ones."""

    BINPACK = "binpack"
    SPREAD = "spread"


class ClaimPhase(StrEnum):
    """Life of a claim: ``Reserved`` (cards picked at bind) → ``Bound`` (pod bound to the node)
    → ``Running`` (container started) → ``Released`` (pod ended or gone; cards free again).
    ``Failed``: the claim could not be honoured (see the message)."""

    RESERVED = "Reserved"
    BOUND = "Bound"
    RUNNING = "Running"
    RELEASED = "Released"
    FAILED = "Failed"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


# Condition types.
COND_READY = "Ready"  # VGPUPool: covers at least one healthy card; VGPUClaim: honoured
COND_CONFLICT = "Conflict"  # VGPUPool: overlaps another pool of equal specificity on some cards


# --------------------------------------------------------------------------- shared parts


class Condition(_Model):
    """A condition in the usual Kubernetes shape (``metav1.Condition``)."""

    type: str = Field(min_length=1, max_length=316, description="Condition type, e.g. Ready or Conflict.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="",
        max_length=1024,
        description="One CamelCase word for machines, e.g. NoCardsCovered.",
    )
    message: str = Field(default="", max_length=32768, description="A sentence for people.")
    last_transition_time: str | None = Field(
        default=None,
        description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="The .metadata.generation the condition was computed for."
    )


_CONDITIONS_EXTRA: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class LabelSelectorRequirement(_Model):
    """One ``matchExpressions`` term of a node selector."""

    key: str = Field(min_length=1, max_length=317, description="Node label key.")
    operator: SelectorOperator = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list,
        max_length=64,
        description="Label values: non-empty for In/NotIn, empty for Exists/DoesNotExist.",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 "
                    ": size(self.values) == 0",
                    "message": "values must be non-empty for In and NotIn, "
                    "and empty for Exists and DoesNotExist",
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN) and not self.values:
            raise ValueError(f"values must be non-empty for operator {self.operator.value}")
        if self.operator in (SelectorOperator.EXISTS, SelectorOperator.DOES_NOT_EXIST) and self.values:
            raise ValueError(f"values must be empty for operator {self.operator.value}")
        return self


class NodeSelector(_Model):
    """Which nodes a pool covers: a label selector (both parts must match; empty = every node)."""

    match_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels a node must carry with exactly these values.",
        json_schema_extra={"maxProperties": 64},
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Further requirements on node labels."
    )

    @property
    def terms(self) -> int:
        """How many requirements the selector has (a measure of its specificity)."""
        return len(self.match_labels) + len(self.match_expressions)


class DeviceFilter(_Model):
    """Which cards of a covered node the pool covers. Each non-empty list must match (AND);
    within a list any entry may match (OR). Empty filter = every card of the node."""

    models: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list,
        max_length=32,
        description="Case-insensitive substrings of the card model, e.g. H200 or A100-SXM4-80GB.",
    )
    uuids: list[Annotated[str, Field(pattern=UUID_PATTERN)]] = Field(
        default_factory=list,
        max_length=256,
        description="Exact card UUIDs as NVML reports them (GPU-...).",
    )
    indexes: list[Annotated[int, Field(ge=0, le=63)]] = Field(
        default_factory=list,
        max_length=64,
        description="Card indexes on the node (NVML order, 0-based).",
    )

    @property
    def empty(self) -> bool:
        return not (self.models or self.uuids or self.indexes)


class RequestDefaults(_Model):
    """What a request gets for the keys it leaves out (HAMi's defaults unless changed)."""

    gpu: int = Field(default=1, ge=1, le=MAX_CARDS, description="Cards per container.")
    gpumem: int = Field(
        default=0,
        ge=0,
        le=MAX_CARD_MEMORY_MIB,
        description="MiB per card; 0 = the whole card's (virtual) memory.",
    )
    gpumem_percentage: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Percent of each card's (virtual) memory; not together with a non-zero gpumem.",
    )
    gpucores: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Percent of a card's SMs, 0 = no compute limit. A request whose memory is the whole card "
            "gets 100 (an exclusive card) unless it names gpucores itself."
        ),
    )
    priority: int = Field(default=1, ge=0, le=1, description="0 high, 1 low.")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.gpumemPercentage) && has(self.gpumem) && self.gpumem > 0)",
                    "message": "set gpumem or gpumemPercentage, not both",
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _memory_exclusive(self) -> RequestDefaults:
        if self.gpumem_percentage is not None and self.gpumem > 0:
            raise ValueError("set gpumem or gpumemPercentage, not both")
        return self


class SchedulingPolicy(_Model):
    """Default placement policies for pods on this pool (a pod may override them)."""

    node_policy: PolicyName = Field(
        default=PolicyName.BINPACK, description="binpack: fill busy nodes first; spread: prefer idle nodes."
    )
    gpu_policy: PolicyName = Field(
        default=PolicyName.SPREAD, description="binpack: fill busy cards first; spread: prefer idle cards."
    )


# --------------------------------------------------------------------------- VGPUPool


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


# --------------------------------------------------------------------------- VGPUClaim


class ClaimDevice(_Model):
    """One card's slice held by the claim."""

    uuid: str = Field(pattern=UUID_PATTERN, description="Card UUID (NVML).")
    index: int = Field(ge=0, le=63, description="Card index on the node.")
    model: str = Field(min_length=1, max_length=128, description="Card model, e.g. NVIDIA H200.")
    memory: int = Field(ge=1, le=MAX_CARD_MEMORY_MIB, description="Memory limit on this card, MiB.")
    cores: int = Field(ge=0, le=100, description="Percent of the card's SMs (0 = no limit, 100 = exclusive).")


def _devices_summary(devices: list[ClaimDevice], fmt: Any) -> str:
    out: list[str] = []
    for d in devices:
        s = fmt(d)
        if s not in out:
            out.append(s)
    return ",".join(out)


class VGPUClaimSpec(_Model):
    """The slices one container of a pod holds on one node. Immutable once created."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "spec is immutable"}]
        }
    )

    pod_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="The pod.")
    pod_uid: str = Field(
        min_length=1,
        max_length=64,
        validation_alias=AliasChoices("podUID", "pod_uid"),
        serialization_alias="podUID",
        description="The pod's UID (the claim belongs to it).",
    )
    container: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description="The container."
    )
    init: bool = Field(default=False, description="True for an init container (not a restartable sidecar).")
    node: str = Field(min_length=1, max_length=253, description="The node the cards are on.")
    pool: str = Field(default="", max_length=253, description="The VGPUPool that covers the cards.")
    priority: int = Field(default=1, ge=0, le=1, description="0 high, 1 low (the shim's task priority).")
    devices: list[ClaimDevice] = Field(
        min_length=1,
        max_length=64,
        description="The cards and the slice of each.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["uuid"]},
    )

    @computed_field(description="Card indexes, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def gpu_summary(self) -> str:
        return ",".join(str(d.index) for d in self.devices)

    @computed_field(description="Memory per card, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def memory_summary(self) -> str:
        return _devices_summary(self.devices, lambda d: f"{d.memory}Mi")

    @computed_field(description="Cores per card, for kubectl get.")  # type: ignore[prop-decorator]
    @property
    def cores_summary(self) -> str:
        return _devices_summary(self.devices, lambda d: f"{d.cores}%")

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        return _without(
            data,
            ("gpuSummary", "memorySummary", "coresSummary", "gpu_summary", "memory_summary", "cores_summary"),
        )


class VGPUClaimStatus(_Model):
    """Where the claim is in its life."""

    phase: ClaimPhase | None = Field(
        default=None, description="Reserved, Bound, Running, Released or Failed."
    )
    message: str = Field(default="", max_length=4096, description="Why the claim is in this phase.")
    observed_generation: int | None = Field(default=None, ge=0, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Conditions.", json_schema_extra=_CONDITIONS_EXTRA
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(oldSelf.phase) || oldSelf.phase != 'Released' || "
                    "(has(self.phase) && self.phase == 'Released')",
                    "message": "a Released claim stays Released",
                }
            ]
        }
    )


class VGPUClaim(_Model):
    """A namespaced record of the slices one (pod, container) holds; owned by the pod."""

    KIND: ClassVar[str] = "VGPUClaim"
    PLURAL: ClassVar[str] = "vgpuclaims"
    SCOPE: ClassVar[str] = "Namespaced"

    api_version: Literal["kvgpu.io/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    kind: Literal["VGPUClaim"] = "VGPUClaim"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: VGPUClaimSpec
    status: VGPUClaimStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    def to_body(self) -> dict[str, Any]:
        """The object as the API server takes it (camelCase, enums as strings, no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


TERMINAL_PHASES = frozenset({ClaimPhase.RELEASED, ClaimPhase.FAILED})


def _without(data: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(data, dict) and any(k in data for k in keys):
        return {k: v for k, v in data.items() if k not in keys}
    return data
