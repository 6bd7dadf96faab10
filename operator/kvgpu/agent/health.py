"""Card health: XID events and NVML errors mark a card unhealthy; it returns when healthy again.

Three parts:

- :class:`HealthState` — the pure state machine. Observations go in (an XID, an NVML error, a
  periodic probe result); :class:`HealthChange` transitions come out. A card turns unhealthy at
  the first critical XID or failed probe (reason e.g. ``XID 79: GPU has fallen off the bus``) and
  turns healthy again only after a probe succeeds and no bad observation came for
  ``recovery_s`` seconds (HAMi never recovers without a restart). XIDs caused by applications
  (13, 31, 43, 45, 68, 109 — an application fault, not the card's) are ignored, as the NVIDIA
  device plugin does by default; more can be ignored with ``ignored_xids``.
- Sources produce observations: :class:`NvmlHealthSource` (a thread blocked in
  ``nvmlEventSetWait`` on ``XidCriticalError``/ECC events of every card, plus a probe every
  ``probe_interval_s`` — handle by UUID, memory query, pending page retirement / row remapping,
  which need a reset) and :class:`SimulatedHealthSource` (faults injected by tests, or read from
  a JSON file ``{"<uuid or index>": "<reason>"}`` for demos).
- :class:`HealthMonitor` — the asyncio side: feeds a source's observations into the state and
  calls ``on_change`` for every transition (the agent then re-publishes the inventory, updates
  the device plugin's list and posts a Node Event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvgpu.core.inventory import NodeInventory

log = logging.getLogger(__name__)

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

XID_TEXT = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def xid_reason(xid: int) -> str:
    text = XID_TEXT.get(xid)
    return f"XID {xid}: {text}" if text else f"XID {xid}"


@dataclass(frozen=True)
class Observation:
    """One health observation. ``kind``: ``xid`` (``xid`` set), ``error`` or ``probe``
    (``ok`` set). ``uuid`` is ``""`` for errors that concern every card."""

    kind: str
    uuid: str
    xid: int = 0
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True)
class HealthChange:
    """A card's transition; ``at`` is the monotonic-clock time of the observation."""

    uuid: str
    healthy: bool
    reason: str
    at: float


@dataclass
class _Card:
    healthy: bool = True
    reason: str = ""
    last_bad: float = float("-inf")


@dataclass
class HealthState:
    """Health of the node's cards (see the module docstring for the rules)."""

    uuids: Iterable[str]
    recovery_s: float = 60.0
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    cards: dict[str, _Card] = field(init=False)

    def __post_init__(self) -> None:
        self.cards = {u: _Card() for u in self.uuids}

    def set_cards(self, uuids: Iterable[str]) -> None:
        """Track exactly ``uuids`` (new cards start healthy; state of known cards is kept)."""
        self.cards = {u: self.cards.get(u, _Card()) for u in uuids}

    def _bad(self, uuid: str, reason: str, now: float, override: bool) -> HealthChange | None:
        # A new XID replaces the reason of an unhealthy card; other observations keep the first.
        c = self.cards.get(uuid)
        if c is None:
            return None
        c.last_bad = now
        if c.healthy or (override and c.reason != reason):
            c.healthy, c.reason = False, reason
            return HealthChange(uuid, False, reason, now)
        return None

    def observe(self, o: Observation, now: float) -> list[HealthChange]:
        """Apply one observation at time ``now`` (seconds, monotonic); return the transitions."""
        targets = [o.uuid] if o.uuid else list(self.cards)
        out: list[HealthChange] = []
        for u in targets:
            ch: HealthChange | None = None
            if o.kind == "xid":
                if o.xid in self.ignored_xids:
                    continue
                ch = self._bad(u, xid_reason(o.xid), now, True)
            elif o.kind == "error":
                ch = self._bad(u, o.reason or "NVML error", now, False)
            elif o.kind == "probe":
                c = self.cards.get(u)
                if c is None:
                    continue
                if not o.ok:
                    ch = self._bad(u, o.reason or "probe failed", now, False)
                elif not c.healthy and now - c.last_bad >= self.recovery_s:
                    c.healthy, c.reason = True, ""
                    ch = HealthChange(u, True, "", now)
            else:
                raise ValueError(f"unknown observation kind {o.kind!r}")
            if ch is not None:
                out.append(ch)
        return out

    def status(self, uuid: str) -> tuple[bool, str]:
        c = self.cards.get(uuid)
        return (True, "") if c is None else (c.healthy, c.reason)

    def apply(self, inv: NodeInventory) -> NodeInventory:
        """``inv`` with every card's ``healthy``/``reason`` set from this state."""
        cards = []
        for card in inv.cards:
            ok, reason = self.status(card.uuid)
            cards.append(replace(card, healthy=ok, reason=reason))
        return replace(inv, cards=tuple(cards))


Emit = Callable[[Observation], None]


class SimulatedHealthSource:
    """Observations for tests and demos.

    ``inject_xid``/``fail``/``recover`` act at once (thread-safe through ``emit``). With ``path``,
    the JSON file ``{"<uuid or index>": "<reason>"}`` is re-read every ``interval_s``: listed cards
    probe bad with that reason, the others probe fine.
    """

    def __init__(
        self, inventory: Callable[[], NodeInventory], path: str | None = None, interval_s: float = 1.0
    ) -> None:
        self.inventory = inventory
        self.path = path
        self.interval_s = interval_s
        self.faults: dict[str, str] = {}
        self._emit: Emit | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, emit: Emit) -> None:
        self._emit = emit
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _resolve(self, key: str) -> str:
        for c in self.inventory().cards:
            if key in (c.uuid, str(c.index)):
                return c.uuid
        return key

    def inject_xid(self, uuid: str, xid: int) -> None:
        assert self._emit is not None
        self._emit(Observation("xid", self._resolve(uuid), xid=xid))

    def fail(self, uuid: str, reason: str) -> None:
        self.faults[self._resolve(uuid)] = reason
        self.probe_all()

    def recover(self, uuid: str) -> None:
        self.faults.pop(self._resolve(uuid), None)
        self.probe_all()

    def _read_file(self) -> None:
        if not self.path:
            return
        try:
            doc = json.loads(Path(self.path).read_text() or "{}")
        except FileNotFoundError:
            doc = {}
        except (OSError, ValueError) as e:
            log.warning("simulated health file %s unreadable: %s", self.path, e)
            return
        self.faults = {self._resolve(str(k)): str(v) for k, v in dict(doc).items()}

    def probe_all(self) -> None:
        if self._emit is None:
            return
        for c in self.inventory().cards:
            reason = self.faults.get(c.uuid)
            self._emit(Observation("probe", c.uuid, ok=reason is None, reason=reason or ""))

    async def _loop(self) -> None:
        while True:
            self._read_file()
            self.probe_all()
            await asyncio.sleep(self.interval_s)


class NvmlHealthSource:
    """XID/ECC events and probes from NVML, in a daemon thread (NVML's wait blocks).

    ``nvml`` is the ``pynvml`` module (injectable); NVML must already be initialised (discovery
    does it). ``uuids()`` gives the cards to watch; a change of that set re-registers events.
    """

    def __init__(
        self,
        uuids: Callable[[], list[str]],
        nvml: Any = None,
        probe_interval_s: float = 10.0,
        wait_ms: int = 1000,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nv = nvml
        self.uuids = uuids
        self.probe_interval_s = probe_interval_s
        self.wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, emit: Emit) -> None:
        self._thread = threading.Thread(target=self._run, args=(emit,), name="kvgpu-health", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def probe(self, uuid: str) -> Observation:
        """Probe one card: reachable, memory query answers, no reset pending."""
        nv = self.nv
        try:
            h = nv.nvmlDeviceGetHandleByUUID(uuid)
            nv.nvmlDeviceGetMemoryInfo(h)
        except Exception as e:
            return Observation("probe", uuid, ok=False, reason=f"NVML: {e}")
        with contextlib.suppress(Exception):
            rows = nv.nvmlDeviceGetRemappedRows(h)  # (corrected, uncorrected, pending, failure)
            if rows[3]:
                return Observation("probe", uuid, ok=False, reason="row remapping failed")
            if rows[2]:
                return Observation("probe", uuid, ok=False, reason="row remapping pending (reset needed)")
        with contextlib.suppress(Exception):
            if nv.nvmlDeviceGetRetiredPagesPendingStatus(h):
                return Observation("probe", uuid, ok=False, reason="page retirement pending (reset needed)")
        return Observation("probe", uuid, ok=True)

    def _register(self, uuids: list[str], emit: Emit) -> tuple[Any, dict[Any, str]]:
        """An event set with XID/ECC events of every card that supports them. Returns
        ``(None, {})`` when NVML cannot create a set or no card registered (probes still run)."""
        nv = self.nv
        try:
            es = nv.nvmlEventSetCreate()
        except Exception as e:
            log.warning("NVML event set unavailable (%s): health from probes only", e)
            return None, {}
        mask = nv.nvmlEventTypeXidCriticalError
        for name in ("nvmlEventTypeDoubleBitEccError", "nvmlEventTypeSingleBitEccError"):
            mask |= getattr(nv, name, 0)
        handles: dict[Any, str] = {}
        for u in uuids:
            try:
                h = nv.nvmlDeviceGetHandleByUUID(u)
            except Exception as e:
                emit(Observation("error", u, reason=f"NVML: {e}"))
                continue
            try:
                nv.nvmlDeviceRegisterEvents(h, mask & nv.nvmlDeviceGetSupportedEventTypes(h), es)
                handles[_addr(h)] = u
            except Exception as e:  # NOT_SUPPORTED: probes still run
                log.warning("no NVML events for %s: %s", u, e)
        if not handles:
            with contextlib.suppress(Exception):
                nv.nvmlEventSetFree(es)
            return None, {}
        return es, handles

    def _run(self, emit: Emit) -> None:
        nv = self.nv
        uuids = sorted(self.uuids())
        es, handles = self._register(uuids, emit)
        next_probe = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_probe:
                    for u in uuids:
                        emit(self.probe(u))
                    next_probe = now + self.probe_interval_s
                    cur = sorted(self.uuids())
                    if cur != uuids:
                        if es is not None:
                            with contextlib.suppress(Exception):
                                nv.nvmlEventSetFree(es)
                        uuids = cur
                        es, handles = self._register(uuids, emit)
                if es is None:
                    self._stop.wait(self.wait_ms / 1000)
                    continue
                try:
                    data = nv.nvmlEventSetWait(es, self.wait_ms)
                except Exception as e:
                    if getattr(e, "value", None) == getattr(nv, "NVML_ERROR_TIMEOUT", -1):
                        continue
                    emit(Observation("error", "", reason=f"NVML event wait: {e}"))
                    self._stop.wait(1.0)
                    continue
                uuid = handles.get(_addr(data.device), "")
                if not uuid:  # an event of a handle we did not register: never blame every card
                    log.warning("NVML event %#x for an unknown device ignored", int(data.eventType))
                    continue
                etype = int(data.eventType)
                if etype & nv.nvmlEventTypeXidCriticalError:
                    emit(Observation("xid", uuid, xid=int(data.eventData)))
                elif etype & getattr(nv, "nvmlEventTypeDoubleBitEccError", 0):
                    emit(Observation("xid", uuid, xid=48))
                # single-bit ECC: informational; probes catch pending retirement.
        finally:
            if es is not None:
                with contextlib.suppress(Exception):
                    nv.nvmlEventSetFree(es)


def _addr(handle: Any) -> Any:
    """A hashable identity of an NVML device handle (a ctypes pointer)."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return handle


OnChange = Callable[[list[HealthChange]], Awaitable[None]]


class HealthMonitor:
    """Feeds a source's observations into a :class:`HealthState`; awaits ``on_change`` per batch.

    ``clock`` is injectable for tests (default ``time.monotonic``).
    """

    def __init__(
        self,
        state: HealthState,
        source: Any,
        on_change: OnChange,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.source = source
        self.on_change = on_change
        self.clock = clock
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()

    async def run(self) -> None:
        """Until cancelled. Errors in ``on_change`` are logged, never stop the monitor."""
        loop = asyncio.get_running_loop()

        def emit(o: Observation) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, o)

        self.source.start(emit)
        try:
            while True:
                o = await self.queue.get()
                changes = self.state.observe(o, self.clock())
                if changes:
                    try:
                        await self.on_change(changes)
                    except Exception:
                        log.exception("health change handler failed")
        finally:
            await self.source.stop()
