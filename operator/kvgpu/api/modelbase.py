"""The parts the VGPUPool and VGPUClaim models share: the limits, the base model (frozen,
camelCase aliases), the enums, conditions, selectors, device filters, request defaults and
scheduling policy. Re-exported by :mod:`kvgpu.api.models`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

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


class Allocation(StrEnum):
    """Who allocates a covered card's slices."""

    EXTENDER = "extender"  #: kvgpu's scheduler extender and device plugin (annotations, nvidia.com/gpu)
    DRA = "dra"  #: kube-scheduler through DRA: the card is a device of driver gpu.kvgpu.io (docs/dra.md)


class PolicyName(StrEnum):
    """Placement policy: ``binpack`` fills used nodes/cards first, ``spread`` prefers empty ones."""

    BINPACK = "binpack"
    SPREAD = "spread"


class ClaimPhase(StrEnum):
    """Life of a claim. Written: ``Released`` (pod ended; cards free again) and ``Failed`` (the
    claim could not be honoured, see the message). A claim without a phase is ``Bound``: the bind
    creates it holding its cards, just before the Binding (:func:`kvgpu.api.vgpuclaim.claim_phase`);
    whether the pod runs is the pod's phase. ``Reserved`` and ``Running`` are not written any
    more (claims of earlier versions may carry ``Bound`` or ``Running``)."""

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


def _without(data: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(data, dict) and any(k in data for k in keys):
        return {k: v for k, v in data.items() if k not in keys}
    return data
