"""A pod's normalised GPU request and the allocator's answer. Pure data.

Produced by :mod:`kvgpu.api.requests` from annotations and HAMi container limits (with the
pool defaults applied), consumed by :mod:`kvgpu.allocator`. Units: memory in MiB, cores in
percent of the card's SMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Policy(str, Enum):
    BINPACK = "binpack"
    SPREAD = "spread"


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """What one container asks for, per card, on ``cards`` distinct physical cards.

    ``memory_mib`` 0 with ``memory_percent`` None means the whole card's (virtual) memory.
    ``memory_percent`` (1..100) is a share of each card's virtual memory.
    ``cores`` 0..100; 100 asks for an exclusive card (no other slice may share it).
    """

    container: str
    cards: int = 1
    memory_mib: int = 0
    memory_percent: int | None = None
    cores: int = 0
    priority: int = 1
    types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    uuids: tuple[str, ...] = ()
    exclude_uuids: tuple[str, ...] = ()
    numa_bind: bool = False
    init: bool = False


@dataclass(frozen=True, slots=True)
class PodRequest:
    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerRequest, ...]
    node_policy: Policy = Policy.BINPACK
    gpu_policy: Policy = Policy.SPREAD

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """One card's slice given to a container. ``mode``: the card's pool mode at allocation
    (``"mps"`` makes the claim string say so); not part of equality, since grants rebuilt from a
    VGPUClaim do not know it."""

    uuid: str
    index: int
    model: str
    memory_mib: int
    cores: int
    mode: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    container: str
    devices: tuple[DeviceGrant, ...]
    priority: int = 1
    init: bool = False


@dataclass(frozen=True, slots=True)
class PodAllocation:
    pod_uid: str
    node: str
    containers: tuple[ContainerAllocation, ...]
