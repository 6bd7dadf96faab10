"""The node-side backstop: ending GPU processes that escaped the shim.

The shim limits what goes through it. A process of a container with a claim that reaches the card
without it (a static binary, a musl program, ``/etc`` renamed so ``ld.so.preload`` is not read,
direct ioctls) is found by the enforcement check (:mod:`kvgpu.agent.enforcement`: NVML lists it
on a card, its cgroup names the container, the container's shim region does not list it). With
the agent's ``unenforced: kill`` (the default) such a process is ended here once it has been seen
unenforced for ``grace_s`` seconds: the same host PID *and* start time in the checks over that
span, so a process that was still attaching to its region, or a PID reused by another process, is
never the one killed. The kill goes through a pidfd opened before the start time is read again,
so the process checked is the process signalled.

``unenforced: report`` keeps the check's Event and metric only.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .enforcement import Attribution, ProcessView, attribute, proc_start_time

log = logging.getLogger(__name__)

ACTIONS = ("kill", "report")


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
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class EscapeKiller:
    """Kills processes seen unenforced for ``grace_s`` seconds or longer; counts them per
    (pod UID, container) in ``kills``. :meth:`end` takes each enforcement snapshot."""

    grace_s: float = 10.0
    killer: Callable[[int, int], bool] = kill_pinned
    start_time: Callable[[int], int | None] = proc_start_time
    attribute_fn: Callable[[int], Attribution] = attribute
    clock: Callable[[], float] = time.monotonic
    kills: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (host PID, start time) -> when it was first seen unenforced (only those seen last time)
    _first_seen: dict[tuple[int, int], float] = field(default_factory=dict)

    def end(self, views: Sequence[ProcessView]) -> list[ProcessView]:
        """Kill the unenforced processes of ``views`` whose grace is over; return them. Blocking
        (``/proc`` reads and a syscall per suspect): the agent calls it in a worker thread."""
        now = self.clock()
        seen: dict[tuple[int, int], float] = {}
        killed = []
        for v in views:
            if v.state != "unenforced" or v.container is None:
                continue
            start = self.start_time(v.process.host_pid)
            if start is None:
                continue  # already gone
            key = (v.process.host_pid, start)
            first = seen[key] = self._first_seen.get(key, now)
            if now - first < self.grace_s:
                continue
            if self.attribute_fn(v.process.host_pid).pod_uid != v.container.pod_uid:
                continue  # no longer the container's process: never kill on an old attribution
            if not self.killer(*key):
                continue
            del seen[key]
            ck = (v.container.pod_uid, v.container.container)
            self.kills[ck] = self.kills.get(ck, 0) + 1
            killed.append(v)
            log.warning("killed process %d (host PID %d) of %s/%s/%s: it ran outside the kvgpu shim on %s "
                        "for %.0f s (%s)", v.inner_pid, v.process.host_pid, v.container.namespace,
                        v.container.pod, v.container.container, v.process.uuid, now - first, v.reason)
        self._first_seen = seen
        return killed

    def forget(self, live: set[tuple[str, str]]) -> None:
        """Drop the counts of containers that are gone (``live``: (pod UID, container))."""
        self.kills = {k: n for k, n in self.kills.items() if k in live}
