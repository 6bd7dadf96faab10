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

A card already in MIG mode publishes its MIG instances instead (:mod:`kvgpu.dra.mig`): devices
``gpu-<index>-mig-<gi>-<ci>`` in the same device slice, consuming the card's counter set, which is
in a slice of its own ``<node>-counters-gpu.kvgpu.io`` (a slice holds devices or counter sets, not
both). The pool's ``resourceSliceCount`` counts every slice. Past 64 devices (128 without MIG
devices) or 8 counter sets, the node gets further slices ``<node>-<k>-gpu.kvgpu.io`` /
``<node>-counters-<k>-gpu.kvgpu.io`` (k = 1, 2, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.core.inventory import Card, NodeInventory
from kvgpu.dra.mig import MIG_CLASS, counter_set, dra_mig_cards, mig_devices

DRIVER = "gpu.kvgpu.io"
"""The DRA driver name (a DNS subdomain), also the name of the DeviceClass of whole/shared cards."""

GROUP_VERSION = "resource.k8s.io/v1"
ALLOCATION_DRA = "dra"
"""The VGPUPool ``allocation`` value whose cards are published as DRA devices."""

CAPACITY_MEMORY = "memory"
CAPACITY_CORES = "cores"
CAPACITY_SHARES = "shares"

MAX_DEVICES = 128
MAX_DEVICES_WITH_COUNTERS = 64  # a slice with a device that consumes counters (API limit)
MAX_COUNTER_SETS = 8


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


def slice_name(node: str, k: int = 0) -> str:
    """The name of ``node``'s ResourceSlice of devices (the ``k``-th past the first)."""
    return f"{node}-{DRIVER}" if k == 0 else f"{node}-{k}-{DRIVER}"


def counter_slice_name(node: str, k: int = 0) -> str:
    """The name of ``node``'s ResourceSlice of MIG cards' counter sets (the ``k``-th past the first)."""
    return f"{node}-counters-{DRIVER}" if k == 0 else f"{node}-counters-{k}-{DRIVER}"


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


def _chunks(items: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def resource_slices(
    inventory: NodeInventory, policies: Mapping[str, DevicePolicy] | None = None, generation: int = 1
) -> list[dict[str, Any]]:
    """The ResourceSlices ``inventory.node`` should have (``metadata`` holds the name only; the
    publisher adds the owner reference). ``policies``: :class:`DevicePolicy` by pool name.
    An empty list when no card is published (the publisher then deletes the node's slices); the
    publisher also deletes the node's slices of this driver that the list no longer names.
    Order: the device slices, then the counter slices."""
    policies = policies or {}
    devices = [card_device(c, policies.get(c.slicing.pool if c.slicing else "", DevicePolicy()))
               for c in dra_cards(inventory)]
    mig_cards = dra_mig_cards(inventory)
    devices += mig_devices(mig_cards)
    if not devices:
        return []
    per_slice = MAX_DEVICES_WITH_COUNTERS if mig_cards else MAX_DEVICES
    specs: list[tuple[str, dict[str, Any]]] = [
        (slice_name(inventory.node, k), {"devices": chunk}) for k, chunk in enumerate(_chunks(devices, per_slice))
    ]
    specs += [
        (counter_slice_name(inventory.node, k), {"sharedCounters": chunk})
        for k, chunk in enumerate(_chunks([counter_set(c) for c in mig_cards], MAX_COUNTER_SETS))
    ]
    pool = {"name": inventory.node, "generation": generation, "resourceSliceCount": len(specs)}
    return [
        {
            "apiVersion": GROUP_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": inventory.node, "pool": dict(pool), **body},
        }
        for name, body in specs
    ]


def _device_class(name: str, device_type: str) -> dict[str, Any]:
    sel = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{device_type}"'
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": sel}}]},
    }


def device_classes() -> list[dict[str, Any]]:
    """kvgpu's DeviceClasses: :data:`DRIVER` selects its shareable cards (``type == "gpu"``),
    :data:`~kvgpu.dra.mig.MIG_CLASS` the MIG instances of cards in MIG mode (``type == "mig"``)."""
    return [_device_class(DRIVER, "gpu"), _device_class(MIG_CLASS, "mig")]
