"""HAMi's metric names, from what the agent really reads: HAMi's scheduler view (per card of
this node: allocated memory, cores, shared count; per container: what it was granted) and its
vGPU monitor view (per container: memory used and limit, SM use; per card: NVML's memory used
and utilisation). Pure (prometheus-client metric families from records), except
:func:`nvml_host_cards`, which calls the NVML module it is given.

HAMi (``cmd/scheduler/metrics.go``, ``cmd/vGPUmonitor/metrics.go``) exports each family under
a current name (``hami_*``, labels ``node``, ``device_uuid`` ...) and, with
``--legacy-metrics`` (on in HAMi's Helm chart), under its older name too (``GPUDeviceMemoryLimit``,
labels ``nodeid``, ``deviceuuid`` ...). Both are exported here, with HAMi's help texts, label
names and units: memory in bytes, cores in percent of one card (HAMi's ``_ratio`` families are
0-100), the node memory ratio 0-1, the quota's memory in MiB (HAMi's own unit there).

Where kvgpu has no such figure the family is left out, never given a constant: the memory
breakdown (``hami_vgpu_memory_context_bytes``/``_module_bytes``/``_buffer_bytes``,
``Device_memory_desc_of_container``), the last kernel (``hami_container_last_kernel_elapsed_seconds``,
``Device_last_kernel_of_container``) and MIG (``hami_mig_device_info``, ``MigInfo``,
``hami_node_gpu_mig_instance_info``, ``nodeGPUMigInstance``): the shim's region has none of them.

The scheduler view of a card is the operator's ledger for this node, counted by the same
allocator (:func:`node_allocation`) from what the agent already has: its own inventory (the
cards with their pools' slicing) and the slices of the pods bound here (their claim annotations,
which the Binding wrote) and of the prepared DRA claims. Nothing is written per allocation for
it, and the per-card series are spread over the agents instead of one operator scrape of every
card in the cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from kvgpu.allocator.ledger import Ledger
from kvgpu.allocator.usage import AllocationError
from kvgpu.core.inventory import NodeInventory
from kvgpu.core.requests import ContainerAllocation, DeviceGrant, PodAllocation

from .usage import MIB, BoundContainer

#: HAMi's labels of each family's current and legacy names (same order as its values).
CARD = ["node", "device_uuid", "device_index", "device_type"]
CARD_LEGACY = ["nodeid", "deviceuuid", "deviceidx", "devicetype"]
CTR = ["namespace", "pod", "container", "vdevice_index", "device_uuid"]
CTR_LEGACY = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"]
ALLOC = ["namespace", "node", "pod", "container_index", "device_uuid"]
ALLOC_LEGACY = ["podnamespace", "nodename", "podname", "containeridx", "deviceuuid"]


def device_type(model: str) -> str:
    """HAMi's ``devicetype`` of an NVIDIA card: ``NVIDIA-`` and NVML's name."""
    return f"NVIDIA-{model}"


@dataclass(frozen=True)
class HostCard:
    """NVML's figures of one card: memory used in bytes, GPU and memory-controller utilisation in
    percent (``None``: NVML could not say)."""

    uuid: str
    index: int
    model: str
    memory_used_bytes: int | None
    gpu_util: float | None
    memory_util: float | None


def node_allocation(inventory: NodeInventory | None,
                    containers: Iterable[BoundContainer]) -> dict[str, Any] | None:
    """This node's allocation per card, counted as the operator's ledger counts it
    (:meth:`kvgpu.allocator.usage.NodeUsage.to_json`: ``[used, total]`` of slots, memory and
    cores, pods, exclusivity), from the node's sliced ``inventory`` and the ``containers`` bound
    here. A prepared DRA claim several containers or pods share is one slice. ``None`` before
    the first inventory."""
    if inventory is None:
        return None
    ledger = Ledger()
    ledger.set_node(inventory)
    cards = {c.uuid: c for c in inventory.cards}
    seen: set[str] = set()
    for c in containers:
        # a prepared DRA claim is held by the claim (its region), whichever pods consume it
        holder, name = (f"dra:{c.region_dir}", "claim") if c.region_dir else (c.pod_uid, c.container)
        key = f"{holder}/{name}"
        if key in seen or not c.devices:
            continue
        seen.add(key)
        grants = tuple(DeviceGrant(d.uuid, cards[d.uuid].index if d.uuid in cards else -1,
                                   cards[d.uuid].model if d.uuid in cards else "", d.memory_mib, d.cores)
                       for d in c.devices)
        alloc = PodAllocation(holder, inventory.node, (ContainerAllocation(name, grants, c.priority, c.init),))
        try:
            ledger.reserve(key, alloc, force=True)  # the claims are the truth, as at the operator's rebuild
        except AllocationError:  # a card granted twice to one container: not a claim the binder writes
            continue
    return ledger.node_usage(inventory.node).to_json()


def _pair(v: Any) -> tuple[int, int]:
    """``[used, total]`` of the allocation; ``(0, 0)`` for anything else."""
    if isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int | float) for x in v):
        return int(v[0]), int(v[1])
    return 0, 0


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def scheduler_card_families(node: str, allocation: Mapping[str, Any] | None) -> Iterator[GaugeMetricFamily]:
    """HAMi's per-card scheduler families from the node's allocation (:func:`node_allocation`,
    ``kvgpu.allocator.usage.NodeUsage.to_json``). ``None`` (no inventory yet): no series.
    Values: bytes, percent of a card's SMs (100 per card), containers."""
    f = {
        "mem_limit": _g("hami_gpu_memory_limit_bytes", "Device memory limit for a certain GPU", CARD),
        "core_limit": _g("hami_gpu_core_limit_ratio", "Device core limit for a certain GPU", CARD),
        "mem_alloc": _g("hami_gpu_memory_allocated_bytes", "Device memory allocated for a certain GPU",
                        ["node", "device_uuid", "device_index", "device_cores", "device_type"]),
        "shared": _g("hami_gpu_shared_count", "Number of containers sharing this GPU", CARD),
        "core_alloc": _g("hami_gpu_core_allocated_ratio", "Device core allocated for a certain GPU", CARD),
        "overview": _g("hami_node_gpu_overview", "GPU overview on a certain node",
                       ["node", "device_uuid", "device_index", "device_cores", "device_memory_limit",
                        "device_type"]),
        "mem_ratio": _g("hami_node_gpu_memory_allocated_ratio",
                        "GPU Memory Allocated Percentage on a certain GPU", CARD),
        "l_mem_limit": _g("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU", CARD_LEGACY),
        "l_core_limit": _g("GPUDeviceCoreLimit", "Device memory core limit for a certain GPU", CARD_LEGACY),
        "l_mem_alloc": _g("GPUDeviceMemoryAllocated", "Device memory allocated for a certain GPU",
                          ["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicetype"]),
        "l_shared": _g("GPUDeviceSharedNum", "Number of containers sharing this GPU", CARD_LEGACY),
        "l_core_alloc": _g("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU", CARD_LEGACY),
        "l_overview": _g("nodeGPUOverview", "GPU overview on a certain node",
                         ["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicememorylimit", "devicetype"]),
        "l_mem_ratio": _g("nodeGPUMemoryPercentage", "GPU Memory Allocated Percentage on a certain GPU",
                          ["nodeid", "deviceuuid", "deviceidx"]),
    }
    cards = (allocation or {}).get("cards") or []
    for c in cards if isinstance(cards, list) else []:
        if not isinstance(c, Mapping) or not c.get("uuid"):
            continue
        uuid, idx, dtype = str(c["uuid"]), str(c.get("index", "")), device_type(str(c.get("model", "")))
        slots_used, _ = _pair(c.get("slots"))
        mem_used, mem_total = _pair(c.get("memoryMiB"))
        cores_used, cores_total = _pair(c.get("cores"))
        lv = [node, uuid, idx, dtype]
        f["mem_limit"].add_metric(lv, mem_total * MIB)
        f["core_limit"].add_metric(lv, cores_total)
        f["mem_alloc"].add_metric([node, uuid, idx, str(cores_total), dtype], mem_used * MIB)
        f["shared"].add_metric(lv, slots_used)
        f["core_alloc"].add_metric(lv, cores_used)
        f["overview"].add_metric([node, uuid, idx, str(cores_total), str(mem_total), dtype], mem_used * MIB)
        f["l_mem_limit"].add_metric(lv, mem_total * MIB)
        f["l_core_limit"].add_metric(lv, cores_total)
        f["l_mem_alloc"].add_metric([node, uuid, idx, str(cores_total), dtype], mem_used * MIB)
        f["l_shared"].add_metric(lv, slots_used)
        f["l_core_alloc"].add_metric(lv, cores_used)
        f["l_overview"].add_metric([node, uuid, idx, str(cores_total), str(mem_total), dtype], mem_used * MIB)
        if mem_total > 0:
            f["mem_ratio"].add_metric(lv, mem_used / mem_total)
            f["l_mem_ratio"].add_metric([node, uuid, idx], mem_used / mem_total)
    yield from f.values()


def scheduler_container_families(node: str, containers: Iterable[BoundContainer]) -> Iterator[GaugeMetricFamily]:
    """HAMi's per-container grants (``hami_vgpu_memory_allocated_bytes``, ``vGPUMemoryAllocated``
    ...) from the claims of the containers bound here: bytes, and cores in percent of a card.
    ``container_index``: the container's position in the pod (init containers first, as HAMi)."""
    mem = _g("hami_vgpu_memory_allocated_bytes", "vGPU memory allocated from a container", ALLOC)
    core = _g("hami_vgpu_core_allocated_ratio", "vGPU core allocated from a container", ALLOC)
    l_mem = _g("vGPUMemoryAllocated", "vGPU memory allocated from a container", ALLOC_LEGACY)
    l_core = _g("vGPUCoreAllocated", "vGPU core allocated from a container", ALLOC_LEGACY)
    for c in containers:
        for d in c.devices:
            lv = [c.namespace, node, c.pod, str(c.index), d.uuid]
            for fam in (mem, l_mem):
                fam.add_metric(lv, d.memory_mib * MIB)
            for fam in (core, l_core):
                fam.add_metric(lv, d.cores)
    yield from (mem, core, l_mem, l_core)


class MonitorFamilies:
    """HAMi's per-container monitor families of one scrape; :meth:`add` one card of a container."""

    def __init__(self) -> None:
        self.used = _g("hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes", CTR)
        self.limit = _g("hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes", CTR)
        self.mem = _g("hami_container_device_memory_bytes", "Container device memory usage in bytes", CTR)
        self.util = _g("hami_container_device_utilization_ratio", "Container device SM utilization ratio", CTR)
        self.l_used = _g("vGPU_device_memory_usage_in_bytes", "vGPU device usage", CTR_LEGACY)
        self.l_limit = _g("vGPU_device_memory_limit_in_bytes", "vGPU device limit", CTR_LEGACY)
        self.l_util = _g("Device_utilization_desc_of_container", "Container device utilization description",
                         CTR_LEGACY)

    def add(self, c: BoundContainer, vdevice: int, uuid: str, used_bytes: float, limit_bytes: float,
            sm_percent: float) -> None:
        """One card (position ``vdevice`` in the claim) of container ``c``: bytes, SM percent."""
        lv = [c.namespace, c.pod, c.container, str(vdevice), uuid]
        for fam in (self.used, self.mem, self.l_used):
            fam.add_metric(lv, used_bytes)
        for fam in (self.limit, self.l_limit):
            fam.add_metric(lv, limit_bytes)
        for fam in (self.util, self.l_util):
            fam.add_metric(lv, sm_percent)

    def families(self) -> Iterator[GaugeMetricFamily]:
        yield from (self.used, self.limit, self.mem, self.util, self.l_used, self.l_limit, self.l_util)


def host_families(node: str, cards: Iterable[HostCard]) -> Iterator[GaugeMetricFamily]:
    """HAMi's per-card NVML families: memory used (bytes), GPU and memory-controller utilisation
    (percent, as HAMi's ``_ratio`` 0-100). A figure NVML did not give is left out."""
    mem = _g("hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes",
             ["node", "device_index", "device_uuid", "device_type"])
    util = _g("hami_host_gpu_utilization_ratio", "GPU core utilization ratio (0-100)",
              ["node", "device_index", "device_uuid", "device_type"])
    mc = _g("hami_host_gpu_memory_controller_utilization_ratio", "GPU memory controller utilization ratio (0-100)",
            ["device_index", "device_uuid", "device_type"])
    l_mem = _g("HostGPUMemoryUsage", "GPU device memory usage", ["nodeid", "deviceidx", "deviceuuid", "devicetype"])
    l_util = _g("HostCoreUtilization", "GPU core utilization", ["nodeid", "deviceidx", "deviceuuid", "devicetype"])
    for h in cards:
        lv = [node, str(h.index), h.uuid, device_type(h.model)]
        if h.memory_used_bytes is not None:
            mem.add_metric(lv, h.memory_used_bytes)
            l_mem.add_metric(lv, h.memory_used_bytes)
        if h.gpu_util is not None:
            util.add_metric(lv, h.gpu_util)
            l_util.add_metric(lv, h.gpu_util)
        if h.memory_util is not None:
            mc.add_metric(lv[1:], h.memory_util)
    yield from (mem, util, mc, l_mem, l_util)


def nvml_host_cards(nvml: Any, cards: Iterable[tuple[str, int, str]]) -> list[HostCard]:
    """Read :class:`HostCard` figures through ``nvml`` (the ``pynvml`` module, initialised) for
    ``(uuid, index, model)`` cards. A call NVML refuses leaves that figure ``None``."""
    out = []
    for uuid, index, model in cards:
        try:
            h = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            continue
        used = gpu = mc = None
        try:
            used = int(nvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:  # NOT_SUPPORTED (unified memory), GPU lost
            pass
        try:
            rates = nvml.nvmlDeviceGetUtilizationRates(h)
            gpu, mc = float(rates.gpu), float(rates.memory)
        except Exception:
            pass
        out.append(HostCard(uuid, index, model, used, gpu, mc))
    return out
