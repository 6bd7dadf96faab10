/*
 * vgpu_launch.c - the launch and wait hooks and the CUDA side of the compute limiter
 * (arithmetic: vgpu_compute.c).
 *
 * Launch hooks (cuLaunchKernel(_ptsz), cuLaunchKernelEx(_ptsz), cuLaunchCooperativeKernel
 * (_ptsz), cuGraphLaunch(_ptsz)) pass through vgpu_compute_gate; a graph launch then goes
 * through vgpu_mem_graph_launch (graph memory, vgpu_cuda_mem.c). Wait hooks
 * (cuStreamSynchronize(_ptsz), cuCtxSynchronize, cuEventSynchronize) close the batch being
 * measured before the application waits, so the GPU time of work the application waits for is
 * measured exactly, and settle it after.
 *
 * Measuring: the slow path records a CUDA event on the launching stream before a batch's
 * first launch and another after its last one (at the next slow path, VGPU_BATCH_NS later,
 * or before an application wait); cuEventElapsedTime of the pair, once both have completed
 * (cuEventQuery, never waited for except to bound the work queued before the first
 * measurement), is the batch's GPU time. A batch closed when its stream had already gone idle
 * (no wait of the application in between) is an upper bound (it includes the idle tail): it is
 * charged at most at the current per-launch estimate. Events are made in the context that was
 * current at the first measurement; launches in other contexts keep their provisional charge.
 */
#include "vgpu_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_NOT_READY 600
/* Kernels at least this long on average are measured one by one (an event before and after
 * each launch: a few us of CPU against >= 200 us of GPU). The application's own waits cannot be
 * relied on to end a batch: the CUDA runtime's cudaDeviceSynchronize reaches the driver through
 * its private export table, not through a hook (measured on the H200), so a batch of a long
 * kernel the application waited for would otherwise close at the next launch, idle time
 * included. */
#define LONG_KERNEL_NS 200000ull
/* A batch's launch count with this bit set: closed when its stream had gone idle, its span an
 * upper bound. */
#define UPPER_BOUND (1ull << 63)


/* The driver's event, stream and context functions (vgpu.drv, resolved at bind time) and the
 * real cuEventSynchronize (the hook table's). */
#define DRV (&vgpu.drv)

static int can_measure(void)
{
    const struct vgpu_drv *f = DRV;
    return f->event_create && f->event_destroy && f->event_record && f->event_query &&
           f->event_elapsed && f->ctx_get_current;
}

/* ------------------------------------------------------------------ setup and schedule */

void vgpu_compute_setup(int d, CUdevice dev)
{
    (void)dev;
    struct vgpu_gate *g = &vgpu.gate[d];
    int cores = vgpu.cfg.policy == VGPU_POLICY_DISABLE ? 0 : (int)vgpu.region.r->dev[d].cores;
    vgpu_gate_init(g, cores, vgpu.cfg.period_ns);
    /* An uncapped high-priority tenant of a coordinated card is measured (never delayed): the
     * agent gives low-priority co-tenants what it leaves. */
    if (!g->active && vgpu.cfg.policy != VGPU_POLICY_DISABLE && vgpu.cfg.priority == 0 &&
        vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0])
        g->active = g->measure_only = 1;
    if (!vgpu.region.private_map)
        g->vt = &vgpu.region.r->dev[d].credit_vt;
    uint64_t margin = 2 * vgpu_coarse_margin();
    if (g->batch_ns < margin)
        g->batch_ns = margin;
}

/* Every 250 ms on the slow path: stamp the container's activity and busy share in its own
 * region (the agent reads them) and read the window the agent laid out for this card. A
 * missing, short or garbage schedule, or one that does not list us yet: our own share at
 * offset 0, alone (capped, never unlimited); retried on every slow path until listed. A window
 * is never longer than our own share. */
static void refresh_schedule(int d, uint64_t now)
{
    struct vgpu_gate *g = &vgpu.gate[d];
    if (g->last_sched_ns && now - g->last_sched_ns < VGPU_SCHED_REFRESH_NS)
        return;
    struct vgpu_region_dev *rd = &vgpu.region.r->dev[d];
    uint64_t hb = atomic_load_explicit(&rd->sched_heartbeat_ns, memory_order_relaxed);
    if (!hb || hb > now || now - hb >= VGPU_SCHED_STALE_NS)
        atomic_store_explicit(&rd->sched_joined_ns, now, memory_order_relaxed); /* (re)joins at the end */
    atomic_store_explicit(&rd->sched_heartbeat_ns, now, memory_order_relaxed);
    if (!g->last_sched_ns || now - g->last_sched_ns >= VGPU_SCHED_REFRESH_NS)
        atomic_store_explicit(&rd->sched_busy_pm, vgpu_gate_busy(g, now), memory_order_relaxed);
    if (g->measure_only) {
        g->last_sched_ns = now;
        return;
    }
    uint32_t off = 0, len = 0, n = 0;
    if (vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] &&
        vgpu_sched_read(vgpu.cfg.sched_dir, rd->uuid, vgpu.cfg.claim, &off, &len, &n) == 0) {
        uint64_t l = g->period_ns * len / 1000;
        g->last_sched_ns = now;
        vgpu_gate_set_window(g, g->period_ns * off / 1000, l < g->share_ns ? l : g->share_ns, n > 1);
        return;
    }
    g->last_sched_ns = vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] ? 0 : now;
    vgpu_gate_set_window(g, 0, g->share_ns, 0);
}

/* ------------------------------------------------------------------ measuring */

static CUevent ev_get(struct vgpu_gate *g)
{
    CUcontext ctx = NULL;
    if (!can_measure() || DRV->ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx)
        return NULL;
    if (!g->ev_ctx)
        g->ev_ctx = ctx;
    if (ctx != g->ev_ctx)
        return NULL;
    if (g->npool)
        return g->pool[--g->npool];
    CUevent e = NULL;
    return DRV->event_create(&e, 0) == CUDA_SUCCESS ? e : NULL;
}

static void ev_put(struct vgpu_gate *g, void *e)
{
    if (!e)
        return;
    if (g->npool < (int)(sizeof g->pool / sizeof g->pool[0]))
        g->pool[g->npool++] = e;
    else
        DRV->event_destroy(e);
}

/* An event pair around a busy segment on an idle stream adds the GPU's time from the event to
 * its first kernel and after its last one: 4.9-5.3 us over the kernels' back-to-back time on the
 * H200 with driver 580 (bench/gpu/suite_cu.c evlat: 10.0 us kernels bracketed 14.9 us, 43.3 ->
 * 48.1, 209.9 -> 215.2), an empty pair 1.3 us. Launch-bound training has a segment per kernel
 * or two, so this is taken off each segment (never more than half of it). */
#define SEG_OVERHEAD_NS 4500ull

static uint64_t segment_ns(float ms)
{
    uint64_t ns = (uint64_t)((double)ms * 1e6);
    return ns > 2 * SEG_OVERHEAD_NS ? ns - SEG_OVERHEAD_NS : ns / 2;
}

/* The oldest batch of the ring is settled: its events back to the pool. */
static void batch_release(struct vgpu_gate *g, struct vgpu_batch *b)
{
    ev_put(g, b->ev_open);
    ev_put(g, b->ev_close);
    ev_put(g, b->ev_probe);
    ev_put(g, b->ev_seg);
    g->ring_head = (g->ring_head + 1) % VGPU_BATCH_RING;
    VGPU_POKE(g->ring_len, g->ring_len - 1);
}

/* Settle completed batches, oldest first; `wait`: wait for the oldest one. */
static void poll_batches(struct vgpu_gate *g, int wait)
{
    while (g->ring_len) {
        struct vgpu_batch *b = &g->ring[g->ring_head];
        CUresult r = DRV->event_query(b->ev_close);
        CUresult (*ev_sync)(CUevent) = REAL(H_EVENTSYNC, CUresult(*)(CUevent));
        if (r == CU_NOT_READY && wait && ev_sync) {
            r = ev_sync(b->ev_close);
            wait = 0;
        }
        if (r == CU_NOT_READY)
            break;
        float ms = -1, pm = -1, seg = -1;
        int ok = r == CUDA_SUCCESS && DRV->event_elapsed(&ms, b->ev_open, b->ev_close) == CUDA_SUCCESS && ms >= 0;
        if (ok && b->tracked &&
            DRV->event_elapsed(&seg, b->ev_seg ? b->ev_seg : b->ev_open, b->ev_close) == CUDA_SUCCESS && seg >= 0) {
            /* gap-tracked: the busy segments' own time, exact */
            uint64_t busy = b->seg_busy_ns + segment_ns(seg);
            vgpu_gate_tracked(g, busy, (uint64_t)((double)ms * 1e6));
            /* Uncapped high priority publishes its demand (work queued or running: the span),
             * not its GPU time alone: time-sliced beside low priority its kernels wait, and
             * its GPU time would hand that wait to the low-priority tenant. */
            vgpu_gate_settle(g, b->launches, b->prov_ns, g->measure_only ? (uint64_t)((double)ms * 1e6) : busy, 3);
            batch_release(g, b);
            continue;
        }
        /* The first kernel's own time (opened right before it, probed right after it), or a
         * batch of one kernel closed behind it: a sample of GPU time with no gaps. */
        if (ok && b->ev_probe && DRV->event_elapsed(&pm, b->ev_open, b->ev_probe) == CUDA_SUCCESS && pm >= 0)
            vgpu_gate_sample(g, (uint64_t)((double)pm * 1e6));
        else if (ok && !b->ev_probe && b->launches == 1)
            vgpu_gate_sample(g, (uint64_t)((double)ms * 1e6));
        /* bit 63 of `launches` flags an upper bound; the count is the rest */
        vgpu_gate_settle(g, b->launches & ~UPPER_BOUND, b->prov_ns, ok ? (uint64_t)((double)ms * 1e6) : 0,
                         ok ? (b->launches & UPPER_BOUND ? 2 : 1) : 0);
        batch_release(g, b);
    }
}

/* ------------------------------------------------------------------ gap tracking
 *
 * Alone on the card, a batch's span counts the GPU's idle time between launches that come
 * slower than their kernels (launch-bound training: the H200 was 48 % busy natively). In a
 * tracked batch (one in VGPU_TRACK_EVERY, at random, on one stream) an event, `tail`, is
 * re-recorded behind every launch, and queried before the next: complete means the GPU has run
 * everything and is idle, so the busy segment ended at `tail` (its time, from the segment's
 * start event, is added up) and a new segment starts with an event before this launch. The
 * batch's GPU time is then the sum of its segments, exact to the launch latency; the other
 * batches are charged their span times the busy share the tracked ones found (gap_pm). */

static void track_stop(struct vgpu_gate *g)
{
    ev_put(g, g->tail);
    ev_put(g, g->cur.ev_seg);
    g->tail = g->cur.ev_seg = NULL;
    g->cur.seg_busy_ns = 0;
    g->tail_set = 0;
    VGPU_POKE(g->tracking, 0);
}

static void track_start(struct vgpu_gate *g, CUstream s)
{
    uint32_t x = g->track_rng ? g->track_rng : (uint32_t)vgpu_now_ns() | 1u;
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    g->track_rng = x;
    if (g->cotenants || g->est_ns >= LONG_KERNEL_NS || !g->cur.ev_open || x % VGPU_TRACK_EVERY)
        return;
    if (!(g->tail = ev_get(g)))
        return;
    g->track_stream = s;
    g->tail_set = 0;
    g->cur.seg_busy_ns = 0;
    VGPU_POKE(g->tracking, 1);
}

/* A stream being captured (torch.cuda.graph warms up on its side stream, then captures on
 * it): querying its work would invalidate the capture, and what is captured does not run now. */
static int capturing(CUstream s)
{
    int st = 0;
    return DRV->stream_is_capturing && DRV->stream_is_capturing(s, &st) == CUDA_SUCCESS && st != 0;
}

/* Before a launch of a tracked batch (under the gate's lock). */
static void track_before(struct vgpu_gate *g, CUstream s)
{
    if (g->tracking && capturing(s)) {
        track_stop(g);
        return;
    }
    if (!g->tracking || (s == g->track_stream && (!g->tail_set || DRV->event_query(g->tail) != CUDA_SUCCESS)))
        return; /* the GPU is still busy with what came before: no gap */
    float ms = -1;
    void *start = g->cur.ev_seg ? g->cur.ev_seg : g->cur.ev_open;
    if (s != g->track_stream || DRV->event_elapsed(&ms, start, g->tail) != CUDA_SUCCESS || ms < 0 ||
        (!g->cur.ev_seg && !(g->cur.ev_seg = ev_get(g))) || DRV->event_record(g->cur.ev_seg, s) != CUDA_SUCCESS) {
        track_stop(g); /* several streams, or an event failed: a plain batch */
        return;
    }
    g->cur.seg_busy_ns += segment_ns(ms);
    g->tail_set = 0;
}

/* After a launch of a tracked batch (under the gate's lock). */
static void track_after(struct vgpu_gate *g, CUstream s)
{
    if (!g->tracking)
        return;
    if (s != g->track_stream || DRV->event_record(g->tail, s) != CUDA_SUCCESS)
        track_stop(g);
    else
        g->tail_set = 1;
}

/* Close the open batch after the work queued on `s` (at_sync: the application waits for it
 * next, so the close marks its end exactly). */
static void batch_close(struct vgpu_gate *g, CUstream s, int at_sync)
{
    if (!g->cur.ev_open)
        return;
    /* Behind the batch's latest launch: on `s` when that is where it went (one stream), else on
     * the legacy stream, which follows every blocking stream (several streams: the batch's
     * last kernel may be on another one than the caller's). */
    if (atomic_load_explicit(&g->last_stream, memory_order_relaxed) != (void *)s)
        s = NULL;
    uint64_t n = atomic_exchange(&g->batch_n, 0);
    struct vgpu_batch b = {.ev_open = g->cur.ev_open, .launches = n, .prov_ns = n * g->est_ns,
                           .ev_probe = g->cur.ev_probe};
    VGPU_POKE(g->cur.ev_open, NULL);
    g->cur.ev_probe = NULL;
    VGPU_POKE(g->probe_pending, 0);
    if (g->tracking && g->tail_set) { /* exact: closed right behind its last launch */
        b.ev_close = g->tail, b.ev_seg = g->cur.ev_seg, b.seg_busy_ns = g->cur.seg_busy_ns, b.tracked = 1;
        g->tail = g->cur.ev_seg = NULL;
    }
    track_stop(g);
    if (g->ring_len == VGPU_BATCH_RING)
        poll_batches(g, 1);
    if (b.tracked) {
        if (n) {
            g->ring[(g->ring_head + g->ring_len) % VGPU_BATCH_RING] = b;
            VGPU_POKE(g->ring_len, g->ring_len + 1);
            return;
        }
        ev_put(g, b.ev_seg);
        b.ev_seg = NULL;
    }
    int idle = !at_sync && DRV->stream_query && DRV->stream_query(s) == CUDA_SUCCESS;
    if (n && g->ring_len < VGPU_BATCH_RING && (b.ev_close = ev_get(g)) &&
        DRV->event_record(b.ev_close, s) == CUDA_SUCCESS) {
        if (idle)
            b.launches |= UPPER_BOUND; /* the stream was idle before the close */
        g->ring[(g->ring_head + g->ring_len) % VGPU_BATCH_RING] = b;
        VGPU_POKE(g->ring_len, g->ring_len + 1);
        return;
    }
    ev_put(g, b.ev_close);
    ev_put(g, b.ev_open);
    ev_put(g, b.ev_probe);
}

static void batch_open(struct vgpu_gate *g, CUstream s)
{
    if (g->cur.ev_open)
        return;
    CUevent e = ev_get(g);
    if (e && DRV->event_record(e, s) != CUDA_SUCCESS) {
        ev_put(g, e);
        e = NULL;
    }
    VGPU_POKE(g->cur.ev_open, e);
    atomic_store(&g->batch_n, 0);
    track_start(g, s);
}

/* ------------------------------------------------------------------ the gate */

static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / VGPU_SEC), (long)(t % VGPU_SEC)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static void gate_slow(int d, CUstream s)
{
    vgpu_symbols_bind();
    struct vgpu_gate *g = &vgpu.gate[d];
    pthread_mutex_lock(&g->mu);
    uint64_t now = vgpu_now_ns();
    if (vgpu_gate_fast(g, now, now, s)) { /* another thread opened it meanwhile */
        pthread_mutex_unlock(&g->mu);
        return;
    }
    int st = 0;
    if (DRV->stream_is_capturing && DRV->stream_is_capturing(s, &st) == CUDA_SUCCESS && st != 0) {
        pthread_mutex_unlock(&g->mu); /* captured work does not run now: not gated */
        return;
    }
    batch_close(g, s, 0);
    poll_batches(g, !g->est_ns && g->ring_len); /* no estimate yet: measure before queuing more */
    for (;;) {
        now = vgpu_now_ns();
        refresh_schedule(d, now);
        g->queued_ns = 0; /* launched, not yet measured: what the co-tenant window must still hold */
        for (unsigned i = 0; i < g->ring_len; i++)
            g->queued_ns += g->ring[(g->ring_head + i) % VGPU_BATCH_RING].prov_ns;
        uint64_t wake = vgpu_gate_decide(g, now);
        if (!wake)
            break;
        g->throttles++;
        if (vgpu.cfg.log_level >= 3)
            vgpu_log(3, "gate d%d: wait %llu us (credit %lld us, gaps %u pm, est %llu ns/launch, window %llu+%llu us of %llu, co-tenants %d)",
                     d, (unsigned long long)((wake - now) / 1000),
                     ((long long)now - (long long)atomic_load(g->vt)) / 1000, g->gap_pm, (unsigned long long)g->est_ns,
                     (unsigned long long)(g->offset_ns / 1000), (unsigned long long)(g->len_ns / 1000),
                     (unsigned long long)(g->period_ns / 1000), g->cotenants);
        /* Wake at least every 250 ms: the schedule may change, and the agent needs our heartbeat. */
        sleep_until(wake - now > VGPU_GATE_MAX_SLEEP_NS ? now + VGPU_GATE_MAX_SLEEP_NS : wake);
        poll_batches(g, 0);
    }
    batch_open(g, s);
    if (g->est_ns >= LONG_KERNEL_NS)
        atomic_store(&g->open_until, 0); /* long kernels: one launch per batch */
    else if (g->cur.ev_open)
        VGPU_POKE(g->probe_pending, 1); /* an event right after this launch: its kernel's own time */
    /* This launch: charged and counted like one of the fast path. */
    if (!g->measure_only)
        atomic_fetch_add_explicit(g->vt, atomic_load_explicit(&g->vt_cost, memory_order_relaxed),
                                  memory_order_relaxed);
    atomic_fetch_add_explicit(&g->batch_n, 1, memory_order_relaxed);
    atomic_store_explicit(&g->last_stream, s, memory_order_relaxed);
    pthread_mutex_unlock(&g->mu);
}

static inline int gate_of_current(void)
{
    int d = vgpu_single_gate;
    if (d < 0) {
        d = vgpu_cur_dev();
        if (d < 0 || !vgpu.gate[d].active)
            return -1;
    }
    return d;
}

void vgpu_compute_gate(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = gate_of_current();
    if (d < 0)
        return;
    /* The coarse clock (a few ns) decides while the batch is clearly open and the credit
     * clearly there; otherwise the precise clock (tens of ns in a VM) does. */
    uint64_t margin = vgpu.coarse_margin; /* set with the device map, before any gate is active */
    struct vgpu_gate *g = &vgpu.gate[d];
    uint64_t c = vgpu_coarse_ns();
    if (__builtin_expect(!vgpu_gate_fast(g, c, c + margin, s), 0)) {
        uint64_t now = vgpu_now_ns();
        if (!vgpu_gate_fast(g, now, now, s))
            gate_slow(d, s);
    }
    if (VGPU_PEEK(g->tracking)) { /* a hint, re-checked under the lock */
        pthread_mutex_lock(&g->mu);
        track_before(g, s);
        pthread_mutex_unlock(&g->mu);
    }
}

/* After a launch: long kernels close their one-launch batch right behind it. */
static inline void compute_after(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = gate_of_current();
    if (d < 0)
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    /* unlocked peeks: the common case (nothing to do) costs no lock; re-checked under it */
    if (!VGPU_PEEK(g->probe_pending) && !VGPU_PEEK(g->tracking) &&
        (VGPU_PEEK(g->est_ns) < LONG_KERNEL_NS || !VGPU_PEEK(g->cur.ev_open)))
        return;
    pthread_mutex_lock(&g->mu);
    int st = 0;
    track_after(g, s);
    if (g->probe_pending) {
        VGPU_POKE(g->probe_pending, 0);
        CUevent e;
        if (g->cur.ev_open && !g->cur.ev_probe && (e = ev_get(g))) {
            if (DRV->event_record(e, s) == CUDA_SUCCESS)
                g->cur.ev_probe = e;
            else
                ev_put(g, e);
        }
    } else if (g->est_ns >= LONG_KERNEL_NS && g->cur.ev_open &&
               !(DRV->stream_is_capturing && DRV->stream_is_capturing(s, &st) == CUDA_SUCCESS && st != 0))
        batch_close(g, s, 1);
    pthread_mutex_unlock(&g->mu);
}

void vgpu_compute_sync(CUstream s, int whole_ctx)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = gate_of_current();
    if (d < 0 || !VGPU_PEEK(vgpu.gate[d].cur.ev_open)) /* a hint, re-checked under the lock */
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    vgpu_symbols_bind();
    pthread_mutex_lock(&g->mu);
    int st = 0;
    if (!(DRV->stream_is_capturing && DRV->stream_is_capturing(whole_ctx ? NULL : s, &st) == CUDA_SUCCESS && st != 0)) {
        batch_close(g, whole_ctx ? NULL : s, 1);
        atomic_store(&g->open_until, 0); /* the next launch opens a new batch */
    }
    pthread_mutex_unlock(&g->mu);
}

void vgpu_compute_synced(void)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = gate_of_current();
    if (d < 0 || !VGPU_PEEK(vgpu.gate[d].ring_len)) /* a hint */
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    pthread_mutex_lock(&g->mu);
    poll_batches(g, 0);
    pthread_mutex_unlock(&g->mu);
}

/* ------------------------------------------------------------------ launches */

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void **);

VGPU_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s);
    CUresult rc = REAL(H_LAUNCH, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e);
    compute_after(s);
    return rc;
}

VGPU_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                      unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    CUresult rc = REAL(H_LAUNCH_PTSZ, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e);
    compute_after(s ? s : CU_STREAM_PER_THREAD);
    return rc;
}

VGPU_API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(c ? c->hStream : NULL);
    CUresult rc = REAL(H_LAUNCHEX, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e);
    compute_after(c ? c->hStream : NULL);
    return rc;
}

VGPU_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(c && c->hStream ? c->hStream : CU_STREAM_PER_THREAD);
    CUresult rc = REAL(H_LAUNCHEX_PTSZ, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e);
    compute_after(c && c->hStream ? c->hStream : CU_STREAM_PER_THREAD);
    return rc;
}

VGPU_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                            unsigned by, unsigned bz, unsigned shm, CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s);
    CUresult rc = REAL(H_COOP, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p);
    compute_after(s);
    return rc;
}

VGPU_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                 unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                                 CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    CUresult rc = REAL(H_COOP_PTSZ, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p);
    compute_after(s ? s : CU_STREAM_PER_THREAD);
    return rc;
}

static CUresult graph_launch(int idx, CUgraphExec g, CUstream s)
{
    vgpu_compute_gate(s);
    CUresult rc = mode() != M_LIMITED ? REAL(idx, CUresult(*)(CUgraphExec, CUstream))(g, s)
                                      : vgpu_mem_graph_launch(idx, g, s); /* graph memory: vgpu_cuda_mem.c */
    compute_after(s);
    return rc;
}

VGPU_API CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    BROKEN_GUARD();
    return graph_launch(H_GRAPH, g, s);
}

VGPU_API CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    BROKEN_GUARD();
    return graph_launch(H_GRAPH_PTSZ, g, s ? s : CU_STREAM_PER_THREAD);
}

/* ------------------------------------------------------------------ waits */

VGPU_API CUresult cuStreamSynchronize(CUstream s)
{
    BROKEN_GUARD();
    vgpu_compute_sync(s, 0);
    CUresult rc = REAL(H_STREAMSYNC, CUresult(*)(CUstream))(s);
    vgpu_compute_synced();
    return rc;
}

VGPU_API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    BROKEN_GUARD();
    vgpu_compute_sync(s ? s : CU_STREAM_PER_THREAD, 0);
    CUresult rc = REAL(H_STREAMSYNC_PTSZ, CUresult(*)(CUstream))(s);
    vgpu_compute_synced();
    return rc;
}

VGPU_API CUresult cuCtxSynchronize(void)
{
    BROKEN_GUARD();
    vgpu_compute_sync(NULL, 1);
    CUresult rc = REAL(H_CTXSYNC, CUresult(*)(void))();
    vgpu_compute_synced();
    return rc;
}

VGPU_API CUresult cuEventSynchronize(CUevent e)
{
    BROKEN_GUARD();
    vgpu_compute_sync(NULL, 1);
    CUresult rc = REAL(H_EVENTSYNC, CUresult(*)(CUevent))(e);
    vgpu_compute_synced();
    return rc;
}
