"""The node-side backstop: ending GPU processes that escaped the shim or its limit.

The shim limits what goes through it. A process of a container with a claim that reaches the card
without it (a static binary, a musl program, ``/etc`` renamed so ``ld.so.preload`` is not read,
direct ioctls) is found by the enforcement check (:mod:`kvgpu.agent.enforcement`: NVML lists it
on a card, its cgroup names the container, the container's shim region does not list it). With
the agent's ``unenforced: kill`` (the default) such a process is ended here once it has been seen
unenforced for ``grace_s`` seconds: the same host PID *and* start time in the checks over that
span, so a process that was still attaching to its region is never the one killed, and a PID
reused by a process of another container never is (its cgroup is read again just before). The
kill goes through a pidfd opened before the start time is read again, so the process checked is
the process signalled. The container is timed too: once some process of it has been seen
unenforced in every check for ``grace_s``, each unenforced process of it is killed at its first
sighting, so a relay of processes that each live less than the grace gets no longer than a check
interval each.

``unenforced: report`` keeps the check's Event and metric only.

**Over the limit.** The shim refuses what would take a container past its memory limit, but it
cannot refuse memory it does not see, and its region is writable by the container (a process
that zeroes the counters is then granted more). What NVML measures cannot be forged from inside:
with ``over_limit: kill`` (the default) a container whose processes on a card hold more than its
claim's memory there plus ``slack_mib`` for ``grace_s`` seconds (being under it for less than
three graces does not start the grace again) loses its largest processes there (pinned and
signalled as above), as many as it takes to bring it under by this check's figures.

**Over the cores.** The compute gate is the shim's too, and its state lives in the same writable
region (and a process that bypasses the shim has no gate at all). NVML's per-process SM
utilisation cannot be forged: with ``over_cores: kill`` a container whose processes on a card used
more than its claim's cores plus ``cores_slack_pts`` points (at most half the headroom), on
average over the checks of the last ``cores_grace_s`` seconds and in the latest check, loses its
busiest processes there until the rest are under. Its use between checks is polled every second
and summed per container as each poll finds it (:class:`~kvgpu.agent.enforcement.SmMeans`), so
processes that ended before the check count; the window goes on after a kill and through idle
checks, so a relay of processes gains nothing. Only cards whose cores are a share of time are
judged so (``hami-core`` pools): an MPS client's cores are a share of the SMs, which NVML counts
as busy whenever any of them is. The window is longer than the memory grace: a gate running a
tenant at its limit in windows is busier in some seconds than in others.

**DRA claims.** A container that consumes a prepared DRA claim is judged as the device plugin's
containers are (its own processes, its own unenforced streak), but its memory and cores are the
claim's: every container of every pod consuming the claim counts against them together
(:func:`~kvgpu.agent.usage.limit_holder`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .enforcement import Attribution, ProcessView, attribute, proc_start_time
from .usage import BoundContainer, limit_holder

log = logging.getLogger(__name__)

ACTIONS = ("kill", "report")
UNENFORCED_KILLED = "GPUUnenforcedKilled"
OVER_LIMIT_KILLED = "GPUOverLimitKilled"
OVER_CORES_KILLED = "GPUOverCoresKilled"
MIB = 1 << 20


def kill_pinned(host_pid: int, start_time: int, proc: str = "/proc") -> bool:
    """``SIGKILL`` ``host_pid`` if it is still the process that started at ``start_time`` (clock
    ticks since boot, ``/proc/<pid>/stat`` field 22). True when the signal was sent; False when the
    process is gone or its PID now belongs to another one."""
    try:
        fd = os.pidfd_open(host_pid)
    except OSError:
        return False
    try:
        if proc_start_time(host_pid, proc) != start_time:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except PermissionError as e:
        log.error("cannot kill process %d: %s (the agent needs the KILL capability)", host_pid, e)
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Kill:
    """A process the backstop ended, and why (the sentence of its pod's Event)."""

    view: ProcessView
    why: str
    reason: str  # the Event's reason: UNENFORCED_KILLED, OVER_LIMIT_KILLED or OVER_CORES_KILLED


def _victims(vs: Sequence[ProcessView], size: Callable[[ProcessView], float]) -> list[ProcessView]:
    """The order in which a group's processes go: the container holding the most first (of a DRA
    claim's consumers, the one that took the claim over rather than a neighbour), and in it the
    largest process first."""
    held: dict[tuple[str, str], float] = {}
    for v in vs:
        assert v.container is not None
        k = (v.container.pod_uid, v.container.container)
        held[k] = held.get(k, 0.0) + size(v)
    return sorted(vs, key=lambda v: (held[(v.container.pod_uid, v.container.container)] if v.container else 0.0,
                                     size(v)), reverse=True)


@dataclass
class Backstop:
    """Kills processes seen unenforced for ``grace_s`` seconds or longer (counted per (pod UID,
    container) in ``kills``), and the largest process of a container over its memory limit on a
    card for as long (``over_limit_kills``). :meth:`end` takes each enforcement snapshot."""

    grace_s: float = 10.0
    #: kill the largest process of a container over its limit on a card (False: report only)
    over_limit: bool = True
    #: NVML use above the limit tolerated (MiB): the driver's page rounding and NVML's lag
    slack_mib: int = 64
    #: kill processes that run outside the shim (False: only containers over their limit)
    unenforced: bool = True
    #: kill the process using the most SMs of a container over its cores on a card
    over_cores: bool = True
    #: points of SM utilisation above a container's cores tolerated on average (NVML's sampling)
    cores_slack_pts: float = 20.0
    #: seconds of checks the SM utilisation is averaged over before a kill
    cores_grace_s: float = 30.0
    #: the cards whose cores are a share of time (``hami-core`` pools: the shim's gate); None =
    #: every card. On an MPS card a client's SMs are a share of the SMs, busy all the time.
    time_shared: Callable[[], set[str]] | None = None
    #: (limit holder, card) -> (a container of it, mean SM percent since the last check of every
    #: process found in it, ended ones included; :attr:`EnforcementMonitor.container_sm`)
    container_sm: Callable[[], Mapping[tuple[str, str, str], tuple[BoundContainer, float]]] | None = None
    killer: Callable[[int, int], bool] = kill_pinned
    start_time: Callable[[int], int | None] = proc_start_time
    attribute_fn: Callable[[int], Attribution] = attribute
    clock: Callable[[], float] = time.monotonic
    kills: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (pod UID, container) -> processes killed because the container was over its limit
    over_limit_kills: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (host PID, start time) -> when it was first seen unenforced (only those seen last time)
    _first_seen: dict[tuple[int, int], float] = field(default_factory=dict)
    #: (pod UID, container) -> since when every check saw some process of it unenforced
    _container_since: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (limit holder, card) -> (since when it is over its limit, when it was last seen over)
    _over_since: dict[tuple[str, str, str], tuple[float, float]] = field(default_factory=dict)
    #: (host PID, start time) -> when the backstop killed it
    _killed: dict[tuple[int, int], float] = field(default_factory=dict)
    #: (pod UID, container) -> processes killed because the container used more SMs than its cores
    over_cores_kills: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (limit holder, card) -> since when it is in every check, and the (time, SM percent)
    #: of its checks in the last cores_grace_s
    _cores_seen: dict[tuple[str, str, str], tuple[float, list[tuple[float, float]]]] = field(default_factory=dict)

    def end(self, views: Sequence[ProcessView]) -> list[Kill]:
        """Kill the unenforced processes of ``views`` whose grace is over (with ``unenforced``),
        the largest process of each container over its limit for its grace (with ``over_limit``)
        and the busiest of each over its cores (with ``over_cores``); return them. Blocking
        (``/proc`` reads and a syscall per suspect): the agent calls it in a worker thread."""
        now = self.clock()
        self._killed = {k: t for k, t in self._killed.items() if now - t < max(self.grace_s, 15.0)}
        killed: list[Kill] = []
        for rule in (self._end_unenforced, self._end_over_limit, self._end_over_cores):
            done = {k.view.process.host_pid for k in killed}
            try:  # one rule's failure must not cost the others (nor the Events of kills made)
                killed += rule([v for v in views if v.process.host_pid not in done])
            except Exception:
                log.exception("backstop rule %s failed", rule.__name__)
        return killed

    def _end_unenforced(self, views: Sequence[ProcessView]) -> list[Kill]:
        """A process is killed once it, or its container (some process of it in every check, a
        relay of short-lived ones included), has been seen unenforced for the grace."""
        if not self.unenforced:
            self._first_seen, self._container_since = {}, {}
            return []
        now = self.clock()
        seen: dict[tuple[int, int], float] = {}
        streaks: dict[tuple[str, str], float] = {}
        killed = []
        for v in views:
            if v.state != "unenforced" or v.container is None:
                continue
            start = self.start_time(v.process.host_pid)
            if start is None:
                continue  # already gone
            key, ck = (v.process.host_pid, start), (v.container.pod_uid, v.container.container)
            first = seen[key] = self._first_seen.get(key, now)
            since = streaks[ck] = self._container_since.get(ck, now)
            if now - min(first, since) < self.grace_s or not self._kill(v, start):
                continue
            del seen[key]
            self.kills[ck] = self.kills.get(ck, 0) + 1
            killed.append(Kill(v, f"process {v.inner_pid or v.process.host_pid} killed: it used card "
                                  f"{v.process.uuid} outside the kvgpu shim ({v.reason})", UNENFORCED_KILLED))
            log.warning("killed process %d (host PID %d) of %s/%s/%s: it ran outside the kvgpu shim on %s "
                        "(the process for %.0f s, its container for %.0f s: %s)", v.inner_pid, v.process.host_pid,
                        v.container.namespace, v.container.pod, v.container.container, v.process.uuid,
                        now - first, now - since, v.reason)
        self._first_seen, self._container_since = seen, streaks
        return killed

    def _groups(self, views: Sequence[ProcessView], cards: set[str] | None = None
                ) -> dict[tuple[str, str, str], list[ProcessView]]:
        """The claimed containers' processes per limit holder and card (``cards``: only those): a
        container's, or a DRA claim's, whose limit all its containers share
        (:func:`~kvgpu.agent.usage.limit_holder`)."""
        groups: dict[tuple[str, str, str], list[ProcessView]] = {}
        for v in views:
            if v.container is not None and v.state != "foreign" and (cards is None or v.process.uuid in cards):
                groups.setdefault((*limit_holder(v.container), v.process.uuid), []).append(v)
        return groups

    def _end_over_limit(self, views: Sequence[ProcessView]) -> list[Kill]:
        """Per (container, card): NVML's bytes of its processes against the claim's memory. Over
        since the first check that saw it over, until it has been under for three graces (being
        under the limit now and then does not start the grace again); over now and for a grace,
        its largest processes are killed, as many as it takes to bring it under."""
        now = self.clock()
        over: dict[tuple[str, str, str], tuple[float, float]] = {}  # -> (over since, last seen over)
        killed = []
        for key, vs in self._groups(views).items():
            c = vs[0].container
            assert c is not None
            limit = next((d.memory_mib for d in c.devices if d.uuid == key[2]), None)
            used = sum(v.process.used_bytes for v in vs)
            if limit is None or used <= (limit + self.slack_mib) * MIB:
                continue
            prev = self._over_since.get(key)
            since = over[key] = (prev[0] if prev else now, now)
            if not self.over_limit or now - since[0] < self.grace_s:
                continue
            held = used
            for victim in _victims(vs, lambda v: v.process.used_bytes):
                if held <= (limit + self.slack_mib) * MIB:
                    break
                if not self._kill(victim):
                    continue  # gone, or not to be signalled: the next largest
                held -= victim.process.used_bytes
                killed.append(self._counted(self.over_limit_kills, victim, OVER_LIMIT_KILLED,
                                            f"({victim.process.used_bytes // MIB} MiB): the container held "
                                            f"{used // MIB} MiB of card {key[2]}, over its {limit} MiB limit"))
                log.warning("killed process %d (host PID %d, %d MiB) of %s/%s/%s: the container held %d MiB of "
                            "%s for %.0f s, over its %d MiB limit", victim.inner_pid, victim.process.host_pid,
                            victim.process.used_bytes // MIB, c.namespace, c.pod, c.container, used // MIB,
                            key[2], now - since[0], limit)
        for key, prev in self._over_since.items():  # under now: kept for 3 graces after it was over
            if key not in over and now - prev[1] < 3 * self.grace_s:
                over[key] = prev
        self._over_since = over
        return killed

    def _end_over_cores(self, views: Sequence[ProcessView]) -> list[Kill]:
        """Per (container, card) with cores below 100: NVML's SM percent of its processes (their
        means since the last check, or latest samples) averaged over the checks of the last
        ``cores_grace_s``; a
        check without its processes counts 0 and does not end the window. Over on average and
        now, its busiest processes are killed, as many as it takes to bring it under."""
        now = self.clock()
        seen: dict[tuple[str, str, str], tuple[float, list[tuple[float, float]]]] = {}
        killed = []
        cards = self.time_shared() if self.time_shared is not None else None
        groups = self._groups([v for v in views if v.sm_util is not None], cards)
        measured = {k: cv for k, cv in (self.container_sm() if self.container_sm is not None else {}).items()
                    if cards is None or k[2] in cards}
        for key in groups.keys() | measured.keys():
            vs = groups.get(key, [])
            c = vs[0].container if vs else measured[key][0]
            assert c is not None
            cores = next((d.cores for d in c.devices if d.uuid == key[2]), 0)
            if not 0 < cores < 100:
                continue
            # its processes now, or every one the polls found since the last check (ended ones too)
            used = min(100.0, max(sum(v.sm_util or 0.0 for v in vs), measured.get(key, (c, 0.0))[1]))
            since, prior = self._cores_seen.get(key, (now, []))
            span = [(t, u) for t, u in prior if now - t < self.cores_grace_s] + [(now, used)]
            seen[key] = (since, span)
            # the slack, but at most half of what is left above the cores: a 90 % slice at 100 % is over
            mean, most = sum(u for _, u in span) / len(span), cores + min(self.cores_slack_pts, (100 - cores) / 2)
            # over on average and now: a process started after a kill is judged on the same
            # window (a relay gains nothing), but only while it is itself over the cores
            if not self.over_cores or now - since < self.cores_grace_s or mean <= most or used <= most:
                continue
            # the listed processes' own use, or the container's whole when that is more (a relay:
            # every process it has now goes, busiest first)
            busy = max(sum(v.sm_util or 0.0 for v in vs), used)
            for victim in _victims(vs, lambda v: v.sm_util or 0.0):
                if busy <= most:
                    break
                if not self._kill(victim):
                    continue
                busy -= victim.sm_util or 0.0
                killed.append(self._counted(self.over_cores_kills, victim, OVER_CORES_KILLED,
                                            f"({victim.sm_util:.0f} % of the SMs): the container used {mean:.0f} % "
                                            f"of card {key[2]}'s SMs over {now - since:.0f} s, over its {cores} %"))
                log.warning("killed process %d (host PID %d) of %s/%s/%s: the container used %.0f %% of %s's "
                            "SMs over %.0f s, over its %d %%", victim.inner_pid, victim.process.host_pid,
                            c.namespace, c.pod, c.container, mean, key[2], now - since, cores)
        for key, (since, prior) in self._cores_seen.items():  # no process there now: an idle check
            span = [(t, u) for t, u in prior if now - t < self.cores_grace_s] + [(now, 0.0)]
            if key not in seen and any(u for _, u in span):
                seen[key] = (since, span)
        self._cores_seen = seen
        return killed

    @staticmethod
    def _counted(table: dict[tuple[str, str], int], victim: ProcessView, reason: str, what: str) -> Kill:
        """Count a kill of ``victim`` for NVML's figures (``what``: the measure, then the limit)."""
        assert victim.container is not None
        ck = (victim.container.pod_uid, victim.container.container)
        table[ck] = table.get(ck, 0) + 1
        return Kill(victim, f"process {victim.inner_pid or victim.process.host_pid} killed {what} (NVML)", reason)

    def _kill(self, v: ProcessView, start: int | None = None) -> bool:
        """Kill ``v``'s process if its cgroup still names ``v``'s pod and container: never on an
        old attribution. Pinned by ``start``, else the start time the snapshot took (the process
        that was measured), else the one read now; one killed in the last ``grace_s`` is not
        signalled (nor counted) again while NVML still lists it."""
        assert v.container is not None
        start = start if start is not None else v.start_time
        start = self.start_time(v.process.host_pid) if start is None else start
        if start is None or (v.process.host_pid, start) in self._killed:
            return False
        a = self.attribute_fn(v.process.host_pid)
        if a.pod_uid != v.container.pod_uid or (a.container_id and v.container.container_id
                                                and a.container_id != v.container.container_id):
            return False
        if not self.killer(v.process.host_pid, start):
            return False
        self._killed[(v.process.host_pid, start)] = self.clock()
        return True

    def counts(self) -> dict[str, dict[tuple[str, str], int]]:
        """Kills so far per (pod UID, container): ``unenforced``, ``over_limit``, ``over_cores``."""
        return {"unenforced": dict(self.kills), "over_limit": dict(self.over_limit_kills),
                "over_cores": dict(self.over_cores_kills)}

    def forget(self, live: set[tuple[str, str]]) -> None:
        """Drop the counts of containers that are gone (``live``: (pod UID, container))."""
        self.kills = {k: n for k, n in self.kills.items() if k in live}
        self.over_limit_kills = {k: n for k, n in self.over_limit_kills.items() if k in live}
        self.over_cores_kills = {k: n for k, n in self.over_cores_kills.items() if k in live}
