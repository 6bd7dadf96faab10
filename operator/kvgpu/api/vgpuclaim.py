"""The VGPUClaim model: one container's slices on a node (:class:`VGPUClaimSpec`) and its
phase (:class:`VGPUClaimStatus`). Re-exported by :mod:`kvgpu.api.models`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, ConfigDict, Field, computed_field, model_validator

from kvgpu.api.modelbase import (
    _CONDITIONS_EXTRA,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    MAX_CARD_MEMORY_MIB,
    UUID_PATTERN,
    ClaimPhase,
    Condition,
    _Model,
    _without,
)
from kvgpu.core.keys import API_VERSION


class ClaimDevice(_Model):
    """One card's slice held by the claim."""

    uuid: str = Field(pattern=UUID_PATTERN, description="Card UUID (NVML).")
    index: int = Field(ge=0, le=63, description="Card index on the node.")
    model: str = Field(min_length=1, max_length=128, description="Card model, e.g. NVIDIA H200.")
    memory: int = Field(ge=1, le=MAX_CARD_MEMORY_MIB, description="Memory limit on this card, MiB.")
    cores: int = Field(ge=0, le=100, description="Percent of the card's SMs (0 = no limit, 100 = exclusive).")


class ResourceClaimRef(_Model):
    """The DRA ResourceClaim a mirrored claim stands for (same namespace)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Its name.")
    uid: str = Field(min_length=1, max_length=64, description="Its UID (a new claim of that name is another one).")


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
    resource_claim: ResourceClaimRef | None = Field(
        default=None,
        description=(
            "Set on a claim the operator mirrors from a DRA ResourceClaim allocated by kube-scheduler for "
            "driver gpu.kvgpu.io (docs/dra.md): the claim then records that allocation (devices from its "
            "consumedCapacity; pod and container: its first consumer) and lives as long as it is allocated."
        ),
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
        default=None, description="Released or Failed once written; none while the claim holds its cards "
        "for its pod (Bound: the claim is created just before the pod's Binding). Reserved, Bound and Running "
        "are accepted from earlier versions."
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


def claim_phase(claim: Any) -> str:
    """A claim's phase for people (a claim object as a dict): the one written (Released, Failed;
    Bound or Running on claims of earlier versions), else ``Bound``: the claim holds its cards for
    its pod."""
    status = (claim.get("status") if isinstance(claim, Mapping) else None) or {}
    return str(status.get("phase") or ClaimPhase.BOUND.value)
