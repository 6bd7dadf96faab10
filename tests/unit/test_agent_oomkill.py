"""The agent's half of ACTIVE_OOM_KILLER: the region's kill count becomes one pod Event per
increase (never again after a restart) and the counter kvgpu_container_oom_kills_total."""

from __future__ import annotations

import os

import pytest
from kvgpu.agent.exporter import BoundContainer, BoundDevice, UsageCollector, default_reader, make_registry
from kvgpu.agent.oomkill import REASON, OomReporter
from kvgpu.agent.usage import DeviceUsage, OomKills, RegionRows, adapt_region
from kvgpu.core.inventory import Card, NodeInventory
from prometheus_client import generate_latest

U0, U1 = "GPU-a", "GPU-b"
POD, POD2 = "0a1b2c3d-1111-2222-3333-444455556666", "0a1b2c3d-1111-2222-3333-777777777777"
MIB = 1 << 20
MAIN = BoundContainer(
    "team", "nb", POD, "main", "team/nb-main", 1, (BoundDevice(U0, 3000, 0), BoundDevice(U1, 1000, 0)), True
)
LATE = BoundContainer("team", "late", POD2, "work", "team/late-work", 1, (BoundDevice(U0, 1000, 0),), True)


def rows(count: int, generation: int = 1, pid: int = 7, dev: int = 1, used: float = 1232.0) -> RegionRows:
    r = RegionRows([DeviceUsage(U0, 3000, 10.0), DeviceUsage(U1, 1000, used)])
    r.oom = OomKills(count, generation, pid, dev, 704.0, used, 1000.0)
    return r


class Regions:
    """A fake region reader: (pod uid, container) -> rows, None (no region) or an exception."""

    def __init__(self, **by_pod: object) -> None:
        self.by: dict[str, object] = dict(by_pod)

    def __call__(self, pod_uid: str, container: str):
        v = self.by.get(pod_uid)
        if isinstance(v, Exception):
            raise v
        return v


def reporter(regions: Regions, containers: list[BoundContainer], events: list) -> OomReporter:
    async def on_kill(c, msg):
        events.append((c.pod, msg))

    return OomReporter(lambda: containers, regions, on_kill=on_kill, card_index={U0: 0, U1: 3}.get)


async def test_one_event_per_increase_and_none_for_old_kills():
    regions = Regions(**{POD: rows(2)})
    events: list = []
    rep = reporter(regions, [MAIN], events)
    await rep.check()  # the agent's first look: the 2 kills are old (its predecessor's)
    assert events == []
    regions.by[POD] = rows(3)
    await rep.check()
    await rep.check()  # the same count again: nothing new
    assert events == [
        (
            "nb",
            "container main: process 7 ended by kvgpu's OOM killer: card 3 used 1232 MiB over its "
            "1000 MiB limit (the process held 704 MiB)",
        )
    ]
    regions.by[POD] = rows(5, pid=9)
    await rep.check()
    assert len(events) == 2 and "2 processes (the last: 9) ended" in events[1][1]
    assert rep.reported == 3

    # A restarted agent (a fresh reporter) does not post the 5 old kills again.
    again: list = []
    rep2 = reporter(regions, [MAIN], again)
    await rep2.check()
    await rep2.check()
    assert again == []
    regions.by[POD] = rows(6)
    await rep2.check()
    assert len(again) == 1 and "process 7 ended" in again[0][1]


async def test_new_regions_and_containers_report_every_kill():
    regions = Regions(**{POD: None})  # no region at the first look: the shim has not run yet
    containers = [MAIN]
    events: list = []
    rep = reporter(regions, containers, events)
    await rep.check()
    regions.by[POD] = rows(1)
    await rep.check()
    assert len(events) == 1 and events[0][0] == "nb"
    # A pod that came after the first look: its kills are all new.
    containers.append(LATE)
    regions.by[POD2] = rows(2, dev=0)
    await rep.check()
    assert len(events) == 2 and "2 processes" in events[1][1] and "card 0 used" in events[1][1]
    # The region re-initialised (another generation): counts from 0 again.
    regions.by[POD] = rows(1, generation=2, pid=11)
    await rep.check()
    assert len(events) == 3 and "process 11 ended" in events[2][1]
    # A container that left is forgotten; back with the same count it is a new container.
    containers.remove(MAIN)
    await rep.check()
    containers.append(MAIN)
    await rep.check()
    assert len(events) == 4


async def test_unreadable_at_start_is_baselined_when_it_becomes_readable():
    regions = Regions(**{POD: OSError("racing")})
    events: list = []
    rep = reporter(regions, [MAIN], events)
    await rep.check()
    regions.by[POD] = rows(4)
    await rep.check()
    assert events == []  # could be kills from before the agent started: not re-posted
    regions.by[POD] = rows(5)
    await rep.check()
    assert len(events) == 1


async def test_message_without_the_container_charge_and_unknown_index():
    regions = Regions(**{POD: None})
    events: list = []
    rep = OomReporter(lambda: [MAIN], regions, on_kill=lambda c, m: _append(events, m))
    await rep.check()
    regions.by[POD] = rows(1, used=0.0)  # an older shim: no oom_last_used
    await rep.check()
    assert events == [
        "container main: process 7 ended by kvgpu's OOM killer: card GPU-b went over its 1000 MiB "
        "limit (the process held 704 MiB)"
    ]


async def _append(events: list, m: str) -> None:
    events.append(m)


def test_adapt_region_carries_the_kill_record():
    from kvgpu import shimcore

    ru = shimcore.RegionUsage(
        path="x",
        claim="team/nb-main",
        priority=0,
        generation=3,
        devices=(shimcore.DeviceUsage(0, U0, 1000.0, 1232.0, 0, ()),),
        oom_kills=2,
        oom_last_pid=7,
        oom_last_dev=0,
        oom_last_mib=704.0,
        oom_last_used_mib=1232.0,
    )
    r = adapt_region(ru)
    assert r.oom == OomKills(2, 3, 7, 0, 704.0, 1232.0, 1000.0)
    assert adapt_region([DeviceUsage(U0, 1, 0.0)]).oom is None  # plain rows: no record


def test_counter_exported_from_the_region():
    inv = NodeInventory("n", (Card(U0, 0, "NVIDIA H200", 143771, 132),), "nvml")
    col = UsageCollector(
        "n", lambda: [MAIN, LATE], lambda: inv, reader=lambda p: rows(4) if POD in str(p) else None
    )
    text = generate_latest(make_registry(col)).decode()
    lines = [x for x in text.splitlines() if x.startswith("kvgpu_container_oom_kills_total{")]
    assert len(lines) == 2
    mine = next(x for x in lines if 'pod="nb"' in x)
    assert 'container="main"' in mine and 'namespace="team"' in mine and mine.endswith(" 4.0")
    assert next(x for x in lines if 'pod="late"' in x).endswith(" 0.0")  # no region yet
    assert "# TYPE kvgpu_container_oom_kills_total counter" in text


async def test_agent_posts_the_event_on_the_pod(sim_agent):
    agent = sim_agent.make()
    await agent._oom_event(MAIN, "container main: process 7 ended")
    assert sim_agent.posted == [("team", "nb", POD, REASON, "Warning", "container main: process 7 ended")]
    assert REASON == "GPUOOMKilled"
    assert agent._make_oom_reporter().interval_s == 5.0


def test_kill_read_from_a_real_region(tmp_path):
    """The shim's own C records the kill; default_reader (kvgpu.shimcore) must see all of it."""
    from kvgpu import shimcore

    try:
        m = shimcore.core()
    except Exception as e:  # no compiler / shim sources here
        pytest.skip(f"shim core unavailable: {e}")
    ffi, lib = m.ffi, m.lib
    d = tmp_path / POD / "main"
    d.mkdir(parents=True)
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(f"v1;claim=team/nb-main;dev={U0},3000,0;dev={U1},1000,0".encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(d / "vgpu.region").encode(), cfg) == 0
    try:
        assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
        assert lib.vgpu_region_set_overhead(h, 1, 1232 * MIB) == 1232 * MIB
        lib.vgpu_region_oom_record(h.r, 1, 4242, 704 * MIB)
        r = default_reader()(d)
        assert r is not None and r.oom is not None
        gen = r.oom.generation
        assert gen >= 1
        assert r.oom == OomKills(1, gen, 4242, 1, 704.0, 1232.0, 1000.0)
    finally:
        lib.vgpu_region_leave(h)
        lib.vgpu_region_close(h)
