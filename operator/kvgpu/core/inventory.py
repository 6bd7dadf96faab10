"""A node's GPU inventory: what the agent publishes in the ``kvgpu.io/inventory`` annotation.

JSON form (``version`` 1), camelCase like the rest of the API::

    {"version": 1, "node": "gpu-0", "source": "nvml" | "simulated",
     "driver": "580.159.04", "cuda": "13.0",
     "cards": [{"uuid": "GPU-...", "index": 0, "model": "NVIDIA H200",
                "memoryMiB": 143771, "smCount": 132, "numa": 0, "migMode": false,
                "healthy": true, "reason": "", "minor": 0,
                "slicing": {"pool": "default", "splitCount": 10, "memoryScaling": 1.0,
                            "coreScaling": 1.0, "mode": "hami-core"}}]}

``slicing`` is the card's effective slicing from the matching VGPUPool (absent when no pool
covers the card: such a card takes no slices); its ``allocation`` (``extender`` when absent, or
``dra``: the card is a DRA device of driver ``gpu.kvgpu.io``, see kvgpu.dra) is the pool's.

The simulated backend's config file (YAML or JSON) lists cards per node::

    nodes:
      - name: gpu-0
        driver: "580.159.04"      # optional
        cards:
          - {model: "NVIDIA H200", memoryMiB: 143771, smCount: 132, numa: 0, count: 4}

UUIDs of simulated cards are derived from the node name and index, so they are stable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

INVENTORY_VERSION = 1


@dataclass(frozen=True, slots=True)
class Slicing:
    """How one physical card is sliced (from the VGPUPool that covers it)."""

    pool: str
    split_count: int = 10
    memory_scaling: float = 1.0
    core_scaling: float = 1.0
    mode: str = "hami-core"
    allocation: str = "extender"
    """``extender`` (kvgpu's scheduler extender and device plugin) or ``dra`` (DRA devices)."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pool": self.pool,
            "splitCount": self.split_count,
            "memoryScaling": self.memory_scaling,
            "coreScaling": self.core_scaling,
            "mode": self.mode,
        }
        if self.allocation != "extender":
            d["allocation"] = self.allocation
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Slicing:
        return cls(
            pool=str(d["pool"]),
            split_count=int(d.get("splitCount", 10)),
            memory_scaling=float(d.get("memoryScaling", 1.0)),
            core_scaling=float(d.get("coreScaling", 1.0)),
            mode=str(d.get("mode", "hami-core")),
            allocation=str(d.get("allocation", "extender")),
        )


@dataclass(frozen=True, slots=True)
class Card:
    """One physical card as discovered (NVML or simulated). Memory in MiB.

    ``minor``: the device node's minor number (``/dev/nvidia<minor>``, NVML
    ``nvmlDeviceGetMinorNumber``); ``None`` when unknown (simulated cards: use the index).
    """

    uuid: str
    index: int
    model: str
    memory_mib: int
    sm_count: int
    numa: int | None = None
    mig_mode: bool = False
    healthy: bool = True
    reason: str = ""
    slicing: Slicing | None = None
    minor: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "uuid": self.uuid,
            "index": self.index,
            "model": self.model,
            "memoryMiB": self.memory_mib,
            "smCount": self.sm_count,
            "numa": self.numa,
            "migMode": self.mig_mode,
            "healthy": self.healthy,
            "reason": self.reason,
        }
        if self.slicing is not None:
            d["slicing"] = self.slicing.to_json()
        if self.minor is not None:
            d["minor"] = self.minor
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Card:
        sl = d.get("slicing")
        return cls(
            uuid=str(d["uuid"]),
            index=int(d["index"]),
            model=str(d["model"]),
            memory_mib=int(d["memoryMiB"]),
            sm_count=int(d.get("smCount", 0)),
            numa=None if d.get("numa") is None else int(d["numa"]),
            mig_mode=bool(d.get("migMode", False)),
            healthy=bool(d.get("healthy", True)),
            reason=str(d.get("reason", "")),
            slicing=Slicing.from_json(sl) if sl else None,
            minor=None if d.get("minor") is None else int(d["minor"]),
        )


@dataclass(frozen=True, slots=True)
class NodeInventory:
    node: str
    cards: tuple[Card, ...]
    source: str = "nvml"
    driver: str = ""
    cuda: str = ""
    version: int = INVENTORY_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "node": self.node,
            "source": self.source,
            "driver": self.driver,
            "cuda": self.cuda,
            "cards": [c.to_json() for c in self.cards],
        }

    def dumps(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal inventories give equal strings."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> NodeInventory:
        """Parse the annotation. Raises ``ValueError`` (incl. ``KeyError``-derived) on bad input."""
        try:
            d = json.loads(text)
            if int(d.get("version", 0)) != INVENTORY_VERSION:
                raise ValueError(f"inventory version {d.get('version')!r} is not {INVENTORY_VERSION}")
            return cls(
                node=str(d["node"]),
                cards=tuple(Card.from_json(c) for c in d["cards"]),
                source=str(d.get("source", "nvml")),
                driver=str(d.get("driver", "")),
                cuda=str(d.get("cuda", "")),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed inventory: {e!r}") from e

    def with_slicing(self, slicing: dict[str, Slicing | None]) -> NodeInventory:
        """Return a copy with each card's slicing set from ``{uuid: Slicing|None}``."""
        return replace(self, cards=tuple(replace(c, slicing=slicing.get(c.uuid)) for c in self.cards))


def simulated_uuid(node: str, index: int) -> str:
    """A stable, NVML-shaped UUID for simulated card ``index`` of ``node``."""
    h = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True, slots=True)
class SimulatedCardSpec:
    model: str = "NVIDIA H200"
    memory_mib: int = 143771
    sm_count: int = 132
    numa: int | None = 0
    count: int = 1


@dataclass(frozen=True, slots=True)
class SimulatedNode:
    name: str
    cards: tuple[SimulatedCardSpec, ...] = field(default_factory=tuple)
    driver: str = "580.159.04"
    cuda: str = "13.0"
    labels: tuple[tuple[str, str], ...] = ()

    def inventory(self) -> NodeInventory:
        cards: list[Card] = []
        for spec in self.cards:
            for _ in range(spec.count):
                i = len(cards)
                cards.append(
                    Card(
                        uuid=simulated_uuid(self.name, i),
                        index=i,
                        model=spec.model,
                        memory_mib=spec.memory_mib,
                        sm_count=spec.sm_count,
                        numa=spec.numa,
                    )
                )
        return NodeInventory(self.name, tuple(cards), "simulated", self.driver, self.cuda)


def parse_simulated(doc: dict[str, Any]) -> list[SimulatedNode]:
    """Parse the simulated backend's config (already loaded from YAML/JSON).

    Raises ``ValueError`` naming the bad entry.
    """
    nodes = []
    for i, n in enumerate(doc.get("nodes") or []):
        try:
            specs = tuple(
                SimulatedCardSpec(
                    model=str(c.get("model", "NVIDIA H200")),
                    memory_mib=int(c.get("memoryMiB", 143771)),
                    sm_count=int(c.get("smCount", 132)),
                    numa=None if c.get("numa") is None else int(c["numa"]),
                    count=int(c.get("count", 1)),
                )
                for c in n.get("cards") or []
            )
            labels = tuple(sorted((str(k), str(v)) for k, v in (n.get("labels") or {}).items()))
            nodes.append(
                SimulatedNode(
                    str(n["name"]),
                    specs,
                    str(n.get("driver", "580.159.04")),
                    str(n.get("cuda", "13.0")),
                    labels,
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"simulated inventory: nodes[{i}] is malformed: {e!r}") from e
    return nodes


def card_dict(card: Card) -> dict[str, Any]:
    return asdict(card)
