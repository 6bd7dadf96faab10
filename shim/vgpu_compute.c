/*
 * vgpu_compute.c - the compute limit: work-conserving credit on measured GPU time.
 *
 * Model (struct vgpu_gate in vgpu.h). A container with `cores` percent earns credit at that
 * rate of wall time, up to a bucket of one share of the period (alone, at most
 * VGPU_BUCKET_MAX_NS of GPU time). Credit is kept as a clock V, container-wide in the region:
 * credit = now - V, V >= now - burst. A launch passes
 * while V <= now, and advances V provisionally by its estimated cost at the share's rate
 * (GPU ns x P / len). Launches are grouped in batches (VGPU_BATCH_NS, or up to the app's own
 * wait); the launch path records a CUDA event before a batch and after it, and when both have
 * run, the batch's real GPU time (cuEventElapsedTime) replaces the provisional charge. So:
 *   - a tenant under its share never waits (its V stays behind now): native latency;
 *   - a tenant over its share waits until its credit is back: its share of GPU time, evenly;
 *   - a kernel longer than any window leaves V far ahead (debt): the tenant waits in proportion.
 *   - a batch's span counts the GPU's idle gaps between launches slower than their kernels:
 *     the first kernel of every batch (and every long one) is bracketed on its own, and a span
 *     well above its launches at that kernel time is charged that time (vgpu_gate_sample);
 * Co-tenants of one card (the node agent's schedule lists more than one) would stretch each
 * other's batches if they ran at once, so a tenant that has spent its burst runs only inside
 * its own window of the frame (time division, offsets from the agent; the frame is
 * VGPU_COTENANT_FRAME_MUL periods: fewer hand-overs, each of which idles the card), launches only what
 * ends inside it (queued work + one launch), and is charged at most a quarter above its
 * bracketed kernel time (the GPU time-slices contexts: event pairs span the others' slices); a tenant with a full
 * bucket still starts at once (a burst below its share). Uncapped high-priority tenants are
 * measured only (never delayed) and publish their busy share, from which the agent gives
 * low-priority tenants what is left.
 *
 * Pure: the gate arithmetic. The busy calibration against the card's own reading is
 * vgpu_calibrate.c; the schedule (its layout, the file) is vgpu_sched.c; the CUDA side (events,
 * waits) is vgpu_launch.c and vgpu_measure.c, the schedule refresh vgpu_gate_inputs.c.
 */
#include "vgpu.h"

#include <string.h>

void vgpu_gate_init(struct vgpu_gate *g, int cores, uint64_t period_ns)
{
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    g->base_period_ns = g->period_ns = period_ns ? period_ns : VGPU_DEFAULT_PERIOD_NS;
    g->active = cores > 0 && cores < 100;
    g->share_ns = g->period_ns * (uint64_t)(cores > 0 && cores < 100 ? cores : 100) / 100;
    g->batch_ns = VGPU_BATCH_NS;
    g->cal_pm = 1000;
    g->vt = &g->local_vt;
    vgpu_gate_set_window(g, 0, g->share_ns, 0);
}

static uint64_t vt_of(const struct vgpu_gate *g, uint64_t gpu_ns)
{
    /* GPU ns at the share's rate: len per period earns len of GPU time; measured GPU time
     * counts as the card's busy time it stands for (calibration, 1000 = as measured). */
    unsigned __int128 busy = (unsigned __int128)gpu_ns * (g->cal_pm ? g->cal_pm : 1000) / 1000;
    return g->len_ns ? (uint64_t)(busy * g->period_ns / g->len_ns) : (uint64_t)busy * 1000;
}

void vgpu_gate_reprice(struct vgpu_gate *g)
{
    atomic_store_explicit(&g->vt_cost, vt_of(g, g->est_ns), memory_order_relaxed);
}

void vgpu_gate_set_window(struct vgpu_gate *g, uint64_t offset_ns, uint64_t len_ns, int cotenants)
{
    uint64_t mul = cotenants ? VGPU_COTENANT_FRAME_MUL : 1;
    g->period_ns = g->base_period_ns * mul;
    g->offset_ns = offset_ns * mul % g->period_ns;
    g->len_ns = len_ns * mul > g->period_ns ? g->period_ns : len_ns * mul;
    g->cotenants = cotenants;
    /* The bucket holds one window's worth of credit (in clock ns: a whole frame); alone, at
     * most VGPU_BUCKET_MAX_NS of GPU time. */
    uint64_t burst = g->len_ns ? g->period_ns : 0;
    if (!cotenants && g->len_ns > VGPU_BUCKET_MAX_NS)
        burst = VGPU_BUCKET_MAX_NS * g->period_ns / g->len_ns;
    VGPU_POKE(g->burst_ns, burst); /* the fast path reads it unlocked */
    vgpu_gate_reprice(g);
}

int vgpu_gate_open_at(struct vgpu_gate *g, uint64_t lo, uint64_t hi)
{
    /* seq_cst: the fast path counts itself in flight (g->inflight) and then reads this, a close
     * stores 0 here and then reads the count; one of the two sees the other only if both loads
     * are sequentially consistent (on x86 a plain load either way) */
    uint64_t until = atomic_load_explicit(&g->open_until, memory_order_seq_cst);
    if (hi >= until)
        return 0;
    if (g->measure_only)
        return 1;
    return atomic_load_explicit(g->vt, memory_order_relaxed) <= lo; /* else out of credit */
}

void vgpu_gate_clamp(struct vgpu_gate *g, uint64_t hi)
{
    uint64_t v = atomic_load_explicit(g->vt, memory_order_relaxed), burst = VGPU_PEEK(g->burst_ns);
    while (v + burst < hi && !atomic_compare_exchange_weak(g->vt, &v, hi - burst))
        ;
}

void vgpu_gate_count(struct vgpu_gate *g)
{
    if (!g->measure_only)
        atomic_fetch_add_explicit(g->vt, atomic_load_explicit(&g->vt_cost, memory_order_relaxed),
                                  memory_order_relaxed);
    /* A plain add (no lock prefix): concurrent threads may lose a count, which only makes the
     * next estimate slightly high; the credit itself is the atomic above. */
    atomic_store_explicit(&g->batch_n, atomic_load_explicit(&g->batch_n, memory_order_relaxed) + 1,
                          memory_order_relaxed);
}

__thread uintptr_t vgpu_thread_tok;
static _Atomic uintptr_t thread_tok_next;

uintptr_t vgpu_thread_token_new(void)
{
    return vgpu_thread_tok = atomic_fetch_add(&thread_tok_next, 1) + 1;
}

int vgpu_gate_measures(struct vgpu_gate *g, void *s)
{
    /* the per-thread handle of another thread than the batch's names another stream */
    if (s == VGPU_STREAM_PER_THREAD && VGPU_PEEK(g->cur.pt_owner) != vgpu_thread_token())
        return 0;
    if (VGPU_PEEK(g->cur.stream) == s)
        return 1;
    int n = VGPU_PEEK(g->cur.nxs);
    for (int i = 0; i < n && i < VGPU_BATCH_STREAMS - 1; i++)
        if (VGPU_PEEK(g->cur.xs[i]) == s)
            return 1;
    return 0;
}

int vgpu_gate_fast(struct vgpu_gate *g, uint64_t lo, uint64_t hi, void *stream)
{
    if (!vgpu_gate_open_at(g, lo, hi))
        return 0;
    /* a stream the open batch does not measure yet: the slow path adds it (or closes the batch) */
    if (VGPU_PEEK(g->cur.ev_open) && !vgpu_gate_measures(g, stream))
        return 0;
    if (!g->measure_only)
        vgpu_gate_clamp(g, hi);
    vgpu_gate_count(g);
    return 1;
}

/* Start of the first own window that ends after t (it may have begun before t). */
static uint64_t window_at(const struct vgpu_gate *g, uint64_t t)
{
    uint64_t P = g->period_ns, off = g->offset_ns;
    uint64_t ws = t >= off ? t - (t - off) % P : off;
    if (t >= off && t >= ws + g->len_ns)
        ws += P;
    return ws;
}

/* Co-tenants: may a launch with credit (t == now) start at once, outside the window? A full
 * bucket may (a tenant under its share is not delayed) until the bucket is spent. A tenant that
 * had to wait within the last two frames is not under its share: it keeps to its window even
 * with a full bucket (a burst beside a co-tenant's window time-slices with it and both tenants'
 * event pairs over-measure). A burst spends one bucket, at most 25 ms of GPU time, and a new
 * one starts only while the tenant's measured busy share is under 3/4 of its window's
 * (VGPU_BURST_MAX_BUSY_PM): a saturating tenant just under its share (its window's last kernel
 * did not fit) never ran out of credit, so it stayed in its burst and launched in its
 * neighbours' windows. */
static int may_burst(struct vgpu_gate *g, uint64_t v, uint64_t t, uint64_t now)
{
    /* a burst beside co-tenants takes no more than a tenant alone banks (VGPU_BUCKET_MAX_NS of
     * GPU time): the bucket holds a whole window, which a burst would spend in others' windows */
    uint64_t most = g->burst_ns;
    if (g->len_ns > VGPU_BUCKET_MAX_NS && VGPU_BUCKET_MAX_NS * g->period_ns / g->len_ns < most)
        most = VGPU_BUCKET_MAX_NS * g->period_ns / g->len_ns;
    if (g->bursting && (int64_t)(v - g->burst_v0) >= (int64_t)most)
        g->bursting = 0;
    if (t != now)
        return 0;
    if (!g->bursting) {
        int full = v + g->burst_ns <= now; /* less than the share used for a frame */
        int waited = g->waited_ns && now - g->waited_ns < 2 * g->period_ns;
        int light = (uint64_t)g->busy_pm * g->period_ns < VGPU_BURST_MAX_BUSY_PM * g->len_ns;
        if (!full || waited || !light)
            return 0;
        g->burst_v0 = v;
        g->bursting = 1;
    }
    return 1;
}

/* Co-tenants outside a burst: own window only. 0 = pass (open_until set), else when to retry. */
static uint64_t window_decide(struct vgpu_gate *g, uint64_t v, uint64_t t, uint64_t now, uint64_t batch_end)
{
    uint64_t ws = window_at(g, t), we = ws + g->len_ns;
    /* The work launched must end inside the window (what is queued, then one more launch):
     * work spilling into a co-tenant's window time-slices with its work, and both pairs of
     * events would count both. A launch longer than the window still starts at its beginning. */
    uint64_t need = g->queued_ns + g->est_ns;
    if (ws <= t && t + need > we && need < g->len_ns) {
        ws += g->period_ns;
        we += g->period_ns;
    }
    if (ws > t) {
        g->waited_ns = now;
        return ws;
    }
    if (t > now) /* t is inside a window */
        return g->waited_ns = now, t;
    /* Credit for no more than what still fits in the window: the fast path then stops queueing
     * (an application that queues ten kernels before it waits) when the window is full,
     * instead of spilling into the next tenant's. */
    uint64_t room = we > now + g->queued_ns ? we - now - g->queued_ns : 0, floor = now - vt_of(g, room);
    if (vt_of(g, room) < now)
        while (v < floor && !atomic_compare_exchange_weak(g->vt, &v, floor))
            ;
    uint64_t stop = we > batch_end + g->est_ns ? batch_end : we - (g->est_ns < we - now ? g->est_ns : 0);
    atomic_store(&g->open_until, stop > now ? stop : now + 1);
    return 0;
}

static uint64_t gate_decide(struct vgpu_gate *g, uint64_t now)
{
    uint64_t batch_end = now + g->batch_ns;
    if (g->measure_only) {
        atomic_store(&g->open_until, batch_end);
        return 0;
    }
    if (!g->len_ns) { /* the schedule leaves us no time (high priority takes it all) */
        atomic_store(&g->open_until, 0);
        return now + VGPU_NO_WINDOW_WAIT_NS;
    }
    uint64_t v = atomic_load(g->vt);
    /* A new container alone starts with half a bucket (its first second holds at most half a
     * bucket more than its share); credit is capped at one bucket: idle time does not bank more. */
    for (;;) {
        uint64_t floor = now - (v || g->cotenants ? g->burst_ns : g->burst_ns / 2);
        if (v >= floor)
            break;
        if (atomic_compare_exchange_weak(g->vt, &v, floor)) {
            v = floor;
            break;
        }
    }
    /* When there is credit again. A launch that costs more than the bucket holds (a long kernel:
     * 100 ms at 10 % is a second of credit) passes only on a full bucket: passing on any credit
     * let the next one start a bucket early, so one second held two of them (20 %). */
    uint64_t cost = atomic_load_explicit(&g->vt_cost, memory_order_relaxed);
    uint64_t t = cost > g->burst_ns ? v + g->burst_ns : v > now ? v : now;
    if (v > now)
        g->bursting = 0;
    if (!g->cotenants && t > now)
        return t;
    if (g->cotenants && !may_burst(g, v, t, now))
        return window_decide(g, v, t, now, batch_end);
    atomic_store(&g->open_until, batch_end);
    return 0;
}

uint64_t vgpu_gate_decide(struct vgpu_gate *g, uint64_t now)
{
    uint64_t r = gate_decide(g, now);
#ifdef VGPU_STATS
    struct vgpu_trace_ent *e = &g->st_trace[g->st_trace_n++ % VGPU_TRACE_LEN];
    e->now = now, e->ret = r, e->queued = g->queued_ns, e->est = g->est_ns;
    e->credit = (int64_t)now - (int64_t)atomic_load(g->vt), e->open_until = atomic_load(&g->open_until);
#endif
    return r;
}

void vgpu_gate_tracked(struct vgpu_gate *g, uint64_t busy_ns, uint64_t span_ns, uint32_t weight)
{
    /* busy / span of one gap-tracked batch into the average the other batches' spans are charged
     * by, weighted by its span: a quarter for a batch of VGPU_GAP_SPAN_NS or more at the normal
     * rate (weight 1), less for a shorter one. The ratio multiplies spans, so spans weigh it:
     * with one weight per batch, a tenant's twenty short launch-bound batches (half idle) a round
     * set it for its one long dense batch, whose untracked half then went at 56 % of its time
     * (39.7 % under 30 %). */
    if (!span_ns || busy_ns > span_ns)
        busy_ns = span_ns;
    if (!span_ns)
        return;
    uint32_t ppm = (uint32_t)(busy_ns * 1000000 / span_ns);
    if (!g->gap_pm) {
        g->gap_ppm = ppm;
    } else { /* kept in ppm: a short batch's step is a small fraction of a per mille */
        /* a batch tracked among fewer stands for more of them, so the ratio still follows the
         * tenant's work within a few tracked batches (a launch-bound phase followed by a dense
         * one: its dense batches are charged by the idle phase's ratio until it does) */
        uint64_t w = (span_ns < VGPU_GAP_SPAN_NS ? span_ns : VGPU_GAP_SPAN_NS) * (weight ? weight : 1);
        w = w < 4 * VGPU_GAP_SPAN_NS ? w : 4 * VGPU_GAP_SPAN_NS; /* at most the whole way */
        int64_t step = ((int64_t)ppm - (int64_t)g->gap_ppm) * (int64_t)w / (int64_t)(4 * VGPU_GAP_SPAN_NS);
        g->gap_ppm = (uint32_t)((int64_t)g->gap_ppm + step);
    }
    g->gap_pm = g->gap_ppm < 1000 ? 1 : (g->gap_ppm + 500) / 1000;
}

/* (an A/B build that tracks less, e.g. -DVGPU_TRACK_EVERY=1000000u, has no lower rate) */
_Static_assert(VGPU_TRACK_UNDER_EVERY <= VGPU_TRACK_EVERY ||
                   (VGPU_TRACK_UNDER_EVERY % VGPU_TRACK_EVERY == 0 && VGPU_TRACK_UNDER_EVERY <= 4 * VGPU_TRACK_EVERY),
               "a batch tracked at the lower rate must weigh in proportion to its span (vgpu_gate_tracked)");

uint32_t vgpu_gate_track_every(const struct vgpu_gate *g, uint64_t hi)
{
    /* Under its share by a margin, the charge's precision decides nothing, and a tracked
     * launch's CPU time (~2.7 us on the H100/H200) slows a launch-bound loop: a transformer
     * under a 90 % limit ran at 84 and 108 % of native tracked one batch in two, 91-92 % one in
     * sixteen by an earlier form of this rule (bench/results/gpu/suite-h100-2026-12-06-b-calls.md).
     * busy_pm is this process's own, rising at once at the 100 ms refresh; the credit is the
     * container's: processes that each use a part of a share the container spends are not
     * under it, however little each uses (a container's processes at their limit, each at
     * share / N, were all "under"). */
    if (g->measure_only || !g->base_period_ns || VGPU_TRACK_UNDER_EVERY <= VGPU_TRACK_EVERY)
        return VGPU_TRACK_EVERY;
    uint64_t share_pm = g->share_ns * 1000 / g->base_period_ns;
    uint64_t v = atomic_load_explicit(g->vt, memory_order_relaxed);
    int full = hi > v && hi - v >= g->burst_ns - g->burst_ns / 16; /* the fast path clamps at hi */
    int under = full && (uint64_t)g->busy_pm + VGPU_TRACK_UNDER_HEADROOM_PM < share_pm;
    return under ? VGPU_TRACK_UNDER_EVERY : VGPU_TRACK_EVERY;
}

void vgpu_gate_forfeit(struct vgpu_gate *g)
{
    /* a batch given up for good, whose GPU time will never be known: charged the most a tenant
     * alone may bank (VGPU_BUCKET_MAX_NS of GPU time), on top of its provisional charge */
    if (!g->measure_only && g->len_ns)
        atomic_fetch_add(g->vt, vt_of(g, VGPU_BUCKET_MAX_NS));
    g->forfeits++;
}

void vgpu_gate_sample(struct vgpu_gate *g, uint64_t ns)
{
    /* Beside co-tenants a kernel's event pair also spans the time slices the GPU gave the other
     * contexts meanwhile (the settle caps a batch at a quarter above the estimate, and never
     * below half its span). */
    if (!g->kern_ns) {
        g->kern_ns = ns;
        return;
    }
    /* beside co-tenants it moves half-way either way (a tenant can pick a tiny first kernel as
     * easily as a long one); alone, an EWMA of 1/8 */
    g->kern_ns = g->cotenants ? (g->kern_ns + ns) / 2 : (g->kern_ns * 7 + ns) / 8;
}

uint64_t vgpu_gate_settle(struct vgpu_gate *g, uint64_t launches, uint64_t prov_ns, uint64_t span_ns, uint64_t twice_ns,
                          int measured)
{
    if (!launches)
        return 0;
    if (!measured) { /* its events cannot be read: its work is unknown */
        vgpu_gate_forfeit(g);
        return 0;
    }
#ifdef VGPU_STATS
    g->st_n[measured]++, g->st_span[measured] += span_ns, g->st_prov[measured] += prov_ns;
    g->st_launches[measured] += launches;
    int st_mode = measured;
#endif
    /* (before the shares below: what an earlier batch charged was charged at its own) */
    span_ns -= twice_ns < span_ns ? twice_ns : span_ns;
    if (measured == 3) {
        /* Gap-tracked: the busy segments' own time, exact (span_ns is already their sum). */
    } else if (measured == 4) {
        /* Several streams: the close on the legacy stream does not follow non-blocking ones,
         * so the span is a lower bound: the provisional charge stands unless it says more. */
        if (span_ns < prov_ns)
            span_ns = prov_ns;
    } else if (!g->cotenants && !g->measure_only && g->gap_pm && (measured == 1 || measured == 5) && launches > 1) {
        /* Alone: a batch's span (several streams: the union of their spans) counts the GPU's
         * idle gaps between launches slower than their kernels; the gap-tracked batches say
         * what share of a span is busy. (A batch of one launch is charged to its own end,
         * vgpu_measure.c: it has no gap.) */
        span_ns = span_ns * g->gap_pm / 1000;
    } else if (g->kern_ns && (measured != 5 || g->cotenants)) {
        /* The batch's span counts the GPU's idle gaps between launches slower than their kernels
         * (CPU time) and, beside co-tenants, their time slices. A span well above its launches
         * at the bracketed kernel time is charged that time; beside co-tenants every batch is
         * charged at most a quarter above it. A kernel bracketed alone is exact as measured. */
        uint64_t k = launches * g->kern_ns, floor = span_ns / 2;
        /* never below half the span: the bracketed kernel is the tenant's to pick (a tiny one
         * first in every batch), and one co-tenant's time slices at most double a span */
        /* (Several streams alone: their kernels may run at once, so launches x kernel time
         * says nothing about the union of their spans.) */
        if (g->cotenants && span_ns > k + k / 4)
            span_ns = k + k / 4 > floor ? k + k / 4 : floor;
        else if (!g->cotenants && launches > 1 && span_ns > k + k / 2)
            span_ns = k > floor ? k : floor;
    }
    if (measured == 4 && g->est_ns) {
        /* the estimate is not moved by a bound that cannot be checked */
    } else if (measured == 2 && g->est_ns) {
        /* An upper bound (it includes the idle time before the close): at most the estimate,
         * which it may only lower. */
        if (span_ns > launches * g->est_ns)
            span_ns = launches * g->est_ns;
        else if (!twice_ns)
            VGPU_POKE(g->est_ns, (g->est_ns + span_ns / launches) / 2); /* peeked unlocked */
    } else if (!twice_ns) { /* (less what ran at once with earlier work: not a launch's time) */
        uint64_t sample = span_ns / launches;
        VGPU_POKE(g->est_ns, g->est_ns ? (g->est_ns * 3 + sample) / 4 : sample);
    }
    g->busy_acc_ns += span_ns;
    g->cal_total_ns += span_ns;
#ifdef VGPU_STATS
    g->st_charged[st_mode] += span_ns;
#endif
    if (g->measure_only)
        return span_ns;
    if (span_ns > prov_ns)
        atomic_fetch_add(g->vt, vt_of(g, span_ns - prov_ns));
    else
        atomic_fetch_sub(g->vt, vt_of(g, prov_ns - span_ns));
    vgpu_gate_reprice(g);
    return span_ns;
}

/* Measured GPU time per mille of the wall time since busy_since_ns (now after it), at most 1000. */
static uint64_t interval_pm(const struct vgpu_gate *g, uint64_t now)
{
    uint64_t pm = g->busy_acc_ns * 1000 / (now - g->busy_since_ns);
    return pm > 1000 ? 1000 : pm;
}

uint32_t vgpu_gate_busy(struct vgpu_gate *g, uint64_t now)
{
    if (!g->busy_since_ns || now <= g->busy_since_ns) {
        g->busy_since_ns = now;
        return g->busy_pm;
    }
    uint64_t pm = interval_pm(g, now);
    /* rises at once (low priority must yield fast); falls over about a second at the 100 ms
     * refresh (7/8 a step) */
    g->busy_pm = pm > g->busy_pm ? (uint32_t)pm : (uint32_t)((g->busy_pm * 7 + pm) / 8);
    g->busy_acc_ns = 0;
    g->busy_since_ns = now;
    return g->busy_pm;
}

int vgpu_gate_busy_rise(struct vgpu_gate *g, uint64_t now)
{
    /* Between refreshes: a share measured over at least VGPU_BUSY_RISE_MIN_NS of the current
     * interval that is above the published one is published at once (a high-priority tenant
     * resuming after a pause: its refresh measured the pause) */
    if (!g->busy_since_ns || now < g->busy_since_ns + VGPU_BUSY_RISE_MIN_NS)
        return 0;
    uint64_t pm = interval_pm(g, now);
    if (pm <= g->busy_pm)
        return 0;
    g->busy_pm = (uint32_t)pm;
    return 1;
}
