"""Region slots of other PID namespaces: the node agent finds each slot's host process.

One shim region can be shared by processes of several PID namespaces: a DRA ResourceClaim's
region is mounted by every container that references the claim (two pods, or two containers of
a pod without ``shareProcessNamespace``). A shim judges by ``/proc`` only the slots of its own
namespace; a slot of another stays charged until this module, which sees every namespace
(``hostPID``), says its process is gone (docs/shim.md, "Slots").

For each taken slot (:func:`kvgpu.shimregion.slot_identities`: container PID, start time and
PID namespace as ``(st_dev, st_ino)`` of ``/proc/<pid>/ns/pid``) the host process is the one
whose ``ns/pid`` is the slot's namespace, whose innermost ``NSpid`` is the slot's PID and whose
start time is the slot's. Then:

- found: its host PID is written into the slot (:func:`kvgpu.shimregion.set_slot_host_pid`);
- not found, and the namespace has no process at all, or every process of it was read and none
  matches: the slot is marked dead (:func:`kvgpu.shimregion.mark_slot_dead`), and the shim
  frees it at its next reap;
- anything unknown (a namespace of ``(0, 0)``, a process of the namespace that could not be
  read, a process whose namespace cannot be read and that has the slot's PID and start time):
  nothing is marked, the slot stays charged (never fail open).

The regions are snapshotted before ``/proc`` is read, so a process that held a slot in the
snapshot and is missing from ``/proc`` has ended. One pass stats ``ns/pid`` of every host
process once and reads ``status``/``stat`` only of processes in namespaces that hold slots.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvgpu import shimregion

log = logging.getLogger(__name__)

PidNs = tuple[int, int]  # (st_dev, st_ino) of /proc/<pid>/ns/pid


class _Unreadable(Exception):
    """A process of the namespace exists but could not be read (not: it ended)."""


def _innermost_pid(proc: Path, host_pid: int) -> int | None:
    """Last ``NSpid`` of ``/proc/<host_pid>/status``; None if the process ended (zombies count as
    ended, as in the shim); :class:`_Unreadable` for any other failure."""
    try:
        # bytes: the process names its own comm, and it need not be UTF-8
        text = (proc / str(host_pid) / "status").read_bytes().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as e:
        raise _Unreadable(str(e)) from e
    state = ns = None
    for line in text.splitlines():
        if line.startswith("State:"):
            state = line.split()[1:2]
        elif line.startswith("NSpid:"):
            ns = line.split()[1:]
    if state in (["Z"], ["X"]):
        return None
    if not ns:
        raise _Unreadable(f"/proc/{host_pid}/status has no NSpid")
    try:
        return int(ns[-1])
    except ValueError as e:
        raise _Unreadable(f"/proc/{host_pid}/status: NSpid {ns!r}") from e


def _start_time(proc: Path, host_pid: int) -> int | None:
    """Field 22 of ``/proc/<host_pid>/stat``; None if the process ended."""
    try:
        stat = (proc / str(host_pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as e:
        raise _Unreadable(str(e)) from e
    try:
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (ValueError, IndexError) as e:
        raise _Unreadable(f"/proc/{host_pid}/stat is malformed") from e


@dataclass
class HostScan:
    """Host PIDs per PID namespace (only the wanted ones), and the (innermost PID, start time)
    of each process whose ``ns/pid`` could not be stat'ed (no ptrace access to it): such a
    process may belong to any namespace, so a slot with its PID and start time is never marked."""

    by_ns: dict[PidNs, list[int]]
    opaque: set[tuple[int, int]]


def host_namespaces(proc: Path, wanted: set[PidNs]) -> HostScan:
    """Scan ``proc`` once (a process that ends during the scan is left out). Raises
    :class:`_Unreadable` when a process can be read neither by ``ns/pid`` nor by ``status``."""
    scan = HostScan({ns: [] for ns in wanted}, set())
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(proc / entry.name / "ns" / "pid")
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            inner = _innermost_pid(proc, int(entry.name))
            start = _start_time(proc, int(entry.name)) if inner is not None else None
            if inner is not None and start is not None:
                scan.opaque.add((inner, start))
            continue
        key = (st.st_dev, st.st_ino)
        if key in scan.by_ns:
            scan.by_ns[key].append(int(entry.name))
    return scan


@dataclass
class _Namespace:
    """The processes of one PID namespace, read lazily: innermost PID -> (host PID, start time)."""

    proc: Path
    host_pids: list[int]
    _index: dict[int, tuple[int, int]] | None = None
    complete: bool = True  # every process was read (or had ended)

    def find(self, pid: int, start_time: int) -> int | None:
        if self._index is None:
            self._index = {}
            for h in self.host_pids:
                try:
                    inner = _innermost_pid(self.proc, h)
                    st = _start_time(self.proc, h) if inner is not None else None
                except _Unreadable as e:
                    log.debug("slot resolution: %s", e)
                    self.complete = False
                    continue
                if inner is not None and st is not None:
                    self._index[inner] = (h, st)
        hit = self._index.get(pid)
        return hit[0] if hit is not None and hit[1] == start_time else None


@dataclass
class Pass:
    """What one pass did (counts of slots)."""

    host_pids_written: int = 0
    marked_dead: int = 0
    unresolved: int = 0  # left charged: namespace unknown or a process of it unreadable


def resolve(region_files: Iterable[Path], proc: str | os.PathLike[str] = "/proc") -> Pass:
    """One pass over ``region_files`` (missing or non-region files are skipped). Never raises for
    a region or a process; returns the counts."""
    snaps: list[tuple[Path, list[shimregion.SlotIdentity]]] = []
    for f in region_files:
        try:
            snaps.append((f, [s for s in shimregion.slot_identities(f) if not s.dead]))
        except (OSError, ValueError):
            continue
    result = Pass()
    wanted = {(s.pidns_dev, s.pidns_ino) for _, slots in snaps for s in slots if s.pidns_ino}
    if not wanted:
        result.unresolved = sum(len(slots) for _, slots in snaps)
        return result
    root = Path(proc)
    try:
        scan = host_namespaces(root, wanted)
    except (_Unreadable, OSError) as e:
        log.warning("slot resolution skipped: %s", e)
        result.unresolved = sum(len(slots) for _, slots in snaps)
        return result
    by_ns = {k: _Namespace(root, v) for k, v in scan.by_ns.items()}
    for f, slots in snaps:
        for s in slots:
            ns = by_ns.get((s.pidns_dev, s.pidns_ino)) if s.pidns_ino else None
            _settle(f, s, ns, (s.pid, s.start_time) in scan.opaque, result)
    return result


def _settle(f: Path, s: shimregion.SlotIdentity, ns: _Namespace | None, maybe_alive: bool, result: Pass) -> None:
    """Write the host PID of slot ``s`` or mark it dead; ``maybe_alive``: a process of unknown
    namespace has its PID and start time."""
    if ns is None:
        result.unresolved += 1
        return
    host = ns.find(s.pid, s.start_time)
    if host is not None:
        if s.host_pid != host and shimregion.set_slot_host_pid(f, s.index, s.pid, s.start_time, host):
            result.host_pids_written += 1
        return
    if not ns.complete or maybe_alive:
        result.unresolved += 1
        return
    if shimregion.mark_slot_dead(f, s.index, s.pid, s.start_time):
        result.marked_dead += 1
        log.info("region %s: slot %d (PID %d of PID namespace %d) has no process left: marked dead",
                 f, s.index, s.pid, s.pidns_ino)


@dataclass
class SlotResolver:
    """Runs :func:`resolve` every ``interval_s`` over ``files()`` (the regions the agent knows)."""

    files: Callable[[], list[Path]]
    interval_s: float = 5.0
    proc: str = "/proc"
    totals: Pass = field(default_factory=Pass)

    async def check(self) -> Pass:
        p = await asyncio.to_thread(lambda: resolve(self.files(), self.proc))
        self.totals.host_pids_written += p.host_pids_written
        self.totals.marked_dead += p.marked_dead
        return p

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("region slot resolution failed")
            await asyncio.sleep(self.interval_s)
