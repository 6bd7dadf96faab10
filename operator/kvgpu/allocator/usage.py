"""What the ledger reports: usage summaries per card, node and pool, its snapshot, a pod's
footprint on its cards, and :class:`AllocationError`. Pure data, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import (
    ContainerAllocation,
    PodAllocation,
)


class AllocationError(RuntimeError):
    """A pod does not fit (any more) on a node, or a reservation conflicts with the ledger.
    The message is written for a person."""


# A pod's footprint on one card: (slots, MiB, cores, exclusive 0|1).
Footprint = tuple[int, int, int, int]


def footprint(containers: Iterable[ContainerAllocation]) -> dict[str, Footprint]:
    """Collapse a pod's container grants into its per-card footprint (see the module doc)."""
    app: dict[str, list[int]] = {}
    init: dict[str, list[int]] = {}
    for ca in containers:
        for g in ca.devices:
            ex = 1 if g.cores >= 100 else 0
            if ca.init:
                f = init.setdefault(g.uuid, [1, 0, 0, 0])
                f[1] = max(f[1], g.memory_mib)
                f[2] = max(f[2], g.cores)
                f[3] |= ex
            else:
                f = app.setdefault(g.uuid, [0, 0, 0, 0])
                f[0] += 1
                f[1] += g.memory_mib
                f[2] += g.cores
                f[3] |= ex
    out: dict[str, Footprint] = {}
    for uuid in sorted(app.keys() | init.keys()):
        a = app.get(uuid, [0, 0, 0, 0])
        i = init.get(uuid, [0, 0, 0, 0])
        out[uuid] = (max(a[0], i[0]), max(a[1], i[1]), max(a[2], i[2]), a[3] | i[3])
    return out


@dataclass(frozen=True, slots=True)
class CardUsage:
    """One card's capacity and use. Memory in (virtual) MiB, cores in percent of SMs."""

    uuid: str
    index: int
    model: str
    pool: str  # "" when no VGPUPool covers the card
    mode: str
    usable: bool
    reason: str  # why the card takes no slices ("" when usable)
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int
    pods: int  # pods with a slice on the card
    exclusive: bool  # held by a slice with cores 100
    dra: bool = False  # in a ``dra`` pool: its slices are ResourceClaims' (mirrored VGPUClaims)

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "model": self.model,
            "pool": self.pool,
            "usable": self.usable,
            "reason": self.reason,
            "slots": [self.slots_used, self.slots_total],
            "memoryMiB": [self.memory_used_mib, self.memory_total_mib],
            "cores": [self.cores_used, self.cores_total],
            "pods": self.pods,
            "exclusive": self.exclusive,
        }


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """A node's cards and totals over its *usable* cards (for the node annotation, the
    VGPUPool status and ``kubectl vgpu nodes``)."""

    node: str
    cards: tuple[CardUsage, ...]
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form (``[used, total]`` pairs), what the agent's HAMi scheduler view and
        ``kubectl vgpu nodes`` read: about 200 bytes per card."""
        return {
            "version": 1,
            "node": self.node,
            "slots": [self.slots_used, self.slots_total],
            "memoryMiB": [self.memory_used_mib, self.memory_total_mib],
            "cores": [self.cores_used, self.cores_total],
            "cards": [c.to_json() for c in self.cards],
        }


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Totals over the usable cards a pool covers (for ``VGPUPool.status``); a ``dra`` pool's
    cards count too (their use: the mirrored VGPUClaims of its ResourceClaims)."""

    pool: str
    nodes: int
    cards: int
    slots_used: int
    slots_total: int
    memory_used_mib: int
    memory_total_mib: int
    cores_used: int
    cores_total: int


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """Everything that defines a ledger's state; compare with ``==``.

    ``nodes``: sorted ``(node, inventory, ((uuid, slots, MiB, cores, exclusive pods, pods), ...))``;
    ``reservations``: sorted ``(key, PodAllocation)``.
    """

    nodes: tuple[tuple[str, NodeInventory, tuple[tuple[str, int, int, int, int, int], ...]], ...]
    reservations: tuple[tuple[str, PodAllocation], ...]
