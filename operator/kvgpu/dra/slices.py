"""A node's cards as ``resource.k8s.io/v1`` ResourceSlices, and kvgpu's DeviceClasses.

Each card of a ``allocation: dra`` pool is one device ``gpu-<index>`` in the node's pool (pool
name = node name) of driver :data:`DRIVER`::

    {"name": "gpu-0",
     "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-..."},
                    "model": {"string": "NVIDIA H200"}, "index": {"int": 0},
                    "numaNode": {"int": 0}, "mode": {"string": "hami-core"},
                    "smCount": {"int": 132}},
     "capacity": {"memory": {"value": "143771Mi", "requestPolicy": {...}},   # MiB x memoryScaling
                  "cores":  {"value": "100", "requestPolicy": {...}},        # 100 x coreScaling
                  "shares": {"value": "10", "requestPolicy": {"default": "1", "validValues": ["1"]}}},
     "allowMultipleAllocations": true}

One allocation consumes one ``share`` (so at most ``splitCount`` claims share a card), the
``memory`` it asks for (at least the pool's ``minSliceMemory``, in steps of 1 MiB, at most the
physical card; the pool's ``defaults.gpumem`` or the whole card when it asks for none) and the
``cores`` (0..100, the pool's ``defaults.gpucores`` when it asks for none; 0 = no compute limit,
HAMi's meaning). An ``exclusive`` card is not shared (``allowMultipleAllocations`` false).
Unhealthy cards and cards in MIG mode are not published as shareable devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.core.inventory import Card, NodeInventory

DRIVER = "gpu.kvgpu.io"
"""The DRA driver name (a DNS subdomain), also the name of the DeviceClass of whole/shared cards."""

GROUP_VERSION = "resource.k8s.io/v1"
ALLOCATION_DRA = "dra"
"""The VGPUPool ``allocation`` value whose cards are published as DRA devices."""

CAPACITY_MEMORY = "memory"
CAPACITY_CORES = "cores"
CAPACITY_SHARES = "shares"


@dataclass(frozen=True, slots=True)
class DevicePolicy:
    """What one pool's devices give a request that leaves capacity out. MiB and percent of SMs;
    0 means: the whole card's memory / no compute limit / no minimum."""

    default_memory_mib: int = 0
    default_cores: int = 0
    min_memory_mib: int = 0


def device_name(card: Card) -> str:
    """The device's name in the pool (a DNS label): ``gpu-<index>``."""
    return f"gpu-{card.index}"


def slice_name(node: str) -> str:
    """The name of ``node``'s ResourceSlice of shareable cards."""
    return f"{node}-{DRIVER}"


def _attributes(card: Card) -> dict[str, dict[str, Any]]:
    attrs: dict[str, dict[str, Any]] = {
        "type": {"string": "gpu"},
        "uuid": {"string": card.uuid},
        "model": {"string": card.model},
        "index": {"int": card.index},
        "smCount": {"int": card.sm_count},
        "mode": {"string": card.slicing.mode if card.slicing else "hami-core"},
    }
    if card.numa is not None:
        attrs["numaNode"] = {"int": card.numa}
    return attrs


def _capacity(card: Card, policy: DevicePolicy, shared: bool) -> dict[str, dict[str, Any]]:
    sl = card.slicing
    assert sl is not None
    mem_total = int(card.memory_mib * sl.memory_scaling)
    cores_total = int(100 * sl.core_scaling)
    cap: dict[str, dict[str, Any]] = {
        CAPACITY_MEMORY: {"value": f"{mem_total}Mi"},
        CAPACITY_CORES: {"value": str(cores_total)},
        CAPACITY_SHARES: {"value": str(sl.split_count)},
    }
    if not shared:
        return cap
    mem_max = min(card.memory_mib, mem_total)
    mem_min = max(1, min(policy.min_memory_mib, mem_max))
    mem_default = policy.default_memory_mib or mem_max
    mem_default = max(mem_min, min(mem_default, mem_max))
    cores_max = min(100, cores_total)
    cores_default = max(0, min(policy.default_cores, cores_max))
    cap[CAPACITY_MEMORY]["requestPolicy"] = {
        "default": f"{mem_default}Mi",
        "validRange": {"min": f"{mem_min}Mi", "max": f"{mem_max}Mi", "step": "1Mi"},
    }
    cap[CAPACITY_CORES]["requestPolicy"] = {
        "default": str(cores_default),
        "validRange": {"min": "0", "max": str(cores_max), "step": "1"},
    }
    cap[CAPACITY_SHARES]["requestPolicy"] = {"default": "1", "validValues": ["1"]}
    return cap


def card_device(card: Card, policy: DevicePolicy = DevicePolicy()) -> dict[str, Any]:
    """One card as a ResourceSlice device (the shape in the module docstring).
    Raises ``ValueError`` for a card no pool covers."""
    if card.slicing is None:
        raise ValueError(f"card {card.uuid} is covered by no pool")
    shared = card.slicing.mode != "exclusive"
    dev: dict[str, Any] = {
        "name": device_name(card),
        "attributes": _attributes(card),
        "capacity": _capacity(card, policy, shared),
    }
    if shared:
        dev["allowMultipleAllocations"] = True
    return dev


def dra_cards(inventory: NodeInventory) -> list[Card]:
    """The cards of ``inventory`` that DRA publishes: healthy, not in MIG mode, in a ``dra`` pool."""
    return [
        c for c in inventory.cards
        if c.slicing is not None and c.slicing.allocation == ALLOCATION_DRA and c.healthy and not c.mig_mode
    ]


def resource_slices(
    inventory: NodeInventory, policies: Mapping[str, DevicePolicy] | None = None, generation: int = 1
) -> list[dict[str, Any]]:
    """The ResourceSlices ``inventory.node`` should have (``metadata`` holds the name only; the
    publisher adds the owner reference). ``policies``: :class:`DevicePolicy` by pool name.
    An empty list when no card is published (the publisher then deletes the node's slices)."""
    policies = policies or {}
    cards = dra_cards(inventory)
    if not cards:
        return []
    devices = [card_device(c, policies.get(c.slicing.pool if c.slicing else "", DevicePolicy())) for c in cards]
    return [
        {
            "apiVersion": GROUP_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name(inventory.node)},
            "spec": {
                "driver": DRIVER,
                "nodeName": inventory.node,
                "pool": {"name": inventory.node, "generation": generation, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    ]


def device_classes() -> list[dict[str, Any]]:
    """kvgpu's DeviceClasses: :data:`DRIVER` selects its shareable cards (``type == "gpu"``)."""
    sel = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    return [
        {
            "apiVersion": GROUP_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": sel}}]},
        }
    ]
