"""Who really uses the cards: NVML's process list reconciled with claims and shim regions.

HAMi only knows reservations; a process that escaped the shim (no preload, a static binary,
``CUDA_DISABLE_CONTROL``) or a GPU process of a pod without slices is invisible to it. Here every
compute process NVML reports on a card is attributed to a pod and container through
``/proc/<pid>/cgroup`` (pod UID and container ID, cgroupfs and systemd layouts) and
``/proc/<pid>/status`` (``NSpid``: its PID inside the container), then classified:

- ``enforced``  — a container with a claim on that card, and the PID is attached to the
  container's shim region for that card;
- ``unenforced`` — a container with a claim, but the process is not in the region (shim not
  loaded or bypassed), or it uses a card its claim does not name;
- ``foreign``   — anything else (a pod without slices, a host process, a pod of another node).

:class:`EnforcementMonitor` takes a snapshot every ``interval_s``; the exporter reads it
(``kvgpu_container_unenforced_processes``, ``kvgpu_container_nvml_memory_bytes``,
``kvgpu_card_foreign_memory_bytes``, ...) and a Warning Event ``GPUUnenforced`` is recorded on
the pod the first time one of its containers is seen unenforced; the backstop
(:mod:`kvgpu.agent.escapes`) then kills such a process after a grace period. The agent needs
``hostPID: true`` so NVML's PIDs and ``/proc`` agree.

It also fills the shim's missing piece: for each attached process whose region slot has no host
PID yet, the agent writes it (:func:`set_region_host_pid`, checked against the slot's start time),
so the shim can find its own process in NVML's per-process usage and charge context/module
overhead — inside a PID namespace it cannot know its host PID itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .usage import BoundContainer, DeviceUsage, limit_holder

log = logging.getLogger(__name__)

_POD_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CID_RE = re.compile(r"(?:cri-containerd-|docker-|crio-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class GpuProcess:
    """A process on a card as NVML reports it (host PID; memory in bytes, 0 if unknown)."""

    uuid: str
    host_pid: int
    used_bytes: int
    compute: bool = True  # False: a graphics context only (Vulkan, OpenGL: never through the shim)


@dataclass(frozen=True)
class Attribution:
    """Where a host PID lives: pod UID and container ID from its cgroup, PID in its namespace."""

    pod_uid: str = ""
    container_id: str = ""
    inner_pid: int = 0
    pidns: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of /proc/<pid>/ns/pid; (0, 0): unknown
    start_time: int = 0  # /proc/<pid>/stat field 22 (the same in every PID namespace); 0: unknown


def attribute(host_pid: int, proc: str = "/proc") -> Attribution:
    """Attribute a host PID to a pod/container. Unknown parts stay empty/0; never raises.

    ``/proc`` is read as bytes: the process names itself (``comm``) and any cgroup below its
    container's, neither need be UTF-8. The container is the first component below the pod's that
    names one (the runtime's), so a cgroup the process made below its container's (where cgroupfs
    is writable), whatever its name, neither hides it nor moves it to a sibling container."""
    base = Path(proc) / str(host_pid)
    pod_uid = container_id = ""
    try:
        for line in (base / "cgroup").read_bytes().decode("utf-8", "replace").splitlines():
            path = line.split(":", 2)[-1]
            m = _POD_RE.search(path)
            if m:
                pod_uid = m.group(1).replace("_", "-")
                ids = (_CID_RE.search(part) for part in path[m.end():].split("/"))
                container_id = next((c.group(1) for c in ids if c), "")
                break
    except OSError:
        pass
    inner = 0
    try:
        for line in (base / "status").read_bytes().decode("utf-8", "replace").splitlines():
            if line.startswith("NSpid:"):
                inner = int(line.split()[-1])
                break
    except (OSError, ValueError):
        pass
    try:  # needs ptrace access (an agent without CAP_SYS_PTRACE: unknown); the start time does not
        st = os.stat(base / "ns" / "pid")
        ns = (st.st_dev, st.st_ino)
    except OSError:
        ns = (0, 0)
    return Attribution(pod_uid, container_id, inner, ns, proc_start_time(host_pid, proc) or 0)


def nvml_processes(nvml: Any, uuids: Iterable[str]) -> list[GpuProcess]:
    """Compute and graphics processes per card from NVML, one entry per PID (a process with both
    kinds of context is listed by both calls, with the same memory): a tenant's Vulkan or OpenGL
    context holds memory the shim never sees (its memory counts; a graphics-only process is not
    accused of running outside the shim, which graphics never pass through). Cards that fail to
    answer are skipped, logged; a card without the graphics call (or failing it) gives its
    compute processes."""
    out = []
    for u in uuids:
        try:
            h = nvml.nvmlDeviceGetHandleByUUID(u)
            procs = list(nvml.nvmlDeviceGetComputeRunningProcesses(h))
            computing = {int(p.pid) for p in procs}
        except Exception as e:
            log.debug("NVML process list of %s failed: %s", u, e)
            continue
        try:
            procs += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(h))
        except Exception as e:
            log.debug("NVML graphics process list of %s failed: %s", u, e)
        used_by: dict[int, int] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            pid = int(p.pid)
            used_by[pid] = max(used_by.get(pid, 0), int(used) if isinstance(used, int) and used > 0 else 0)
        out += [GpuProcess(u, pid, used, pid in computing) for pid, used in used_by.items()]
    return out


class ProcessUtilization:
    """Per-process SM utilisation from ``nvmlDeviceGetProcessUtilization`` (percent per host PID).

    Each call returns the samples NVML took since the previous call on that card (the highest
    sample per PID); a card without new samples answers ``{}`` for its processes.
    """

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        self.last: dict[str, int] = {}

    def __call__(self, uuids: Iterable[str]) -> dict[tuple[str, int], float]:
        out: dict[tuple[str, int], float] = {}
        for u in uuids:
            try:
                h = self.nv.nvmlDeviceGetHandleByUUID(u)
                samples = self.nv.nvmlDeviceGetProcessUtilization(h, self.last.get(u, 0))
            except Exception:  # NOT_FOUND: no samples since last time; NOT_SUPPORTED
                continue
            for smp in samples:
                if not 0 <= smp.smUtil <= 100:  # a blank or broken sample: never a measurement
                    continue
                key = (u, int(smp.pid))
                out[key] = max(out.get(key, 0.0), float(smp.smUtil))
                self.last[u] = max(self.last.get(u, 0), int(smp.timeStamp))
        return out


class SmMeans:
    """SM utilisation averaged over the polls since the last :meth:`take`, per process (card UUID,
    host PID) and, with ``attribute``, per container (card UUID, pod UID, container ID) as each
    poll found it: a process that ended before the check still counts for its container, so a
    relay of short-lived processes cannot hide. A poll without a sample counts 0. Polled about
    once a second (:meth:`sample`; NVML keeps one sample per process, of about its last second),
    so a process cannot hide its use by idling when the five-second check comes. Thread-safe."""

    def __init__(self, poll: Callable[[], dict[tuple[str, int], float]],
                 attribute: Callable[[int], Attribution] | None = None) -> None:
        self.poll = poll
        self.attribute = attribute
        self._lock = threading.Lock()
        self._sum: dict[tuple[str, int], float] = {}
        self._containers: dict[tuple[str, str, str], float] = {}
        self._polls = 0

    def sample(self) -> None:
        got = self.poll()
        per: dict[tuple[str, str, str], float] = {}
        for (u, pid), v in got.items():
            if self.attribute is None:
                break
            a = self.attribute(pid)
            if a.pod_uid:
                per[(u, a.pod_uid, a.container_id)] = min(100.0, per.get((u, a.pod_uid, a.container_id), 0.0) + v)
        with self._lock:
            self._polls += 1
            for k, v in got.items():
                self._sum[k] = self._sum.get(k, 0.0) + v
            for c, v in per.items():
                self._containers[c] = self._containers.get(c, 0.0) + v

    def take(self) -> tuple[dict[tuple[str, int], float], dict[tuple[str, str, str], float]] | None:
        """(per process, per container) means since the last take; None when nothing was polled."""
        with self._lock:
            if not self._polls:
                return None
            out = ({k: v / self._polls for k, v in self._sum.items()},
                   {k: v / self._polls for k, v in self._containers.items()})
            self._sum, self._containers, self._polls = {}, {}, 0
        return out


def _by_container(means: Mapping[tuple[str, str, str], float], containers: Sequence[BoundContainer]
                  ) -> dict[tuple[str, str, str], tuple[BoundContainer, float]]:
    """:class:`SmMeans`' (card, pod UID, container ID) means summed per :func:`limit_holder` and
    card (``(pod UID, container name, card)``; a DRA claim's containers together), for the claimed
    containers (a cgroup without a container ID: the pod's only one)."""
    by_id: dict[tuple[str, str], list[BoundContainer]] = {}
    by_pod: dict[str, list[BoundContainer]] = {}
    for bc in containers:
        by_pod.setdefault(bc.pod_uid, []).append(bc)
        if bc.container_id:
            by_id.setdefault((bc.pod_uid, bc.container_id), []).append(bc)
    out: dict[tuple[str, str, str], tuple[BoundContainer, float]] = {}
    for (u, pod, cid), v in means.items():
        c = _entry(by_id.get((pod, cid)) or (by_pod.get(pod) if not cid and len(by_pod.get(pod, ())) == 1 else None),
                   u)
        if c is not None:
            key = (*limit_holder(c), u)
            out[key] = (c, min(100.0, out[key][1] + v) if key in out else v)
    return out


@dataclass(frozen=True)
class ProcessView:
    """One classified process. ``container`` is the claimed container it belongs to, if any."""

    process: GpuProcess
    state: str  # "enforced" | "unenforced" | "foreign"
    reason: str
    container: BoundContainer | None = None
    pod_uid: str = ""
    inner_pid: int = 0  # the process's PID in its container's namespace (0: unknown)
    needs_host_pid: bool = False  # attached to the region, but its slot lacks the host PID
    #: percent of the card's SMs in NVML's latest sample since the last check (0: none, idle);
    #: None when the check does not sample utilisation
    sm_util: float | None = None
    #: the process's start time when the snapshot was taken (clock ticks since boot; None:
    #: unknown): a kill for what was measured is pinned to it
    start_time: int | None = None


def classify(
    processes: Sequence[GpuProcess],
    containers: Sequence[BoundContainer],
    regions: Mapping[tuple[str, str], Sequence[DeviceUsage] | None],
    attribute_fn: Callable[[int], Attribution] = attribute,
) -> list[ProcessView]:
    """Classify each process. ``regions`` maps each container's :func:`limit_holder` ((pod UID,
    container name), or a DRA claim's region) to the region rows (``None``: no region)."""
    by_id: dict[tuple[str, str], list[BoundContainer]] = {}
    by_pod: dict[str, list[BoundContainer]] = {}
    for bc in containers:
        by_pod.setdefault(bc.pod_uid, []).append(bc)
        if bc.container_id:
            by_id.setdefault((bc.pod_uid, bc.container_id), []).append(bc)
    out = []
    for p in processes:
        a = attribute_fn(p.host_pid)
        # a cgroup without a container ID (v1 layouts): the pod's one claimed container
        c = _entry(by_id.get((a.pod_uid, a.container_id))
                   or (by_pod.get(a.pod_uid, []) if len(by_pod.get(a.pod_uid, ())) == 1 and not a.container_id
                       else None), p.uuid)
        if not p.compute:  # graphics only: counted (memory), never accused of escaping the shim
            state = "foreign" if c is None else "enforced"
            out.append(ProcessView(p, state, "graphics context only", c, a.pod_uid, a.inner_pid))
            continue
        if c is None:
            why = "pod without slices" if a.pod_uid else "not in a pod"
            out.append(ProcessView(p, "foreign", why, None, a.pod_uid, a.inner_pid))
            continue
        if p.uuid not in {d.uuid for d in c.devices}:
            out.append(
                ProcessView(p, "unenforced", "uses a card its claim does not name", c, a.pod_uid, a.inner_pid)
            )
            continue
        rows = regions.get(limit_holder(c))
        if rows is None:
            out.append(
                ProcessView(
                    p, "unenforced", "no shim region: the shim is not loaded", c, a.pod_uid, a.inner_pid
                )
            )
            continue
        mine = [r for r in rows if r.uuid == p.uuid] or list(rows)
        pids = {pid for r in mine for pid in r.pids}
        if _host_slot(mine, p.host_pid, a):
            out.append(ProcessView(p, "enforced", "", c, a.pod_uid, a.inner_pid))
            continue
        if not pids:  # the region lists no PIDs at all: cannot tell, do not accuse
            out.append(
                ProcessView(p, "enforced", "region lists no PIDs (unverified)", c, a.pod_uid, a.inner_pid)
            )
            continue
        if a.inner_pid and (a.inner_pid not in pids or not _same_process(mine, a, shared=bool(c.region_dir))):
            out.append(
                ProcessView(
                    p,
                    "unenforced",
                    f"PID {a.inner_pid} is not attached to the shim",
                    c,
                    a.pod_uid,
                    a.inner_pid,
                )
            )
            continue
        out.append(ProcessView(p, "enforced", "", c, a.pod_uid, a.inner_pid, needs_host_pid=True))
    return out


def _entry(entries: Sequence[BoundContainer] | None, uuid: str) -> BoundContainer | None:
    """Of a container's entries (one per claim: a container may consume two DRA claims, or have
    slices and a claim), the one naming card ``uuid``, else the first."""
    if not entries:
        return None
    return next((c for c in entries if any(d.uuid == uuid for d in c.devices)), entries[0])


def _host_slot(rows: Sequence[DeviceUsage], host_pid: int, a: Attribution) -> bool:
    """Whether a slot names ``host_pid`` for this very process: the agent writes a host PID only
    after matching the slot's start time, so a slot left by a killed process whose host PID was
    reused must not vouch for the newcomer (its start time differs)."""
    starts = [st for r in rows for _, st, _, h in r.slot_ids if h == host_pid]
    if starts:
        return any(not st or not a.start_time or st == a.start_time for st in starts)
    return host_pid in {h for r in rows for h in r.host_pids}  # rows without slot records


def _same_process(rows: Sequence[DeviceUsage], a: Attribution, shared: bool) -> bool:
    """Whether a slot of the region with ``a``'s inner PID is ``a``'s process: the same PID
    namespace where both sides know it, and in a ``shared`` region (a DRA claim's, written by the
    containers of several pods) the same start time where both know it. Such a region holds the
    same PID once per pod: a PID 1 outside the shim must not pass for another pod's attached
    PID 1, and the start time settles it without ptrace access to ``ns/pid`` (which the chart's
    agent lacks). The start time is not asked of a container's own region: a process of a nested
    PID namespace without its own ``/proc`` records the start time of the container's process of
    its number, and an honest one would be killed. Rows without slot records match on the PID."""
    slots = [(st, ns) for r in rows for pid, st, ns, _ in r.slot_ids if pid == a.inner_pid]
    if not slots:
        return True
    return any((not shared or not st or not a.start_time or st == a.start_time)
               and (not any(ns) or not any(a.pidns) or ns == a.pidns) for st, ns in slots)


def proc_start_time(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot; the same in every PID namespace)."""
    try:
        stat = (Path(proc) / str(pid) / "stat").read_bytes()  # bytes: comm need not be UTF-8
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def set_region_host_pid(region_file: Path, inner_pid: int, host_pid: int, start_time: int | None) -> bool:
    """Write ``host_pid`` into the region slot of ``inner_pid`` (:func:`kvgpu.shimregion.set_host_pid`).

    The slot must also carry ``start_time`` when given (guards against PID reuse). The shim uses
    the host PID to find its own process in NVML's per-process usage (a container has its own PID
    namespace). Returns True when a slot was updated; False if no slot matched or the file is not a
    region.
    """
    from kvgpu import shimregion

    return shimregion.set_host_pid(region_file, inner_pid, host_pid, start_time)


HostPidWriter = Callable[[BoundContainer, int, int], bool]  # (container, inner pid, host pid)

PodEvent = Callable[[BoundContainer, str], Awaitable[None]]


@dataclass
class EnforcementMonitor:
    """Periodic snapshot of classified processes; one pod event per unenforced container.

    ``processes()`` lists GPU processes (NVML, or a fake); ``containers()`` the claimed containers;
    ``read_region(pod_uid, container)`` the region rows or ``None``.
    """

    processes: Callable[[], list[GpuProcess]]
    containers: Callable[[], list[BoundContainer]]
    read_region: Callable[[str, str], Sequence[DeviceUsage] | None]
    #: the region rows of an entry with a ``region_dir`` (a DRA claim's; without it such entries
    #: count as having no region)
    read_dir: Callable[[str], Sequence[DeviceUsage] | None] | None = None
    on_unenforced: PodEvent | None = None
    #: the backstop (:meth:`kvgpu.agent.escapes.Backstop.end`): kills what escaped the shim or its
    #: limit in a snapshot and returns (process, why) of each; ``on_killed`` records an Event for each
    end_escapes: Callable[[Sequence[ProcessView]], Sequence[Any]] | None = None
    on_killed: Callable[[BoundContainer, str, str], Awaitable[None]] | None = None  # (container, reason, why)
    attribute_fn: Callable[[int], Attribution] = attribute
    start_time_fn: Callable[[int], int | None] = proc_start_time
    host_pid_writer: HostPidWriter | None = None
    utilization: Callable[[], dict[tuple[str, int], float]] | None = None
    #: per-process SM means between checks (polled every ``sample_s``): the views' ``sm_util``
    #: (else each process's latest sample from ``utilization``)
    sm_means: SmMeans | None = None
    sample_s: float = 1.0
    interval_s: float = 5.0
    host_pids_written: int = 0
    #: (pod uid, container, card uuid) -> SM percent of the container's processes (NVML samples)
    container_util: dict[tuple[str, str, str], float] = field(default_factory=dict)
    #: (pod uid, container, card uuid) -> (container, mean SM percent between the last two checks
    #: of every process the polls found in it, ended ones included: :class:`SmMeans`)
    container_sm: dict[tuple[str, str, str], tuple[BoundContainer, float]] = field(default_factory=dict)
    snapshot: list[ProcessView] = field(default_factory=list)
    _reported: set[tuple[str, str]] = field(default_factory=set)

    def _rows(self, c: BoundContainer) -> Sequence[DeviceUsage] | None:
        """``c``'s region rows: its own region, or its DRA claim's (none without ``read_dir``)."""
        if not c.region_dir:
            return self.read_region(c.pod_uid, c.container)
        return self.read_dir(c.region_dir) if self.read_dir is not None else None

    async def check(self) -> list[ProcessView]:
        """Take one snapshot (NVML and /proc reads happen in a worker thread)."""

        def work() -> list[ProcessView]:
            containers = self.containers()
            procs = self.processes()
            regions: dict[tuple[str, str], Sequence[DeviceUsage] | None] = {}
            for c in containers:
                if limit_holder(c) in regions:
                    continue  # a DRA claim's region, read for another of its containers
                try:
                    regions[limit_holder(c)] = self._rows(c)
                except Exception:
                    regions[limit_holder(c)] = None
            views = [replace(v, start_time=self.start_time_fn(v.process.host_pid)) if v.container else v
                     for v in classify(procs, containers, regions, self.attribute_fn)]
            if self.utilization is not None:
                samples = self.utilization()
                util: dict[tuple[str, str, str], float] = {}
                for v in views:
                    if v.container is None:
                        continue
                    k = (v.container.pod_uid, v.container.container, v.process.uuid)
                    util[k] = min(
                        100.0, util.get(k, 0.0) + samples.get((v.process.uuid, v.process.host_pid), 0.0)
                    )
                # Containers with slices but no process on a card use 0 % of it.
                for c in containers:
                    for d in c.devices:
                        util.setdefault((c.pod_uid, c.container, d.uuid), 0.0)
                self.container_util = util
                means = self.sm_means.take() if self.sm_means is not None else None
                per = samples if means is None else means[0]
                views = [replace(v, sm_util=per.get((v.process.uuid, v.process.host_pid), 0.0)) for v in views]
                self.container_sm = _by_container(means[1] if means else {}, containers)
            if self.host_pid_writer is not None:
                for v in views:
                    if not (v.needs_host_pid and v.container and v.inner_pid):
                        continue
                    rows = regions.get(limit_holder(v.container)) or []
                    if any(v.process.host_pid in r.host_pids for r in rows):
                        continue
                    try:
                        if self.host_pid_writer(v.container, v.inner_pid, v.process.host_pid):
                            self.host_pids_written += 1
                    except Exception as e:
                        log.debug("could not write host PID %d: %s", v.process.host_pid, e)
            return views

        views = await asyncio.to_thread(work)
        self.snapshot = views
        if self.end_escapes is not None:
            for k in await asyncio.to_thread(self.end_escapes, views):
                await self._killed_event(k.view, k.reason, k.why)
        live = {(c.pod_uid, c.container) for c in self.containers()}
        self._reported &= live
        for v in views:
            if v.state != "unenforced" or v.container is None:
                continue
            key = (v.container.pod_uid, v.container.container)
            if key in self._reported:
                continue
            self._reported.add(key)
            log.warning(
                "container %s/%s/%s runs unenforced on %s: %s",
                v.container.namespace,
                v.container.pod,
                v.container.container,
                v.process.uuid,
                v.reason,
            )
            if self.on_unenforced is not None:
                try:
                    await self.on_unenforced(v.container, f"card {v.process.uuid}: {v.reason}")
                except Exception:
                    log.exception("could not record the GPUUnenforced event")
        return views

    async def _killed_event(self, v: ProcessView, reason: str, why: str) -> None:
        if self.on_killed is None or v.container is None:
            return
        try:
            await self.on_killed(v.container, reason, why)
        except Exception:
            log.exception("could not record the event of a process the backstop killed")

    async def run(self) -> None:
        """Until cancelled (with ``sm_means``, its polls run beside the checks)."""
        sampler = asyncio.create_task(self._sample()) if self.sm_means is not None else None
        try:
            while True:
                try:
                    await self.check()
                except Exception:
                    log.exception("enforcement check failed")
                # jittered: a tenant that sees when checks come (their writes to its region) cannot
                # plan around the next one
                await asyncio.sleep(self.interval_s * random.uniform(0.7, 1.3))
        finally:
            if sampler is not None:
                sampler.cancel()

    async def _sample(self) -> None:
        assert self.sm_means is not None
        while True:
            try:
                await asyncio.to_thread(self.sm_means.sample)
            except Exception as e:
                log.debug("SM utilisation poll failed: %s", e)
            await asyncio.sleep(self.sample_s)
