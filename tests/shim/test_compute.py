"""The compute limiter: pure arithmetic through cffi, the schedule file, then against the stub
card's simulated queue (kernels of STUB_KERNEL_US on one FIFO shared by all processes). The
workload classes of issue 21 are in test_compute_workloads.py."""

from __future__ import annotations

import random
import subprocess
import threading

import pytest

from .conftest import claim, uuid

MS = 1_000_000


def gate(core, cores: int, period_ms: int = 100):
    g = core.ffi.new("struct vgpu_gate *")
    core.lib.vgpu_gate_init(g, cores, period_ms * MS)
    return g


def test_gate_arithmetic(core) -> None:
    """Credit on measured GPU time: a full bucket launches at once, provisional charges move the
    credit clock, a measured batch corrects them, a long kernel leaves debt to wait out."""
    lib = core.lib
    assert gate(core, 0).active == 0 and gate(core, 100).active == 0
    assert gate(core, 20).burst_ns == 100 * MS  # a share x period bucket: 20 ms of GPU time
    g = gate(core, 30)  # ... at most 25 ms of GPU time: 83.3 ms of credit clock at 30 %
    B = 25 * MS * 100 // 30
    assert g.active == 1 and g.len_ns == 30 * MS and g.burst_ns == B
    t = 1000 * 100 * MS + 7 * MS
    assert lib.vgpu_gate_decide(g, t) == 0  # a new container: half a bucket, pass at once
    assert g.local_vt == t - B // 2 and g.open_until == t + g.batch_ns
    t += 2 * B
    assert lib.vgpu_gate_decide(g, t) == 0 and g.local_vt == t - B  # idle since: a full bucket, no more
    assert lib.vgpu_gate_fast(g, t, t, core.ffi.NULL) == 1  # no estimate yet: free
    # a batch of 10 launches took 5 ms of GPU time: 16.7 ms of credit clock at 30 %
    lib.vgpu_gate_settle(g, 10, 0, 5 * MS, 0, 1)
    assert g.est_ns == 500_000 and g.local_vt == t - B + 5 * MS * 100 // 30
    assert g.vt_cost == 500_000 * 100 // 30
    # each launch now advances the clock provisionally; out of credit -> slow path
    passed = sum(lib.vgpu_gate_fast(g, t + 2, t + 2, core.ffi.NULL) for _ in range(100))
    assert passed == 41  # 66.7 ms of credit / 1.667 ms per launch, the last one into debt
    # the batch really took 2x the estimate: the correction is charged too
    vt = g.local_vt
    lib.vgpu_gate_settle(g, 41, 41 * 500_000, 41 * 1_000_000, 0, 1)
    assert g.local_vt == vt + 41 * 500_000 * 100 // 30
    wake = lib.vgpu_gate_decide(g, t + 3)
    assert wake == g.local_vt  # wait until the credit is back
    # a 100 ms kernel (measured) at 30 %: 333 ms of debt to wait out; a launch dearer than the
    # bucket passes on a full bucket only, so the next one waits the whole 333 ms, not 333 less
    # the bucket (one second would then hold more than its share)
    g2 = gate(core, 30)
    g2.local_vt = t - 10 * B  # a container idle for a while: a full bucket
    lib.vgpu_gate_decide(g2, t)
    lib.vgpu_gate_settle(g2, 1, 0, 100 * MS, 0, 1)
    assert g2.local_vt == t - B + 100 * MS * 100 // 30
    assert lib.vgpu_gate_decide(g2, t + 1) == t + 100 * MS * 100 // 30
    # an upper bound (stream idle before the close) never charges more than the estimate
    lib.vgpu_gate_settle(g2, 1, 100 * MS, 900 * MS, 0, 2)
    assert g2.est_ns == 100 * MS


def test_time_an_earlier_batch_charged_is_not_charged_again(core) -> None:
    """A batch whose span reaches into GPU time an earlier batch charged already (a batch opened
    on an idle stream while another stream's work, measured in the batch before, still ran) is
    charged the rest of its span, at the gap ratio's share where one applies; the per-launch
    estimate does not learn from it (its span is not its launches' own time); never below zero."""
    lib = core.lib
    g = gate(core, 30)
    t = 1000 * 100 * MS
    lib.vgpu_gate_decide(g, t)
    lib.vgpu_gate_settle(g, 10, 0, 5 * MS, 0, 1)
    vt, est = g.local_vt, g.est_ns
    assert est == 500_000
    assert lib.vgpu_gate_settle(g, 10, 0, 8 * MS, 3 * MS, 1) == 5 * MS
    assert g.local_vt == vt + 5 * MS * 100 // 30 and g.est_ns == est
    g.gap_pm = 800  # the rest of the span at the ratio (what was charged before was charged at its own)
    assert lib.vgpu_gate_settle(g, 10, 0, 8 * MS, 3 * MS, 1) == 4 * MS
    vt = g.local_vt
    assert lib.vgpu_gate_settle(g, 10, 0, 2 * MS, 3 * MS, 3) == 0 and g.local_vt == vt
    assert g.est_ns == est
    # without an overlap the same batch charges and teaches as before
    assert lib.vgpu_gate_settle(g, 10, 0, 8 * MS, 0, 3) == 8 * MS
    assert g.est_ns == (est * 3 + 800_000) // 4


def test_busy_calibration_charges_the_cards_busy_time(core) -> None:
    """Alone on the card, measured GPU time is charged as the busy time NVML counted for it (event
    pairs count the short gaps between kernels as busy): both over the samples' span, summed over
    the last spans, bounded; spans under half the share do not count; back to 1 beside co-tenants
    or other processes."""
    lib = core.lib
    g = gate(core, 30)
    t = 1000 * 100 * MS
    half = 500 * MS

    def run(t0: int, t1: int, measured_per_ms: int) -> None:
        """Settle measured_per_ms ns of GPU time each ms of [t0, t1] (launches of 50 us at most),
        noting the series."""
        for ms in range((t1 - t0) // MS):
            lib.vgpu_gate_settle(g, 20, 0, measured_per_ms, 0, 1)
            lib.vgpu_gate_cal_note(g, t0 + (ms + 1) * MS)

    lib.vgpu_gate_decide(g, t)
    lib.vgpu_gate_cal_note(g, t)
    assert lib.vgpu_gate_cal_own(g, t - MS, t) == 2**64 - 1  # before the series: unknown
    run(t, t + 2 * half, 300_000)  # 30 % of the wall measured
    # the series reads the measured time of any span back (25 ms points, interpolated)
    assert abs(lib.vgpu_gate_cal_own(g, t + 100 * MS, t + 600 * MS) - 150 * MS) <= MS
    lib.vgpu_gate_calibrate(g, t, t + half, 135 * MS, 1)  # NVML: 27 % in that span
    assert g.cal_pm == 900
    assert g.vt_cost == g.est_ns * 900 // 1000 * 100 // 30
    vt = g.local_vt
    lib.vgpu_gate_settle(g, 600, 0, 30 * MS, 0, 1)
    assert g.local_vt == vt + 30 * MS * 900 // 1000 * 100 // 30
    # the next span weighs in with the decayed sums: 0.75 x 135 + 141 over 0.75 x 150 + 150
    lib.vgpu_gate_calibrate(g, t + 100 * MS, t + 600 * MS, 141 * MS, 1)
    assert abs(g.cal_pm - (135 * 3 / 4 + 141) * 1000 / (150 * 3 / 4 + 150)) <= 5
    # a span under half the share (start-up, idle) does not count
    pm = g.cal_pm
    run(t + 2 * half + 30 * MS, t + 4 * half, 100_000)
    lib.vgpu_gate_calibrate(g, t + 2 * half + 100 * MS, t + 4 * half, 10 * MS, 1)
    assert g.cal_pm == pm
    # far below: bounded at 85 %
    run(t + 4 * half, t + 6 * half, 300_000)
    for _ in range(8):
        lib.vgpu_gate_calibrate(g, t + 4 * half, t + 5 * half, 30 * MS, 1)
    assert g.cal_pm == 850
    # another process on the card: its busy time is not ours, charges as measured
    lib.vgpu_gate_calibrate(g, 0, 0, 0, 0)
    assert g.cal_pm == 1000 and g.cal_own_busy == 0
    # NVML counts more than was measured: never charged above the measured time where gap
    # tracking took no event overhead off it ...
    lib.vgpu_gate_calibrate(g, t + 4 * half, t + 5 * half, 400 * MS, 1)
    assert g.cal_pm == 1000 and lib.vgpu_gate_cal_raise(g) == 1000
    # ... and above it at most by what was taken off (here 6 %), never by more than 15 %
    for _ in range(400):
        lib.vgpu_gate_seg_overhead(g, 50_000, 3_000)
    assert lib.vgpu_gate_cal_raise(g) == 1060
    lib.vgpu_gate_calibrate(g, 0, 0, 0, 0)
    run(t + 6 * half, t + 8 * half, 300_000)
    for _ in range(8):
        lib.vgpu_gate_calibrate(g, t + 6 * half, t + 7 * half, 160 * MS, 1)  # 1.067 x
    assert g.cal_pm == 1060
    for _ in range(8):
        lib.vgpu_gate_calibrate(g, t + 6 * half, t + 7 * half, 156 * MS, 1)  # 1.04 x: within the bound
    assert 1035 <= g.cal_pm <= 1045, g.cal_pm
    for _ in range(400):
        lib.vgpu_gate_seg_overhead(g, 10_000, 5_000)  # half taken off: the hard bound
    assert lib.vgpu_gate_cal_raise(g) == 1150
    for _ in range(8):
        lib.vgpu_gate_calibrate(g, t + 6 * half, t + 7 * half, 300 * MS, 1)
    assert g.cal_pm == 1150
    # kernels of a few ms are calibrated (a span's samples hold a kernel more or less: a few
    # percent of a span) ...
    lib.vgpu_gate_calibrate(g, 0, 0, 0, 0)
    for step in range(100):  # a 3 ms kernel each 10 ms: 30 % of the wall
        lib.vgpu_gate_settle(g, 1, 0, 3 * MS, 0, 1)
        lib.vgpu_gate_cal_note(g, t + 8 * half + (step + 1) * 10 * MS)
    assert 2_900_000 <= g.est_ns <= 3_000_000
    lib.vgpu_gate_calibrate(g, t + 9 * half, t + 10 * half, 135 * MS, 1)
    assert 895 <= g.cal_pm <= 905, g.cal_pm
    # ... kernels of 4 ms or more are not: one settles when it ends, so a span of samples held a
    # kernel the card had counted in the span before, which swung the ratio (100 ms kernels)
    for _ in range(8):
        lib.vgpu_gate_settle(g, 1, 0, 100 * MS, 0, 1)
    lib.vgpu_gate_calibrate(g, t + 8 * half, t + 9 * half, 135 * MS, 1)
    assert g.est_ns >= 4 * MS and g.cal_pm == 1000
    # co-tenants: the card's time is shared, no calibration
    lib.vgpu_gate_set_window(g, 0, 30 * MS, 1)
    lib.vgpu_gate_calibrate(g, t + 4 * half, t + 5 * half, 100 * MS, 1)
    assert g.cal_pm == 1000



def test_container_calibration(core) -> None:
    """Processes of one container the schedule lists alone on the card (vgpu_gate_calibrate_
    container): the card's busy time, the container's, against the share of the span. Held back
    while the card says less, the ratio falls half the way toward the reading a step, at most
    25 % a step, to no less than 85 % over the card's compute processes (four at most); above the
    share it rises half the way too, all the way when the card says 1.5 x the share or more;
    inside a 3 % band, or (down) when this process did not wait for credit, it stays. The first
    step that moves the ratio goes all the way (at most 50 % down)."""
    lib = core.lib
    g = gate(core, 30)
    t, half = 1000 * 100 * MS, 500 * MS
    lib.vgpu_gate_settle(g, 100, 0, 5 * MS, 0, 1)  # an estimate of 50 us a launch
    # a first reading within the band moves nothing, and the next one is still the first step
    lib.vgpu_gate_calibrate_container(g, t, t + half, 148 * MS, 2, half)
    assert g.cal_pm == 1000 and g.cal_container == 1 and g.cal_cont_moved == 0
    # the card was busy 20 % under a 30 % share, the process held back all the span: f = 0.667,
    # all the way on the first step
    lib.vgpu_gate_calibrate_container(g, t, t + half, 100 * MS, 2, half)
    assert g.cal_pm == 666 and g.cal_cont_moved == 1
    assert g.vt_cost == g.est_ns * g.cal_pm // 1000 * 100 // 30
    pm = g.cal_pm
    lib.vgpu_gate_calibrate_container(g, t, t + half, 30 * MS, 2, half)  # then f = 0.2: bounded to -25 %
    assert g.cal_pm == pm * 750 // 1000
    pm = g.cal_pm
    lib.vgpu_gate_calibrate_container(g, t, t + half, 140 * MS, 2, half)  # f = 0.933: half of it
    assert g.cal_pm == pm * (1000 - (1000 - 933) // 2) // 1000
    for _ in range(20):
        lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 2, half)
    assert g.cal_pm == 425  # 850 / 2 processes
    lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 8, half)
    assert g.cal_pm == 425 * 750 // 1000  # 8 processes count as 4; the ratio falls 25 % a step
    for _ in range(20):
        lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 8, half)
    assert g.cal_pm == 212
    # not held back (waited under a quarter of the span): under the share says nothing
    lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 8, half // 5)
    assert g.cal_pm == 212
    # within the band: nothing either way
    lib.vgpu_gate_calibrate_container(g, t, t + half, 147 * MS, 8, half)
    lib.vgpu_gate_calibrate_container(g, t, t + half, 153 * MS, 8, half)
    assert g.cal_pm == 212
    # the card says 1.4 x the share: half the way up, waited or not
    lib.vgpu_gate_calibrate_container(g, t, t + half, 210 * MS, 8, 0)
    assert g.cal_pm == 212 * 1200 // 1000
    # the card says 2 x (the siblings stopped: no noise): all the way up at once
    pm = g.cal_pm
    lib.vgpu_gate_calibrate_container(g, t, t + half, 300 * MS, 8, 0)
    assert g.cal_pm == pm * 2
    # never above the measured time where gap tracking took nothing off
    for _ in range(10):
        lib.vgpu_gate_calibrate_container(g, t, t + half, 450 * MS, 2, 0)
    assert g.cal_pm == 1000
    # a span too short to judge moves nothing
    lib.vgpu_gate_calibrate_container(g, t, t + 100 * MS, 0, 2, 100 * MS)
    assert g.cal_pm == 1000
    # alone again (NVML lists this process only): from the container's ratio, no lower than 85 %
    for _ in range(20):
        lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 4, half)
    assert g.cal_pm == 212
    lib.vgpu_gate_calibrate(g, t, t + half, 0, 1)
    assert g.cal_container == 0 and g.cal_pm == 850 and g.cal_cont_moved == 0
    # back among siblings: the first step goes all the way again, down at most 50 %
    lib.vgpu_gate_calibrate_container(g, t, t + half, 30 * MS, 2, half)  # f = 0.2
    assert g.cal_pm == 425
    h = gate(core, 30)  # a first step up goes all the way too, to no more than the measured time
    lib.vgpu_gate_settle(h, 100, 0, 5 * MS, 0, 1)
    h.cal_pm = 400
    lib.vgpu_gate_calibrate_container(h, t, t + half, 180 * MS, 2, 0)  # f = 1.2
    assert h.cal_pm == 480 and h.cal_cont_moved == 1
    # co-tenants: no calibration at all
    lib.vgpu_gate_set_window(g, 0, 30 * MS, 1)
    lib.vgpu_gate_calibrate_container(g, t, t + half, 10 * MS, 2, half)
    assert g.cal_pm == 1000


def test_container_calibration_settles_on_the_share_under_noise(core) -> None:
    """The card's reading of a container swings a third either way a span (the processes take
    turns at the credit; the samples lag the work). Modelled as a container whose busy time is
    its charge's inverse (k / cal_pm of the share), the ratio's steps must settle on the share on
    average, not under it: a rise all the way against a fall half the way settled at 0.93. Its
    first seconds reach the share too (the first step goes all the way)."""
    lib = core.lib
    rng = random.Random(7)
    t, half = 1000 * 100 * MS, 500 * MS
    for k in (0.55, 0.35):  # 2 and 4 processes' worth of stretched spans
        g = gate(core, 30)
        lib.vgpu_gate_settle(g, 100, 0, 5 * MS, 0, 1)
        seen = []
        for _ in range(400):
            f = k / ((g.cal_pm or 1000) / 1000)  # the container's busy time / its share
            seen.append(min(f, 1 / 0.3))
            busy = int(150 * MS * min(f, 1 / 0.3) * (1 + rng.uniform(-1 / 3, 1 / 3)))
            lib.vgpu_gate_calibrate_container(g, t, t + half, busy, 4, half)
        mean = sum(seen[40:]) / len(seen[40:])
        assert 0.97 <= mean <= 1.03, (k, mean)
        assert 0.9 <= sum(seen[6:12]) / 6, (k, seen[:12])  # within 3 s of the start
        # the first 3 s: a first step all the way (half the way: 0.88 and 0.73 of the share)
        assert sum(seen[:6]) / 6 >= (0.95 if k > 0.5 else 0.8), (k, seen[:6])


def test_a_tenant_cannot_talk_its_charges_down(core) -> None:
    """Review findings on the gap ratio and the bracketed kernel: a tenant trained the gap ratio
    low with a launch-bound phase and then ran long kernels, one launch per batch, charged at
    0.5 % of their time; beside co-tenants it put a 5 us kernel first in every batch of 20 ms
    ones, charging 800 ms of GPU as 0.3 ms. A one-launch batch has no gap to discount, and no
    batch is charged below half its span."""
    lib = core.lib
    t = 1000 * 100 * MS
    g = gate(core, 10)
    lib.vgpu_gate_decide(g, t)
    for _ in range(40):  # launch-bound phase: 0.5 % of each tracked span busy
        lib.vgpu_gate_tracked(g, 25_000, 5 * MS, 1)
    assert g.gap_pm <= 10
    vt = g.local_vt
    lib.vgpu_gate_settle(g, 1, 0, 200 * MS, 0, 1)  # one 200 ms kernel, closed right behind it
    assert g.local_vt - vt == 200 * MS * 100 // 10  # charged in full: 2 s of credit clock at 10 %
    c = gate(core, 30)
    lib.vgpu_gate_set_window(c, 0, 30 * MS, 1)
    lib.vgpu_gate_decide(c, t)
    for _ in range(10):
        lib.vgpu_gate_sample(c, 5_000)  # the probed first kernel: 5 us
        vt = c.local_vt
        lib.vgpu_gate_settle(c, 5, 0, 80 * MS, 0, 1)  # 5 us + 4 x 20 ms
        assert c.local_vt - vt >= 40 * MS * 100 // 30  # at least half of the 80 ms span


def test_short_batches_do_not_set_the_gap_ratio_of_long_ones(core) -> None:
    """The gap ratio multiplies spans, so a tracked batch weighs on it by its span: twenty short
    batches a round, half idle (15 us busy in 30 us), and one dense 8 ms batch leave it near the
    long batch's; per batch (a quarter each) the short ones set it to about a half, and the
    untracked long batches went at half their time. A run of long launch-bound batches still
    moves it as fast as before."""
    lib = core.lib
    g = gate(core, 30)
    for _ in range(10):
        for _ in range(20):
            lib.vgpu_gate_tracked(g, 15_000, 30_000, 1)
        lib.vgpu_gate_tracked(g, 8 * MS, 8 * MS, 1)
    # spans: 8 ms dense against 0.6 ms half idle a round: about 96 % busy
    assert g.gap_pm >= 900, g.gap_pm
    for _ in range(40):  # a launch-bound phase of 5 ms batches: 0.5 % busy
        lib.vgpu_gate_tracked(g, 25_000, 5 * MS, 1)
    assert g.gap_pm <= 10, g.gap_pm
    # short batches alone still move it all the way, however small each step (100 us, half busy)
    for _ in range(2000):
        lib.vgpu_gate_tracked(g, 50_000, 100_000, 1)
    assert 450 <= g.gap_pm <= 550, g.gap_pm


def test_a_tenant_well_under_its_share_is_gap_tracked_less(core) -> None:
    """A tracked launch costs ~2.7 us of CPU on the H100/H200, so a launch-bound loop under a
    limit that does not bind lost up to a fifth of its speed to the tracking of one batch in two.
    While the process's measured busy share is 10 points or more under the share and the
    container's credit is (nearly) full, fewer batches are tracked; near or at the share, or with
    the container's credit spent (its other processes use the rest), the normal rate."""
    lib = core.lib
    t = 1000 * 100 * MS
    g = gate(core, 90)
    g.local_vt = t - g.burst_ns  # a full bucket
    g.busy_pm = 900
    normal = lib.vgpu_gate_track_every(g, t)
    assert normal >= 1
    g.busy_pm = 640  # the transformer under 90 %: wants 64 % of the card
    under = lib.vgpu_gate_track_every(g, t)
    assert under > normal
    g.busy_pm = 810  # 9 points under: tracked as usual
    assert lib.vgpu_gate_track_every(g, t) == normal
    s = gate(core, 30)
    s.local_vt = t - s.burst_ns
    s.busy_pm = 290  # saturating at its share
    assert lib.vgpu_gate_track_every(s, t) == normal
    s.busy_pm = 150
    assert lib.vgpu_gate_track_every(s, t) == under
    # two processes of a container at its limit, each at half the share: the credit is spent
    s.local_vt = t - s.burst_ns // 20
    assert lib.vgpu_gate_track_every(s, t) == normal
    s.local_vt = t + 5 * MS  # in debt
    assert lib.vgpu_gate_track_every(s, t) == normal
    s.local_vt = t - s.burst_ns
    s.measure_only = 1  # uncapped high priority publishes its demand: always the normal rate
    assert lib.vgpu_gate_track_every(s, t) == normal


def test_a_batch_tracked_among_fewer_moves_the_gap_ratio_further(core) -> None:
    """A batch tracked at the lower rate stands for the batches not tracked: its step towards its
    share is that many times a normal one's, and batches of every span still weigh in proportion
    to it (a cap at half the way let a tenant's short idle batches weigh four times its long
    dense ones). Without it, a launch-bound phase's low ratio would charge a dense phase that
    follows for many tracked batches."""
    lib = core.lib
    a, b = gate(core, 90), gate(core, 90)
    for x in (a, b):
        lib.vgpu_gate_tracked(x, 25_000, 5 * MS, 1)  # launch-bound: 0.5 % busy
    lib.vgpu_gate_tracked(a, 5 * MS, 5 * MS, 1)  # dense: a quarter of the way
    lib.vgpu_gate_tracked(b, 5 * MS, 5 * MS, 4)  # dense, standing for 4: the whole way
    assert 240 <= a.gap_pm <= 260, a.gap_pm
    assert b.gap_pm == 1000, b.gap_pm
    c, d = gate(core, 90), gate(core, 90)
    for x in (c, d):
        lib.vgpu_gate_tracked(x, 25_000, 5 * MS, 1)
    lib.vgpu_gate_tracked(c, 1250_000, 1250_000, 4)  # a dense 1.25 ms batch standing for 4 ...
    lib.vgpu_gate_tracked(d, 5 * MS, 5 * MS, 1)  # ... moves it as one 5 ms batch of the normal rate
    assert c.gap_pm == d.gap_pm > 200, (c.gap_pm, d.gap_pm)


def test_a_batch_whose_events_cannot_be_read_is_charged_a_bucket(core) -> None:
    """Settled unmeasured (its events failed or cannot be read), a batch of launches keeps its
    provisional charge and is charged a bucket on top (VGPU_BUCKET_MAX_NS, 25 ms of GPU time):
    a tenant that keeps the estimate low must not run unmeasured work at that estimate. An empty
    batch costs nothing."""
    lib = core.lib
    g = gate(core, 30)
    lib.vgpu_gate_decide(g, 1000 * 100 * MS)
    vt = g.local_vt
    lib.vgpu_gate_settle(g, 0, 0, 0, 0, 0)
    assert g.local_vt == vt
    lib.vgpu_gate_settle(g, 20, 20 * 5_000, 0, 0, 0)
    assert abs((g.local_vt - vt) - 25 * MS * 100 // 30) <= 1, g.local_vt - vt


def test_co_tenant_gate_bursts_when_full_then_keeps_to_its_window(core) -> None:
    lib = core.lib
    g = gate(core, 30)
    assert g.period_ns == 100 * MS and g.burst_ns < g.period_ns  # alone: 25 ms of GPU time
    lib.vgpu_gate_set_window(g, 50 * MS, 30 * MS, 1)  # window at 50..80 ms of each period ...
    m = g.period_ns // (100 * MS)  # ... scaled to the co-tenants' frame of m periods
    assert m >= 2 and g.period_ns == m * 100 * MS and g.burst_ns == g.period_ns
    assert (g.offset_ns, g.len_ns) == (50 * MS * m, 30 * MS * m)
    base = 1000 * 100 * MS * m  # a frame's start
    t = base + 10 * MS  # outside the window, bucket full (idle): a burst at once
    assert lib.vgpu_gate_decide(g, t) == 0 and g.bursting == 1
    lib.vgpu_gate_settle(g, 10, 0, 31 * MS * m, 0, 1)  # the burst spent the bucket (and a bit more)
    # out of credit for a while, outside the window then: wait for the window
    assert lib.vgpu_gate_decide(g, t + MS) == base + 50 * MS * m and g.bursting == 0
    # credit back but outside the window: still the window, not another burst
    wake = lib.vgpu_gate_decide(g, g.local_vt + MS)
    assert wake == base + 50 * MS * m
    assert lib.vgpu_gate_decide(g, wake) == 0 and g.open_until <= wake + 30 * MS * m
    # the schedule leaves no time at all: wait (and re-read it) in 100 ms steps
    lib.vgpu_gate_set_window(g, 0, 0, 1)
    assert lib.vgpu_gate_decide(g, wake) == wake + 100 * MS
    # alone again: the bucket is 25 ms of GPU time again
    lib.vgpu_gate_set_window(g, 0, 30 * MS, 0)
    assert (g.period_ns, g.burst_ns, g.len_ns) == (100 * MS, 25 * MS * 100 // 30, 30 * MS)


def co_tenant_run(lib, g, t: int, frames: int, use_pct: int) -> tuple[int, int]:
    """A co-tenant using use_pct % of its share, settled every 10 ms, its busy share refreshed
    every 100 ms (as the shim's schedule refresh does), deciding after each settle. Returns
    (how many decisions outside its window passed, the time at the end)."""
    outside = 0
    lib.vgpu_gate_busy(g, t)
    for i in range(frames * g.period_ns // (10 * MS)):
        t += 10 * MS
        lib.vgpu_gate_settle(g, 4, 0, 10 * MS * g.len_ns // g.period_ns * use_pct // 100, 0, 1)
        if i % 10 == 9:
            lib.vgpu_gate_busy(g, t)
        in_window = (t - g.offset_ns) % g.period_ns < g.len_ns
        outside += lib.vgpu_gate_decide(g, t) == 0 and not in_window
    return outside, t


def test_a_saturating_co_tenant_keeps_to_its_window(core) -> None:
    """On the H200 a saturating 70 % co-tenant used a little under its share (its window's last
    kernels did not fit), so it never ran out of credit, stayed in its burst and launched in its
    neighbour's window, where the card time-sliced both: the neighbour's batches measured twice
    their time and it lost 3 points. A burst now ends once it has been charged a bucket, and a
    new one starts only while the tenant's busy share is under 3/4 of its window's."""
    lib = core.lib
    g = gate(core, 70)
    lib.vgpu_gate_set_window(g, 0, 70 * MS, 1)
    t = 1000 * 100 * MS * (g.period_ns // (100 * MS)) + g.len_ns + MS  # in the neighbour's window
    assert lib.vgpu_gate_decide(g, t) == 0 and g.bursting == 1  # a full bucket: a burst
    outside, t = co_tenant_run(lib, g, t, 6, 95)
    assert g.bursting == 0 and g.busy_pm >= 600
    assert outside <= 2 * (g.period_ns - g.len_ns) // (10 * MS)  # the first bucket's burst only
    assert co_tenant_run(lib, g, t, 4, 95)[0] == 0  # then its window only
    # a burst spends at most 25 ms of GPU time (35.7 ms of credit clock at 70 %, here 10 ms a
    # step), not the window's whole bucket (200 ms): the rest of it would land in others' windows
    b = gate(core, 70)
    lib.vgpu_gate_set_window(b, 0, 70 * MS, 1)
    u = 1000 * 100 * MS * (b.period_ns // (100 * MS)) + b.len_ns + MS
    lib.vgpu_gate_busy(b, u)
    assert lib.vgpu_gate_decide(b, u) == 0 and b.bursting == 1
    v0, steps = b.burst_v0, 0
    while b.bursting and b.burst_v0 == v0 and steps < 40:  # until it ends (or a new one begins)
        u, steps = u + 10 * MS, steps + 1
        lib.vgpu_gate_settle(b, 4, 0, 10 * MS * 70 * 95 // 100 // 100, 0, 1)
        lib.vgpu_gate_decide(b, u)
    assert steps <= 4, steps
    # a light tenant (an inference server: 40 % of its share) still starts at once anywhere
    light = gate(core, 30)
    lib.vgpu_gate_set_window(light, 0, 30 * MS, 1)
    outside, _ = co_tenant_run(lib, light, t + light.len_ns + MS, 6, 40)
    assert outside == 6 * (light.period_ns - light.len_ns) // (10 * MS)


def test_a_tenant_under_its_share_stays_on_the_fast_path(core) -> None:
    """Credit above a bucket is dropped where a launch passes, not by sending the launch to the
    slow path: a tenant under its share gathers credit faster than it spends it, and the slow
    path at (nearly) every launch closed its batch each time (gpt at 60 % on the H200: 1.6
    launches a batch, a fifth of its speed lost with no wait at all). The bucket still holds at
    most one bucket of credit."""
    lib = core.lib
    g = gate(core, 60)
    t = 1000 * 100 * MS
    assert lib.vgpu_gate_decide(g, t) == 0
    lib.vgpu_gate_settle(g, 10, 0, 100_000, 0, 1)  # 10 us launches
    B = g.burst_ns
    g.open_until = t + 10**12  # the batch stays open: the fast path alone decides
    t1 = t + B  # idle for a bucket's time: more credit than a bucket
    assert lib.vgpu_gate_fast(g, t1, t1, core.ffi.NULL) == 1
    assert g.local_vt == t1 - B + g.vt_cost  # clamped to a full bucket, then charged
    # 10 us launches 1 ms apart: the credit clock falls behind time; each still passes fast
    passed = sum(lib.vgpu_gate_fast(g, t1 + k * MS, t1 + k * MS, core.ffi.NULL) for k in range(1, 4))
    assert passed == 3 and g.local_vt == t1 + 3 * MS - B + g.vt_cost


def test_measure_only_gate_never_waits_and_publishes_its_busy_share(core) -> None:
    lib = core.lib
    g = gate(core, 0)
    g.active = g.measure_only = 1
    t = 500 * 100 * MS
    assert lib.vgpu_gate_decide(g, t) == 0
    lib.vgpu_gate_busy(g, t)
    lib.vgpu_gate_settle(g, 100, 0, 200 * MS, 0, 1)
    assert lib.vgpu_gate_decide(g, t + 1) == 0 and lib.vgpu_gate_fast(g, t + 2, t + 2, core.ffi.NULL) == 1
    assert lib.vgpu_gate_busy(g, t + 250 * MS) == 800


def test_a_busy_share_rises_at_once_and_falls_over_a_second(core) -> None:
    """An uncapped high-priority tenant resuming after a pause: its refresh measured the pause
    (a low share, low priority gets a window); the rise is published as soon as 20 ms of the new
    interval show it, not at the next 100 ms refresh. A fall is smoothed (7/8 a refresh)."""
    lib = core.lib
    g = gate(core, 0)
    g.active = g.measure_only = 1
    t = 500 * 100 * MS
    lib.vgpu_gate_busy(g, t)
    assert lib.vgpu_gate_busy(g, t + 1000 * MS) == 0  # a second without work
    lib.vgpu_gate_settle(g, 4, 0, 9 * MS, 0, 1)
    assert lib.vgpu_gate_busy_rise(g, t + 1010 * MS) == 0 and g.busy_pm == 0  # under 20 ms: not yet
    lib.vgpu_gate_settle(g, 4, 0, 18 * MS, 0, 1)
    assert lib.vgpu_gate_busy_rise(g, t + 1030 * MS) == 1 and g.busy_pm == 900
    assert lib.vgpu_gate_busy_rise(g, t + 1060 * MS) == 0 and g.busy_pm == 900  # 27/60: no fall here
    assert lib.vgpu_gate_busy(g, t + 1100 * MS) == (900 * 7 + 270) // 8  # the refresh: 27 of 100 ms
    assert lib.vgpu_gate_busy(g, t + 1200 * MS) == 821 * 7 // 8  # nothing in 100 ms


@pytest.mark.parametrize(
    "shares, prios, self_, expect",
    [
        ([300, 700], [1, 1], 0, (0, 300)),
        ([300, 700], [1, 1], 1, (300, 700)),
        ([700, 300], [1, 0], 1, (0, 300)),       # high priority first
        ([700, 300], [1, 0], 0, (300, 700)),
        ([800, 600], [1, 0], 0, (600, 400)),     # low priority squeezed into what is left
        ([800, 600], [0, 0], 1, (571, 428)),     # high alone overcommits: scaled
    ],
)
def test_schedule_layout(core, shares, prios, self_, expect) -> None:
    ffi, lib = core.ffi, core.lib
    off, ln = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    lib.vgpu_sched_layout(ffi.new("uint32_t[]", shares), ffi.new("uint32_t[]", prios),
                          ffi.new("uint64_t[]", list(range(len(shares)))), len(shares), self_, off, ln)
    assert (off[0], ln[0]) == expect


def test_shim_layout_and_agent_layout_agree(core) -> None:
    from kvgpu.agent.schedule import Tenant, layout

    ffi, lib = core.ffi, core.lib
    off, ln = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    for shares, prios in [([300, 700], [1, 1]), ([700, 300], [1, 0]), ([800, 600], [1, 0]),
                          ([800, 600], [0, 0]), ([100, 250, 900, 400], [1, 0, 1, 0])]:
        n = len(shares)
        agent = {w.key: (w.offset_pm, w.len_pm)
                 for w in layout([Tenant(str(i), prios[i], shares[i], i) for i in range(n)])}
        for i in range(n):
            lib.vgpu_sched_layout(ffi.new("uint32_t[]", shares), ffi.new("uint32_t[]", prios),
                                  ffi.new("uint64_t[]", list(range(n))), n, i, off, ln)
            assert agent[str(i)] == (off[0], ln[0]), (shares, prios, i)


def test_shim_reads_the_agents_schedule_and_refuses_garbage(core, tmp_path) -> None:
    from kvgpu.agent.schedule import HEADER, MAGIC, Window, encode, write_schedule

    ffi, lib = core.ffi, core.lib
    o, n = ffi.new("uint32_t *"), ffi.new("uint32_t *")

    def read(key: bytes = b"a/one", uuid: bytes = b"GPU-x") -> tuple[int, int] | None:
        ok = lib.vgpu_sched_read(str(tmp_path).encode(), uuid, key, o, n, ffi.NULL) == 0
        return (o[0], n[0]) if ok else None

    assert read() is None  # no file
    path = write_schedule(tmp_path, "GPU-x", encode([Window("a/one", 0, 300), Window("b/two", 300, 700)]))
    assert path.stat().st_mode & 0o777 == 0o644
    assert read() == (0, 300) and read(b"b/two") == (300, 700)
    assert read(b"c/three") is None and read(uuid=b"GPU-y") is None  # not listed; one file per card
    good = path.read_bytes()
    for bad in (good[:10], good[:-1], b"\xff" * len(good), b"",
                HEADER.pack(MAGIC, 1, 328, 2) + good[16:],  # the old version
                HEADER.pack(MAGIC, 2, 328, 33) + good[16:],  # more entries than there can be
                encode([Window("a/one", 900, 300)]),  # beyond the period
                encode([Window("a/one", 0, 300)])[:16] + b"x" * 320 + good[16 + 320:16 + 328]):  # no NUL
        path.write_bytes(bad)
        assert read() is None, bad[:24]
    path.write_bytes(good)
    assert read() == (0, 300)


def test_a_tenant_cannot_write_the_schedule(box) -> None:
    """The old design's file was 0666 with a mutex every tenant took; now the agent's file is
    0644 (root's on a node, read-only mounted in containers), and the shim opens it read-only: a
    tenant run never changes it, even when it could write the directory."""
    from kvgpu.agent.schedule import Window, encode, write_schedule

    sched = box.dir / "sched"
    path = write_schedule(sched, uuid(0), encode([Window("ns/other", 0, 500)]))
    before = (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino)
    rd = box.dir / "r-alone"
    rd.mkdir()
    env = box.env(claim((0, 1000, 30), name="ns/alone"), KVGPU_SCHED_DIR=sched, KVGPU_REGION_DIR=rd)
    box.run("launch", "kernel", "0.6", "20", env=env)
    assert (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert sorted(p.name for p in sched.iterdir()) == [path.name]
    # its activity went into its own region instead
    from kvgpu.shimcore import read_region

    dev = read_region(rd / "vgpu.region").devices[0]
    assert dev.sched_heartbeat_ns > 0 and 0 < dev.sched_joined_ns <= dev.sched_heartbeat_ns


def rate(box, env, mode="kernel", secs=2.0) -> float:
    return box.json("launch", mode, str(secs), "20", env=env, timeout=60)[0]["rate"]


@pytest.fixture
def stub2ms(box):
    box.base_env["STUB_KERNEL_US"] = "2000"
    return box


def own_region(box, tag) -> str:
    """A fresh region directory: another container (a region keeps the claim that created it)."""
    d = box.dir / f"region-{tag}"
    d.mkdir(exist_ok=True)
    return str(d)


def test_share_follows_the_limit(stub2ms) -> None:
    box = stub2ms
    native = rate(box, box.env(shim=False))
    for target in (20, 50, 80):
        # one container per claim: a region keeps the claim that created it
        got = rate(box, box.env(claim((0, 1000, target)), KVGPU_REGION_DIR=own_region(box, target))) \
            / native * 100
        assert abs(got - target) <= 6, (target, got)


@pytest.mark.parametrize("mode", ["ex", "coop", "graph", "ptsz", "gpa", "launch0", "grid", "gridasync", "multi"])
def test_every_launch_path_is_gated(stub2ms, mode) -> None:
    box = stub2ms
    native = rate(box, box.env(shim=False), mode, 1.0)
    got = rate(box, box.env(claim((0, 1000, 25))), mode, 1.5) / native * 100
    assert 15 <= got <= 35, got


def co_tenants(box, a: tuple[int, int], b: tuple[int, int], secs=3.0) -> tuple[float, float]:
    """Two containers on card 0, with the node agent's schedule writer running (a thread calling
    the real :class:`~kvgpu.agent.schedule.Scheduler` over their claims and regions)."""
    import json
    import threading
    from pathlib import Path

    from kvgpu.agent.schedule import Scheduler, TenantSource

    sched = box.dir / "sched"
    sources = []
    envs = []
    for i, (cores, prio) in enumerate((a, b)):
        rd = box.dir / f"r{i}"
        rd.mkdir(exist_ok=True)
        sources.append(TenantSource(f"ns/t{i}", prio, {uuid(0): cores}, Path(rd) / "vgpu.region"))
        envs.append(box.env(claim((0, 1000, cores), name=f"ns/t{i}", priority=prio),
                            KVGPU_SCHED_DIR=sched, KVGPU_REGION_DIR=rd))
    writer = Scheduler(sched, lambda: sources, lambda: [uuid(0)])
    stop = threading.Event()
    t = threading.Thread(target=writer.serve, args=(stop, 0.1), daemon=True)
    t.start()
    try:
        procs = [subprocess.Popen([str(box.kit.cuprog), "launch", "kernel", str(secs), "20"], env=env,
                                  stdout=subprocess.PIPE, text=True) for env in envs]
        outs = [json.loads(p.communicate(timeout=60)[0])["rate"] for p in procs]
        box.last_layout = writer.tick()
    finally:
        stop.set()
        t.join()
    return outs[0], outs[1]


def test_co_tenants_30_70(stub2ms) -> None:
    box = stub2ms
    native = rate(box, box.env(shim=False))
    ra, rb = co_tenants(box, (30, 1), (70, 1))
    print(f"co-tenants 30+70: {ra / native * 100:.1f} % + {rb / native * 100:.1f} %")
    assert [(w.key, w.offset_pm, w.len_pm) for w in box.last_layout[uuid(0)]] == [
        ("ns/t0", 0, 300), ("ns/t1", 300, 700)]
    assert abs(ra / native * 100 - 30) <= 6 and abs(rb / native * 100 - 70) <= 6, (ra, rb, native)


def test_priority_wins_when_overcommitted(stub2ms) -> None:
    box = stub2ms
    native = rate(box, box.env(shim=False))
    low, high = co_tenants(box, (70, 1), (70, 0))
    print(f"priority 70 low + 70 high: {low / native * 100:.1f} % + {high / native * 100:.1f} %")
    assert [(w.key, w.offset_pm, w.len_pm) for w in box.last_layout[uuid(0)]] == [
        ("ns/t1", 0, 700), ("ns/t0", 700, 300)]
    assert abs(high / native * 100 - 70) <= 7 and abs(low / native * 100 - 30) <= 7, (low, high, native)


def test_no_limit_no_throttle(stub2ms) -> None:
    box = stub2ms
    native = rate(box, box.env(shim=False), secs=1.0)
    assert rate(box, box.env(claim((0, 1000, 0))), secs=1.0) >= 0.9 * native
    # HAMi-core's policy switch lifts HAMi-style limits ...
    off = box.env(CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="disable",
                  KVGPU_REGION_DIR=own_region(box, "hami"))
    assert rate(box, off, secs=1.0) >= 0.9 * native
    # ... but not a kvgpu claim's (an image ENV must not lift what the operator granted).
    kept = box.env(claim((0, 1000, 30)), GPU_CORE_UTILIZATION_POLICY="disable",
                   KVGPU_REGION_DIR=own_region(box, "kept"))
    assert rate(box, kept, secs=1.0) <= 0.6 * native


def per_thread_batch(core) -> tuple[object, int, object]:
    """A 30 % gate with a batch open on a per-thread stream (no owner set): (gate, its time in
    ns, the CU_STREAM_PER_THREAD handle)."""
    g = gate(core, 30)
    t = 1000 * 100 * MS
    assert core.lib.vgpu_gate_decide(g, t) == 0
    g.cur.ev_open = core.ffi.cast("void *", 0x99)
    g.cur.stream = core.ffi.cast("void *", 0x2)
    return g, t, core.ffi.cast("void *", 0x2)


def test_another_threads_per_thread_stream_is_not_the_batchs(core) -> None:
    """CU_STREAM_PER_THREAD (0x2) is one handle naming each thread's own stream. A batch open on
    this thread's per-thread stream measures that stream only: the same handle from another
    thread is another stream, which the fast path must send to the slow path (before, it passed
    as a launch on the batch's stream, and on a card that runs the two at once its work was
    outside the batch's events)."""
    lib = core.lib
    g, t, per_thread = per_thread_batch(core)
    g.cur.pt_owner = lib.vgpu_thread_token()
    assert lib.vgpu_gate_measures(g, per_thread) == 1
    assert lib.vgpu_gate_fast(g, t + 1, t + 1, per_thread) == 1
    seen: dict[str, int] = {}

    def other() -> None:
        seen["token_differs"] = int(lib.vgpu_thread_token() != g.cur.pt_owner)
        seen["measures"] = lib.vgpu_gate_measures(g, per_thread)
        seen["fast"] = lib.vgpu_gate_fast(g, t + 2, t + 2, per_thread)

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen == {"token_differs": 1, "measures": 0, "fast": 0}, seen


def test_a_new_thread_is_not_an_exited_owner(core) -> None:
    """The batch's per-thread stream belongs to the thread that opened it. Threads started after
    that one exited get its TLS block back from the C library (5 addresses for 200 threads in a
    row here): a token taken from a TLS address then named a new thread the owner, and its own
    per-thread stream passed as the batch's (work outside the batch's events)."""
    lib = core.lib
    g, _, per_thread = per_thread_batch(core)
    tokens: list[int] = []
    measured: list[int] = []

    def owner() -> None:
        g.cur.pt_owner = lib.vgpu_thread_token()
        tokens.append(int(g.cur.pt_owner))

    def later() -> None:
        tokens.append(int(lib.vgpu_thread_token()))
        measured.append(lib.vgpu_gate_measures(g, per_thread))

    for target in [owner] + [later] * 50:
        th = threading.Thread(target=target)
        th.start()
        th.join()
    assert tokens[0] != 0 and len(set(tokens)) == len(tokens), (len(set(tokens)), len(tokens))
    assert measured == [0] * 50, measured
