"""Python view of the shim's pure core (``shim/_build/_vgpucore``, built by ``shim/build.py``).

The node agent's usage exporter reads each container's shared region with :func:`read_region`;
the tests drive the claim parser, the region and the compute gate through :func:`core`.

Units: memory in MiB (float, from the region's bytes), compute in percent of the card's SMs.
The region layout is documented in ``docs/shim.md``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

_MIB = 1024 * 1024
_BUILD = Path(__file__).resolve().parents[2] / "shim" / "_build"
_core: ModuleType | None = None


class ShimCoreUnavailable(ImportError):
    """The cffi module is not built and cannot be built here (no shim sources or compiler)."""


def core() -> ModuleType:
    """Return the cffi module (``.ffi``, ``.lib``), building it from ``shim/`` if needed."""
    global _core
    if _core is not None:
        return _core
    try:
        _core = importlib.import_module("_vgpucore")
        return _core
    except ImportError:
        pass
    if str(_BUILD) not in sys.path:
        sys.path.insert(0, str(_BUILD))
    try:
        _core = importlib.import_module("_vgpucore")
        return _core
    except ImportError:
        build = _BUILD.parent / "build.py"
        if not build.exists():
            raise ShimCoreUnavailable("kvgpu shim core module _vgpucore is not built") from None
        subprocess.run([sys.executable, str(build)], check=True, capture_output=True)
        importlib.invalidate_caches()
        _core = importlib.import_module("_vgpucore")
        return _core


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """One process of the container on one card (from its region slot)."""

    pid: int  # PID inside the container
    host_pid: int  # host PID if the agent filled it, else 0
    data_mib: float  # counted allocations
    overhead_mib: float  # context/module/pool overhead charged after NVML reconciliation

    @property
    def used_mib(self) -> float:
        return self.data_mib + self.overhead_mib


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One card of the container's claim."""

    index: int  # position in the claim (HAMi mode: CUDA device index)
    uuid: str  # "" until a process of the container has mapped it (HAMi mode)
    limit_mib: float  # 0 = no memory limit
    used_mib: float  # charged to the container (data + overhead of live processes)
    cores: int  # compute limit, percent of SMs (0 = none)
    sm_util: int | None  # last known SM utilisation of the container, percent
    processes: tuple[ProcessUsage, ...] = field(default=())
    sched_joined_ns: int = 0  # compute gate: CLOCK_MONOTONIC when it became active (0 = never)
    sched_heartbeat_ns: int = 0  # compute gate: its last schedule refresh (the agent's liveness)
    sched_busy_pm: int = 0  # compute gate: measured GPU time of its work, per mille of wall time
    context_mib: float = 0  # what a context took on this card (learnt by the first process)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes)


@dataclass(frozen=True, slots=True)
class RegionUsage:
    """A snapshot of one container's shared region."""

    path: str
    claim: str  # "<namespace>/<name>" of the VGPUClaim, "" in HAMi mode
    priority: int
    generation: int  # bumped whenever the region file is (re)initialised
    devices: tuple[DeviceUsage, ...]
    oom_kills: int = 0  # processes the shim's ACTIVE_OOM_KILLER ended (0 again after a re-init)
    oom_last_pid: int = 0  # the last one: its PID inside the container,
    oom_last_dev: int = 0  # its card (position in the claim),
    oom_last_mib: float = 0.0  # what it held on that card,
    oom_last_used_mib: float = 0.0  # and the container's charge there then (0: an older shim)


def _s(ffi: Any, arr: Any) -> str:
    return bytes(ffi.string(arr)).decode("utf-8", "replace")


def read_region(path: str | Path) -> RegionUsage:
    """Read a region file (``<KVGPU_REGION_DIR>/vgpu.region``) without taking a slot.

    Raises ``FileNotFoundError`` if it does not exist and ``ValueError`` if it is not a
    kvgpu region of this layout version. Counters are read without the lock: each value is
    consistent, the set may be a few microseconds apart.
    """
    m = core()
    ffi, lib = m.ffi, m.lib
    h = ffi.new("struct vgpu_region_handle *")
    if lib.vgpu_region_attach(h, str(path).encode()) != 0:
        err = ffi.errno
        if not Path(path).exists():
            raise FileNotFoundError(str(path))
        raise ValueError(f"{path}: not a kvgpu region of this version (errno {err})")
    try:
        r = h.r
        devices = []
        for d in range(r.ndev):
            rd = r.dev[d]
            procs = tuple(
                ProcessUsage(
                    pid=s.pid,
                    host_pid=s.host_pid,
                    data_mib=s.data[d] / _MIB,
                    overhead_mib=s.overhead[d] / _MIB,
                )
                for s in r.slot
                if s.pid
            )
            devices.append(
                DeviceUsage(
                    index=d,
                    uuid=_s(ffi, rd.uuid),
                    limit_mib=rd.limit / _MIB,
                    used_mib=lib.vgpu_region_used(r, d) / _MIB,
                    cores=rd.cores,
                    sm_util=None if rd.sm_util == 0xFFFFFFFF else rd.sm_util,
                    processes=procs,
                    sched_joined_ns=rd.sched_joined_ns,
                    sched_heartbeat_ns=rd.sched_heartbeat_ns,
                    sched_busy_pm=rd.sched_busy_pm,
                    context_mib=rd.ctx_bytes / _MIB,
                )
            )
        return RegionUsage(
            path=str(path),
            claim=_s(ffi, r.claim),
            priority=r.priority,
            generation=r.generation,
            devices=tuple(devices),
            oom_kills=r.oom_kills,
            oom_last_pid=r.oom_last_pid,
            oom_last_dev=r.oom_last_dev,
            oom_last_mib=r.oom_last_bytes / _MIB,
            oom_last_used_mib=r.oom_last_used / _MIB,
        )
    finally:
        lib.vgpu_region_close(h)
