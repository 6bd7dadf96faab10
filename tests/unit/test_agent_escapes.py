"""The node-side backstop (kvgpu.agent.escapes): a process of a claimed container that runs
outside the shim, or the largest one of a container over its memory limit, is killed once seen
so for the grace period, with real processes (``sleep``) standing in for the tenant; NVML and
the cgroup attribution are fakes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from kvgpu.agent.enforcement import (
    Attribution,
    EnforcementMonitor,
    GpuProcess,
    ProcessView,
    SmMeans,
    proc_start_time,
)
from kvgpu.agent.escapes import OVER_CORES_KILLED, OVER_LIMIT_KILLED, UNENFORCED_KILLED, Backstop, kill_pinned
from kvgpu.agent.exporter import BoundContainer, BoundDevice, DeviceUsage, UsageCollector, make_registry
from kvgpu.core.inventory import Card, NodeInventory
from prometheus_client import generate_latest

U0 = "GPU-a"
POD = "0a1b2c3d-1111-2222-3333-444455556666"
CID = "ab" * 32
MAIN = BoundContainer("team", "nb", POD, "main", "team/nb-main", 1, (BoundDevice(U0, 3000, 30),), True, CID)


@pytest.fixture
def tenant():
    """A live process standing in for the tenant's escaped GPU program."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def view(pid: int, state: str = "unenforced") -> ProcessView:
    return ProcessView(GpuProcess(U0, pid, 1 << 30), state, "PID 8 is not attached to the shim", MAIN, POD, 8)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def killer_for(pid: int, pod: str = POD, **kw) -> tuple[Backstop, Clock]:
    clock = Clock()
    return Backstop(grace_s=10.0, clock=clock, attribute_fn={pid: Attribution(pod, CID, 8)}.get, **kw), clock


def gone(p: subprocess.Popen, timeout: float = 5.0) -> bool:
    try:
        return p.wait(timeout) == -9
    except subprocess.TimeoutExpired:
        return False


def test_kill_pinned_ends_only_the_process_that_started_then(tenant) -> None:
    start = proc_start_time(tenant.pid)
    assert start is not None
    assert not kill_pinned(tenant.pid, start + 1)  # another process now under that PID: spared
    assert tenant.poll() is None
    assert kill_pinned(tenant.pid, start)
    assert gone(tenant)
    assert not kill_pinned(tenant.pid, start)  # reaped: nothing to kill


def test_an_escaped_process_is_killed_once_its_grace_is_over(tenant) -> None:
    killer, clock = killer_for(tenant.pid)
    assert killer.end([view(tenant.pid)]) == []
    clock.t += 5
    assert killer.end([view(tenant.pid)]) == []
    assert tenant.poll() is None  # seen twice, but for 5 s only
    clock.t += 5
    [k] = killer.end([view(tenant.pid)])
    assert k.view.process.host_pid == tenant.pid and k.reason == UNENFORCED_KILLED
    assert gone(tenant)
    assert killer.kills == {(POD, "main"): 1} and killer.over_limit_kills == {}


def test_the_grace_starts_again_when_the_process_was_not_seen_unenforced(tenant) -> None:
    killer, clock = killer_for(tenant.pid)
    killer.end([view(tenant.pid)])
    clock.t += 5
    killer.end([view(tenant.pid, "enforced")])  # attached to its region by then
    clock.t += 6
    assert killer.end([view(tenant.pid)]) == []  # 11 s after the first sighting, but not in a row
    clock.t += 10
    assert len(killer.end([view(tenant.pid)])) == 1
    assert gone(tenant)


@pytest.mark.parametrize("state", ["enforced", "foreign"])
def test_enforced_and_foreign_processes_are_never_killed(tenant, state: str) -> None:
    killer, clock = killer_for(tenant.pid)
    v = view(tenant.pid, state)
    if state == "foreign":
        v = ProcessView(v.process, "foreign", "pod without slices", None, "other", 1)
    for _ in range(5):
        assert killer.end([v]) == []
        clock.t += 10
    assert tenant.poll() is None and killer.kills == {}


def test_a_process_that_left_the_container_is_spared(tenant) -> None:
    killer, clock = killer_for(tenant.pid, pod="another-pod")  # its cgroup now names another pod
    killer.end([view(tenant.pid)])
    clock.t += 20
    assert killer.end([view(tenant.pid)]) == []
    assert tenant.poll() is None


def test_a_reused_pid_starts_its_own_grace(tenant) -> None:
    real = proc_start_time(tenant.pid)
    starts = iter([real - 5, real, real])  # first sighting: an older process under the same PID
    killer, clock = killer_for(tenant.pid)
    killer.start_time = lambda pid: next(starts)
    killer.end([view(tenant.pid)])
    clock.t += 5
    killer.end([])  # the older process is gone: the container's streak ends with it
    clock.t += 5
    assert killer.end([view(tenant.pid)]) == []  # this process was first seen just now
    assert tenant.poll() is None
    clock.t += 10
    assert len(killer.end([view(tenant.pid)])) == 1
    assert gone(tenant)


@pytest.fixture
def relay():
    """Short-lived escaped processes of one container, one after another (what a tenant would run
    to stay under a per-process grace)."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_relay_of_short_lived_processes_is_killed_once_its_container_used_up_the_grace(relay) -> None:
    clock = Clock()
    attribution: dict[int, Attribution] = {}
    killer = Backstop(grace_s=10.0, clock=clock, attribute_fn=attribution.get)
    first, second, third = relay(), relay(), relay()
    for p in (first, second, third):
        attribution[p.pid] = Attribution(POD, CID, 8)
    assert killer.end([view(first.pid)]) == []
    first.kill()
    clock.t += 5
    assert killer.end([view(second.pid)]) == []  # the container has been unenforced for 5 s
    second.kill()
    clock.t += 5
    [k] = killer.end([view(third.pid)])  # seen once, but its container for 10 s in a row
    assert k.view.process.host_pid == third.pid and "outside the kvgpu shim" in k.why
    assert gone(third)
    assert killer.kills == {(POD, "main"): 1}


def test_the_container_streak_ends_when_a_check_sees_none_of_its_processes_unenforced(relay) -> None:
    clock = Clock()
    attribution: dict[int, Attribution] = {}
    killer = Backstop(grace_s=10.0, clock=clock, attribute_fn=attribution.get)
    first, second = relay(), relay()
    for p in (first, second):
        attribution[p.pid] = Attribution(POD, CID, 8)
    killer.end([view(first.pid)])
    clock.t += 5
    killer.end([view(first.pid, "enforced")])  # attached by then: nothing of the container escaped
    clock.t += 5
    assert killer.end([view(second.pid)]) == []
    assert second.poll() is None and first.poll() is None


def test_report_only_kills_nothing_and_keeps_no_timers(tenant) -> None:
    killer, clock = killer_for(tenant.pid, unenforced=False)
    for _ in range(4):
        assert killer.end([view(tenant.pid)]) == []
        clock.t += 10
    assert tenant.poll() is None and killer.kills == {}
    killer.unenforced = True  # switched on: the grace starts now, not at the first report
    assert killer.end([view(tenant.pid)]) == []
    assert tenant.poll() is None


def test_counts_of_containers_that_are_gone_are_dropped() -> None:
    killer = Backstop(kills={(POD, "main"): 2, ("old", "main"): 1}, over_limit_kills={("old", "main"): 1})
    killer.forget({(POD, "main")})
    assert killer.counts() == {"unenforced": {(POD, "main"): 2}, "over_limit": {}, "over_cores": {}}


async def test_the_monitor_kills_records_an_event_and_the_exporter_counts_it(tenant) -> None:
    events = []

    async def on_killed(c, reason, msg):
        events.append((c.pod, c.container, reason, msg))

    killer, clock = killer_for(tenant.pid)
    mon = EnforcementMonitor(
        processes=lambda: [GpuProcess(U0, tenant.pid, 1 << 30)],
        containers=lambda: [MAIN],
        read_region=lambda uid, name: [DeviceUsage(U0, 3000, 1.0, (7,))],  # PID 7 only: 8 escaped
        attribute_fn={tenant.pid: Attribution(POD, CID, 8)}.__getitem__,
        end_escapes=killer.end,
        on_killed=on_killed,
    )
    await mon.check()
    clock.t += 10
    await mon.check()
    assert gone(tenant)
    assert events == [("nb", "main", UNENFORCED_KILLED, f"process 8 killed: it used card {U0} outside the "
                                                        "kvgpu shim (PID 8 is not attached to the shim)")]

    inv = NodeInventory("n", (Card(U0, 0, "NVIDIA H200", 143771, 132),), "nvml")
    col = UsageCollector("n", lambda: [MAIN], lambda: inv, reader=lambda p: [DeviceUsage(U0, 3000, 1.0, (7,))],
                         processes=lambda: mon.snapshot, backstop=killer.counts)
    text = generate_latest(make_registry(col)).decode()
    line = next(x for x in text.splitlines() if x.startswith("kvgpu_container_unenforced_kills_total{"))
    assert 'container="main"' in line and line.endswith(" 1.0")
    line = next(x for x in text.splitlines() if x.startswith("kvgpu_container_over_limit_kills_total{"))
    assert line.endswith(" 0.0")


def held(pid: int, mib: int, inner: int = 8) -> ProcessView:
    """An enforced process of MAIN (3000 MiB limit on U0) holding ``mib`` by NVML."""
    return ProcessView(GpuProcess(U0, pid, mib << 20), "enforced", "", MAIN, POD, inner)


@pytest.fixture
def two():
    """Two live processes of the same container."""
    ps = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    yield ps
    for p in ps:
        p.kill()
        p.wait()


def over_limit_backstop(ps, **kw) -> tuple[Backstop, Clock]:
    clock = Clock()
    attrs = {p.pid: Attribution(POD, CID, 8 + i) for i, p in enumerate(ps)}
    return Backstop(grace_s=10.0, clock=clock, attribute_fn=attrs.get, **kw), clock


def test_a_container_over_its_limit_loses_its_largest_process(two) -> None:
    """NVML shows 2000 + 1200 MiB against a 3000 MiB limit (e.g. the region zeroed by the tenant,
    so the shim granted more): after the grace the 2000 MiB process is killed, then no more."""
    small, large = two
    backstop, clock = over_limit_backstop(two)
    snapshot = [held(small.pid, 1200, 8), held(large.pid, 2000, 9)]
    assert backstop.end(snapshot) == []
    clock.t += 10
    [k] = backstop.end(snapshot)
    assert k.reason == OVER_LIMIT_KILLED and k.view.process.host_pid == large.pid
    assert k.why == (f"process 9 killed (2000 MiB): the container held 3200 MiB of card {U0}, "
                     "over its 3000 MiB limit (NVML)")
    assert gone(large) and small.poll() is None
    assert backstop.over_limit_kills == {(POD, "main"): 1}
    clock.t += 5
    assert backstop.end([held(small.pid, 1200, 8)]) == []  # under the limit now
    assert small.poll() is None


def test_use_within_the_slack_or_for_less_than_the_grace_is_left_alone(two) -> None:
    small, large = two
    backstop, clock = over_limit_backstop(two)
    at_slack = [held(small.pid, 1000, 8), held(large.pid, 2064, 9)]  # 3064 MiB: the limit + 64
    for _ in range(4):
        assert backstop.end(at_slack) == []
        clock.t += 10
    over = [held(small.pid, 1000, 8), held(large.pid, 2100, 9)]
    backstop.end(over)
    clock.t += 5
    for _ in range(6):
        backstop.end(at_slack)  # under for three graces since it was last over: the grace starts again
        clock.t += 5
    clock.t += 1
    assert backstop.end(over) == []
    assert small.poll() is None and large.poll() is None


def test_dipping_under_the_limit_now_and_then_does_not_restart_the_grace(two) -> None:
    small, large = two
    backstop, clock = over_limit_backstop(two)
    over, under = [held(small.pid, 1000, 8), held(large.pid, 9000, 9)], [held(small.pid, 1000, 8)]
    assert backstop.end(over) == []
    clock.t += 5
    assert backstop.end(under) == []  # the large process freed its memory for one check
    clock.t += 5
    [k] = backstop.end(over)  # over since 10 s ago, under only in between
    assert k.view.process.host_pid == large.pid and gone(large)


def test_a_container_over_its_limit_one_check_in_four_is_still_killed(two) -> None:
    small, large = two
    backstop, clock = over_limit_backstop(two)
    over, under = [held(small.pid, 1000, 8), held(large.pid, 9000, 9)], [held(small.pid, 1000, 8)]
    kills = []
    for i in range(8):  # over, under, under, under, over, ...: 15 s between its excesses
        kills += backstop.end(over if i % 4 == 0 else under)
        clock.t += 5
    assert [k.view.process.host_pid for k in kills] == [large.pid] and gone(large)


def crowd(relay, n: int) -> tuple[Backstop, Clock, list[subprocess.Popen]]:
    """``n`` live processes of MAIN (inner PIDs 8, 9, ...) and a backstop that attributes them."""
    clock = Clock()
    ps = [relay() for _ in range(n)]
    table = {p.pid: Attribution(POD, CID, 8 + i) for i, p in enumerate(ps)}
    return Backstop(grace_s=10.0, clock=clock, attribute_fn=table.get), clock, ps


def test_an_excess_spread_over_many_processes_is_ended_in_one_check(relay) -> None:
    backstop, clock, ps = crowd(relay, 5)
    hogs = [held(p.pid, 1024 + i, 8 + i) for i, p in enumerate(ps)]  # 5 x ~1 GiB against 3000 MiB
    backstop.end(hogs)
    clock.t += 10
    killed = backstop.end(hogs)
    # the largest first, until what is left (2 x ~1 GiB) is under the limit
    assert sorted(k.view.process.host_pid for k in killed) == sorted(p.pid for p in ps[2:])
    assert all(gone(p) for p in ps[2:]) and all(p.poll() is None for p in ps[:2])


def test_sm_use_spread_over_many_processes_is_ended_in_one_check(relay) -> None:
    backstop, clock, ps = crowd(relay, 10)
    spread = [busy(p.pid, 10 + i / 10, 8 + i) for i, p in enumerate(ps)]  # 10 x ~10 % against 30 cores
    for _ in range(7):
        killed = backstop.end(spread)
        clock.t += 5.04
    assert len(killed) == 6  # the busiest first: ~104 % down to ~41 %, under 30 + 20
    assert all(gone(p) for p in ps[4:]) and all(p.poll() is None for p in ps[:4])


def test_a_check_without_the_container_s_processes_does_not_end_its_sm_window(two) -> None:
    backstop, clock = cores_backstop(two)
    kills = []
    for i in range(8):  # 100 % in every check but the 4th, which sees no process on the card
        kills.append(backstop.end([] if i == 3 else [busy(two[0].pid, 100)]))
        clock.t += 5.04
        if kills[-1]:
            break
    assert [len(k) for k in kills] == [0] * 6 + [1]  # 30 s after the first sighting: the window held
    assert gone(two[0])


def test_over_limit_report_only_kills_nothing(two) -> None:
    backstop, clock = over_limit_backstop(two, over_limit=False)
    snapshot = [held(two[0].pid, 2000, 8), held(two[1].pid, 2000, 9)]
    for _ in range(3):
        assert backstop.end(snapshot) == []
        clock.t += 10
    assert all(p.poll() is None for p in two)


def test_another_containers_memory_does_not_count(two) -> None:
    other = BoundContainer("team", "nb2", "pod-2", "main", "team/nb2-main", 1, (BoundDevice(U0, 3000, 30),), True,
                           "cd" * 32)
    backstop, clock = over_limit_backstop(two)
    snapshot = [held(two[0].pid, 2000, 8),
                ProcessView(GpuProcess(U0, two[1].pid, 2000 << 20), "enforced", "", other, "pod-2", 9)]
    for _ in range(3):
        assert backstop.end(snapshot) == []
        clock.t += 10


def test_a_kill_the_agent_may_not_send_is_logged_not_counted(tenant, monkeypatch, caplog) -> None:
    import signal

    def denied(fd, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(signal, "pidfd_send_signal", denied)
    assert not kill_pinned(tenant.pid, proc_start_time(tenant.pid))
    assert "needs the KILL capability" in caplog.text
    killer, clock = killer_for(tenant.pid)
    killer.end([view(tenant.pid)])
    clock.t += 10
    assert killer.end([view(tenant.pid)]) == [] and killer.kills == {}
    assert tenant.poll() is None


async def test_the_agent_builds_the_backstop_its_settings_ask_for(sim_agent) -> None:
    agent, posted = sim_agent.make, sim_agent.posted

    a = agent()
    assert a._make_escapes() is not None
    assert a.backstop is not None and a.backstop.time_shared is not None and a.backstop.time_shared() == set()
    assert a.backstop is not None and a.backstop.unenforced and a.backstop.over_limit
    assert a.backstop.grace_s == 10.0 and a.backstop.slack_mib == 64
    a = agent(unenforced="report", over_limit_slack_mib=128)
    assert a._make_escapes() is not None and not a.backstop.unenforced and a.backstop.over_limit
    assert a.backstop.slack_mib == 128
    assert a.backstop.over_cores and a.backstop.cores_slack_pts == 20 and a.backstop.cores_grace_s == 30
    a = agent(unenforced="report", over_limit="report", over_cores_slack_pts=35, over_cores_grace_s=60)
    assert a._make_escapes() is not None and a.backstop.over_cores and not a.backstop.over_limit
    assert a.backstop.cores_slack_pts == 35 and a.backstop.cores_grace_s == 60
    a = agent(unenforced="report", over_limit="report", over_cores="report")
    assert a._make_escapes() is None and a.backstop is None
    with pytest.raises(ValueError, match="over_limit='ignore'"):
        agent(over_limit="ignore")._make_escapes()
    with pytest.raises(ValueError, match="over_cores='ignore'"):
        agent(over_cores="ignore")._make_escapes()
    await a._killed_event(MAIN, OVER_LIMIT_KILLED, "process 9 killed")
    assert posted == [("team", "nb", POD, OVER_LIMIT_KILLED, "Warning", "container main: process 9 killed")]


def busy(pid: int, pct: float, inner: int = 8, state: str = "enforced") -> ProcessView:
    """A process of MAIN (30 % cores on U0) at ``pct`` % of the SMs in NVML's latest sample."""
    return ProcessView(GpuProcess(U0, pid, 64 << 20), state, "", MAIN, POD, inner, sm_util=pct)


def cores_backstop(ps, **kw) -> tuple[Backstop, Clock]:
    clock = Clock()
    table = {p.pid: Attribution(POD, CID, 8 + i) for i, p in enumerate(ps)}
    return Backstop(grace_s=10.0, clock=clock, attribute_fn=table.get, **kw), clock


def test_a_container_over_its_cores_for_the_window_loses_its_busiest_process(two) -> None:
    backstop, clock = cores_backstop(two)
    for _ in range(6):  # 30 % cores; 60 + 35 % of the SMs in every check, for 25.2 s
        assert backstop.end([busy(two[0].pid, 60, 8), busy(two[1].pid, 35, 9)]) == []
        clock.t += 5.04  # a check takes time: checks are never exactly the interval apart
    [k] = backstop.end([busy(two[0].pid, 60, 8), busy(two[1].pid, 35, 9)])  # 30.2 s of checks
    assert k.view.process.host_pid == two[0].pid and k.reason == OVER_CORES_KILLED
    assert k.why == (f"process 8 killed (60 % of the SMs): the container used 95 % of card {U0}'s SMs over 30 s, "
                     "over its 30 % (NVML)")
    assert gone(two[0]) and two[1].poll() is None
    assert backstop.over_cores_kills == {(POD, "main"): 1} and backstop.kills == {}


def test_after_a_kill_the_next_busy_process_is_killed_at_once_and_a_quiet_one_spared(relay) -> None:
    clock = Clock()
    attribution: dict[int, Attribution] = {}
    backstop = Backstop(grace_s=10.0, clock=clock, attribute_fn=attribution.get)
    first, quiet, second = relay(), relay(), relay()
    for i, p in enumerate((first, quiet, second)):
        attribution[p.pid] = Attribution(POD, CID, 8 + i)
    for _ in range(6):
        assert backstop.end([busy(first.pid, 99, 8)]) == []
        clock.t += 5.04
    assert len(backstop.end([busy(first.pid, 99, 8)])) == 1 and gone(first)
    clock.t += 5.04
    assert backstop.end([busy(quiet.pid, 25, 9)]) == []  # the window is still over, this process is not
    clock.t += 5.04
    [k] = backstop.end([busy(quiet.pid, 25, 9), busy(second.pid, 99, 10)])  # the relay's next one
    assert k.view.process.host_pid == second.pid and gone(second)
    assert quiet.poll() is None and backstop.over_cores_kills == {(POD, "main"): 2}


def test_sm_use_is_judged_on_the_mean_over_the_window_not_one_sample(two) -> None:
    backstop, clock = cores_backstop(two)
    # a tenant at its 30 % in windows: NVML's moments swing between 0 and 100, the mean is 38
    for pct in (100, 0, 10, 100, 0, 20, 100, 0, 10, 40, 30, 50, 0):
        assert backstop.end([busy(two[0].pid, pct)]) == []
        clock.t += 5
    # within the slack (30 + 20) for the whole window: spared; one idle check does not reset it
    for pct in (45, 45, 45, 45, 45, 45, 45):
        assert backstop.end([busy(two[0].pid, pct)]) == []
        clock.t += 5
    assert two[0].poll() is None and backstop.over_cores_kills == {}


@pytest.mark.parametrize("kw", [{"over_cores": False}, {"cores_grace_s": 1000}])
def test_over_cores_report_only_or_a_long_window_kills_nothing(two, kw) -> None:
    backstop, clock = cores_backstop(two, **kw)
    for _ in range(10):
        assert backstop.end([busy(two[0].pid, 100)]) == []
        clock.t += 5
    assert two[0].poll() is None


def test_uncapped_containers_and_unsampled_checks_are_never_judged_on_cores(two) -> None:
    backstop, clock = cores_backstop(two)
    uncapped = BoundContainer("team", "nb", POD, "main", "team/nb-main", 1, (BoundDevice(U0, 3000, 0),), True, CID)
    for _ in range(10):
        out = backstop.end([
            ProcessView(GpuProcess(U0, two[0].pid, 1 << 30), "enforced", "", uncapped, POD, 8, sm_util=100),
            ProcessView(GpuProcess(U0, two[1].pid, 1 << 30), "enforced", "", MAIN, POD, 9),  # no sample
        ])
        assert out == []
        clock.t += 5
    assert all(p.poll() is None for p in two)


def test_cards_whose_cores_are_not_a_time_share_are_not_judged_on_sm_use(two) -> None:
    backstop, clock = cores_backstop(two, time_shared=lambda: {"GPU-other"})  # U0 is an MPS card
    for _ in range(10):
        assert backstop.end([busy(two[0].pid, 100)]) == []
        clock.t += 5
    assert two[0].poll() is None
    backstop.time_shared = lambda: {U0}
    for _ in range(6):
        assert backstop.end([busy(two[0].pid, 100)]) == []
        clock.t += 5
    assert len(backstop.end([busy(two[0].pid, 100)])) == 1
    assert gone(two[0])


async def test_the_monitor_gives_the_backstop_each_process_s_latest_sm_sample(tenant) -> None:
    seen = []
    mon = EnforcementMonitor(
        processes=lambda: [GpuProcess(U0, tenant.pid, 1 << 30), GpuProcess(U0, 4242, 1 << 20)],
        containers=lambda: [MAIN],
        read_region=lambda uid, name: [DeviceUsage(U0, 3000, 1.0, (8,))],
        attribute_fn={tenant.pid: Attribution(POD, CID, 8), 4242: Attribution(POD, CID, 9)}.__getitem__,
        utilization=lambda: {(U0, tenant.pid): 87.0},
        end_escapes=lambda views: seen.extend(views) or [],
    )
    await mon.check()
    assert {v.process.host_pid: v.sm_util for v in seen} == {tenant.pid: 87.0, 4242: 0.0}


def test_sm_means_average_every_poll_since_the_last_take_idle_polls_counting_zero() -> None:
    polls = iter([{(U0, 7): 100.0}, {}, {(U0, 7): 100.0, (U0, 8): 30.0}, {}, {}])
    means = SmMeans(lambda: next(polls))
    assert means.take() is None  # nothing polled yet
    for _ in range(5):  # a tenant busy in 2 of 5 seconds, idle whenever the check might look
        means.sample()
    assert means.take() == ({(U0, 7): 40.0, (U0, 8): 6.0}, {})  # no attribution: no containers
    assert means.take() is None


def test_sm_means_per_container_keep_processes_that_ended_before_the_check() -> None:
    polls = iter([{(U0, 7): 100.0}, {(U0, 8): 100.0}, {(U0, 9): 100.0, (U0, 99): 50.0}, {(U0, 10): 60.0}])
    who = {7: Attribution(POD, CID, 1), 8: Attribution(POD, CID, 2), 9: Attribution(POD, CID, 3),
           10: Attribution(POD, CID, 4), 99: Attribution("", "", 99)}
    means = SmMeans(lambda: next(polls), who.__getitem__)
    for _ in range(4):  # a new short-lived process each second; a host process beside them
        means.sample()
    per_process, per_container = means.take()
    assert per_process[(U0, 7)] == 25.0 and per_container == {(U0, POD, CID): 90.0}


async def test_the_monitor_gives_the_backstop_the_means_between_checks_when_it_polls(tenant) -> None:
    seen = []
    polled = iter([{(U0, tenant.pid): 90.0}, {(U0, tenant.pid): 70.0}])
    means = SmMeans(lambda: next(polled))
    mon = EnforcementMonitor(
        processes=lambda: [GpuProcess(U0, tenant.pid, 1 << 30)],
        containers=lambda: [MAIN],
        read_region=lambda uid, name: [DeviceUsage(U0, 3000, 1.0, (8,))],
        attribute_fn={tenant.pid: Attribution(POD, CID, 8)}.__getitem__,
        utilization=lambda: {(U0, tenant.pid): 0.0},  # idle in the latest sample, at the check
        sm_means=means,
        end_escapes=lambda views: seen.extend(views) or [],
    )
    means.sample()
    means.sample()
    await mon.check()
    assert [v.sm_util for v in seen] == [80.0]
    await mon.check()  # no poll since: each process's latest sample
    assert [v.sm_util for v in seen[1:]] == [0.0]


async def test_the_monitor_polls_sm_use_between_its_checks() -> None:
    import asyncio

    polls: list[int] = []
    mon = EnforcementMonitor(processes=lambda: [], containers=lambda: [], read_region=lambda uid, name: None,
                             utilization=lambda: {}, sm_means=SmMeans(lambda: polls.append(1) or {}),
                             sample_s=0.02, interval_s=10.0)
    task = asyncio.create_task(mon.run())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(polls) >= 5  # many polls within one check interval


@pytest.mark.parametrize(("pct", "killed"), [(94, False), (100, True)])
def test_a_large_slice_is_judged_on_half_its_headroom(two, pct: float, killed: bool) -> None:
    big = BoundContainer("team", "nb", POD, "main", "team/nb-main", 1, (BoundDevice(U0, 3000, 90),), True, CID)
    backstop, clock = cores_backstop(two)
    kills = []
    for _ in range(8):  # 90 % cores: the line is 95, not 110 (which nothing could pass)
        kills += backstop.end([ProcessView(GpuProcess(U0, two[0].pid, 1 << 20), "enforced", "", big, POD, 8,
                                           sm_util=pct)])
        clock.t += 5.04
        if kills:
            break
    assert bool(kills) is killed and (gone(two[0]) if killed else two[0].poll() is None)


def test_a_process_measured_then_replaced_under_its_pid_is_not_killed(two) -> None:
    """The snapshot's start time pins the kill: a PID the measured process left to another
    process of the same pod (a sidecar) is spared."""
    backstop, clock = cores_backstop(two)
    real = proc_start_time(two[0].pid)
    stale = replace(busy(two[0].pid, 100), start_time=real - 7)  # measured: an earlier process
    for _ in range(8):
        assert backstop.end([stale]) == []
        clock.t += 5.04
    assert two[0].poll() is None


def test_a_killed_process_still_listed_is_not_signalled_or_counted_again(two) -> None:
    backstop, clock = cores_backstop(two)
    kills = []
    for _ in range(9):  # NVML may list a killed process for a check or two after the kill (the 7th)
        kills += backstop.end([busy(two[0].pid, 100)])
        clock.t += 5.04
    assert len(kills) == 1 and backstop.over_cores_kills == {(POD, "main"): 1}


def test_a_failing_rule_does_not_cost_the_others(tenant, caplog) -> None:
    killer, clock = killer_for(tenant.pid)

    def broken() -> set[str]:
        raise RuntimeError("inventory gone")

    killer.time_shared = broken
    killer.end([view(tenant.pid)])
    clock.t += 10
    assert len(killer.end([view(tenant.pid)])) == 1 and gone(tenant)  # the unenforced rule still acts
    assert "backstop rule _end_over_cores failed" in caplog.text


def test_a_graphics_only_process_counts_for_memory_but_is_never_called_unenforced() -> None:
    from kvgpu.agent.enforcement import classify

    gl = GpuProcess(U0, 4242, 5000 << 20, compute=False)
    [v] = classify([gl], [MAIN], {(POD, "main"): [DeviceUsage(U0, 3000, 1.0, (7,))]},
                   {4242: Attribution(POD, CID, 8)}.__getitem__)
    assert v.state == "enforced" and v.container == MAIN and "graphics" in v.reason


def test_a_relay_of_processes_gone_before_each_check_is_still_judged_on_its_container(relay) -> None:
    """Each process of the relay lives a second or two; the check sees at most the newest, or
    none: the container's polled mean (ended processes included) is what is judged."""
    clock = Clock()
    attribution: dict[int, Attribution] = {}
    measured: dict = {}
    backstop = Backstop(grace_s=10.0, clock=clock, attribute_fn=attribution.get, container_sm=lambda: measured)
    kills = []
    for i in range(12):
        measured = {(POD, "main", U0): (MAIN, 95.0)}  # what the polls found since the last check
        listed = []
        if i % 2:  # every other check one young process is still there, idle so far
            p = relay()
            attribution[p.pid] = Attribution(POD, CID, 8)
            listed = [busy(p.pid, 0.0)]
        kills += backstop.end(listed)
        clock.t += 5.04
    assert kills and all(k.reason == OVER_CORES_KILLED for k in kills)


async def test_the_monitor_hands_the_backstop_each_container_s_polled_use() -> None:
    polled = iter([{(U0, 5001): 100.0}, {(U0, 5002): 80.0}])  # both ended before the check
    who = {5001: Attribution(POD, CID, 8), 5002: Attribution(POD, CID, 9)}
    means = SmMeans(lambda: next(polled), who.__getitem__)
    mon = EnforcementMonitor(processes=lambda: [], containers=lambda: [MAIN], read_region=lambda uid, name: None,
                             utilization=lambda: {}, sm_means=means)
    means.sample()
    means.sample()
    await mon.check()
    assert mon.container_sm == {(POD, "main", U0): (MAIN, 90.0)}


def test_in_a_shared_claim_the_consumer_that_took_it_over_loses_a_process_not_its_neighbour(relay) -> None:
    """Two pods share a DRA claim of 3000 MiB: the neighbour's one process holds 1400 MiB, the
    other pod spreads 1800 MiB over two processes of 900. Over the limit, the process that goes
    is one of the pod holding the most, though the neighbour's process is the largest."""
    region = "/state/claims/uid-a/region"
    shared = (BoundDevice(U0, 3000, 30),)
    neighbour = BoundContainer("team", "a", "pod-a", "main", "team/a", 1, shared, True, "aa" * 32, region_dir=region)
    taker = BoundContainer("team", "b", "pod-b", "main", "team/a", 1, shared, True, "bb" * 32, region_dir=region)
    first, *others = [relay() for _ in range(3)]
    attrs = {first.pid: Attribution("pod-a", "aa" * 32, 8)} | {p.pid: Attribution("pod-b", "bb" * 32, 9 + i)
                                                               for i, p in enumerate(others)}
    clock = Clock()
    backstop = Backstop(grace_s=10.0, clock=clock, attribute_fn=attrs.get)
    snapshot = [ProcessView(GpuProcess(U0, first.pid, 1400 << 20), "enforced", "", neighbour, "pod-a", 8)] + [
        ProcessView(GpuProcess(U0, p.pid, 900 << 20), "enforced", "", taker, "pod-b", 9 + i)
        for i, p in enumerate(others)]
    assert backstop.end(snapshot) == []
    clock.t += 10
    [k] = backstop.end(snapshot)
    assert k.view.container is taker and k.reason == OVER_LIMIT_KILLED
    assert first.poll() is None and backstop.over_limit_kills == {("pod-b", "main"): 1}
