"""Health transitions: XIDs, NVML errors, probes, recovery; the simulated and NVML sources."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from kvgpu.agent.health import (
    HealthMonitor,
    HealthState,
    NvmlHealthSource,
    Observation,
    SimulatedHealthSource,
)
from kvgpu.core.inventory import Card, NodeInventory

A, B = "GPU-a", "GPU-b"
INV = NodeInventory("n", (Card(A, 0, "m", 1000, 10), Card(B, 1, "m", 1000, 10)), "simulated")


def test_xid_marks_unhealthy_and_recovery_needs_quiet_period():
    s = HealthState([A, B], recovery_s=60)
    (ch,) = s.observe(Observation("xid", A, xid=79), now=100)
    assert (ch.uuid, ch.healthy, ch.reason) == (A, False, "XID 79: GPU has fallen off the bus")
    assert s.observe(Observation("xid", A, xid=79), now=101) == []  # no duplicate transition
    # Probe fine but too soon: still unhealthy, reason kept.
    assert s.observe(Observation("probe", A, ok=True), now=150) == []
    assert s.status(A) == (False, "XID 79: GPU has fallen off the bus")
    (back,) = s.observe(Observation("probe", A, ok=True), now=161)
    assert back.healthy and back.reason == "" and s.status(A) == (True, "")
    assert s.status(B) == (True, "")


def test_application_xids_are_ignored():
    s = HealthState([A])
    for x in (13, 31, 43, 45, 68, 109):
        assert s.observe(Observation("xid", A, xid=x), now=1) == []
    assert s.status(A) == (True, "")
    s2 = HealthState([A], ignored_xids=frozenset({79}))
    assert s2.observe(Observation("xid", A, xid=79), now=1) == []


def test_probe_failure_and_node_wide_error():
    s = HealthState([A, B], recovery_s=0)
    (ch,) = s.observe(Observation("probe", B, ok=False, reason="row remapping pending (reset needed)"), 5)
    assert not ch.healthy and "reset" in ch.reason
    changes = s.observe(Observation("error", "", reason="NVML event wait: Unknown Error"), 6)
    assert [c.uuid for c in changes] == [A]  # B stays unhealthy with its first reason
    assert s.status(B)[1] == "row remapping pending (reset needed)"
    assert {c.uuid for c in s.observe(Observation("probe", A, ok=True), 7)} == {A}
    inv = s.apply(INV)
    assert [(c.healthy, c.reason) for c in inv.cards] == [
        (True, ""),
        (False, "row remapping pending (reset needed)"),
    ]


def test_unknown_cards_and_set_cards():
    s = HealthState([A])
    assert s.observe(Observation("xid", "GPU-x", xid=79), 1) == []
    s.observe(Observation("xid", A, xid=48), 1)
    s.set_cards([A, B])
    assert s.status(A)[0] is False and s.status(B) == (True, "")


async def test_monitor_with_simulated_source(tmp_path):
    f = tmp_path / "health.json"
    f.write_text(json.dumps({"1": "simulated: fan failure"}))  # by index
    t = [0.0]
    state = HealthState([A, B], recovery_s=10)
    src = SimulatedHealthSource(lambda: INV, path=str(f), interval_s=0.02)
    got: list = []
    changed = asyncio.Event()

    async def on_change(changes):
        got.extend(changes)
        changed.set()

    mon = HealthMonitor(state, src, on_change, clock=lambda: t[0])
    task = asyncio.create_task(mon.run())
    await asyncio.wait_for(changed.wait(), 5)
    assert (got[0].uuid, got[0].healthy, got[0].reason) == (B, False, "simulated: fan failure")
    changed.clear()
    src.inject_xid(A, 94)
    await asyncio.wait_for(changed.wait(), 5)
    assert got[-1].uuid == A and got[-1].reason == "XID 94: contained ECC error"
    # Clear the file and move the clock past the recovery window: both come back.
    f.write_text("{}")
    t[0] = 100.0
    for _ in range(200):
        if state.status(A)[0] and state.status(B)[0]:
            break
        await asyncio.sleep(0.02)
    assert state.status(A) == (True, "") and state.status(B) == (True, "")
    assert {c.uuid for c in got if c.healthy} == {A, B}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class FakeNvmlEvents:
    """pynvml surface used by NvmlHealthSource: one XID 79 event, then timeouts."""

    nvmlEventTypeXidCriticalError = 8
    nvmlEventTypeDoubleBitEccError = 2
    nvmlEventTypeSingleBitEccError = 1
    NVML_ERROR_TIMEOUT = 10

    class Timeout(Exception):
        value = 10

    def __init__(self):
        import ctypes

        self.handles = {A: ctypes.pointer(ctypes.c_int(1)), B: ctypes.pointer(ctypes.c_int(2))}
        self.events = [SimpleNamespace(device=self.handles[B], eventType=8, eventData=79)]
        self.registered = []
        self.lost = set()

    def nvmlEventSetCreate(self):
        return object()

    def nvmlEventSetFree(self, es):
        pass

    def nvmlDeviceGetHandleByUUID(self, u):
        return self.handles[u]

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return 0xFF

    def nvmlDeviceRegisterEvents(self, h, mask, es):
        self.registered.append(mask)

    def nvmlDeviceGetMemoryInfo(self, h):
        if any(self.handles[u] is h for u in self.lost):
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(total=1, used=0, free=1)

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, 0, 0, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return 0

    def nvmlEventSetWait(self, es, ms):
        import time

        if self.events:
            return self.events.pop(0)
        time.sleep(ms / 1000)
        raise self.Timeout()


async def test_nvml_source_emits_xids_and_probes():
    fake = FakeNvmlEvents()
    fake.lost.add(A)
    state = HealthState([A, B], recovery_s=1000)
    got: list = []
    done = asyncio.Event()

    async def on_change(changes):
        got.extend(changes)
        if {c.uuid for c in got} == {A, B}:
            done.set()

    src = NvmlHealthSource(lambda: [A, B], nvml=fake, probe_interval_s=0.05, wait_ms=10)
    task = asyncio.create_task(HealthMonitor(state, src, on_change).run())
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    reasons = {c.uuid: c.reason for c in got}
    assert reasons[B] == "XID 79: GPU has fallen off the bus"
    assert reasons[A].startswith("NVML:")
    assert fake.registered and all(m & 8 for m in fake.registered)


async def test_nvml_source_without_events_still_probes():
    class NoEvents(FakeNvmlEvents):
        def nvmlEventSetCreate(self):
            raise RuntimeError("Not Supported")

    fake = NoEvents()
    fake.lost.add(B)
    state = HealthState([A, B], recovery_s=1000)
    got: list = []
    done = asyncio.Event()

    async def on_change(changes):
        got.extend(changes)
        done.set()

    src = NvmlHealthSource(lambda: [A, B], nvml=fake, probe_interval_s=0.05, wait_ms=10)
    task = asyncio.create_task(HealthMonitor(state, src, on_change).run())
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [(c.uuid, c.healthy) for c in got] == [(B, False)]
