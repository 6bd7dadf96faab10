"""Per-container usage exporter (prometheus-client), computed on every scrape.

Sources:

- **claims** — the containers bound to this node and their slices, from the pods' claim
  annotations (``kvgpu.io/claim.<container>``, the ``KVGPU_CLAIM`` string the operator writes at
  bind time). A container's limit series exist as soon as its pod is bound, before any CUDA call
  (HAMi's monitor only shows a container after CUDA initialised — #281, #1794).
- **regions** — the shim's shared region of each container in
  ``<region_root>/<pod-uid>/<container>/``, read through an injectable reader (default
  ``kvgpu.shimcore.read_region``): memory used, the limit the shim enforces, processes.
- **inventory** — card index/model for labels and card-level series.

Metrics (labels ``node, namespace, pod, container, claim, device_uuid, device_index`` for the
container series; bytes and percent):

====================================== =============================================================
``kvgpu_container_memory_limit_bytes``  the claim's memory limit on the card (always present)
``kvgpu_container_core_limit_percent``  the claim's compute limit (0 = unlimited)
``kvgpu_container_memory_used_bytes``   charged by the shim (0 before CUDA starts)
``kvgpu_container_sm_utilization_percent``  the container's SM use on the card
``kvgpu_container_processes``           processes attached to the region
``kvgpu_container_region_active``       1 when the shim's region exists and was read
``kvgpu_container_oom_kills_total``     processes the shim's ``ACTIVE_OOM_KILLER`` ended (the
                                        region's count; labels ``node, namespace, pod, container,
                                        claim``; resets when the region is re-initialised)
``kvgpu_container_enforced_limit_bytes``  the limit the shim reports (differs from the claim = bug)
``kvgpu_card_info`` / ``_healthy`` / ``_memory_bytes`` / ``_slices``  per card of the node
``kvgpu_region_read_errors_total``      regions that could not be read
``kvgpu_container_unenforced_processes``  processes of the container outside the shim (see
                                        :mod:`kvgpu.agent.enforcement`), with ``processes``
``kvgpu_container_nvml_memory_bytes``   the container's memory on the card as NVML measures it
``kvgpu_container_unenforced_kills_total``  processes of the container the agent killed for
                                        running outside the shim (:mod:`kvgpu.agent.escapes`)
``kvgpu_container_over_limit_kills_total``  processes the agent killed while the container held
                                        more of a card than its limit (NVML)
``kvgpu_container_over_cores_kills_total``  processes the agent killed while the container used
                                        more of a card's SMs than its cores (NVML)
``kvgpu_card_foreign_memory_bytes`` / ``_processes``  use of the card no claim accounts for
====================================== =============================================================

With ``hami_compat`` HAMi's names are exported too (:mod:`kvgpu.agent.hamiview`): its monitor
view per container (``hami_vgpu_memory_used_bytes``, ``vGPU_device_memory_usage_in_bytes`` ...,
with a real container index instead of HAMi's constant 0), its scheduler view per card of this
node counted as the operator's ledger counts it (``allocation``:
:func:`kvgpu.agent.hamiview.node_allocation`) and per container from the claims
(``hami_gpu_memory_allocated_bytes``, ``GPUDeviceMemoryAllocated`` ...), and NVML's per-card
figures (``host``: ``hami_host_gpu_memory_used_bytes``, ``HostGPUMemoryUsage`` ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory

from .hamiview import (
    HostCard,
    MonitorFamilies,
    host_families,
    scheduler_card_families,
    scheduler_container_families,
)
from .usage import (
    MIB,
    BoundContainer,
    BoundDevice,
    DeviceUsage,
    RegionReader,
    adapt_region,
    containers_of_pod,
    default_reader,
    gc_regions,
    pending_device_sets,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- collector

_CLABELS = ["node", "namespace", "pod", "container", "claim", "device_uuid", "device_index"]
_CARD = ["node", "device_uuid", "device_index", "model"]


class UsageCollector(Collector):
    """A prometheus-client collector; ``containers()`` and ``inventory()`` are read per scrape."""

    def __init__(
        self,
        node: str,
        containers: Callable[[], Iterable[BoundContainer]],
        inventory: Callable[[], NodeInventory | None],
        reader: RegionReader | None = None,
        region_root: str = keys.HOST_REGION_ROOT,
        hami_compat: bool = True,
        processes: Callable[[], Sequence[Any]] | None = None,
        utilization: Callable[[], Mapping[tuple[str, str, str], float]] | None = None,
        allocation: Callable[[list[BoundContainer]], Mapping[str, Any] | None] | None = None,
        host: Callable[[], Iterable[HostCard]] | None = None,
        backstop: Callable[[], Mapping[str, Mapping[tuple[str, str], int]]] | None = None,
    ) -> None:
        self.node = node
        self.containers = containers
        self.inventory = inventory
        self.reader = reader if reader is not None else default_reader()
        self.region_root = Path(region_root)
        self.hami_compat = hami_compat
        self.processes = processes  # -> enforcement.ProcessView snapshot
        self.utilization = utilization  # -> {(pod uid, container, uuid): SM percent} measured by NVML
        # (the scrape's containers) -> this node's allocation per card (hamiview.node_allocation):
        # counted from the same snapshot as the per-container series, so one scrape never shows
        # a pod in one and not in the other
        self.allocation = allocation
        self.host = host  # -> NVML's figures per card (HAMi's host series)
        # -> {"unenforced" | "over_limit" | "over_cores": {(pod uid, container): processes killed}}
        self.backstop = backstop
        self.read_errors = 0

    def region_dir(self, c: BoundContainer) -> Path:
        return Path(c.region_dir) if c.region_dir else self.region_root / c.pod_uid / c.container

    def collect(self) -> Iterator[Any]:
        inv = self.inventory()
        index = {c.uuid: str(c.index) for c in inv.cards} if inv else {}
        fams = _ContainerFamilies()
        tally = _ProcessTally(self.processes() if self.processes is not None else [])
        measured = dict(self.utilization()) if self.utilization is not None else {}
        containers = list(self.containers())
        killed = self.backstop() if self.backstop is not None else {}  # once per scrape
        for c in containers:
            self._add_container(fams, c, index, measured, tally)
            for why, fam in fams.backstop.items() if self.backstop is not None else ():
                fam.add_metric([self.node, c.namespace, c.pod, c.container, c.claim],
                               sum(killed.get(why, {}).get((c.pod_uid, n), 0) for n in _names(c)))
        yield from fams.g.values()
        yield fams.active
        yield fams.ooms
        if self.backstop is not None:
            yield from fams.backstop.values()
        if self.hami_compat:
            yield from self._hami_families(fams, containers)
        yield from self._card_families(inv, tally.foreign)
        yield self._agent_info(inv)
        err = CounterMetricFamily(
            "kvgpu_region_read_errors", "Shared regions that could not be read.", labels=["node"]
        )
        err.add_metric([self.node], self.read_errors)
        yield err

    def _hami_families(self, fams: _ContainerFamilies, containers: list[BoundContainer]) -> Iterator[Any]:
        """HAMi's monitor, scheduler and host families (see :mod:`kvgpu.agent.hamiview`)."""
        yield from fams.h.families()
        yield from scheduler_card_families(self.node, self.allocation(containers) if self.allocation else None)
        yield from scheduler_container_families(self.node, containers)
        if self.host is not None:
            yield from host_families(self.node, self.host())

    def _read(self, c: BoundContainer) -> tuple[dict[str, DeviceUsage], bool, int]:
        """The container's region: per card usage, whether it was read, the OOM kills it counts."""
        try:
            rows = self.reader(self.region_dir(c))
            if rows is None:
                return {}, False, 0
            oom = getattr(rows, "oom", None)
            return {u.uuid: u for u in rows}, True, oom.count if oom is not None else 0
        except Exception as e:  # a corrupt or racing region must not break the scrape
            self.read_errors += 1
            log.warning("region of %s/%s/%s unreadable: %s", c.namespace, c.pod, c.container, e)
            return {}, False, 0

    def _add_container(self, fams: _ContainerFamilies, c: BoundContainer, index: dict[str, str],
                       measured: Mapping[tuple[str, str, str], float], tally: _ProcessTally) -> None:
        """One container's series: region state, then per card of its claim."""
        usage, ok, kills = self._read(c)
        fams.active.add_metric([self.node, c.namespace, c.pod, c.container, c.claim], 1.0 if ok else 0.0)
        fams.ooms.add_metric([self.node, c.namespace, c.pod, c.container, c.claim], kills)
        g = fams.g
        for vi, d in enumerate(c.devices):
            lv = [self.node, c.namespace, c.pod, c.container, c.claim, d.uuid, index.get(d.uuid, "")]
            u = usage.get(d.uuid)
            used = (u.used_mib * MIB) if u else 0.0
            # SM use from the agent's own NVML samples, never from the region: the container
            # writes its region and could report any figure there.
            sm = min(100.0, sum(measured.get((c.pod_uid, n, d.uuid), 0.0) for n in _names(c)))
            g["limit"].add_metric(lv, d.memory_mib * MIB)
            g["cores"].add_metric(lv, d.cores)
            g["used"].add_metric(lv, used)
            g["sm"].add_metric(lv, sm)
            g["procs"].add_metric(lv, len(u.pids) if u else 0)
            if self.processes is not None:
                ks = [(c.pod_uid, n, d.uuid) for n in _names(c)]
                g["unenforced"].add_metric(lv, sum(tally.unenforced.get(k, 0) for k in ks))
                g["nvml"].add_metric(lv, sum(tally.nvml_mem.get(k, 0) for k in ks))
            if u is not None:
                g["enforced"].add_metric(lv, u.limit_mib * MIB)
            if self.hami_compat:
                fams.h.add(c, vi, d.uuid, used, d.memory_mib * MIB, sm)

    def _card_families(self, inv: NodeInventory | None, foreign: dict[str, list[int]]) -> Iterator[Any]:
        """Per card of the node: info, health, memory, slices; foreign use with NVML processes."""
        info = GaugeMetricFamily("kvgpu_card_info", "A card of the node (value 1).", labels=[*_CARD, "numa"])
        healthy = GaugeMetricFamily("kvgpu_card_healthy", "1 healthy, 0 unhealthy.", labels=_CARD)
        mem = GaugeMetricFamily("kvgpu_card_memory_bytes", "Physical memory of the card.", labels=_CARD)
        slices = GaugeMetricFamily(
            "kvgpu_card_slices", "Slices the card offers (0 = no pool covers it).", labels=_CARD
        )
        for card in inv.cards if inv else ():
            lv = [self.node, card.uuid, str(card.index), card.model]
            info.add_metric([*lv, "" if card.numa is None else str(card.numa)], 1)
            healthy.add_metric(lv, 1 if card.healthy else 0)
            mem.add_metric(lv, card.memory_mib * MIB)
            slices.add_metric(lv, card.slicing.split_count if card.slicing else 0)
        yield from (info, healthy, mem, slices)
        if self.processes is None:
            return
        fmem = GaugeMetricFamily(
            "kvgpu_card_foreign_memory_bytes",
            "Device memory of processes on the card that no claim accounts for.",
            labels=_CARD,
        )
        fprocs = GaugeMetricFamily(
            "kvgpu_card_foreign_processes",
            "Processes on the card that belong to no claimed container.",
            labels=_CARD,
        )
        for card in inv.cards if inv else ():
            lv = [self.node, card.uuid, str(card.index), card.model]
            fmem.add_metric(lv, sum(foreign.get(card.uuid, [])))
            fprocs.add_metric(lv, len(foreign.get(card.uuid, [])))
        yield from (fmem, fprocs)

    def _agent_info(self, inv: NodeInventory | None) -> GaugeMetricFamily:
        from kvgpu import __version__

        agent = GaugeMetricFamily(
            "kvgpu_agent_info", "The agent (value 1).", labels=["node", "version", "source", "driver", "cuda"]
        )
        agent.add_metric(
            [self.node, __version__, inv.source if inv else "", inv.driver if inv else "", inv.cuda if inv else ""],
            1,
        )
        return agent


class _ContainerFamilies:
    """The per-container metric families of one scrape (``g``: kvgpu's, ``h``: HAMi's names)."""

    def __init__(self) -> None:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=_CLABELS)

        self.g = {
            "limit": gauge("kvgpu_container_memory_limit_bytes",
                           "Memory limit of the container's slice on the card (from its claim)."),
            "cores": gauge("kvgpu_container_core_limit_percent",
                           "Compute limit of the slice, percent of the card's SMs (0 = none)."),
            "used": gauge("kvgpu_container_memory_used_bytes", "Device memory charged to the container by the shim."),
            "sm": gauge("kvgpu_container_sm_utilization_percent",
                        "SM utilisation of the container on the card, percent."),
            "procs": gauge("kvgpu_container_processes", "Processes of the container attached to the shim's region."),
            "enforced": gauge("kvgpu_container_enforced_limit_bytes",
                              "Memory limit the shim enforces (should equal the claim's)."),
            "unenforced": gauge("kvgpu_container_unenforced_processes",
                                "GPU processes of the container the shim does not control (escaped isolation)."),
            "nvml": gauge("kvgpu_container_nvml_memory_bytes",
                          "Device memory of the container's processes on the card as NVML measures it."),
        }
        self.active = GaugeMetricFamily(
            "kvgpu_container_region_active",
            "1 when the shim's shared region of the container exists and was read.",
            labels=["node", "namespace", "pod", "container", "claim"],
        )
        self.ooms = CounterMetricFamily(
            "kvgpu_container_oom_kills",
            "Processes of the container the shim's ACTIVE_OOM_KILLER ended (from its region).",
            labels=["node", "namespace", "pod", "container", "claim"],
        )
        self.backstop = {
            "unenforced": CounterMetricFamily(
                "kvgpu_container_unenforced_kills",
                "Processes of the container the node agent killed for running outside the shim.",
                labels=["node", "namespace", "pod", "container", "claim"]),
            "over_limit": CounterMetricFamily(
                "kvgpu_container_over_limit_kills",
                "Processes of the container the node agent killed while it held more of a card than its limit.",
                labels=["node", "namespace", "pod", "container", "claim"]),
            "over_cores": CounterMetricFamily(
                "kvgpu_container_over_cores_kills",
                "Processes of the container the node agent killed while it used more of a card's SMs than its cores.",
                labels=["node", "namespace", "pod", "container", "claim"]),
        }
        self.h = MonitorFamilies()


def _names(c: BoundContainer) -> list[str]:
    """The containers an entry stands for: one, or a DRA claim's consumers in one pod (joined by
    ``,``; the enforcement check counts each on its own)."""
    return c.container.split(",") if c.region_dir else [c.container]


class _ProcessTally:
    """NVML's processes (enforcement's view) summed per (pod UID, container, card), and those of
    no claimed container per card (foreign)."""

    def __init__(self, views: Iterable[Any]) -> None:
        self.unenforced: dict[tuple[str, str, str], int] = {}
        self.nvml_mem: dict[tuple[str, str, str], int] = {}
        self.foreign: dict[str, list[int]] = {}
        for v in views:
            if v.container is None:
                self.foreign.setdefault(v.process.uuid, []).append(v.process.used_bytes)
                continue
            k = (v.container.pod_uid, v.container.container, v.process.uuid)
            self.nvml_mem[k] = self.nvml_mem.get(k, 0) + v.process.used_bytes
            if v.state == "unenforced":
                self.unenforced[k] = self.unenforced.get(k, 0) + 1


def make_registry(collector: UsageCollector) -> CollectorRegistry:
    """A fresh registry holding ``collector`` (and nothing else)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread. Returns (server, thread)."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=addr, registry=registry)


__all__ = [
    "MIB",
    "BoundContainer",
    "BoundDevice",
    "DeviceUsage",
    "HostCard",
    "RegionReader",
    "UsageCollector",
    "adapt_region",
    "containers_of_pod",
    "default_reader",
    "gc_regions",
    "make_registry",
    "pending_device_sets",
    "serve",
]
