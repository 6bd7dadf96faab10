"""MIG instances as DRA partitionable devices (``DRAPartitionableDevices``, beta in 1.36), and what a
container that is given one gets. Pure: no I/O.

A card of an ``allocation: dra`` pool that is already in MIG mode (the agent never changes a card's
mode or its instances) publishes:

- a **counter set** ``gpu-<index>-counters`` (in a ResourceSlice of its own: the API allows only
  one of ``devices`` and ``sharedCounters`` per slice) with the card's totals::

      {"name": "gpu-1-counters",
       "counters": {"memory": {"value": "143771Mi"}, "multiprocessors": {"value": "132"}}}

- each MIG instance as a device ``gpu-<index>-mig-<gi>-<ci>`` that **consumes** its memory (MiB)
  and SMs from that set, so kube-scheduler never allocates more of a card than it has::

      {"name": "gpu-1-mig-7-0",
       "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.18gb"},
                      "uuid": {"string": "MIG-..."}, "parentUUID": {"string": "GPU-..."},
                      "index": {"int": 1}, "model": {"string": "NVIDIA H200"},
                      "smCount": {"int": 16}, "numaNode": {"int": 0}},
       "capacity": {"memory": {"value": "16384Mi"}, "multiprocessors": {"value": "16"}},
       "consumesCounters": [{"counterSet": "gpu-1-counters",
                             "counters": {"memory": {"value": "16384Mi"},
                                          "multiprocessors": {"value": "16"}}}]}

  ``index`` is the parent card's. A MIG device is one whole device (no ``allowMultipleAllocations``):
  the hardware isolates it, so no shim limit applies. The DeviceClass :data:`MIG_CLASS` selects
  them; a claim picks a profile with a CEL selector on ``profile``.

:func:`mig_container_edits` is what the node's prepare gives the container of an allocated MIG
device: its device nodes and environment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvgpu.core.inventory import Card, MigInstance, NodeInventory

MIG_CLASS = "mig.gpu.kvgpu.io"
"""The DeviceClass of MIG devices (``type == "mig"``)."""

COUNTER_MEMORY = "memory"
COUNTER_MULTIPROCESSORS = "multiprocessors"
ALLOCATION_DRA = "dra"


def counter_set_name(card: Card) -> str:
    """The name (a DNS label) of ``card``'s counter set: ``gpu-<index>-counters``."""
    return f"gpu-{card.index}-counters"


def mig_device_name(card: Card, inst: MigInstance) -> str:
    """The name (a DNS label) of a MIG device in the pool: ``gpu-<index>-mig-<gi>-<ci>``."""
    return f"gpu-{card.index}-mig-{inst.gi}-{inst.ci}"


def is_mig_device_name(name: str) -> bool:
    """Whether a device name of the driver's pool names a MIG instance (:func:`mig_device_name`)."""
    head, sep, _ = name.partition("-mig-")
    return bool(sep) and head.startswith("gpu-") and head[4:].isdigit()


def dra_mig_cards(inventory: NodeInventory) -> list[Card]:
    """The cards of ``inventory`` whose MIG instances DRA publishes: healthy, in MIG mode, with
    instances, in a ``dra`` pool."""
    return [
        c for c in inventory.cards
        if c.mig_mode and c.mig_instances and c.healthy
        and c.slicing is not None and c.slicing.allocation == ALLOCATION_DRA
    ]


def _amounts(memory_mib: int, sms: int) -> dict[str, dict[str, str]]:
    return {COUNTER_MEMORY: {"value": f"{memory_mib}Mi"}, COUNTER_MULTIPROCESSORS: {"value": str(sms)}}


def counter_set(card: Card) -> dict[str, Any]:
    """``card``'s counter set (the shape in the module docstring): its memory (MiB) and SMs."""
    return {"name": counter_set_name(card), "counters": _amounts(card.memory_mib, card.sm_count)}


def mig_device(card: Card, inst: MigInstance) -> dict[str, Any]:
    """One MIG instance of ``card`` as a ResourceSlice device (the shape in the module docstring)."""
    attrs: dict[str, dict[str, Any]] = {
        "type": {"string": "mig"},
        "profile": {"string": inst.profile},
        "uuid": {"string": inst.uuid},
        "parentUUID": {"string": card.uuid},
        "index": {"int": card.index},
        "model": {"string": card.model},
        "smCount": {"int": inst.sm_count},
    }
    if card.numa is not None:
        attrs["numaNode"] = {"int": card.numa}
    return {
        "name": mig_device_name(card, inst),
        "attributes": attrs,
        "capacity": _amounts(inst.memory_mib, inst.sm_count),
        "consumesCounters": [{"counterSet": counter_set_name(card),
                              "counters": _amounts(inst.memory_mib, inst.sm_count)}],
    }


def mig_devices(cards: Iterable[Card]) -> list[dict[str, Any]]:
    """The MIG devices of ``cards``, card by card, instances in NVML's order."""
    return [mig_device(c, m) for c in cards for m in c.mig_instances]


def find_mig_device(inventory: NodeInventory, name: str) -> tuple[Card, MigInstance] | None:
    """The card and instance that device ``name`` (:func:`mig_device_name`) of ``inventory``'s pool
    is; ``None`` when no MIG device has that name (the node's inventory changed)."""
    for c in inventory.cards:
        for m in c.mig_instances:
            if mig_device_name(c, m) == name:
                return c, m
    return None


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """What a container gets for one MIG device: ``device_nodes`` (paths under ``/dev``, the same
    on the host and in the container, access ``rw``) and ``env``."""

    device_nodes: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


class MigCapsUnknown(ValueError):
    """The MIG instance's ``/dev/nvidia-caps`` minors are unknown, so it cannot be handed out."""


def mig_container_edits(card: Card, inst: MigInstance) -> ContainerEdits:
    """The device nodes and env a container needs to use MIG instance ``inst`` of ``card``, as the
    NVIDIA container toolkit gives them: the parent's ``/dev/nvidia<minor>`` (the minor, else the
    index) and the ``/dev/nvidia-caps/nvidia-cap<N>`` of its GPU instance and its compute instance,
    and ``NVIDIA_VISIBLE_DEVICES=<MIG UUID>``. The caller adds the node's control nodes
    (``nvidiactl``, ``nvidia-uvm`` ...) as for a whole card, and **no other** ``nvidia-caps`` node
    (another instance's cap would open that instance). No shim, no limits: MIG isolates in hardware.

    Raises :class:`MigCapsUnknown` when a cap minor is unknown (the driver's mig-minors table was not
    readable at discovery): a container without its caps would see no GPU.
    """
    if inst.gi_cap_minor is None or inst.ci_cap_minor is None:
        raise MigCapsUnknown(f"MIG device {inst.uuid} of card {card.uuid}: the minors of its "
                             "/dev/nvidia-caps nodes are unknown (/proc/driver/nvidia-caps/mig-minors unread)")
    minor = card.minor if card.minor is not None else card.index
    nodes = (f"/dev/nvidia{minor}", f"/dev/nvidia-caps/nvidia-cap{inst.gi_cap_minor}",
             f"/dev/nvidia-caps/nvidia-cap{inst.ci_cap_minor}")
    return ContainerEdits(nodes, {"NVIDIA_VISIBLE_DEVICES": inst.uuid})
