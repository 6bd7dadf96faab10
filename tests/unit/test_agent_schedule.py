"""The agent's compute schedule (issue 14): the pure layout, the plan from claims and region
heartbeats, and the atomic writer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvgpu.agent.schedule import (
    STALE_NS,
    Activity,
    Scheduler,
    Tenant,
    TenantSource,
    Window,
    decode,
    encode,
    layout,
    plan,
    uncapped_reservation,
    write_schedule,
)

S = 1_000_000_000


def windows(ts: list[Tenant]) -> list[tuple[str, int, int]]:
    return [(w.key, w.offset_pm, w.len_pm) for w in layout(ts)]


@pytest.mark.parametrize(
    "tenants, expect",
    [
        ([("a", 1, 300), ("b", 1, 700)], [("a", 0, 300), ("b", 300, 700)]),
        ([("a", 1, 700), ("b", 0, 300)], [("b", 0, 300), ("a", 300, 700)]),  # high priority first
        ([("a", 1, 800), ("b", 0, 600)], [("b", 0, 600), ("a", 600, 400)]),  # low squeezed into the rest
        ([("a", 0, 800), ("b", 0, 600)], [("a", 0, 571), ("b", 571, 428)]),  # high alone overcommits
        ([("a", 1, 500), ("b", 1, 700), ("c", 0, 1000)], [("c", 0, 1000), ("a", 1000, 0), ("b", 1000, 0)]),
        ([], []),
    ],
)
def test_layout_rule(tenants, expect) -> None:
    assert windows([Tenant(k, p, s, i) for i, (k, p, s) in enumerate(tenants)]) == expect


def test_layout_orders_equals_by_join_time_and_never_exceeds_the_period() -> None:
    got = windows([Tenant("late", 1, 400, 20), Tenant("early", 1, 400, 10), Tenant("mid", 1, 400, 15)])
    assert [k for k, _, _ in got] == ["early", "mid", "late"]
    assert sum(n for _, _, n in got) <= 1000 and all(o + n <= 1000 for _, o, n in got)
    many = layout([Tenant(f"t{i}", i % 2, 90, i) for i in range(40)])
    assert len(many) == 32  # VGPU_SCHED_MAX


def test_encode_decode_round_trip_and_refusals() -> None:
    ws = [Window("ns/a", 0, 300), Window("ns/b", 300, 700)]
    data = encode(ws)
    assert len(data) == 16 + 2 * 328 and decode(data) == ws
    for bad in (data[:8], data[:-1], b"\0" * len(data)):
        with pytest.raises(ValueError):
            decode(bad)


def src(key: str, prio: int, cores: int, uuid: str = "GPU-1") -> TenantSource:
    return TenantSource(key, prio, {uuid: cores}, Path(f"/r/{key}"))


def test_plan_trusts_the_claim_and_uses_the_region_only_for_liveness() -> None:
    now = 100 * S
    sources = [src("ns/a", 1, 30), src("ns/b", 1, 70), src("ns/idle", 0, 50), src("ns/nolimit", 1, 0)]
    act = {
        "ns/a": {"GPU-1": Activity(now - 5 * S, now - S // 4)},
        "ns/b": {"GPU-1": Activity(1, now)},  # claims to have joined first: not believed
        "ns/idle": {"GPU-1": Activity(1, now - STALE_NS)},  # silent 3 s: out
        "ns/nolimit": {"GPU-1": Activity(1, now)},  # no limit, low priority: never in the schedule
    }
    first = {("ns/a", "GPU-1"): 50 * S}
    layouts, seen = plan(sources, act, first, now)
    assert [(w.key, w.offset_pm, w.len_pm) for w in layouts["GPU-1"]] == [("ns/a", 0, 300), ("ns/b", 300, 700)]
    assert seen == {("ns/a", "GPU-1"): 50 * S, ("ns/b", "GPU-1"): now}
    # a region that lists a card its claim does not have changes nothing
    act["ns/a"]["GPU-9"] = Activity(1, now)
    assert set(plan(sources, act, seen, now)[0]) == {"GPU-1"}
    # the agent's first pass keeps the regions' join order (never later than now)
    _, seen0 = plan(sources, act, {}, now, fresh_start=True)
    assert seen0[("ns/b", "GPU-1")] == 1 and seen0[("ns/a", "GPU-1")] == now - 5 * S
    # the priority is the claim's: a region cannot make a tenant priority 0
    layouts, _ = plan([src("ns/a", 1, 70), src("ns/b", 0, 70)],
                      {"ns/a": {"GPU-1": Activity(1, now)}, "ns/b": {"GPU-1": Activity(2, now)}}, {}, now)
    assert [(w.key, w.len_pm) for w in layouts["GPU-1"]] == [("ns/b", 700), ("ns/a", 300)]


def test_an_uncapped_high_priority_tenant_leaves_low_priority_the_rest() -> None:
    """Issue 21: a priority-0 tenant with no limit (cores 0 or 100) is listed with what it
    measurably uses (plus headroom), so a low-priority tenant gets what it leaves."""
    now = 100 * S
    for cores in (0, 100):
        sources = [src("ns/hi", 0, cores), src("ns/lo", 1, 50)]
        for busy, lo_len in ((1000, 0), (600, 320), (0, 500)):
            act = {"ns/hi": {"GPU-1": Activity(1, now, busy)}, "ns/lo": {"GPU-1": Activity(2, now)}}
            seen = {("ns/hi", "GPU-1"): now - 2 * S, ("ns/lo", "GPU-1"): now - 2 * S}
            layouts, _ = plan(sources, act, seen, now)
            w = {x.key: (x.offset_pm, x.len_pm) for x in layouts["GPU-1"]}
            assert w["ns/hi"] == (0, uncapped_reservation(busy)), (cores, busy)
            assert w["ns/lo"] == (uncapped_reservation(busy), lo_len), (cores, busy)
            # in its first second (as the agent saw it) it keeps the card: its shim has not
            # measured what it uses yet, and low priority would take the card meanwhile
            layouts, _ = plan(sources, act, {**seen, ("ns/hi", "GPU-1"): now - S // 2}, now)
            assert [(x.key, x.len_pm) for x in layouts["GPU-1"]] == [("ns/hi", 1000), ("ns/lo", 0)]
    # a low-priority tenant without a limit is never listed (nothing to leave it)
    layouts, _ = plan([src("ns/x", 1, 100)], {"ns/x": {"GPU-1": Activity(1, now, 900)}}, {}, now)
    assert layouts == {}


def test_writer_replaces_atomically_mode_0644_and_not_through_links(tmp_path: Path) -> None:
    d = tmp_path / "sched"
    d.mkdir(mode=0o777)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, d / "GPU-1.sched")  # left by a tenant when the directory was writable
    os.symlink(victim, d / ".GPU-1.sched.tmp")
    p = write_schedule(d, "GPU-1", encode([Window("ns/a", 0, 300)]))
    assert victim.read_text() == "keep" and not p.is_symlink()
    assert stat.S_IMODE(p.stat().st_mode) == 0o644 and stat.S_IMODE(d.stat().st_mode) == 0o755
    assert decode(p.read_bytes()) == [Window("ns/a", 0, 300)]
    ino = p.stat().st_ino
    write_schedule(d, "GPU-1", encode([]))
    assert p.stat().st_ino != ino and decode(p.read_bytes()) == []  # a new file, renamed over
    assert sorted(x.name for x in d.iterdir()) == ["GPU-1.sched"]
    with pytest.raises(ValueError):
        write_schedule(d, "../etc", b"")


def test_scheduler_writes_changes_only_and_empties_cards_that_go_quiet(tmp_path: Path) -> None:
    now = [10 * S]
    act = {"ns/a": {"GPU-1": Activity(1, now[0])}}
    sch = Scheduler(tmp_path, lambda: [src("ns/a", 1, 30)], lambda: ["GPU-1", "GPU-2"],
                    read=lambda p: act.get(p.name and f"ns/{p.name}", {}), clock=lambda: now[0])
    sch.tick()
    f1, f2 = tmp_path / "GPU-1.sched", tmp_path / "GPU-2.sched"
    assert decode(f1.read_bytes()) == [Window("ns/a", 0, 300)] and decode(f2.read_bytes()) == []
    ino = f1.stat().st_ino
    now[0] += S
    sch.tick()
    assert f1.stat().st_ino == ino  # unchanged content: not rewritten
    f1.write_bytes(encode([Window("ns/a", 0, 1000)]))  # a pod with the old writable mount
    sch.tick()
    assert decode(f1.read_bytes()) == [Window("ns/a", 0, 300)]  # put back at the next pass
    now[0] += STALE_NS
    sch.tick()
    assert decode(f1.read_bytes()) == []


def test_one_claim_name_on_two_cards_from_two_regions_keeps_both(tmp_path: Path) -> None:
    """A VGPUClaim and a ResourceClaim may share ``<namespace>/<name>`` on cards of two pools."""
    now = 10 * S
    regions = {"dp": {"GPU-1": Activity(1, now)}, "dra": {"GPU-2": Activity(1, now)}}
    srcs = [TenantSource("ns/a", 1, {"GPU-1": 30}, tmp_path / "dp"),
            TenantSource("ns/a", 1, {"GPU-2": 40}, tmp_path / "dra")]
    sch = Scheduler(tmp_path / "sched", lambda: srcs, read=lambda p: regions[p.name], clock=lambda: now)
    assert sch.tick() == {"GPU-1": [Window("ns/a", 0, 300)], "GPU-2": [Window("ns/a", 0, 400)]}


def test_sources_come_from_the_claim_annotations(tmp_path: Path) -> None:
    from kvgpu.agent.schedule import sources_of
    from kvgpu.agent.usage import containers_of_pod
    from kvgpu.core import keys

    text = "v1;claim=ns/p-main;priority=0;dev=GPU-1,1000,30"
    pod = {"metadata": {"namespace": "ns", "name": "p", "uid": "uid-1",
                        "annotations": {keys.claim_annotation("main"): text}},
           "spec": {"containers": [{"name": "main"}]}, "status": {"phase": "Running"}}
    (s,) = sources_of(containers_of_pod(pod), tmp_path)
    assert s == TenantSource("ns/p-main", 0, {"GPU-1": 30}, tmp_path / "uid-1" / "main" / "vgpu.region")
