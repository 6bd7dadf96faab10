"""Pure records of the agent: containers bound to this node (from claim annotations), the shim's
region usage (through ``kvgpu.shimregion``), region directory GC. Standard library and
``kvgpu.core`` only (``kvgpu.shimregion`` lazily), so GPU check scripts can import it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgpu.core import claimstr, keys

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
    index: int = 0  # position in the pod: init containers first, then app containers (HAMi's)
    #: the host directory of its region where it is not ``<region root>/<pod UID>/<container>``:
    #: a prepared DRA claim's, shared by every container of the claim (:mod:`kvgpu.agent.draregions`)
    region_dir: str = ""
    init: bool = False  # an init container (its slices count as the ledger counts init containers')


def _pair(v: Any) -> tuple[int, int]:
    """A recorded PID namespace ``(st_dev, st_ino)``; ``(0, 0)`` when there is none."""
    return (int(v[0]), int(v[1])) if v else (0, 0)


def limit_holder(c: BoundContainer) -> tuple[str, str]:
    """What a limit binds: ``(pod UID, container)``, or ``("", region_dir)`` for a DRA claim's
    container, whose limits are the claim's, shared by every container of every pod that
    consumes it (one region)."""
    return ("", c.region_dir) if c.region_dir else (c.pod_uid, c.container)


def container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """Container name -> runtime ID (without the ``<runtime>://`` prefix) of the containers the
    kubelet has created, init containers included (from the pod's status)."""
    status = pod.get("status") or {}
    return {cs.get("name"): str(cs.get("containerID")).split("://", 1)[-1]
            for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
            if cs.get("containerID")}


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
    ids = container_ids(pod)
    out = []
    inits = len(spec.get("initContainers") or [])
    for position, c in enumerate((spec.get("initContainers") or []) + (spec.get("containers") or [])):
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
                index=position,
                init=position < inits,
            )
        )
    return out


def pending_device_sets(containers: Iterable[BoundContainer]) -> list[list[str]]:
    """Card-UUID lists of bound containers the kubelet has not created yet (device plugin hint)."""
    return [[d.uuid for d in c.devices] for c in containers if not c.started]


# --------------------------------------------------------------------------- regions


@dataclass(frozen=True)
class DeviceUsage:
    """One card's usage in a container's region. Memory in MiB."""

    uuid: str
    limit_mib: int
    used_mib: float
    pids: tuple[int, ...] = ()
    host_pids: tuple[int, ...] = ()  # host PIDs of those processes where known (0s dropped)
    #: (PID, start time, PID namespace (st_dev, st_ino), host PID) of those processes, as their
    #: slots recorded them (0 and (0, 0): not recorded)
    slot_ids: tuple[tuple[int, int, tuple[int, int], int], ...] = ()


@dataclass(frozen=True)
class OomKills:
    """The region's record of the shim's ``ACTIVE_OOM_KILLER`` (container-wide; memory in MiB)."""

    count: int  # processes ended since the region was (re)initialised
    generation: int  # the region's generation (a re-initialised region counts from 0 again)
    last_pid: int = 0  # the last one's PID inside the container
    last_device: int = 0  # its card: position in the claim
    last_process_mib: float = 0.0  # what that process held on the card
    last_used_mib: float = 0.0  # the container's charge on the card at the kill (0: not recorded)
    last_limit_mib: float = 0.0  # the limit on that card


class RegionRows(list[DeviceUsage]):
    """What :func:`adapt_region` returns: the per-card rows, and the region's OOM-kill record
    (``None`` where the reader gave none, e.g. a fake that returns plain rows)."""

    oom: OomKills | None = None


RegionReader = Callable[[Path], Sequence[DeviceUsage] | None]


def _first(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(obj, Mapping) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def adapt_region(usage: Any) -> RegionRows:
    """Normalise what a region reader returned (``RegionUsage`` with ``devices``, or a list of
    per-device records, objects or dicts) into :class:`DeviceUsage` rows; a ``RegionUsage``'s
    ``oom_kills`` record comes along as the rows' ``oom``."""
    out = RegionRows()
    if usage is None:
        return out
    devs = _first(usage, "devices", default=usage)
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
        pids = _first(d, "pids", default=()) or ()
        procs = _first(d, "processes", default=()) or ()
        host = tuple(int(h) for p in procs if (h := _first(p, "host_pid", default=0)))
        ids = tuple((int(_first(p, "pid", default=0) or 0), int(_first(p, "start_time", default=0) or 0),
                     _pair(_first(p, "pidns", default=None)), int(_first(p, "host_pid", default=0) or 0))
                    for p in procs)
        out.append(
            DeviceUsage(
                str(_first(d, "uuid", default="")),
                int(limit or 0),
                float(used or 0),
                tuple(int(p) for p in pids),
                host,
                ids,
            )
        )
    if not isinstance(usage, Sequence) and (kills := _first(usage, "oom_kills")) is not None:
        dev = int(_first(usage, "oom_last_dev", default=0) or 0)
        out.oom = OomKills(
            int(kills),
            int(_first(usage, "generation", default=0) or 0),
            int(_first(usage, "oom_last_pid", default=0) or 0),
            dev,
            float(_first(usage, "oom_last_mib", default=0) or 0),
            float(_first(usage, "oom_last_used_mib", default=0) or 0),
            float(out[dev].limit_mib) if 0 <= dev < len(out) else 0.0,
        )
    return out


REGION_FILE = "vgpu.region"  # the shim's file in the container's region directory


def default_reader() -> RegionReader:
    """A reader of ``<dir>/vgpu.region`` through :func:`kvgpu.shimregion.read_region` (plain
    Python over the region's layout: nothing compiled to load). Returns ``None`` for a directory
    without a region (the container has not started CUDA); raises ``ValueError`` for a file that
    is not a region of this layout version.
    """
    from kvgpu import shimregion

    def read(path: Path) -> RegionRows | None:
        try:
            return adapt_region(shimregion.read_region(path / REGION_FILE))
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


def prepare_region_dir(
    root: str | os.PathLike[str], pod_uid: str, container: str, run_as: tuple[int | None, int | None]
) -> Path:
    """Create ``<root>/<pod-uid>/<container>``, the host side of the container's region mount,
    so that the container's own user can write it (the device plugin calls this from
    ``Allocate``, before the kubelet sets up the container's sub-path mount; a sub-path the kubelet
    creates itself is root's, mode 0755, and a non-root tenant's shim could not create its region).

    ``run_as``: ``(uid, gid)`` from the pod spec: the directory is theirs, mode 0770; where the image
    decides the user (``None``), mode 0777 — only this container mounts it. Needs ``CAP_CHOWN``
    for ``run_as`` (not ``CAP_FOWNER``: the mode is set before the owner). Raises ``OSError``;
    refuses (``ValueError``) a pod UID or container name that is not one path component."""
    for part in (pod_uid, container):
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise ValueError(f"not a path component: {part!r}")
    pod_dir = Path(root) / pod_uid
    pod_dir.mkdir(parents=True, exist_ok=True)
    d = pod_dir / container
    d.mkdir(exist_ok=True)
    uid, gid = run_as
    mode = 0o770 if uid is not None else 0o777
    # chmod while the agent still owns it (no CAP_FOWNER needed), then chown (CAP_CHOWN only:
    # the chart's agent drops every other capability).
    if d.stat().st_mode & 0o7777 != mode:
        d.chmod(mode)
    if uid is not None or gid is not None:
        os.chown(d, -1 if uid is None else uid, -1 if gid is None else gid)
    return d
