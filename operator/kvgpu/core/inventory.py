"""A node's GPU inventory: what the agent publishes in the ``kvgpu.io/inventory`` annotation.

JSON form (``version`` 1), camelCase like the rest of the API::

    {"version": 1, "node": "gpu-0", "source": "nvml" | "simulated",
     "driver": "580.159.04", "cuda": "13.0",
     "cards": [{"uuid": "GPU-...", "index": 0, "model": "NVIDIA H200",
                "memoryMiB": 143771, "smCount": 132, "numa": 0, "migMode": false,
                "healthy": true, "reason": "", "minor": 0,
                "slicing": {"pool": "default", "splitCount": 10, "memoryScaling": 1.0,
                            "coreScaling": 1.0, "mode": "hami-core"},
                "migInstances": [{"uuid": "MIG-...", "index": 0, "profile": "1g.18gb",
                                  "memoryMiB": 16384, "smCount": 16, "gi": 7, "ci": 0,
                                  "giCapMinor": 66, "ciCapMinor": 67}]}]}

``migInstances`` (only on a card whose ``migMode`` is true, and only when it has instances) are the
card's MIG devices as they exist: the agent never creates, destroys or changes them, nor the
card's mode. The key is optional, so the format stays version 1: an old agent's annotation parses
(no instances), and an old parser ignores the key. ``gi``/``ci``: GPU- and compute-instance ids;
``giCapMinor``/``ciCapMinor``: the minors of their ``/dev/nvidia-caps/nvidia-cap<N>`` nodes
(absent when unknown).

``slicing`` is the card's effective slicing from the matching VGPUPool (absent when no pool
covers the card: such a card takes no slices); its ``allocation`` (``extender`` when absent, or
``dra``: the card is a DRA device of driver ``gpu.kvgpu.io``, see kvgpu.dra) is the pool's.

The simulated backend's config file (YAML or JSON) lists cards per node::

    nodes:
      - name: gpu-0
        driver: "580.159.04"      # optional
        cards:
          - {model: "NVIDIA H200", memoryMiB: 143771, smCount: 132, numa: 0, count: 4}
          - model: "NVIDIA H200"          # a card already in MIG mode, cut into instances
            migInstances: [{profile: 1g.18gb, count: 3}, {profile: 2g.35gb, count: 2}]

``migInstances`` (profiles of :mod:`kvgpu.core.migprofiles`, in order) puts the card in MIG mode
(``migMode: true`` alone: MIG mode without instances); the profiles must fit the card's compute
and memory slices. UUIDs of simulated cards and instances are derived from the node name and
indices, so they are stable; instance ``gi`` ids count from 1 in order, ``ci`` is 0, and the cap
minors follow the driver's ``/proc/driver/nvidia-caps/mig-minors`` layout (:func:`mig_cap_minor`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvgpu.core.migprofiles import mig_card_model

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
class MigInstance:
    """One MIG device of a card in MIG mode, as it exists (NVML or simulated). Memory in MiB.

    ``index``: the MIG device's index on its parent (NVML ``nvmlDeviceGetMigDeviceHandleByIndex``);
    ``gi``/``ci``: GPU- and compute-instance ids; ``gi_cap_minor``/``ci_cap_minor``: minors of
    ``/dev/nvidia-caps/nvidia-cap<N>`` giving access to them (``None``: unknown).
    """

    uuid: str
    index: int
    profile: str
    memory_mib: int
    sm_count: int
    gi: int
    ci: int = 0
    gi_cap_minor: int | None = None
    ci_cap_minor: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "uuid": self.uuid,
            "index": self.index,
            "profile": self.profile,
            "memoryMiB": self.memory_mib,
            "smCount": self.sm_count,
            "gi": self.gi,
            "ci": self.ci,
        }
        if self.gi_cap_minor is not None:
            d["giCapMinor"] = self.gi_cap_minor
        if self.ci_cap_minor is not None:
            d["ciCapMinor"] = self.ci_cap_minor
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MigInstance:
        return cls(
            uuid=str(d["uuid"]),
            index=int(d["index"]),
            profile=str(d["profile"]),
            memory_mib=int(d["memoryMiB"]),
            sm_count=int(d.get("smCount", 0)),
            gi=int(d["gi"]),
            ci=int(d.get("ci", 0)),
            gi_cap_minor=None if d.get("giCapMinor") is None else int(d["giCapMinor"]),
            ci_cap_minor=None if d.get("ciCapMinor") is None else int(d["ciCapMinor"]),
        )


@dataclass(frozen=True, slots=True)
class Card:
    """One physical card as discovered (NVML or simulated). Memory in MiB.

    ``minor``: the device node's minor number (``/dev/nvidia<minor>``, NVML
    ``nvmlDeviceGetMinorNumber``); ``None`` when unknown (simulated cards: use the index).
    ``mig_instances``: the MIG devices of a card in MIG mode (empty otherwise).
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
    mig_instances: tuple[MigInstance, ...] = ()

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
        if self.mig_instances:
            d["migInstances"] = [m.to_json() for m in self.mig_instances]
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
            mig_instances=tuple(MigInstance.from_json(m) for m in d.get("migInstances") or ()),
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


def simulated_mig_uuid(node: str, index: int, gi: int) -> str:
    """A stable, NVML-shaped UUID (``MIG-...``) for GPU instance ``gi`` of simulated card ``index``."""
    h = hashlib.sha256(f"{node}/{index}/mig/{gi}".encode()).hexdigest()
    return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


MIG_CAP_GIS_PER_GPU = 15
MIG_CAP_CIS_PER_GI = 8


def mig_cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The minor of ``/dev/nvidia-caps/nvidia-cap<N>`` for ``gpu<minor>/gi<gi>/access`` (``ci``
    None) or ``gpu<minor>/gi<gi>/ci<ci>/access`` in the driver's mig-minors table: ``config`` 1,
    ``monitor`` 2, then per GPU minor 15 GPU instances, each its access followed by its 8 compute
    instances'. The NVML path reads the table itself; this is for simulated cards."""
    base = 3 + gpu_minor * MIG_CAP_GIS_PER_GPU * (1 + MIG_CAP_CIS_PER_GI) + gi * (1 + MIG_CAP_CIS_PER_GI)
    return base if ci is None else base + 1 + ci


@dataclass(frozen=True, slots=True)
class SimulatedMigSpec:
    """``count`` instances of MIG ``profile`` on a simulated card."""

    profile: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class SimulatedCardSpec:
    model: str = "NVIDIA H200"
    memory_mib: int = 143771
    sm_count: int = 132
    numa: int | None = 0
    count: int = 1
    mig_mode: bool = False
    mig: tuple[SimulatedMigSpec, ...] = ()

    def instances(self, node: str, index: int) -> tuple[MigInstance, ...]:
        """This spec's MIG instances on card ``index`` of ``node`` (the card's minor is its index).
        Raises ``ValueError`` for an unknown profile or a layout the card cannot hold."""
        if not self.mig:
            return ()
        geo = mig_card_model(self.model)
        profiles = [geo.profile(m.profile) for m in self.mig for _ in range(m.count)]
        compute = sum(p.compute_slices for p in profiles)
        memory = sum(p.memory_slices for p in profiles)
        if compute > geo.compute_slices or memory > geo.memory_slices:
            raise ValueError(f"migInstances take {compute}/{geo.compute_slices} compute and {memory}/"
                             f"{geo.memory_slices} memory slices of a {geo.model}: give fewer instances")
        return tuple(
            MigInstance(uuid=simulated_mig_uuid(node, index, gi), index=gi - 1, profile=p.name,
                        memory_mib=p.memory_mib, sm_count=p.sm_count, gi=gi, ci=0,
                        gi_cap_minor=mig_cap_minor(index, gi), ci_cap_minor=mig_cap_minor(index, gi, 0))
            for gi, p in enumerate(profiles, start=1)
        )


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
                        mig_mode=spec.mig_mode or bool(spec.mig),
                        mig_instances=spec.instances(self.name, i),
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
                    mig_mode=bool(c.get("migMode", False)),
                    mig=_mig_specs(c.get("migInstances")),
                )
                for c in n.get("cards") or []
            )
            for spec in specs:
                spec.instances(str(n["name"]), 0)  # an unknown profile or too many instances: now
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


def _mig_specs(doc: Any) -> tuple[SimulatedMigSpec, ...]:
    """``migInstances`` of a simulated card: a list of ``{profile: <name>, count: <n ≥ 1>}``.
    Raises ``ValueError`` naming the key and the allowed form."""
    if doc is None:
        return ()
    if not isinstance(doc, list) or not all(isinstance(m, dict) and isinstance(m.get("profile"), str) for m in doc):
        raise ValueError(f"migInstances must be a list of {{profile: <name like 1g.18gb>, count: <n>}}, not {doc!r}")
    out = []
    for m in doc:
        count = m.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"migInstances[].count of {m['profile']} must be an integer ≥ 1, not {count!r}")
        out.append(SimulatedMigSpec(m["profile"], count))
    return tuple(out)


def card_dict(card: Card) -> dict[str, Any]:
    return asdict(card)
