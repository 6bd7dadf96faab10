"""The shim's shared region (``<KVGPU_REGION_DIR>/vgpu.region``) read and annotated in plain
Python: :mod:`ctypes` structures over a copy of the file read with ``pread`` (never a mapping:
the container owns the file and could truncate it under the agent), no compiled module.

The layout is the C one of ``shim/vgpu.h`` (``struct vgpu_region``, ``vgpu_region_dev``,
``vgpu_slot``; documented in ``docs/shim.md``, "Shared region"). ``tests/shim/test_region_layout.py``
compiles the header and compares every field's offset and size and each struct's size with the
structures here, so the two cannot drift apart.

What the node agent does with a region:

- :func:`read_region` -> :class:`RegionUsage`: a snapshot (a copy of the file, no slot, no lock);
- :func:`set_host_pid`: the host PID of a container process into its slot;
- :func:`slot_identities` -> :class:`SlotIdentity`: who holds each slot (PID, start time, PID
  namespace), and :func:`mark_slot_dead`: the agent's word that a slot's process is gone (the
  shim reaps a slot of another PID namespace only then);

Units: memory in MiB (float, from the region's bytes), compute in percent of the card's SMs,
times in CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = 0x5247564B  # "KVGR" little endian (VGPU_REGION_MAGIC)
VERSION = 2  # VGPU_REGION_VERSION
MAX_DEV = 16  # VGPU_MAX_DEV
MAX_SLOTS = 128  # VGPU_MAX_SLOTS
UUID_LEN = 96  # VGPU_UUID_LEN
CLAIM_LEN = 320  # VGPU_CLAIM_LEN
_MIB = 1024 * 1024

u32, i32, u64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64


class RegionDev(ctypes.Structure):
    """``struct vgpu_region_dev`` (168 bytes). ``_Atomic uint64_t`` fields are plain u64 here:
    same size and alignment on the ABIs the shim builds for."""

    _fields_ = [
        ("uuid", ctypes.c_char * UUID_LEN),
        ("limit", u64),
        ("cores", u32),
        ("unused", u32),
        ("used", u64),
        ("credit_vt", u64),
        ("ctx_bytes", u64),
        ("sched_joined_ns", u64),
        ("sched_heartbeat_ns", u64),
        ("sched_busy_pm", u64),
        ("reserved", u64 * 1),
    ]


class Slot(ctypes.Structure):
    """``struct vgpu_slot`` (304 bytes): one process of the container."""

    _fields_ = [
        ("pid", i32),
        ("host_pid", i32),
        ("start_time", u64),
        ("data", u64 * MAX_DEV),
        ("overhead", u64 * MAX_DEV),
        ("pidns_dev", u64),
        ("pidns_ino", u64),
        ("dead_key", u64),
        ("reserved", u64 * 1),
    ]


class Region(ctypes.Structure):
    """``struct vgpu_region`` (42080 bytes). ``lock`` is the robust ``pthread_mutex_t`` (a
    64-byte union in C), which this module never takes."""

    _fields_ = [
        ("magic", u32),
        ("version", u32),
        ("size", u32),
        ("ndev", u32),
        ("max_slots", u32),
        ("priority", u32),
        ("generation", u64),
        ("claim", ctypes.c_char * CLAIM_LEN),
        ("lock", ctypes.c_char * 64),
        ("oom_kills", u64),
        ("oom_last_pid", i32),
        ("oom_last_dev", u32),
        ("oom_last_bytes", u64),
        ("oom_last_used", u64),
        ("reserved", u64 * 4),
        ("dev", RegionDev * MAX_DEV),
        ("slot", Slot * MAX_SLOTS),
    ]


REGION_SIZE = ctypes.sizeof(Region)


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """One process of the container on one card (from its region slot)."""

    pid: int  # PID inside the container
    host_pid: int  # host PID if the agent filled it, else 0
    data_mib: float  # counted allocations
    overhead_mib: float  # context/module/pool overhead charged after NVML reconciliation
    pidns: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of its /proc/<pid>/ns/pid; (0, 0): unknown
    start_time: int = 0  # clock ticks since boot (/proc/<pid>/stat field 22); 0: unknown

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


def _valid(r: Region) -> bool:
    """The shim's own test (``valid()`` in vgpu_region.c), plus a sane ``ndev``."""
    return (r.magic == MAGIC and r.version == VERSION and r.size == REGION_SIZE
            and r.max_slots == MAX_SLOTS and r.ndev <= MAX_DEV)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _open(path: Path, flags: int) -> int:
    """Open a region file the container may have replaced: no symlink is followed and a FIFO does
    not block (``O_NOFOLLOW | O_NONBLOCK``), and it must be a regular file. FileNotFoundError and
    PermissionError pass; anything else that is not a plain file is a ValueError."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"{path}: not a kvgpu region ({e.strerror})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a kvgpu region (not a regular file)")
    return fd


def _read(fd: int, path: Path) -> Region:
    """The region at ``fd`` by ``pread``: never a mapping, which a container that truncates its
    file under the agent would turn into SIGBUS. ValueError if short."""
    data = os.pread(fd, REGION_SIZE, 0)
    if len(data) < REGION_SIZE:
        raise ValueError(f"{path}: not a kvgpu region of version {VERSION} (smaller than {REGION_SIZE} bytes)")
    return Region.from_buffer_copy(data)


def _snapshot(path: Path) -> Region:
    """A copy of the region in ``path``; FileNotFoundError if missing, ValueError if not a region."""
    fd = _open(path, os.O_RDONLY)
    try:
        r = _read(fd, path)
    finally:
        os.close(fd)
    if not _valid(r):
        raise ValueError(f"{path}: not a kvgpu region of version {VERSION} "
                         f"(magic {r.magic:#x}, version {r.version}, size {r.size})")
    return r


def read_region(path: str | os.PathLike[str]) -> RegionUsage:
    """Read a region file without taking a slot or the lock.

    Raises ``FileNotFoundError`` if it does not exist (``PermissionError`` if unreadable) and
    ``ValueError`` if it is not a kvgpu region of this layout version, or not a regular file (a
    symlink, a FIFO: the container owns the directory). The file is copied in one ``pread``: the
    counters may be a few microseconds apart.
    """
    p = Path(path)
    r = _snapshot(p)
    live = [s for s in r.slot if s.pid]
    devices = []
    for d in range(r.ndev):
        rd = r.dev[d]
        devices.append(DeviceUsage(
            index=d,
            uuid=_text(rd.uuid),
            limit_mib=rd.limit / _MIB,
            used_mib=rd.used / _MIB,
            cores=rd.cores,
            processes=tuple(ProcessUsage(s.pid, s.host_pid, s.data[d] / _MIB, s.overhead[d] / _MIB,
                                         (s.pidns_dev, s.pidns_ino), s.start_time) for s in live),
            sched_joined_ns=rd.sched_joined_ns,
            sched_heartbeat_ns=rd.sched_heartbeat_ns,
            sched_busy_pm=rd.sched_busy_pm,
            context_mib=rd.ctx_bytes / _MIB,
        ))
    return RegionUsage(
        path=str(p), claim=_text(r.claim), priority=r.priority, generation=r.generation,
        devices=tuple(devices), oom_kills=r.oom_kills, oom_last_pid=r.oom_last_pid,
        oom_last_dev=r.oom_last_dev, oom_last_mib=r.oom_last_bytes / _MIB,
        oom_last_used_mib=r.oom_last_used / _MIB,
    )


def slot_key(pid: int, start_time: int) -> int:
    """``VGPU_SLOT_KEY`` of vgpu.h: ``(pid << 42) | (start_time mod 2**42)`` (a u64)."""
    return ((pid & 0xFFFFFFFF) << 42 | (start_time & ((1 << 42) - 1))) & 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class SlotIdentity:
    """Who holds a taken slot: ``pid`` in its PID namespace ``(pidns_dev, pidns_ino)`` (st_dev,
    st_ino of its ``/proc/<pid>/ns/pid``; ``(0, 0)``: unknown), ``start_time`` in clock ticks since
    boot, ``host_pid`` as the agent wrote it (0: not yet), ``dead``: the agent's mark is on it."""

    index: int
    pid: int
    start_time: int
    pidns_dev: int
    pidns_ino: int
    host_pid: int
    dead: bool


def slot_identities(path: str | os.PathLike[str]) -> list[SlotIdentity]:
    """The taken slots of the region at ``path`` (a snapshot, no lock). Raises like
    :func:`read_region` (``FileNotFoundError``, ``ValueError``)."""
    r = _snapshot(Path(path))
    return [SlotIdentity(i, s.pid, s.start_time, s.pidns_dev, s.pidns_ino, s.host_pid,
                         s.dead_key != 0 and s.dead_key == slot_key(s.pid, s.start_time))
            for i, s in enumerate(r.slot) if s.pid]


def _store_u32(path: Path, offset_of: Callable[[Region], int | None], value: int,
               ctype: type[ctypes.c_uint32] | type[ctypes.c_uint64] = ctypes.c_uint32) -> bool:
    """Open ``path`` read-write, check it is a region, and store ``value`` as one aligned 32-bit
    (``ctype`` u64: 64-bit) word at the offset ``offset_of(snapshot)`` picks (None: store
    nothing). True if stored."""
    try:
        fd = _open(path, os.O_RDWR)
    except (FileNotFoundError, ValueError):
        return False
    try:
        r = _read(fd, path)
        off = offset_of(r) if _valid(r) else None
        if off is None:
            return False
        word = ctype(value & (0xFFFFFFFF if ctype is ctypes.c_uint32 else 0xFFFFFFFFFFFFFFFF))
        return os.pwrite(fd, bytes(word), off) == ctypes.sizeof(ctype)  # one aligned word
    except ValueError:
        return False
    finally:
        os.close(fd)


_SLOT0 = Region.slot.offset
_HOST_PID = Slot.host_pid.offset
_DEAD_KEY = Slot.dead_key.offset


def set_host_pid(path: str | os.PathLike[str], inner_pid: int, host_pid: int, start_time: int | None) -> bool:
    """Write ``host_pid`` into the slot of container PID ``inner_pid`` (and ``start_time``, when
    given: a guard against PID reuse). True when a slot was changed; False if none matched, it
    already held ``host_pid``, or the file is missing or not a region.

    Without the region's lock (a robust pthread mutex, which needs the shim's recovery code): the
    slot is checked in a snapshot and the 32-bit ``host_pid`` stored alone. If the process left and
    another took the slot in between, that one carries a wrong host PID until the agent's next
    pass writes its own (the agent rewrites any slot whose ``host_pid`` differs); the shim only
    uses it to find its NVML per-process usage, and a PID that is not its own matches nothing.
    """

    def pick(r: Region) -> int | None:
        for s in range(min(int(r.max_slots), MAX_SLOTS)):
            slot = r.slot[s]
            if slot.pid == inner_pid and (start_time is None or slot.start_time == start_time):
                return None if slot.host_pid == host_pid else _SLOT0 + s * ctypes.sizeof(Slot) + _HOST_PID
        return None

    return _store_u32(Path(path), pick, host_pid)


def _slot_offset(r: Region, index: int, pid: int, start_time: int, field_offset: int) -> int | None:
    if not 0 <= index < min(int(r.max_slots), MAX_SLOTS):
        return None
    slot = r.slot[index]
    if slot.pid != pid or slot.start_time != start_time:
        return None
    return _SLOT0 + index * ctypes.sizeof(Slot) + field_offset


def set_slot_host_pid(path: str | os.PathLike[str], index: int, pid: int, start_time: int, host_pid: int) -> bool:
    """Write ``host_pid`` into slot ``index`` if it still holds (``pid``, ``start_time``) and
    does not carry it already. True when stored. (Same lock-free store as :func:`set_host_pid`.)"""

    def pick(r: Region) -> int | None:
        off = _slot_offset(r, index, pid, start_time, _HOST_PID)
        return None if off is None or r.slot[index].host_pid == host_pid else off

    return _store_u32(Path(path), pick, host_pid)


def mark_slot_dead(path: str | os.PathLike[str], index: int, pid: int, start_time: int) -> bool:
    """Mark slot ``index`` dead: store ``slot_key(pid, start_time)`` in its ``dead_key`` (one
    aligned 64-bit store, no lock). The shim frees the slot at its next reap only while the slot
    still holds that (pid, start time): a process that took the slot in between carries another
    key, so a late mark cannot drop a live process's charge. True when stored; False if the slot
    no longer holds that process or the file is missing or not a region."""
    return _store_u32(Path(path), lambda r: _slot_offset(r, index, pid, start_time, _DEAD_KEY),
                      slot_key(pid, start_time), ctypes.c_uint64)
