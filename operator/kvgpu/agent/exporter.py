"""Per-container usage exporter (prometheus-client), computed on every scrape.

Sources:

- **claims** — the containers bound to this node and their slices, from the pods' claim
  annotations (``kvgpu.io/claim.<container>``, the ``KVGPU_CLAIM`` string the operator writes at
  bind time). A container's limit series exist as soon as its pod is bound, before any CUDA call
  (HAMi's monitor only shows a container after CUDA initialised — #281, #1794).
- **regions** — the shim's shared region of each container in
  ``<region_root>/<pod-uid>/<container>/``, read through an injectable reader (default
  ``kvgpu.shimcore.read_region``): memory used, the limit the shim enforces, processes, SM use.
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
``kvgpu_container_enforced_limit_bytes``  the limit the shim reports (differs from the claim = bug)
``kvgpu_card_info`` / ``_healthy`` / ``_memory_bytes`` / ``_slices``  per card of the node
``kvgpu_region_read_errors_total``      regions that could not be read
``kvgpu_container_unenforced_processes``  processes of the container outside the shim (see
                                        :mod:`kvgpu.agent.enforcement`), with ``processes``
``kvgpu_container_nvml_memory_bytes``   the container's memory on the card as NVML measures it
``kvgpu_card_foreign_memory_bytes`` / ``_processes``  use of the card no claim accounts for
====================================== =============================================================

With ``hami_compat`` the HAMi monitor names ``hami_vgpu_memory_used_bytes``,
``hami_vgpu_memory_limit_bytes`` and ``hami_container_device_utilization_ratio`` (labels
``namespace, pod, container, vdevice_index, device_uuid``) are exported too, so existing
dashboards keep working — with a real container index instead of HAMi's constant 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgpu.core import claimstr, keys
from kvgpu.core.inventory import NodeInventory

log = logging.getLogger(__name__)
MIB = 1 << 20


# --------------------------------------------------------------------------- claims


@dataclass(frozen=True)
class BoundDevice:
    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True)
class BoundContainer:
    """A container with slices on this node (from its pod's claim annotation)."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    claim: str  # "<namespace>/<name>" of the VGPUClaim
    priority: int
    devices: tuple[BoundDevice, ...]
    started: bool = False  # the container has been created by the kubelet
    container_id: str = ""  # runtime ID without the "<runtime>://" prefix, "" before creation


def containers_of_pod(pod: Mapping[str, Any]) -> list[BoundContainer]:
    """The bound containers of one pod (API dict). Ended pods and bad claim strings give none.

    A claim annotation that does not decode is logged and skipped (the shim would refuse it too).
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return []
    ann = meta.get("annotations") or {}
    ids = {
        cs.get("name"): str(cs.get("containerID")).split("://", 1)[-1]
        for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
        if cs.get("containerID")
    }
    out = []
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        name = c.get("name", "")
        text = ann.get(keys.claim_annotation(name))
        if not text:
            continue
        try:
            cs = claimstr.decode(text)
        except claimstr.ClaimStringError as e:
            log.warning(
                "pod %s/%s container %s: bad claim annotation: %s",
                meta.get("namespace"),
                meta.get("name"),
                name,
                e,
            )
            continue
        out.append(
            BoundContainer(
                namespace=str(meta.get("namespace", "")),
                pod=str(meta.get("name", "")),
                pod_uid=str(meta.get("uid", "")),
                container=name,
                claim=cs.claim,
                priority=cs.priority,
                devices=tuple(BoundDevice(d.uuid, d.memory_mib, d.cores) for d in cs.devices),
                started=name in ids,
                container_id=ids.get(name, ""),
            )
        )
    return out


def pending_device_sets(containers: Iterable[BoundContainer]) -> list[list[str]]:
    """Card-UUID lists of bound containers the kubelet has not created yet (device plugin hint)."""
    return [[d.uuid for d in c.devices] for c in containers if not c.started]


# --------------------------------------------------------------------------- regions


@dataclass(frozen=True)
class DeviceUsage:
    """One card's usage in a container's region. Memory in MiB, SM use in percent (None: unknown)."""

    uuid: str
    limit_mib: int
    used_mib: float
    pids: tuple[int, ...] = ()
    sm_util: float | None = None
    host_pids: tuple[int, ...] = ()  # host PIDs of those processes where known (0s dropped)


RegionReader = Callable[[Path], Sequence[DeviceUsage] | None]


def _first(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(obj, Mapping) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def adapt_region(usage: Any) -> list[DeviceUsage]:
    """Normalise what a region reader returned (``RegionUsage`` with ``devices``, or a list of
    per-device records, objects or dicts) into :class:`DeviceUsage` rows."""
    if usage is None:
        return []
    devs = _first(usage, "devices", default=usage)
    out = []
    for d in devs or []:
        if isinstance(d, DeviceUsage):
            out.append(d)
            continue
        limit = _first(d, "limit_mib", "memory_limit_mib", "limit")
        used = _first(d, "used_mib", "memory_used_mib", "used")
        if limit is None and (b := _first(d, "limit_bytes")) is not None:
            limit = int(b) // MIB
        if used is None and (b := _first(d, "used_bytes")) is not None:
            used = int(b) / MIB
        sm = _first(d, "sm_util", "sm_utilization", "sm_percent")
        pids = _first(d, "pids", default=()) or ()
        procs = _first(d, "processes", default=()) or ()
        host = tuple(int(h) for p in procs if (h := _first(p, "host_pid", default=0)))
        out.append(
            DeviceUsage(
                str(_first(d, "uuid", default="")),
                int(limit or 0),
                float(used or 0),
                tuple(int(p) for p in pids),
                None if sm is None else float(sm),
                host,
            )
        )
    return out


REGION_FILE = "vgpu.region"  # the shim's file in the container's region directory


def default_reader() -> RegionReader:
    """A reader of ``<dir>/vgpu.region`` through ``kvgpu.shimcore.read_region``.

    Returns ``None`` for a directory without a region (the container has not started CUDA). If
    the shim's core module cannot be loaded here, returns a reader that always answers ``None``
    (usage series stay 0; limits from claims are still exported) and logs why once.
    """
    try:
        from kvgpu import shimcore

        shimcore.core()  # load (or build) once at start, never during a scrape
    except Exception as e:  # ImportError, ShimCoreUnavailable, a failed build
        log.warning("shim core unavailable (%s): usage series will stay at 0", e)

        def nothing(path: Path) -> None:
            return None

        return nothing

    def read(path: Path) -> list[DeviceUsage] | None:
        try:
            return adapt_region(shimcore.read_region(path / REGION_FILE))
        except FileNotFoundError:
            return None

    return read


def gc_regions(
    root: str | os.PathLike[str], live_pod_uids: set[str], min_age_s: float = 300.0, now: float | None = None
) -> list[Path]:
    """Delete ``<root>/<pod-uid>`` directories of pods no longer on this node, once older than
    ``min_age_s`` (so a pod bound a moment ago is never raced). Returns what was removed."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.is_dir() or d.name in live_pod_uids:
            continue
        try:
            if now - d.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


# --------------------------------------------------------------------------- collector

_CLABELS = ["node", "namespace", "pod", "container", "claim", "device_uuid", "device_index"]
_HLABELS = ["namespace", "pod", "container", "vdevice_index", "device_uuid"]
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
    ) -> None:
        self.node = node
        self.containers = containers
        self.inventory = inventory
        self.reader = reader if reader is not None else default_reader()
        self.region_root = Path(region_root)
        self.hami_compat = hami_compat
        self.processes = processes  # -> enforcement.ProcessView snapshot
        self.utilization = utilization  # -> {(pod uid, container, uuid): SM percent} measured by NVML
        self.read_errors = 0

    def region_dir(self, c: BoundContainer) -> Path:
        return self.region_root / c.pod_uid / c.container

    def collect(self) -> Iterator[Any]:
        inv = self.inventory()
        index = {c.uuid: str(c.index) for c in inv.cards} if inv else {}
        g = {
            "limit": GaugeMetricFamily(
                "kvgpu_container_memory_limit_bytes",
                "Memory limit of the container's slice on the card (from its claim).",
                labels=_CLABELS,
            ),
            "cores": GaugeMetricFamily(
                "kvgpu_container_core_limit_percent",
                "Compute limit of the slice, percent of the card's SMs (0 = none).",
                labels=_CLABELS,
            ),
            "used": GaugeMetricFamily(
                "kvgpu_container_memory_used_bytes",
                "Device memory charged to the container by the shim.",
                labels=_CLABELS,
            ),
            "sm": GaugeMetricFamily(
                "kvgpu_container_sm_utilization_percent",
                "SM utilisation of the container on the card, percent.",
                labels=_CLABELS,
            ),
            "procs": GaugeMetricFamily(
                "kvgpu_container_processes",
                "Processes of the container attached to the shim's region.",
                labels=_CLABELS,
            ),
            "enforced": GaugeMetricFamily(
                "kvgpu_container_enforced_limit_bytes",
                "Memory limit the shim enforces (should equal the claim's).",
                labels=_CLABELS,
            ),
        }
        active = GaugeMetricFamily(
            "kvgpu_container_region_active",
            "1 when the shim's shared region of the container exists and was read.",
            labels=["node", "namespace", "pod", "container", "claim"],
        )
        h = {
            "used": GaugeMetricFamily(
                "hami_vgpu_memory_used_bytes", "HAMi-compatible: container memory used.", labels=_HLABELS
            ),
            "limit": GaugeMetricFamily(
                "hami_vgpu_memory_limit_bytes", "HAMi-compatible: container memory limit.", labels=_HLABELS
            ),
            "util": GaugeMetricFamily(
                "hami_container_device_utilization_ratio",
                "HAMi-compatible: container SM utilisation (percent).",
                labels=_HLABELS,
            ),
        }
        views = list(self.processes()) if self.processes is not None else []
        measured = dict(self.utilization()) if self.utilization is not None else {}
        unenforced: dict[tuple[str, str, str], int] = {}
        nvml_mem: dict[tuple[str, str, str], int] = {}
        foreign: dict[str, list[int]] = {}
        for v in views:
            if v.container is None:
                foreign.setdefault(v.process.uuid, []).append(v.process.used_bytes)
                continue
            k = (v.container.pod_uid, v.container.container, v.process.uuid)
            nvml_mem[k] = nvml_mem.get(k, 0) + v.process.used_bytes
            if v.state == "unenforced":
                unenforced[k] = unenforced.get(k, 0) + 1
        g["unenforced"] = GaugeMetricFamily(
            "kvgpu_container_unenforced_processes",
            "GPU processes of the container the shim does not control (escaped isolation).",
            labels=_CLABELS,
        )
        g["nvml"] = GaugeMetricFamily(
            "kvgpu_container_nvml_memory_bytes",
            "Device memory of the container's processes on the card as NVML measures it.",
            labels=_CLABELS,
        )
        for c in self.containers():
            usage: dict[str, DeviceUsage] = {}
            ok = False
            try:
                rows = self.reader(self.region_dir(c))
                if rows is not None:
                    usage = {u.uuid: u for u in rows}
                    ok = True
            except Exception as e:  # a corrupt or racing region must not break the scrape
                self.read_errors += 1
                log.warning("region of %s/%s/%s unreadable: %s", c.namespace, c.pod, c.container, e)
            active.add_metric([self.node, c.namespace, c.pod, c.container, c.claim], 1.0 if ok else 0.0)
            for vi, d in enumerate(c.devices):
                lv = [self.node, c.namespace, c.pod, c.container, c.claim, d.uuid, index.get(d.uuid, "")]
                u = usage.get(d.uuid)
                used = (u.used_mib * MIB) if u else 0.0
                sm = u.sm_util if u and u.sm_util is not None else None
                if sm is None:
                    sm = measured.get((c.pod_uid, c.container, d.uuid), 0.0)
                g["limit"].add_metric(lv, d.memory_mib * MIB)
                g["cores"].add_metric(lv, d.cores)
                g["used"].add_metric(lv, used)
                g["sm"].add_metric(lv, sm)
                g["procs"].add_metric(lv, len(u.pids) if u else 0)
                if self.processes is not None:
                    k = (c.pod_uid, c.container, d.uuid)
                    g["unenforced"].add_metric(lv, unenforced.get(k, 0))
                    g["nvml"].add_metric(lv, nvml_mem.get(k, 0))
                if u is not None:
                    g["enforced"].add_metric(lv, u.limit_mib * MIB)
                if self.hami_compat:
                    hl = [c.namespace, c.pod, c.container, str(vi), d.uuid]
                    h["used"].add_metric(hl, used)
                    h["limit"].add_metric(hl, d.memory_mib * MIB)
                    h["util"].add_metric(hl, sm)
        yield from g.values()
        yield active
        if self.hami_compat:
            yield from h.values()
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
        if self.processes is not None:
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
        err = CounterMetricFamily(
            "kvgpu_region_read_errors", "Shared regions that could not be read.", labels=["node"]
        )
        err.add_metric([self.node], self.read_errors)
        yield err


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
    "BoundContainer",
    "BoundDevice",
    "DeviceUsage",
    "UsageCollector",
    "adapt_region",
    "containers_of_pod",
    "gc_regions",
    "make_registry",
    "pending_device_sets",
    "serve",
]
