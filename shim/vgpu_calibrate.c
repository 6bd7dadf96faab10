/*
 * vgpu_calibrate.c - the busy calibration: the charge of measured GPU time against the card's
 * own busy time (NVML's utilization samples, read by vgpu_gate_inputs.c). A series of the
 * measured total (a point at most every VGPU_CAL_POINT_NS) gives the tenant's own GPU time over
 * the samples' span; a lone process's ratio is a ratio of decayed sums (vgpu_gate_calibrate),
 * the processes of a container alone on the card step theirs toward the container's share
 * (vgpu_gate_calibrate_container). Every charge is scaled by the ratio (cal_pm, vgpu_compute.c).
 *
 * Pure: arithmetic on struct vgpu_gate, no I/O.
 */
#include "vgpu.h"

void vgpu_gate_cal_note(struct vgpu_gate *g, uint64_t now)
{
    if (g->cal_pt_len) {
        unsigned last = (g->cal_pt_head + g->cal_pt_len - 1) % VGPU_CAL_POINTS;
        if (now < g->cal_pt_t[last] + VGPU_CAL_POINT_NS)
            return;
    }
    unsigned i = (g->cal_pt_head + g->cal_pt_len) % VGPU_CAL_POINTS;
    if (g->cal_pt_len == VGPU_CAL_POINTS)
        g->cal_pt_head = (g->cal_pt_head + 1) % VGPU_CAL_POINTS;
    else
        g->cal_pt_len++;
    g->cal_pt_t[i] = now;
    g->cal_pt_total[i] = g->cal_total_ns;
}

/* The measured total at t: interpolated between the points around it; the newest total after
 * the last point. Requires t >= the oldest point. */
static uint64_t cal_total_at(const struct vgpu_gate *g, uint64_t t)
{
    unsigned prev = g->cal_pt_head;
    for (unsigned k = 1; k < g->cal_pt_len; k++) {
        unsigned i = (g->cal_pt_head + k) % VGPU_CAL_POINTS;
        if (g->cal_pt_t[i] >= t) {
            uint64_t t0 = g->cal_pt_t[prev], v0 = g->cal_pt_total[prev], dt = g->cal_pt_t[i] - t0;
            return dt ? v0 + (uint64_t)((unsigned __int128)(g->cal_pt_total[i] - v0) * (t - t0) / dt) : v0;
        }
        prev = i;
    }
    return g->cal_total_ns;
}

void vgpu_gate_seg_overhead(struct vgpu_gate *g, uint64_t busy_ns, uint64_t ovh_ns)
{
    /* decayed per batch by 1/64: hundreds of tracked batches a second, so about the last
     * quarter second's */
    g->seg_busy_sum = g->seg_busy_sum - g->seg_busy_sum / 64 + busy_ns;
    g->seg_ovh_sum = g->seg_ovh_sum - g->seg_ovh_sum / 64 + ovh_ns;
}

uint32_t vgpu_gate_cal_raise(const struct vgpu_gate *g)
{
    if (VGPU_CAL_MAX_PM <= 1000u || !g->seg_busy_sum)
        return VGPU_CAL_MAX_PM < 1000u ? VGPU_CAL_MAX_PM : 1000u;
    uint64_t pm = 1000 + (uint64_t)((unsigned __int128)g->seg_ovh_sum * 1000 / g->seg_busy_sum);
    return (uint32_t)(pm < VGPU_CAL_MAX_PM ? pm : VGPU_CAL_MAX_PM);
}

uint64_t vgpu_gate_cal_own(const struct vgpu_gate *g, uint64_t t0, uint64_t t1)
{
    if (!g->cal_pt_len || t0 < g->cal_pt_t[g->cal_pt_head] || t1 < t0)
        return ~0ull;
    return cal_total_at(g, t1) - cal_total_at(g, t0);
}

void vgpu_gate_calibrate(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns, int alone)
{
    /* The limit is a share of the card's busy time as the driver counts it (NVML utilization:
     * the time a kernel ran). Event pairs count the GPU's short idle gaps between back-to-back
     * kernels as busy (a few us each: over 10 % of a span of 25 us kernels), so a tenant alone
     * on the card is charged, from its measured GPU time, the card's busy time that time stood
     * for. Above the measured time only as far as the events' own reading goes: gap tracking
     * takes an estimate of the event overhead off each busy segment (vgpu_track.c), which on
     * short kernels on two streams at once was too much (the card counted 1.088 x the measured
     * time on an H100: 33-34 % under 30 %); where nothing was taken off, a ratio above 1 is
     * noise (on the H200 it came from launch-bound training, and throttled it under its share).
     * Both are taken over the same span (the samples', which lag the work by up to a
     * sample period: a span of our own would see a rising tenant's work before the card's
     * samples do), summed over the last seconds (a ratio of sums: one span's noise moves it
     * little). Only spans where the tenant used at least half its share count (start-up and
     * idle phases, whose event spans hold long gaps, would pull it down just before the tenant
     * saturates), and only alone: beside co-tenants or other processes the card's busy time is
     * not its own. */
    if (g->cal_container) { /* from the container's ratio: the sums are the process's own again */
        g->cal_container = 0;
        g->cal_cont_moved = 0;
        g->cal_card_busy = g->cal_own_busy = 0;
        if (g->cal_pm && g->cal_pm < VGPU_CAL_MIN_PM)
            g->cal_pm = VGPU_CAL_MIN_PM;
    }
    if (!alone || g->cotenants || g->measure_only || g->est_ns >= VGPU_CAL_LONG_NS) {
        /* A long kernel settles when it ends, after the card's samples counted most of it, so
         * a span of samples held a kernel the card had counted in the span before: the ratio
         * swung to 85 % and 100 ms kernels at 10 % came 0.88 s apart, two in one second. Kernels
         * of a few ms (bracketed one by one, but beside another thread's short ones on its
         * per-thread stream, whose batches span them) are calibrated: uncalibrated, such a
         * process ran the card 27 % under 30 % (the suite's ptds, H100s). */
        g->cal_pm = 1000;
        g->cal_card_busy = g->cal_own_busy = 0;
    } else {
        uint64_t own = vgpu_gate_cal_own(g, t0, t1), span = t1 - t0;
        if (own != ~0ull && span && own >= VGPU_CAL_MIN_WORK_NS &&
            (unsigned __int128)own * 2 * g->period_ns >= (unsigned __int128)span * g->len_ns) {
            g->cal_card_busy = g->cal_card_busy * 3 / 4 + card_busy_ns;
            g->cal_own_busy = g->cal_own_busy * 3 / 4 + own;
            uint64_t pm = (uint64_t)((unsigned __int128)g->cal_card_busy * 1000 / g->cal_own_busy);
            uint64_t max = vgpu_gate_cal_raise(g);
            g->cal_pm = (uint32_t)(pm < VGPU_CAL_MIN_PM ? VGPU_CAL_MIN_PM : pm > max ? max : pm);
        }
    }
    vgpu_gate_reprice(g);
}

void vgpu_gate_calibrate_container(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns,
                                   unsigned procs, uint64_t waited_ns)
{
    /* Processes of one container share the card's time: each one's batches span its siblings'
     * time slices too, so charged as measured the container got 19 % (2 processes) and 16.6 %
     * (4) of the H200 under 30 %. No process knows its siblings' measurements (the region is
     * the container's to write), but the card's busy time, alone on the card, is the
     * container's: charged too much, the container is held back while the card says it used
     * less than its share, and the ratio falls; charged too little, the card says more and it
     * rises: half the way, or all the way at once when the card says far more than the share
     * (a tenant that drove it down, then stopped the siblings whose time slices justified it,
     * runs above its share until the next step). */
    if (g->measure_only || g->cotenants || !g->len_ns || t1 <= t0) {
        vgpu_gate_calibrate(g, 0, 0, 0, 0);
        return;
    }
    g->cal_container = 1; /* (the lone-process sums are not read meanwhile: reset on the way back) */
    uint64_t span = t1 - t0, share = (uint64_t)((unsigned __int128)span * g->len_ns / g->period_ns);
    if (span < VGPU_CAL_NS / 4 || !share)
        return;
    uint64_t f = (uint64_t)((unsigned __int128)card_busy_ns * 1000 / share);
    uint64_t pm = g->cal_pm ? g->cal_pm : 1000;
    unsigned n = procs < 1 ? 1 : procs > VGPU_CAL_CONT_PROCS ? VGPU_CAL_CONT_PROCS : procs;
    uint64_t lo = VGPU_CAL_MIN_PM / n, hi = vgpu_gate_cal_raise(g);
    /* half the way a step, up as down: one span's busy time swings by a third either way (the
     * processes take turns at the credit, and the samples lag the work), and a rise all the way
     * with a fall half the way settled where the falls made up for the rises: under the share
     * (model: 0.93 of it at a third's noise; the H100s' cards 27.2 and 25.4 % under 30 %). A
     * reading past that noise (siblings stopped) is taken all the way at once. */
    /* The first step goes all the way: from a ratio of 1 the reading is far under the share
     * (0.63 of it for 2 processes), and half-way steps spent the container's first seconds
     * under it (model: 0.86 of the share in the first 3 s, 0.94 from a first step all the way;
     * the H100s' 2 and 4 processes 26.2 and 26.6 % under 30 %). Its span starts at a wait for
     * credit, so it holds work, not the idle time before it. */
    int first = !g->cal_cont_moved;
    uint64_t up = first ? VGPU_CAL_CONT_FIRST_PM : VGPU_CAL_CONT_UP_GAIN_PM;
    uint64_t down = first ? VGPU_CAL_CONT_FIRST_PM : VGPU_CAL_CONT_GAIN_PM;
    uint64_t was = pm;
    if (f > VGPU_CAL_CONT_JUMP_PM)
        pm = pm * f / 1000;
    else if (f > 1000 + VGPU_CAL_CONT_BAND_PM)
        pm = pm * (1000 + (f - 1000) * up / 1000) / 1000;
    else if (f + VGPU_CAL_CONT_BAND_PM < 1000 && waited_ns * 4 >= span)
        pm = pm * (1000 - (1000 - (f > VGPU_CAL_CONT_STEP_PM ? f : VGPU_CAL_CONT_STEP_PM)) * down / 1000) / 1000;
    g->cal_pm = (uint32_t)(pm < lo ? lo : pm > hi ? hi : pm);
    if (g->cal_pm != was) /* a step moving nothing is not the first */
        g->cal_cont_moved = 1;
    vgpu_gate_reprice(g);
}
