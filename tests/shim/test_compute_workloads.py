"""The compute limiter per workload class (issue 21), on the stub card: each kernel runs for
its gridDimX microseconds (STUB_GRID_US=1) on one FIFO shared by every process, and ``cuprog
work`` reports the share of wall time its own kernels ran (the stub's completed GPU time), per
second too, and request latencies. The share is the goal's measure directly (no native run
needed: a saturating loop keeps the stub card 100 % busy alone).

Tolerances are for a loaded 2-core CI machine: ±5 points where the GPU goal is ±3."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import claim, uuid


@pytest.fixture
def card(box):
    box.base_env["STUB_GRID_US"] = "1"
    # event pairs cost what they cost on the H200 (the limiter takes that off each busy segment)
    box.base_env["STUB_EVENT_GAP_US"] = "5"
    return box


def work(box, env, *args: str, timeout: float = 60) -> dict[str, Any]:
    return box.json("work", *args, env=env, timeout=timeout)[0]


def region(box, tag: str) -> Path:
    d = box.dir / f"region-{tag}"
    d.mkdir(exist_ok=True)
    return d


def alone(box, cores: int, tag: str, prio: int = 1) -> dict[str, str]:
    return box.env(claim((0, 1000, cores), name=f"ns/{tag}", priority=prio), KVGPU_REGION_DIR=region(box, tag))


@contextlib.contextmanager
def busy_cores(on: bool = True) -> Iterator[None]:
    """A busy loop on every core meanwhile (on): launching threads get preempted between the gate
    and the driver."""
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count() or 2)] if on else []
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_saturating_gets_its_share_evenly(card) -> None:
    r = work(card, alone(card, 30, "sat"), "sat", "3.2", "2000", "20")
    print("saturating at 30 %:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 30) <= 5, r
    assert all(abs(x * 100 - 30) <= 8 for x in r["per_sec"]), r


def test_the_first_second_holds_its_share_too(card) -> None:
    """A tenant starts with a full bucket (credit banked while idle), spent in its first second
    on top of its share: at 70 % a bucket of a period's share made that second 77 %. Alone the
    bucket is at most 25 ms of GPU time (2.5 points)."""
    r = work(card, alone(card, 70, "sat70"), "sat", "3.2", "2000", "20")
    print("saturating at 70 %:", r["busy"], r["per_sec"])
    assert all(abs(x * 100 - 70) <= 5 for x in r["per_sec"]), r


@pytest.mark.parametrize("nvml_pm, lo, hi", [(880, 30 / 0.88, 30 / 0.88), (800, 30 / 0.85, 30 / 0.85),
                                              (1300, 30 / 1.15, 30)])
def test_the_limit_is_a_share_of_the_cards_busy_time(card, nvml_pm, lo, hi) -> None:
    """The stub's NVML counts nvml_pm / 1000 of the kernels' time as busy (a real card does not
    count the short gaps between back-to-back kernels, which event pairs include): alone on the
    card, the tenant gets its limit of the busy time NVML shows, within the bounds (at most
    1 / 0.85 of its limit in kernel time; at least 1 / 1.15 of it, and less than its limit only
    as far as gap tracking took an event overhead off its busy segments: the stub's events
    have none, so the calibration gives some of it back). The first second runs as measured
    (calibration starts after half a second). Kernels of 100 us: kernels of 200 us or more are
    measured one by one, exactly, and not calibrated."""
    env = alone(card, 30, f"cal{nvml_pm}")
    env["STUB_NVML_BUSY_PM"] = str(nvml_pm)
    r = work(card, env, "sat", "4.2", "100", "200")
    steady = sum(r["per_sec"][1:]) / len(r["per_sec"][1:]) * 100  # kernels' share after the first second
    print(f"NVML at {nvml_pm} pm, 30 %: kernels {steady:.1f} (expected {lo:.1f}-{hi:.1f}), per second {r['per_sec']}")
    assert lo - 2 <= steady <= hi + 2, r


@pytest.mark.parametrize("sync_every", ["1", "10"])
def test_long_kernels_are_charged_their_duration(card, sync_every) -> None:
    """~100 ms kernels, the app waits for each (cuStreamSynchronize) or for every tenth: before,
    the drain never saw them and the tenant ran at 98 % of native under a 10 % limit. Evenly: one
    kernel a second, the first second included (a kernel that passed on part of a bucket let the
    next start a bucket early: two in the first second, 16 % on the H200; a new container's
    first ten kernels, queued before the first was measured, ran back to back: 90 %)."""
    r = work(card, alone(card, 10, f"long{sync_every}"), "sat", "4.2", "100000", sync_every)
    print(f"100 ms kernels at 10 %, a sync every {sync_every}:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 10) <= 5, r
    assert all(x <= 0.15 for x in r["per_sec"]), r


def not_delayed(native: dict[str, Any], limited: dict[str, Any]) -> bool:
    """A tenant under its share waits for no window: its requests take what they take natively.
    The margins are wide for a loaded 2-core CI machine (scheduling jitter of a few ms at the tail)
    and still far below a window's wait (the period is 100 ms; the old limiter's p50 was 50 ms)."""
    return (limited["p50_ms"] <= native["p50_ms"] + 3
            and limited["p99_ms"] <= 1.5 * native["p99_ms"] + 10)


@pytest.mark.parametrize("hidden", ["0", "1"])
def test_waits_the_shim_does_not_see(card, hidden) -> None:
    """On the H200 the CUDA runtime's cudaDeviceSynchronize never reached the hooked
    cuCtxSynchronize (it uses the driver's private export table): 163 ms kernels ran unlimited
    under 10 % and 6 ms requests under 30 % waited 59 ms. Long kernels are therefore measured one
    by one (an event before and after each), whatever waits for them."""
    env = alone(card, 10, f"hid{hidden}")
    env["CUPROG_HIDDEN_SYNC"] = hidden
    r = work(card, env, "sat", "4.2", "100000", "1")
    print(f"100 ms kernels at 10 %, hidden sync {hidden}:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 10) <= 5, r
    native = work(card, card.env(shim=False), "req", "2", "3000", "2", "50")
    env = alone(card, 30, f"hreq{hidden}")
    env["CUPROG_HIDDEN_SYNC"] = hidden
    q = work(card, env, "req", "3", "3000", "2", "50")
    print("requests of 2 x 3 ms, native p99", native["p99_ms"], "limited", q["p50_ms"], q["p99_ms"])
    assert not_delayed(native, q), (native, q)


def test_long_kernels_without_the_apps_sync_are_charged_too(card) -> None:
    r = work(card, alone(card, 20, "long2"), "sat", "3.2", "50000", "1000000")
    print("50 ms kernels, no sync, at 20 %:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 20) <= 6, r


@pytest.mark.parametrize("hidden", ["0", "1"])
def test_requests_of_many_short_kernels_are_not_delayed(card, hidden) -> None:
    """The H200's inference request: ~114 kernels of ~50 us, then cudaDeviceSynchronize (a wait
    the hooks do not see), every 50 ms under a 30 % limit. A batch closed on an idle stream had
    its launch count passed with the upper-bound flag still set, so its whole span, idle time
    included, was charged when the estimate was odd: p99 117 ms against 6 ms natively."""
    native = work(card, card.env(shim=False), "req", "2", "50", "114", "50")
    env = alone(card, 30, f"short{hidden}")
    env["CUPROG_HIDDEN_SYNC"] = hidden
    r = work(card, env, "req", "4", "50", "114", "50")
    print("114 x 50 us requests: native p99", native["p99_ms"], "limited", r["p50_ms"], r["p99_ms"])
    assert not_delayed(native, r), (native, r)


def test_calibration_costs_a_tenant_under_its_share_nothing(card) -> None:
    """Requests of 10 ms every 50 ms under a 30 % limit (two thirds of the share, never held
    back), with an NVML whose utilization query takes 30 ms (under contention): the calibration's
    calls are made only where a launch waits for credit anyway, so no request pays for them."""
    native = work(card, card.env(shim=False), "req", "2", "2500", "4", "50")
    env = alone(card, 30, "calcost")
    env["STUB_NVML_DELAY_US"] = "30000"
    r = work(card, env, "req", "4", "2500", "4", "50")
    print("4 x 2.5 ms requests, NVML 30 ms: native p99", native["p99_ms"], "limited", r["p50_ms"], r["p99_ms"])
    assert not_delayed(native, r), (native, r)
    assert r["p99_ms"] < native["p99_ms"] + 25, (native, r)


def test_a_tenant_under_its_share_is_not_delayed(card) -> None:
    """6 ms of GPU work every 50 ms (12 %) under a 30 % limit: before, every request waited for
    the tenant's window (p50 50 ms against 6 ms native)."""
    native = work(card, card.env(shim=False), "req", "2", "1000", "6", "50")
    r = work(card, alone(card, 30, "req"), "req", "3", "1000", "6", "50")
    print("requests native p50/p99", native["p50_ms"], native["p99_ms"], "limited", r["p50_ms"], r["p99_ms"])
    assert not_delayed(native, r), (native, r)
    assert abs(r["busy"] - native["busy"]) <= 0.02, (native, r)


def test_several_streams_share_one_limit(card) -> None:
    r = work(card, alone(card, 30, "streams"), "sat", "3.2", "2000", "20", "4")
    print("4 streams at 30 %:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 30) <= 6, r


@contextlib.contextmanager
def schedule_writer(sched: Path, sources: list[Any]) -> Iterator[Any]:
    """The node agent's schedule writer (the real Scheduler) for `sources` on card 0, serving
    every 100 ms in a thread meanwhile."""
    from kvgpu.agent.schedule import Scheduler

    writer = Scheduler(sched, lambda: sources, lambda: [uuid(0)])
    stop = threading.Event()
    t = threading.Thread(target=writer.serve, args=(stop, 0.1), daemon=True)
    t.start()
    try:
        yield writer
    finally:
        stop.set()
        t.join()


def tenants(box, specs: list[tuple[int, int]], args: list[str], secs: float | list[float] = 3.2,
            modes: list[tuple[str, list[str]]] | None = None,
            extra_env: list[dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """Containers on card 0 at once, (cores, priority) each, with the node agent's schedule
    writer running in a thread (the real Scheduler over their claims and regions). The stub card
    time-slices between them as a GPU does between processes (STUB_TIMESLICE): a kernel running
    beside another tenant's takes twice its wall time, and an event pair around it says so."""
    from kvgpu.agent.schedule import TenantSource

    sched = box.dir / "sched"
    sources, envs = [], []
    for i, (cores, prio) in enumerate(specs):
        rd = region(box, f"t{i}")
        sources.append(TenantSource(f"ns/t{i}", prio, {uuid(0): cores}, rd / "vgpu.region"))
        envs.append(box.env(claim((0, 1000, cores), name=f"ns/t{i}", priority=prio),
                            KVGPU_SCHED_DIR=sched, KVGPU_REGION_DIR=rd, STUB_TIMESLICE="1",
                            **(extra_env[i] if extra_env else {})))
    with schedule_writer(sched, sources) as writer:
        runs = modes or [("sat", args)] * len(envs)
        each = secs if isinstance(secs, list) else [secs] * len(envs)
        procs = [subprocess.Popen([str(box.kit.cuprog), "work", mode, str(sec), *margs], env=env,
                                  stdout=subprocess.PIPE, text=True)
                 for env, (mode, margs), sec in zip(envs, runs, each, strict=True)]
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
        box.last_layout = writer.tick()
    print(specs, [round(o["busy"] * 100, 1) for o in outs], box.last_layout.get(uuid(0)))
    return outs


@pytest.mark.parametrize("specs, expect", [
    ([(30, 1), (70, 1)], [30, 70]),
    ([(20, 1), (30, 1), (50, 1)], [20, 30, 50]),
    ([(70, 1), (50, 1)], [58.3, 41.7]),          # overcommitted: scaled into the card
    ([(70, 1), (70, 0)], [30, 70]),              # high priority first, low gets what is left
])
def test_co_tenants_split_the_card(card, specs, expect) -> None:
    outs = tenants(card, specs, ["2000", "20"])
    for o, e in zip(outs, expect, strict=True):
        assert abs(o["busy"] * 100 - e) <= 6, (specs, [o["busy"] for o in outs])


def test_uncapped_high_priority_leaves_low_priority_only_the_rest(card) -> None:
    """Issue 21: a priority-0 tenant with no limit was never in the schedule, so the low-priority
    one kept running beside it. Now it is measured, the agent lists what it uses, and low
    priority gets what it leaves: nothing while it saturates the card."""
    hi, lo = tenants(card, [(0, 0), (50, 1)], ["2000", "20"])
    assert hi["busy"] >= 0.85 and lo["busy"] <= 0.10, (hi, lo)


def test_low_priority_yields_at_once_when_high_priority_wakes(card) -> None:
    """An uncapped high-priority tenant in light use (listed with a small busy share, so low
    priority has a window), then paused (no CUDA call: its next refresh measures the pause), then
    saturating, as a job that set up, waited at a barrier and started: it takes the card back at
    once. It measures its own saturating phase only; what low priority kept of it is missing."""
    hi, lo = tenants(card, [(0, 0), (50, 1)], ["2000", "20"], secs=[3.0, 5.5],
                     extra_env=[{"CUPROG_IDLE_MS": "1200", "CUPROG_PAUSE_MS": "500"}, {}])
    assert hi["busy"] >= 0.9, (hi, lo)



def test_processes_of_a_container_share_its_compute_limit(card) -> None:
    """Three processes of one container, each a launch-bound loop (50 us kernels every 150 us:
    a third of the card alone), under the container's 30 %: the credit is the container's, so
    together they get 30 %. Each process alone measures a tenth of the card, far under the share:
    it must still be charged as precisely as one at the limit (a process's own busy share does
    not decide that the container is under its share)."""
    env = alone(card, 30, "procs3")
    procs = [subprocess.Popen([str(card.kit.cuprog), "work", "gap", "3.2", "50", "150", "50"], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
    busy = [o["busy"] for o in outs]  # each process's own GPU time, a share of its run
    print("three launch-bound processes of one container at 30 %:", busy, [o["per_sec"] for o in outs])
    assert 30 - 5 <= sum(busy) * 100 <= 30 + 4, busy
    # every whole second, summed over the processes (they start within a few ms of each other)
    assert all(sum(x) * 100 <= 30 + 8 for x in zip(*(o["per_sec"] for o in outs), strict=False)), outs


@pytest.mark.parametrize("kus, gap_us, mix, every", [(100, 150, "0", 50), (300, 100, "0", 50), (80, 120, "1", 50),
                                                   (40, 100, "1", 50), (100, 200, "0", 1), (60, 150, "1", 3)])
def test_launch_bound_work_is_charged_its_gpu_time(card, kus, gap_us, mix, every) -> None:
    """A framework whose launches are slower than its kernels (GPT training on the H200: the card
    48 % busy natively) leaves the GPU idle between them; the limit is a share of GPU time, so
    the idle gaps must not be charged. Before, the batch's event span counted them: 17 % busy
    under a 30 % limit. `every`: the app waits after so many launches; after each one (a
    torch.compile'd step, then host code, then the wait: the kernel has ended before the wait
    begins) the close lands on an idle stream, and its span would count the host time (25 %
    busy under 30 % on the H200)."""
    card.base_env["CUPROG_MIX"] = mix  # kernels of one length, or mixed as in a training step
    native = work(card, card.env(shim=False), "gap", "2", str(kus), str(gap_us), str(every))
    r = work(card, alone(card, 30, f"gap{kus}-{every}"), "gap", "3.2", str(kus), str(gap_us), str(every))
    target = min(30.0, native["busy"] * 100)
    print(f"launch-bound {kus}/{gap_us} us: native {native['busy']:.3f}, at 30 %: {r['busy']:.3f}", r["per_sec"])
    assert abs(r["busy"] * 100 - target) <= 5, (native, r)


@pytest.mark.parametrize("kus, gap_us", [(50, 75), (60, 90), (60, 80)])
def test_the_gap_trackings_own_cpu_time_is_not_charged_as_idle(card, kus, gap_us) -> None:
    """A gap-tracked batch queries an event before each launch and records one after it: CPU time
    that delays every launch, so where the GPU waits for launches its gaps grow, and the busy
    share it finds is below what the untracked batches it charges have. On the H200 host that fed
    a GPT loop fastest (kernels of 12-17 us every ~20 us, where the tracking's ~1.7 us shows)
    that ran 3.4 points over a 50 % limit. Here the query costs 120 us of CPU
    (STUB_QUERY_US), so the effect is large: with that time counted as idle the tenant ran
    7-13 points over its 30 %."""
    card.base_env["STUB_QUERY_US"] = "120"
    native = work(card, card.env(shim=False), "gap", "2", str(kus), str(gap_us), "50")
    r = work(card, alone(card, 30, f"track{kus}"), "gap", "3.2", str(kus), str(gap_us), "50")
    target = min(30.0, native["busy"] * 100)
    print(f"tracked at {kus}/{gap_us} us: native {native['busy']:.3f}, at 30 %: {r['busy']:.3f}", r["per_sec"])
    # over the target is what this guards against (tracking time taken for idle time); under it,
    # a loaded CI machine's stalls are charged as the 120 us queries' CPU time (25.1 once in CI)
    assert target - 6 <= r["busy"] * 100 <= target + 3, (native, r)


def test_work_on_several_non_blocking_streams_is_measured(card) -> None:
    """A batch on several streams was closed on the legacy stream, which does not follow
    non-blocking streams (torch's side streams are), and charged its launches at the estimate,
    which only single-stream batches move: a tenant that trained the estimate on 5 us kernels on
    one stream, then ran 500 us kernels on two side streams, ran at 38.6 % under 30 %. Each
    stream of a batch now has its own event pair."""
    card.base_env.update(CUPROG_NB_STREAMS="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5")
    r = work(card, alone(card, 30, "nbstreams"), "sat", "3.2", "500", "20", "2")
    print("two non-blocking streams after 5 us kernels, at 30 %:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 30) <= 4, r
    assert all(abs(x * 100 - 30) <= 8 for x in r["per_sec"]), r


@pytest.mark.parametrize("every", ["3", "7", "50"])
def test_event_records_that_fail_keep_the_limit(card, every) -> None:
    """Every N-th cuEventRecord of the process fails (the stub's STUB_EVENT_FAIL): a batch whose
    join event failed was closed on the legacy stream alone, which does not follow non-blocking
    streams, and settled at that span or the estimate: a tenant that trained the estimate on 5 us
    kernels and then ran 2 ms kernels on two non-blocking streams went past its limit. Every
    measured stream of such a batch is now closed too, and the spans that can be read raise the
    lower bound."""
    card.base_env.update(CUPROG_NB_STREAMS="1", CUPROG_SIDE_ONLY="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5",
                         CUPROG_LEAD_KUS="5", CUPROG_THREADS="2", CUPROG_TINY_THREADS="1", STUB_EVENT_FAIL=every)
    r = work(card, alone(card, 30, f"evfail{every}"), "sat", "3.2", "2000", "5", "2")
    print(f"every {every}th event record failing, two non-blocking streams, at 30 %:", r["busy"], r["per_sec"])
    assert r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


@pytest.mark.parametrize("streams", ["3", "6", "8"])
def test_work_on_more_streams_than_a_batch_measures_is_measured(card, streams) -> None:
    """A batch measures at most VGPU_BATCH_STREAMS streams. Past that it was closed on the legacy
    stream, a lower bound that never moves the estimate: a tenant that trained the estimate on
    5 us kernels, then ran 2 ms kernels round-robin on more streams than that (a 5 us kernel
    first after each sync of five, which keeps the first-kernel samples low), was charged at the
    5 us estimate: 98 % busy under 30 % on 7 side streams. A launch on one stream too many now
    closes the batch and opens the next. The limit holds; consecutive batches on different
    streams overlap on the GPU and the overlap is charged to both, so such work runs at 25-26 %
    (the same on 2 side streams, within a batch's 4): an over-charge, bounded here."""
    card.base_env.update(CUPROG_NB_STREAMS="1", CUPROG_SIDE_ONLY="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5",
                         CUPROG_LEAD_KUS="5")
    r = work(card, alone(card, 30, f"nb{streams}"), "sat", "3.2", "2000", "5", streams)
    print(f"{streams} streams after 5 us kernels, at 30 %:", r["busy"], r["per_sec"])
    assert 22 <= r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


@pytest.mark.parametrize("loaded", [False, True])
def test_threads_on_streams_of_their_own_are_measured(card, loaded) -> None:
    """Two threads, each launching 2 ms kernels on a non-blocking stream of its own, after 5 us
    kernels that set the estimate (and a 5 us kernel first after each sync): the limit holds.
    Loaded: a busy loop on every core meanwhile, so the threads are preempted between the gate
    and the driver. A launch counted in a batch and preempted before it reached the driver was
    then closed out by the other thread: the batch's span missed it (36-37 % under 30 % on the
    2-core CI machine); a close now waits for launches in flight."""
    card.base_env.update(CUPROG_NB_STREAMS="1", CUPROG_SIDE_ONLY="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5",
                         CUPROG_LEAD_KUS="5", CUPROG_THREADS="2")
    with busy_cores(loaded):
        r = work(card, alone(card, 30, "threads2-loaded" if loaded else "threads2"), "sat", "6", "2000", "5", "2")
    print("two threads on streams of their own after 5 us kernels, at 30 %:", r["busy"], r["per_sec"])
    # 3.2 s runs, unloaded, on the 2-core CI machine: 31.6-35.2 % in 11; 6 s runs 29.8-34.2 % in
    # 16, single seconds up to 40.2 % (lower-bound batches charged at the estimate: docs/shim.md,
    # "Not done"). The hole this guards gave 36-37 % in the mean.
    assert 22 <= r["busy"] * 100 <= 30 + 5, r
    assert all(x * 100 <= 30 + 12 for x in r["per_sec"]), r


def test_work_in_a_second_context_is_measured(card) -> None:
    """A tenant keeps the per-launch estimate low in its primary context (a 5 us kernel first
    after each sync) and runs 2 ms kernels on the legacy stream of a second context of the card,
    switching to it and back around them. The batch's events belong to the context they were
    made in: before, launches in another context passed the fast path (the legacy stream's
    handle is the same in every context) and were charged the first context's estimate, 97 %
    busy under 30 %."""
    card.base_env.update(CUPROG_CTX2="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5", CUPROG_LEAD_KUS="5")
    r = work(card, alone(card, 30, "ctx2"), "sat", "3.2", "2000", "5")
    print("2 ms kernels in a second context after 5 us kernels in the first, at 30 %:", r["busy"], r["per_sec"])
    assert r["rc"] == 0, r
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


def test_work_on_a_stream_of_another_context_is_measured(card) -> None:
    """The same 2 ms kernels launched into a stream made in the second context while the
    primary one stays current (the driver takes a CUkernel launch's context from its stream). The
    batch's events, made in the current context, cannot be recorded on that stream: the launches
    passed as work of a batch that could only be charged its estimate, 5 us each (98 % busy under
    30 % on the stub). The gate now measures in the stream's own context."""
    card.base_env.update(CUPROG_CTX2="1", CUPROG_CTX2_STREAM="1", CUPROG_WARMUP_MS="300", CUPROG_WARMUP_KUS="5",
                         CUPROG_LEAD_KUS="5")
    r = work(card, alone(card, 30, "ctx2-stream"), "sat", "3.2", "2000", "5")
    print("2 ms kernels on a stream of a second context after 5 us kernels in the first, at 30 %:", r["busy"],
          r["per_sec"])
    assert r["rc"] == 0, r
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


def test_work_on_another_threads_per_thread_stream_is_measured(card) -> None:
    """`CU_STREAM_PER_THREAD` is one handle that names each thread's own stream (the stub gives
    each thread its own). After 5 us kernels, the main thread launches a 5 us kernel on its
    per-thread stream (a batch opens there), a second thread then twenty 100 us kernels on its
    own, the main thread waits for its stream (closing the batch there), then the second for its
    own. The second thread's launches pass as launches on the batch's stream; on the stub its
    work is measured all the same (gap tracking records its tails from the launching thread, on
    that thread's stream, and the stub runs kernels one after another), so this guards the class
    rather than showing the hole docs/shim.md lists for batches that are not tracked on a card
    that runs the two streams at once."""
    native = card.json("relay", "1", "100", "20", env=card.env(shim=False))[0]
    r = card.json("relay", "3.2", "100", "20", env=alone(card, 30, "relay"))[0]
    print("per-thread streams in turns: native", native["busy"], "at 30 %:", r["busy"])
    # it wants far more than its 30 % natively (79.6 % on a loaded 2-core machine: the threads'
    # launches, not the card, set its pace there)
    assert r["rc"] == 0 and native["busy"] > 0.6, (native, r)
    assert 30 - 6 <= r["busy"] * 100 <= 30 + 4, r


@pytest.mark.parametrize("card1_cores", [60, 0])
def test_work_on_a_stream_of_another_card_passes_that_cards_gate(card, card1_cores) -> None:
    """A two-card claim, card 0 at 30 %: with card 0's context current, 2 ms kernels go to a
    stream made in a context of card 1 (the driver runs them on card 1). They are card 1's work:
    held to card 1's 60 %, or not held at all where card 1 has no compute limit. Charged to the
    current card's gate instead (before), card 1 ran at card 0's 30 % in both cases, and a
    tenant running card 1 from both contexts got card 1's limit plus card 0's."""
    tag = f"xcard-{card1_cores}"
    env = card.env(claim((0, 1000, 30), (1, 1000, card1_cores), name=f"ns/{tag}"), KVGPU_REGION_DIR=region(card, tag),
                   STUB_NDEV="2", CUPROG_CTX2="1", CUPROG_CTX2_STREAM="1", CUPROG_CTX2_DEV="1", CUPROG_DONE_PHYS="1")
    r = work(card, env, "sat", "3.2", "2000", "5")
    print(f"2 ms kernels on a stream of card 1 (limit {card1_cores or 'none'}) with card 0 current:", r["busy"],
          r["per_sec"])
    assert r["rc"] == 0, r
    if card1_cores:
        assert card1_cores - 6 <= r["busy"] * 100 <= card1_cores + 4, r
    else:
        assert r["busy"] * 100 >= 90, r


def test_a_graph_on_an_uncapped_cards_stream_passes_the_capped_cards_gate(card) -> None:
    """A graph's kernel nodes may run in another card's context than its stream's (a capture
    forked across cards), so a graph launched on a stream of card 1, which has no compute limit,
    passes card 0's 30 % gate: graphs of 2 ms there ran at 98 % when only the stream's card
    decided. (The stub runs a graph's work on its stream's card.)"""
    tag = "xcard-graph"
    env = card.env(claim((0, 1000, 30), (1, 1000, 0), name=f"ns/{tag}"), KVGPU_REGION_DIR=region(card, tag),
                   STUB_NDEV="2", STUB_GRAPH_US="2000", CUPROG_GRAPH="1", CUPROG_CTX2="1", CUPROG_CTX2_STREAM="1",
                   CUPROG_CTX2_DEV="1", CUPROG_DONE_PHYS="1")
    r = work(card, env, "sat", "3.2", "2000", "5")
    print("graphs of 2 ms on a stream of uncapped card 1 with card 0 (30 %) current:", r["busy"], r["per_sec"])
    assert r["rc"] == 0, r
    assert 30 - 6 <= r["busy"] * 100 <= 30 + 4, r


@pytest.mark.parametrize("v1", ["0", "1"])
def test_a_destroyed_context_takes_its_events_along(card, v1) -> None:
    """The second context is destroyed and made anew every 4 syncs while its batches may still
    be unsettled (by cuCtxDestroy_v2, or by the CUDA < 4.0 name the driver still exports): the
    gate releases that context's events before it goes (a later query or destroy of them would
    touch freed handles; the stub aborts then), and the limit holds across the renewals."""
    card.base_env.update(CUPROG_CTX2="1", CUPROG_CTX2_RENEW="4", CUPROG_CTX2_V1=v1, CUPROG_WARMUP_MS="300",
                         CUPROG_WARMUP_KUS="5", CUPROG_LEAD_KUS="5")
    r = work(card, alone(card, 30, f"ctx2renew{v1}"), "sat", "3.2", "2000", "5")
    print("a second context renewed every 4 syncs, at 30 %:", r["busy"], r["per_sec"])
    assert r["rc"] == 0, r
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r


@pytest.mark.parametrize("how", ["reset", "release"])
def test_a_reset_primary_context_takes_its_events_along(card, how) -> None:
    """Every 4 syncs the primary context is reset (cudaDeviceReset) or released for the last
    time, then retained again, and the driver hands back the same handle (the stub does, and
    aborts on any use of an event of the old one). The gate releases the context's events first:
    kept in its pool, they made every later batch open without events, charged at the estimate
    the 5 us kernels had set."""
    card.base_env.update(CUPROG_PRIMARY_RESET="4", CUPROG_PRIMARY_HOW=how, CUPROG_WARMUP_MS="300",
                         CUPROG_WARMUP_KUS="5", CUPROG_LEAD_KUS="5")
    r = work(card, alone(card, 30, f"primary{how}"), "sat", "3.2", "2000", "5")
    print(f"the primary context {how} every 4 syncs, at 30 %:", r["busy"], r["per_sec"])
    assert r["rc"] == 0, r
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r


def test_a_thread_of_tiny_kernels_in_its_own_context_does_not_hide_the_others(card) -> None:
    """Review finding (an attack): one thread launches 5 us kernels, each waited for, in a context
    of its own, so nearly every one of its launches moves the gate there and closes the batch of
    the threads that run 2 ms kernels in theirs, often while one of those is preempted between
    the gate and the driver (a busy loop on every core). Such a batch is only a lower bound at
    the estimate, which the 5 us batches keep low: the limit must still hold."""
    card.base_env.update(CUPROG_CTX2="1", CUPROG_NB_STREAMS="1", CUPROG_SIDE_ONLY="1", CUPROG_WARMUP_MS="300",
                         CUPROG_WARMUP_KUS="5", CUPROG_THREADS="4", CUPROG_TINY_THREADS="1")
    with busy_cores():
        r = work(card, alone(card, 30, "ctxtiny"), "sat", "3.2", "2000", "5", "2")
    print("a thread of 5 us kernels beside threads of 2 ms kernels, contexts of their own, at 30 %:",
          r["busy"], r["per_sec"])
    assert r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


def test_a_wait_by_another_thread_keeps_the_side_streams_measured(card) -> None:
    """Review finding (an attack on the per-thread-stream change): after 5 us kernels, each round
    a 5 us kernel on the main thread's per-thread stream opens a batch, one launch into a
    capturing stream keeps it untracked, five 2 ms kernels on a non-blocking stream join it, and
    a second thread's wait on that stream closes it. A close by another thread than the
    per-thread stream's skipped the other streams' closes and settled the batch as a lower bound
    at the estimate: 91-98 % busy under 30 %. Only the per-thread stream's close moves to the
    legacy stream now."""
    r = card.json("hostile", "ptforeign", "3", "2000", "5", env=alone(card, 30, "ptforeign"), timeout=30)[0]
    print("side-stream work closed by another thread's wait, at 30 %:", r)
    assert r["rc"] == 0 and r["launches"] > 50, r
    assert r["busy"] * 100 <= 30 + 4, r


def test_batches_left_running_behind_a_wait_are_charged(card) -> None:
    """Review finding: after 5 us kernels, a stream is held by cuStreamWaitValue32 while 200
    batches of one 2 ms kernel queue behind it (each closed by a wait on another, idle, stream),
    then 20 of 5 us, then the value is written. The first full ring waits a second and gives its
    oldest batch up; after that every batch pushed out of a full ring was dropped at its
    provisional charge, at the estimate: 67 % busy under 30 % over 3 s, the one-second wait
    included. Given-up batches now wait in an overflow and are settled when they complete; one
    pushed out of a full overflow is charged a bucket of GPU time."""
    r = card.json("hostile", "gaveup", "3", "2000", "200", env=alone(card, 30, "gaveup"), timeout=60)[0]
    print("batches held behind a wait value, then released, at 30 %:", r)
    assert r["rc"] == 0 and r["launches"] >= 200, r
    assert r["busy"] * 100 <= 30 + 4, r


def test_a_context_released_while_another_thread_launches(card) -> None:
    """Review finding: a thread releases the primary context for the last time and retains it
    again in a loop while another launches and waits. Between the release of the gate's events
    and the driver's destruction of the context, the launching thread made new events in it,
    which the stub then finds destroyed (abort). The context is now marked dying meanwhile: no
    event is made in it, and a launch in it waits for the driver's return."""
    r = card.json("hostile", "primrace", "3", "5", "1", env=alone(card, 30, "primrace"), timeout=60)[0]
    print("primary context released and retained in a loop beside launches:", r)
    assert r["rc"] == 0 and r["rounds"] > 100 and r["launches"] > 100, r


def test_streams_destroyed_with_work_queued_are_measured(card) -> None:
    """A tenant creates a non-blocking stream, queues four 2 ms kernels on it, destroys it at
    once (the work runs on), sleeps as long as that work, then launches 5 us kernels on the
    legacy stream and waits for each (which keeps the per-launch estimate low), round after
    round. The batch was closed only at the next wait, on a stream that no longer existed: the
    record failed (charged a bucket: 14 % under 30 %), and on a real driver it could land on the
    next stream given the same handle. The destroy now closes the batch first: the tenant gets
    its share, neither more nor much less."""
    r = card.json("hostile", "sdestroy", "3", "2000", "4", env=alone(card, 30, "sdestroy"), timeout=60)[0]
    print("streams destroyed with 2 ms kernels queued, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 20, r
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r


def test_a_tenant_cannot_keep_only_its_idle_batches_tracked(card) -> None:
    """Review finding: rounds of an idle batch (ten 5 us kernels 300 us apart) and a dense one
    (2 ms kernels back to back, with one launch into a stream the tenant keeps capturing, which
    ends the batch's gap tracking). Only the idle batches stayed tracked, the gap ratio fell to
    their busy share, and the dense batches were charged that share of their span. A batch whose
    tracking stopped is now charged its whole span."""
    r = card.json("hostile", "gapbias", "3", "2000", "5", env=alone(card, 30, "gapbias"), timeout=60)[0]
    print("dense batches with their tracking stopped beside idle tracked ones, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 20, r
    assert r["busy"] * 100 <= 30 + 4, r
def test_a_capture_begun_on_a_stream_of_the_batch_does_not_hide_its_work(card) -> None:
    """Review finding: a tenant that keeps the estimate low opens a batch with a 5 us kernel,
    queues twenty 2 ms kernels on a non-blocking stream that joins it, begins a capture on that
    stream and launches again once they have run: the close on the capturing stream was
    captured (it never runs), the batch could not be read, and forty milliseconds of GPU time
    went for a bucket of 25 ms. A capture that begins on a stream of the open batch now closes
    it first."""
    r = card.json("hostile", "capture", "3", "2000", "20", env=alone(card, 30, "capture"), timeout=60)[0]
    print("a capture begun on a stream of the batch, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 5, r
    assert 30 - 6 <= r["busy"] * 100 <= 30 + 4, r


@pytest.mark.parametrize(("variant", "race"), [("capend", "STUB_CAPTURE_ENDS_AFTER_CHECK"),
                                             ("caprestart", "STUB_CAPTURE_RESTARTS_AROUND_LAUNCH")])
def test_a_capture_ended_under_a_launch_does_not_free_it(card, variant: str, race: str) -> None:
    """Review findings: a launch into a capturing stream passes ungated (captured work does not
    run now), and the check comes before the driver: another thread ending the capture in
    between (capend), or ending it and beginning a new one around the launch (caprestart), made
    the launch run uncharged. The stub runs those races right after the shim's check (kernels of
    small grids: streams side by side); a tenant doing that with 2 ms kernels between 5 us ones
    on another stream ran them free. A launch let through as captured whose stream is not in
    the same capture (cuStreamGetCaptureInfo's id) after the driver's return is charged a
    bucket of GPU time."""
    env = {**alone(card, 30, variant), race: "1", "STUB_CONCURRENT": "1"}
    r = card.json("hostile", variant, "3", "2000", "1", env=env, timeout=60)[0]
    print(f"{variant}: a capture raced around the launch, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 5, r
    assert r["busy"] * 100 <= 30 + 4, r


def test_a_launch_config_rewritten_after_the_gate_does_not_move_the_launch(card) -> None:
    """Review finding: cuLaunchKernelEx's config was read by the gate (a capturing stream: no
    gate) and again by the driver, so another thread rewriting its stream in between launched
    the kernel on a stream that runs, uncharged. The stub rewrites it right after the shim's
    capture check; the driver now gets the copy the gate read, and the kernel is captured."""
    env = {**alone(card, 30, "cfgswap"), "STUB_CONCURRENT": "1"}
    r = card.json("hostile", "cfgswap", "3", "2000", "1", env=env, timeout=60)[0]
    print("a launch config rewritten after the capture check, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 5, r
    assert r["busy"] * 100 <= 30 + 4, r


def test_a_thread_cancelled_while_the_gate_holds_it_back(card) -> None:
    """Review finding: pthread_cancel of a thread that the gate holds back (it sleeps under the
    gate's lock, a cancellation point) ended the thread with the lock held, and the next launch
    of any other thread of the process waited for ever. A second thread launches 2 ms kernels
    at 30 % and is cancelled after 2-20 ms, again and again, while the main thread launches
    and waits between cancellations: every launch returns and the limit holds."""
    r = card.json("hostile", "cancel", "3", "2000", "4", env=alone(card, 30, "cancel"), timeout=60)[0]
    print("a throttled thread cancelled again and again beside launches, at 30 %:", r)
    assert r["rc"] == 0 and r["rounds"] > 50 and r["launches"] == r["rounds"], r
    assert r["busy"] * 100 <= 30 + 4, r


@pytest.mark.parametrize("loaded", [False, True])
def test_threads_in_contexts_of_their_own_are_measured(card, loaded) -> None:
    """Three threads, each in a context of its own on the card (cuCtxCreate), launching 2 ms
    kernels after 5 us ones: the gate follows whichever context launches, and the limit holds.
    Loaded: a busy loop on every core, so a thread is often preempted between the gate and the
    driver while another one's launch moves the gate to its own context and closes the batch."""
    card.base_env.update(CUPROG_CTX2="1", CUPROG_NB_STREAMS="1", CUPROG_SIDE_ONLY="1", CUPROG_WARMUP_MS="300",
                         CUPROG_WARMUP_KUS="5", CUPROG_LEAD_KUS="5", CUPROG_THREADS="3")
    with busy_cores(loaded):
        r = work(card, alone(card, 30, "ctxthreads-loaded" if loaded else "ctxthreads"), "sat", "3.2", "2000", "5", "2")
    print("three threads in contexts of their own, at 30 %:", r["busy"], r["per_sec"])
    assert 30 - 5 <= r["busy"] * 100 <= 30 + 4, r
    assert all(x * 100 <= 30 + 8 for x in r["per_sec"]), r


@pytest.mark.parametrize("kus, gap_us, mix", [(10, 15, "0"), (20, 30, "1"), (16, 30, "0")])
def test_launch_bound_work_on_two_streams_is_charged_its_gpu_time(card, kus, gap_us, mix) -> None:
    """Launch-bound work on two non-blocking streams (torch's side streams): the union of the
    streams' spans counts the GPU's idle gaps between launches. Gap tracking now follows every
    stream of a batch (the GPU is idle when the latest launch on each has ended); with only the
    union, the H200 ran such a loop (two side streams, 53 % busy natively) at 17.5 % under a
    30 % limit."""
    card.base_env.update(CUPROG_MIX=mix, CUPROG_NB_STREAMS="1", CUPROG_GAP_STREAMS="2")
    native = work(card, card.env(shim=False), "gap", "2", str(kus), str(gap_us), "50")
    r = work(card, alone(card, 30, f"gap2s{kus}"), "gap", "3.2", str(kus), str(gap_us), "50")
    target = min(30.0, native["busy"] * 100)
    print(f"two streams, launch-bound {kus}/{gap_us} us: native {native['busy']:.3f}, at 30 %: {r['busy']:.3f}",
          r["per_sec"])
    assert abs(r["busy"] * 100 - target) <= 4, (native, r)


def test_a_capture_after_launches_on_its_stream_stays_valid(card) -> None:
    """torch.cuda.graph warms up on a side stream, then captures on it: on the H200 the gap
    tracker queried its event behind the warm-up's launches during the capture, which CUDA
    refuses (cudaErrorStreamCaptureInvalidated). A capturing stream is never tracked."""
    r = work(card, alone(card, 30, "cap"), "capture", "1.5", "50")
    assert r["rc"] == 0 and r["launches"] > 100, r


def test_a_wait_on_another_stream_does_not_hide_non_blocking_work(card) -> None:
    """Review finding: kernels on a non-blocking stream, then a wait on another stream, closed the
    batch on the legacy stream, which does not follow non-blocking streams: the span came out
    near zero, and beside a co-tenant (no gap tracking) the kernels were nearly free. A batch on
    one stream now closes on it, and one on several is charged at least its provisional charge.
    (The stub's non-blocking stream is left out of its legacy stream's wait, but the shim's other
    measurements held the limit here before the fix too: this guards the class, the review's
    arithmetic is the reason for the change.)"""
    r = work(card, alone(card, 20, "nbwait"), "nbwait", "3.2", "150", "20")
    print("non-blocking stream, wait elsewhere, at 20 %:", r["busy"], r["per_sec"])
    assert abs(r["busy"] * 100 - 20) <= 5, r
    a, b = tenants(card, [(30, 1), (70, 1)], [], modes=[("nbwait", ["150", "20"]), ("sat", ["2000", "20"])])
    assert a["busy"] * 100 <= 30 + 6 and b["busy"] * 100 >= 70 - 8, (a, b)


@pytest.mark.parametrize("warmup_ms", ["0", "300"])
def test_a_kernel_waiting_for_a_later_launch_does_not_hang_the_gate(card, warmup_ms) -> None:
    """Stream A waits for a value (cuStreamWaitValue32) that stream B writes only after 40 more
    kernels on A and one on B, all launched by the same thread: a kernel waiting for its peer's
    (NCCL over two cards), a persistent kernel the thread stops later. The gate waited for a
    batch's end under its lock without a bound, before a capped gate's first estimate (a cold
    start) and on a full ring of batches (warm: 2 ms kernels are batches of one), so the next
    launch never returned, while natively the program runs through. A wait now ends after
    VGPU_MEASURE_WAIT_NS (1 s), the batch is given up and the gate waits no more: one second
    once, not one per launch; the limit holds afterwards."""
    card.base_env["CUPROG_WARMUP_MS"] = warmup_ms
    native = work(card, card.env(shim=False), "waitval", "1", "2000", "40", "20", timeout=20)
    assert native["rc"] == 0 and native["pre_s"] < 0.5, native
    try:
        r = work(card, alone(card, 30, f"waitval{warmup_ms}"), "waitval", "3.2", "2000", "40", "20", timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("hung under a 30 % limit (natively the program runs through)")
    print(f"wait for a later launch (warm-up {warmup_ms} ms) at 30 %: pattern {r['pre_s']} s "
          f"(native {native['pre_s']} s), then {r['busy']}", r["per_sec"])
    assert r["rc"] == 0 and r["pre_s"] < 3, r
    assert abs(r["busy"] * 100 - 30) <= 5, r
    assert all(abs(x * 100 - 30) <= 8 for x in r["per_sec"]), r


def test_two_threads_at_their_own_pace_on_per_thread_streams_get_the_share(card) -> None:
    """The suite's ptds case: the main thread launches a 5 us kernel and waits for its
    per-thread stream, over and over; a second thread launches five 2 ms kernels on its own
    per-thread stream and waits for it, each round. Natively the card is busy with the second
    thread's kernels almost all the time; under 30 % the tenant gets its share in every second.

    Each thread's launches close the other's batch; a batch closed by another thread than its
    stream's owner closes on the legacy stream, which the stub now models as the driver runs it
    (it waits for every blocking stream, and their later work waits for it). 29.2 % here, the
    time any of the tenant's kernels ran (overlaps counted once, as NVML's utilization does);
    on H100s 24.5-28 % with seconds down to 19 % (docs/shim.md, "Not done")."""
    card.base_env["STUB_CONCURRENT"] = "1"  # as on a GPU: the 5 us kernels run beside the others
    native = card.json("ptds", "1.5", "2000", "5", env=card.env(shim=False))[0]
    r = card.json("ptds", "4", "2000", "5", env=alone(card, 30, "ptds"))[0]
    print("ptds: native", native["busy"], "at 30 %:", r["busy"], r["per_sec"])
    assert r["rc"] == 0 and native["busy"] > 0.9, (native, r)
    assert 30 - 4 <= r["busy"] * 100 <= 30 + 4, r
    assert all(30 - 5 <= x * 100 <= 30 + 5 for x in r["per_sec"]), r


def one_container(box, cores: int, runs: list[tuple[list[str], dict[str, str]]],
                  during: Callable[[Path], None] | None = None) -> list[dict[str, Any]]:
    """Processes of one container (one claim, one region), ``cuprog work ARGS`` each with its own
    extra environment, at once on a card that shares its time among the processes with work
    (STUB_TIMESLICE), with the node agent's schedule writer listing the container alone on the
    card. ``during(region_file)`` runs in a thread meanwhile (the tenant's own doings)."""
    from kvgpu.agent.schedule import TenantSource

    sched, rd = box.dir / "sched", region(box, "c")
    source = TenantSource("ns/c", 1, {uuid(0): cores}, rd / "vgpu.region")
    env = box.env(claim((0, 1000, cores), name="ns/c", priority=1), KVGPU_SCHED_DIR=sched, KVGPU_REGION_DIR=rd,
                  STUB_TIMESLICE="1", KVGPU_LOG_LEVEL=os.environ.get("DBG_LOG", "1"))
    with schedule_writer(sched, [source]):
        procs = [subprocess.Popen([str(box.kit.cuprog), "work", *args], env={**env, **extra},
                                  stdout=subprocess.PIPE, text=True) for args, extra in runs]
        side = threading.Thread(target=during, args=(rd / "vgpu.region",), daemon=True) if during else None
        if side:
            side.start()
        outs = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
        if side:
            side.join()
        return outs


def sat(secs: float, **env: str) -> tuple[list[str], dict[str, str]]:
    """A saturating loop of 2 ms kernels, a sync every 20, for secs."""
    return ["sat", str(secs), "2000", "20"], env


def test_saturating_processes_of_a_container_get_its_share_together(card) -> None:
    """Four processes of one container that each want the whole card: the card shares its time
    among them, so each process's event pairs also span its siblings' time slices, and charged as
    measured the container got 16.6 % of the H200 under 30 % (24-26 % on this stub). The
    container calibration compares the card's busy time with the container's share: together
    they get it. The first two seconds are left out (the calibration steps every half second)."""
    outs = one_container(card, 30, [sat(6.2)] * 4)
    later = [sum(x) * 100 for x in list(zip(*(o["per_sec"] for o in outs), strict=False))[2:]]
    print("4 saturating processes of one container at 30 %:", [round(x, 1) for x in later])
    assert later and abs(sum(later) / len(later) - 30) <= 3, later
    assert all(abs(x - 30) <= 6 for x in later), later


def test_a_container_cannot_keep_its_siblings_discount_after_they_stop(card) -> None:
    """The attack on the container calibration: four processes saturate together (the card's
    time is shared, the ratio falls to what their spans overstate), then three stop and stay idle
    with their contexts (NVML still lists four processes), so the ratio would let the last one
    run at 1 / ratio of the share. The card's busy time says so at the next calibration step: the
    ratio rises at once, and the seconds after stay at the share."""
    idle = sat(4.5, CUPROG_LINGER_MS="5000")
    a, *rest = one_container(card, 30, [sat(8.2), idle, idle, idle])
    after = [x * 100 for x in a["per_sec"][5:]]
    before = [sum(x) * 100 for x in zip(a["per_sec"][:4], *(o["per_sec"] for o in rest), strict=False)]
    print("the process left alone at 30 %:", [round(x, 1) for x in after], "before, all four:",
          [round(x, 1) for x in before])
    assert after and all(x <= 30 + 5 for x in after[1:]) and after[0] <= 30 + 10, after
    assert abs(sum(after) / len(after) - 30) <= 4, after


def forge_credit(until_s: float) -> Callable[[Path], None]:
    """The tenant keeps its container's credit clock V half a second ahead until until_s from
    now: every process of the container waits for credit while the card idles."""
    from kvgpu.shimregion import Region, RegionDev

    at = Region.dev.offset + RegionDev.credit_vt.offset  # dev[0].credit_vt
    t0 = time.monotonic()

    def run(path: Path) -> None:
        while time.monotonic() - t0 < until_s:
            if path.exists() and path.stat().st_size > at + 8:
                fd = os.open(path, os.O_RDWR)
                os.pwrite(fd, struct.pack("<Q", time.monotonic_ns() + 500_000_000), at)
                os.close(fd)
            time.sleep(0.02)

    return run


def test_a_forged_wait_leaves_no_lasting_discount(card) -> None:
    """Found in review: a forged credit clock holds the container back while the card idles,
    with three idle contexts on the card (NVML lists four processes), so each calibration step
    lowered the ratio, to 21 %; after the forgery the process ran at the whole card (99 % under
    30 %), never waited again, and so was never calibrated again. A ratio under a lone process's
    floor is now checked every half second whether the process waits or not."""
    idle = sat(0.05, CUPROG_LINGER_MS="12000")
    a, *_ = one_container(card, 30, [sat(11.2), idle, idle, idle], during=forge_credit(6.0))
    after = [x * 100 for x in a["per_sec"][7:]]
    print("after a forged wait of 6 s, at 30 %:", [round(x, 1) for x in after], "all:", a["per_sec"])
    # the first step after the forgery still reads its idle span: the ratio rises a step later,
    # up to a second and a half after the forgery ends
    assert len(after) >= 3 and after[0] <= 30 + 20 and all(x <= 30 + 5 for x in after[1:]), after
