"""The node-wide compute schedule: the agent is its only writer (issue 14, "Shared compute schedule").

One file per card, ``<sched dir>/<UUID>.sched`` (host ``/var/lib/kvgpu/sched``, mounted read-only
at ``/var/run/kvgpu-sched`` in every sliced container), lists the compute window of each active
co-tenant of that card: its claim name, the window's offset and its length, in per mille of the
gate's period. The shim only reads it (``vgpu_sched_read`` in ``shim/vgpu_sched.c``) and
re-reads it every 100 ms; this module replaces it atomically (temp file, rename), mode 0644.

Who asks for what comes from the claims (pod annotations from the API: priority and cores);
each container's own region says only whether it is active: the shim stamps
``dev[d].sched_heartbeat_ns`` (CLOCK_MONOTONIC) on its gate's slow path, and an entry silent for
3 s drops out. The layout rule: priority 0 first, then by join time (when this agent first saw
the tenant active; the region's ``sched_joined_ns`` only orders tenants found active at the
agent's first pass); high-priority shares are granted as asked, scaled only if they alone exceed
the card; low-priority shares are scaled into what is left. An uncapped high-priority tenant
(cores 0 or 100, never delayed by its shim) is listed with what it uses: its region's measured
``sched_busy_pm`` plus headroom (:func:`uncapped_reservation`), so low priority gets what high
priority leaves; in its first second (before its shim has measured much) it is listed with the
whole card.

Layout (little endian): header ``magic u32 = 0x4853564b ("KVSH"), version u32 = 2, entry size
u32 = 328, count u32`` then ``count`` entries ``key[320] (NUL-padded claim name), offset_pm u32,
len_pm u32``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .usage import BoundContainer

log = logging.getLogger(__name__)

MAGIC = 0x4853564B  # "KVSH"
VERSION = 2
KEY_LEN = 320  # VGPU_CLAIM_LEN
MAX_ENTRIES = 32  # VGPU_SCHED_MAX
HEADER = struct.Struct("<IIII")  # magic, version, entry size, count
ENTRY = struct.Struct(f"<{KEY_LEN}sII")  # key, offset_pm, len_pm
STALE_NS = 3_000_000_000  # an entry silent this long drops out
UNCAPPED_WARMUP_NS = 1_000_000_000  # an uncapped high-priority tenant this new keeps the card
#: Seconds between passes. With the shim's own 100 ms refresh, an uncapped high-priority tenant
#: that starts to saturate takes the card back from low priority within about 0.3 s.
INTERVAL_S = 0.1
SUFFIX = ".sched"


@dataclass(frozen=True)
class Tenant:
    """One container asking for a share of one card."""

    key: str  # claim name "<namespace>/<name>": what the shim looks itself up by
    priority: int  # 0 high, 1 low (from the claim)
    share_pm: int  # cores per mille (from the claim)
    joined_ns: int  # orders tenants of one priority


@dataclass(frozen=True)
class Window:
    key: str
    offset_pm: int
    len_pm: int


def layout(tenants: Sequence[Tenant]) -> list[Window]:
    """The windows of one card's live tenants, in period order. Pure; the shim's former rule."""
    order = sorted(tenants, key=lambda t: (t.priority, t.joined_ns, t.key))[:MAX_ENTRIES]
    hi = sum(t.share_pm for t in order if t.priority == 0)
    lo = sum(t.share_pm for t in order if t.priority != 0)
    left = 1000 - min(hi, 1000)
    out, off = [], 0
    for t in order:
        if t.priority == 0:
            n = t.share_pm * 1000 // hi if hi > 1000 else t.share_pm
        else:
            n = t.share_pm * left // lo if lo > left else t.share_pm
        out.append(Window(t.key, off, n))
        off += n
    return out


def encode(windows: Sequence[Window]) -> bytes:
    ws = list(windows)[:MAX_ENTRIES]
    body = b"".join(ENTRY.pack(w.key.encode()[: KEY_LEN - 1], w.offset_pm, w.len_pm) for w in ws)
    return HEADER.pack(MAGIC, VERSION, ENTRY.size, len(ws)) + body


def decode(data: bytes) -> list[Window]:
    """The windows of a schedule file; ``ValueError`` for anything the shim would refuse too."""
    if len(data) < HEADER.size:
        raise ValueError("short schedule header")
    magic, version, esize, count = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or esize != ENTRY.size or count > MAX_ENTRIES:
        raise ValueError(f"not a kvgpu schedule v{VERSION} (magic {magic:#x}, version {version})")
    if len(data) < HEADER.size + count * ENTRY.size:
        raise ValueError("short schedule")
    out = []
    for i in range(count):
        key, off, n = ENTRY.unpack_from(data, HEADER.size + i * ENTRY.size)
        out.append(Window(key.split(b"\0", 1)[0].decode("utf-8", "replace"), off, n))
    return out


def _component(uuid: str) -> str:
    if not uuid or uuid in (".", "..") or "/" in uuid or "\0" in uuid:
        raise ValueError(f"not a card UUID: {uuid!r}")
    return uuid


def write_schedule(sched_dir: str | os.PathLike[str], uuid: str, data: bytes) -> Path:
    """Replace ``<sched_dir>/<uuid>.sched`` atomically with ``data``: a fresh temp file (never
    through a link a former tenant left in the directory), mode 0644, renamed over the old one."""
    d = Path(sched_dir)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    final = d / (_component(uuid) + SUFFIX)
    tmp = d / f".{uuid}{SUFFIX}.tmp"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return final


# --------------------------------------------------------------------------- who is active


@dataclass(frozen=True)
class TenantSource:
    """A container with slices, as the claim says (trusted), and where its region lies."""

    key: str
    priority: int
    cores: Mapping[str, int]  # card UUID -> percent of its SMs
    region_file: Path


@dataclass(frozen=True)
class Activity:
    joined_ns: int
    heartbeat_ns: int
    busy_pm: int = 0  # measured GPU time of the container's work, per mille of wall time


ActivityReader = Callable[[Path], Mapping[str, Activity]]


def read_activity(region_file: Path) -> dict[str, Activity]:
    """Card UUID -> the shim's activity stamps in a region; ``{}`` without a usable region."""
    from kvgpu import shimregion

    try:
        r = shimregion.read_region(region_file)
    except (FileNotFoundError, ValueError):
        return {}
    return {d.uuid: Activity(d.sched_joined_ns, d.sched_heartbeat_ns, d.sched_busy_pm) for d in r.devices if d.uuid}


def sources_of(containers: Iterable[BoundContainer], region_root: str | os.PathLike[str]) -> list[TenantSource]:
    """The tenants of this node from its bound containers (claim annotations from the API) and
    their region files on the host, ``<region root>/<pod UID>/<container>/vgpu.region``."""
    from .usage import REGION_FILE

    return [
        TenantSource(c.claim, c.priority, {d.uuid: d.cores for d in c.devices},
                     Path(region_root) / c.pod_uid / c.container / REGION_FILE)
        for c in containers
        if c.pod_uid and c.container and "/" not in c.pod_uid + c.container
    ]


def limited(cores: int) -> bool:
    """The shim gates 0 < cores < 100 (and measures, without delaying, uncapped priority 0)."""
    return 0 < cores < 100


def uncapped_reservation(busy_pm: int) -> int:
    """What an uncapped high-priority tenant keeps from low-priority co-tenants: its measured
    busy share with 10 % + 2 points of headroom (it is never delayed; low priority gets the rest)."""
    return max(0, min(1000, busy_pm * 11 // 10 + 20))


def plan(
    sources: Iterable[TenantSource],
    activity: Mapping[str, Mapping[str, Activity]],
    first_seen: Mapping[tuple[str, str], int],
    now: int,
    fresh_start: bool = False,
) -> tuple[dict[str, list[Window]], dict[tuple[str, str], int]]:
    """Each card's windows from the claims and the regions' heartbeats. Pure.

    ``activity``: tenant key -> card UUID -> stamps. ``first_seen``: (key, UUID) -> when this agent
    first saw the tenant active (the join order); the updated map is returned. ``fresh_start``:
    the agent's first pass, where tenants already active keep the order of their regions'
    join stamps (never later than ``now``)."""
    per_card: dict[str, list[Tenant]] = {}
    seen: dict[tuple[str, str], int] = {}
    for s in sources:
        acts = activity.get(s.key) or {}
        for uuid, cores in s.cores.items():
            a = acts.get(uuid)
            if not (limited(cores) or s.priority == 0) or a is None or not a.heartbeat_ns:
                continue
            if a.heartbeat_ns <= now and now - a.heartbeat_ns >= STALE_NS:
                continue
            joined = first_seen.get((s.key, uuid))
            if joined is None:
                joined = min(a.joined_ns or now, now) if fresh_start else now
            seen[(s.key, uuid)] = joined
            # An uncapped high-priority tenant is listed with what it uses; until its shim has
            # measured that for a while (its first second, as this agent saw it), with the card.
            warm = now - joined >= UNCAPPED_WARMUP_NS
            share = cores * 10 if limited(cores) else uncapped_reservation(a.busy_pm) if warm else 1000
            per_card.setdefault(uuid, []).append(Tenant(s.key, s.priority, share, joined))
    return {u: layout(ts) for u, ts in per_card.items()}, seen


def _identity(sched_dir: Path, uuid: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(Path(sched_dir) / (uuid + SUFFIX))
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class Scheduler:
    """Writes every card's schedule file from the claims and the regions.

    ``sources``: the containers with slices on this node now. ``cards``: UUIDs to keep a file for
    (a card without active tenants gets an empty schedule, so nothing stale stays behind)."""

    sched_dir: Path
    sources: Callable[[], Iterable[TenantSource]]
    cards: Callable[[], Iterable[str]] = lambda: ()
    read: ActivityReader = read_activity
    clock: Callable[[], int] = time.monotonic_ns  # CLOCK_MONOTONIC, as the shim's stamps
    _first_seen: dict[tuple[str, str], int] = field(default_factory=dict)
    _written: dict[str, tuple[bytes, tuple[int, int, int]]] = field(default_factory=dict)
    _passes: int = 0

    def tick(self) -> dict[str, list[Window]]:
        """One pass: read, lay out, write the files whose content changed. Returns the layouts."""
        srcs = list(self.sources())
        activity: dict[str, dict[str, Activity]] = {}
        for s in srcs:  # one key on several cards (a VGPUClaim and a ResourceClaim of one name): merged
            activity.setdefault(s.key, {}).update(self.read(s.region_file))
        layouts, self._first_seen = plan(srcs, activity, self._first_seen, self.clock(), self._passes == 0)
        self._passes += 1
        for uuid in set(self.cards()) | set(layouts) | set(self._written):
            data = encode(layouts.get(uuid, []))
            last = self._written.get(uuid)
            # Rewritten when the content changes, and when the file is not the one this agent
            # wrote (a pod created before the read-only mount can still replace it).
            if last is not None and last[0] == data and _identity(self.sched_dir, uuid) == last[1]:
                continue
            try:
                write_schedule(self.sched_dir, uuid, data)
                self._written[uuid] = (data, _identity(self.sched_dir, uuid) or (0, 0, 0))
            except (OSError, ValueError) as e:
                log.warning("cannot write the compute schedule of %s: %s", uuid, e)
        return layouts

    def serve(self, stop: threading.Event, interval_s: float = INTERVAL_S) -> None:
        """Tick until ``stop`` is set (a thread; the tests run the agent's writer this way)."""
        while not stop.is_set():
            self.tick()
            stop.wait(interval_s)

    async def run(self, interval_s: float = INTERVAL_S) -> None:
        while True:
            try:
                await asyncio.to_thread(self.tick)
            except Exception:  # a bad region must not stop everyone's schedule
                log.exception("compute schedule pass failed")
            await asyncio.sleep(interval_s)


__all__ = [
    "INTERVAL_S",
    "Activity",
    "Scheduler",
    "Tenant",
    "TenantSource",
    "Window",
    "decode",
    "encode",
    "layout",
    "plan",
    "read_activity",
    "sources_of",
    "uncapped_reservation",
    "write_schedule",
]
