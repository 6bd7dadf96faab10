"""Reporting the shim's ``ACTIVE_OOM_KILLER``: a Warning Event ``GPUOOMKilled`` on the pod.

With ``ACTIVE_OOM_KILLER=true`` the shim ends the process with the most memory on a card when
memory it could not refuse takes the container over its limit, and counts it in the container's
region (``oom_kills``, the last victim's PID, card, bytes and the container's charge then; see
docs/shim.md). :class:`OomReporter` reads every claimed container's region each ``interval_s``
and, when the count has grown since its last look, records one Event for the increase (the
Prometheus counter ``kvgpu_container_oom_kills_total`` is the region's count itself, exported by
:mod:`kvgpu.agent.exporter`).

No kill is reported twice, across agent restarts too: the agent's first round takes every count
it reads as already reported (the kills before it started were the previous agent's to report, or
happened while none ran: the counter still has them). A container that the first round listed but
could not read keeps that rule until a read succeeds; one whose region did not exist yet, or that
appeared later, has all its kills reported. A re-initialised region (another ``generation``)
counts from 0 again. A DRA claim's region is shared by its consuming pods: one that appears later
starts from the count last seen in that region, so it is told only of kills after it came.

Not done here: a node-side backstop that kills processes the shim cannot reach (see docs/agent.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .usage import BoundContainer, DeviceUsage, OomKills

log = logging.getLogger(__name__)

REASON = "GPUOOMKilled"

OomEvent = Callable[[BoundContainer, str], Awaitable[None]]


def kill_message(c: BoundContainer, oom: OomKills, new: int, card: str) -> str:
    """The Event's text for ``new`` kills of which ``oom`` describes the last (``card``: the
    card's index on the node, or its UUID when the index is unknown)."""
    who = f"process {oom.last_pid}" if new == 1 else f"{new} processes (the last: {oom.last_pid})"
    if c.region_dir:  # a DRA claim: one region (and one OOM count) for all its containers
        subject = f"ResourceClaim {c.claim} (container(s) {c.container or '-'})"
    else:
        subject = f"container {c.container}"
    lim = f"{oom.last_limit_mib:.0f} MiB limit"
    if oom.last_used_mib > 0:
        over = f"card {card} used {oom.last_used_mib:.0f} MiB over its {lim}"
    else:  # a shim that does not record the container's charge
        over = f"card {card} went over its {lim}"
    held = f" (the process held {oom.last_process_mib:.0f} MiB)" if oom.last_process_mib > 0 else ""
    return f"{subject}: {who} ended by kvgpu's OOM killer: {over}{held}"


@dataclass
class OomReporter:
    """Turns growth of the regions' ``oom_kills`` into pod Events, once per increase.

    ``containers()`` lists the claimed containers of the node; ``read_region(pod_uid, container)``
    their region rows (:class:`~kvgpu.agent.usage.RegionRows` with ``oom``; ``None``: no region);
    ``card_index(uuid)`` the card's index on the node, if known; ``read_dir(path)`` reads the
    region of an entry with a ``region_dir`` (a DRA claim's; such entries are skipped without it).
    """

    containers: Callable[[], Sequence[BoundContainer]]
    read_region: Callable[[str, str], Sequence[DeviceUsage] | None]
    on_kill: OomEvent | None = None
    card_index: Callable[[str], int | None] = lambda uuid: None
    read_dir: Callable[[Path], Sequence[DeviceUsage] | None] | None = None
    interval_s: float = 5.0
    reported: int = 0  # kills reported by this agent
    #: (pod uid, container, region dir) -> (region generation, kills seen); generation -1: no region yet
    _seen: dict[tuple[str, str, str], tuple[int, int]] = field(default_factory=dict)
    #: listed in the first round but not read yet: their first count is taken as seen
    _baseline: set[tuple[str, str, str]] = field(default_factory=set)
    _started: bool = False

    def _read(self, containers: Sequence[BoundContainer]) -> list[tuple[BoundContainer, object]]:
        out: list[tuple[BoundContainer, object]] = []
        for c in containers:
            if c.region_dir and self.read_dir is None:
                continue
            try:
                if c.region_dir and self.read_dir is not None:
                    rows = self.read_dir(Path(c.region_dir))
                else:
                    rows = self.read_region(c.pod_uid, c.container)
            except Exception as e:  # a corrupt or racing region: next round
                log.debug("region of %s/%s/%s unreadable: %s", c.namespace, c.pod, c.container, e)
                out.append((c, e))
                continue
            out.append((c, rows))
        return out

    async def check(self) -> list[tuple[BoundContainer, str]]:
        """One round; returns the (container, message) pairs reported."""
        containers = list(self.containers())
        reads = await asyncio.to_thread(self._read, containers)
        first, self._started = not self._started, True
        live = {_key(c) for c in containers}
        claims = {k[2]: v for k, v in self._seen.items() if k[2] and v[0] >= 0}  # a DRA region's last look
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        self._baseline &= live
        found: list[tuple[BoundContainer, str]] = []
        for c, rows in reads:
            key = _key(c)
            if isinstance(rows, Exception):
                if first:
                    self._baseline.add(key)
                continue
            if rows is None:  # no region (yet): whatever one counts later is new
                self._seen[key] = (-1, 0)
                self._baseline.discard(key)
                continue
            oom: OomKills | None = getattr(rows, "oom", None)
            if oom is None:
                continue
            # a pod that starts consuming a DRA claim later: kills before it came were reported
            prev = self._seen.get(key) or claims.get(c.region_dir)
            self._seen[key] = (oom.generation, oom.count)
            if prev is None and (first or key in self._baseline):
                self._baseline.discard(key)
                continue
            base = prev[1] if prev is not None and prev[0] == oom.generation and oom.count >= prev[1] else 0
            new = oom.count - base
            if new <= 0:
                continue
            uuid = c.devices[oom.last_device].uuid if 0 <= oom.last_device < len(c.devices) else ""
            idx = self.card_index(uuid) if uuid else None
            card = str(idx) if idx is not None else (uuid or str(oom.last_device))
            msg = kill_message(c, oom, new, card)
            log.warning("pod %s/%s: %s", c.namespace, c.pod, msg)
            found.append((c, msg))
            self.reported += new
            if self.on_kill is not None:
                try:
                    await self.on_kill(c, msg)
                except Exception:
                    log.exception("could not record the %s event", REASON)
        return found

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("OOM-kill check failed")
            await asyncio.sleep(self.interval_s)


def _key(c: BoundContainer) -> tuple[str, str, str]:
    return c.pod_uid, c.container, c.region_dir
