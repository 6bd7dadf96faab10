/*
 * vgpu_measure.c - the GPU time of a container's work, for the compute limiter (its gate:
 * vgpu_launch.c; its arithmetic: vgpu_compute.c).
 *
 * Batches: the gate's slow path records a CUDA event on the launching stream before a batch's
 * first launch and another after its last one (at the next slow path, VGPU_BATCH_NS later, or
 * before an application wait); cuEventElapsedTime of the pair, once both have completed
 * (cuEventQuery; waited for only to bound the work queued before the first measurement and to
 * make room in a full ring, at most VGPU_MEASURE_WAIT_NS), is the batch's GPU time. A batch
 * closed when its stream had already gone idle (no wait of the application in between) is an
 * upper bound (it includes the idle tail): it is charged at most at the current per-launch
 * estimate. Gap tracking, which measures a sampled batch launch by launch, is vgpu_track.c.
 *
 * Contexts: an event belongs to the context it was made in and is recorded only on that
 * context's streams, and the legacy and per-thread stream handles name the current context's
 * stream. The gate measures in one context at a time (ev_ctx, the pool's): a slow-path launch in
 * another context closes the open batch in its own context and moves the gate to the new one
 * (vgpu_measure_follow); the fast path sends a launch on those handles from another context to
 * the slow path (vgpu_launch.c). Batches closed in a context settle as before; their events are
 * destroyed, not pooled, once the gate has moved on.
 */
#include "vgpu_cuda.h"

#include <string.h>
#include <time.h>

#define DRV (&vgpu.drv)

static int vgpu_can_measure(void)
{
    const struct vgpu_drv *f = DRV;
    return f->event_create && f->event_destroy && f->event_record && f->event_query &&
           f->event_elapsed && f->ctx_get_current;
}

/* ------------------------------------------------------------------ measuring */

CUevent vgpu_measure_event(struct vgpu_gate *g)
{
    CUcontext ctx = NULL;
    if (!vgpu_can_measure() || DRV->ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx)
        return NULL;
    if (ctx == g->ctx_dying) /* its events would go with it */
        return NULL;
    if (!g->ev_ctx)
        VGPU_POKE(g->ev_ctx, (void *)ctx);
    if (ctx != g->ev_ctx)
        return NULL;
    if (g->npool)
        return g->pool[--g->npool];
    CUevent e = NULL;
    return DRV->event_create(&e, 0) == CUDA_SUCCESS ? e : NULL;
}

void vgpu_measure_put(struct vgpu_gate *g, void *e)
{
    if (!e)
        return;
    if (g->npool < (int)(sizeof g->pool / sizeof g->pool[0]))
        g->pool[g->npool++] = e;
    else
        DRV->event_destroy(e);
}

/* An event whose record failed: destroyed, never pooled (the pool hands back the last event put,
 * so one that cannot be recorded would fail every later batch, each then charged a bucket). */
static void event_failed(void *e)
{
    if (e)
        DRV->event_destroy(e);
}

/* A batch's events: back to the pool once it is settled. Or, `pending`, given up while its work
 * may still run: destroyed (the driver frees them once the GPU has passed them), since a pooled
 * one would be recorded again while the GPU still owes it. */
static void batch_free(struct vgpu_gate *g, struct vgpu_batch *b, int pending)
{
    pending = pending || b->ctx != g->ev_ctx; /* another context's events: never pooled */
    void *ev[4 + 2 * (VGPU_BATCH_STREAMS - 1) + VGPU_BATCH_STREAMS] = {b->ev_open, b->ev_close, b->ev_probe, b->ev_seg};
    for (int i = 0; i < b->nxs; i++)
        ev[4 + 2 * i] = b->xs_open[i], ev[5 + 2 * i] = b->xs_close[i];
    for (int i = 0; i < b->ntails; i++)
        ev[4 + 2 * (VGPU_BATCH_STREAMS - 1) + i] = b->tails[i];
    for (unsigned i = 0; i < sizeof ev / sizeof ev[0]; i++)
        if (!pending)
            vgpu_measure_put(g, ev[i]);
        else if (ev[i])
            DRV->event_destroy(ev[i]);
}

static void ring_pop(struct vgpu_gate *g)
{
    g->ring_head = (g->ring_head + 1) % VGPU_BATCH_RING;
    VGPU_POKE(g->ring_len, g->ring_len - 1);
}

/* The oldest batch of the ring is settled (or, `pending`, given up): its events go, it leaves. */
static void batch_release(struct vgpu_gate *g, struct vgpu_batch *b, int pending)
{
    batch_free(g, b, pending);
    ring_pop(g);
}

/* Wait for a batch's end: cuEventQuery, sleeping 20 us doubling to 1 ms in between, for at most
 * VGPU_MEASURE_WAIT_NS. Never cuEventSynchronize: the batch may hold a kernel that ends only
 * after this thread's next launch, and every thread of the process would wait on the lock. */
static CUresult batch_query(const struct vgpu_batch *b)
{
    CUresult r = b->ev_close ? DRV->event_query(b->ev_close) : CUDA_SUCCESS;
    for (int i = 0; i < b->nxs && r == CUDA_SUCCESS; i++)
        if (b->xs_close[i])
            r = DRV->event_query(b->xs_close[i]);
    for (int i = 0; i < b->ntails && r == CUDA_SUCCESS; i++)
        r = DRV->event_query(b->tails[i]);
    return r;
}

static CUresult wait_end(struct vgpu_batch *b)
{
    uint64_t t0 = vgpu_now_ns(), pause = 20000, waited;
    CUresult r;
    while ((r = batch_query(b)) == CU_NOT_READY &&
           (waited = vgpu_now_ns() - t0) < VGPU_MEASURE_WAIT_NS) {
        struct timespec ts = {0, (long)(pause < VGPU_MEASURE_WAIT_NS - waited ? pause : VGPU_MEASURE_WAIT_NS - waited)};
        nanosleep(&ts, NULL);
        pause = pause < VGPU_MS / 2 ? pause * 2 : VGPU_MS;
    }
    return r;
}

/* Where event e lies after the batch's ev_open, in ms (negative: before it); 0 on failure. */
static int offset_ms(const struct vgpu_batch *b, void *e, float *at)
{
    float ms = 0;
    if (DRV->event_elapsed(&ms, b->ev_open, e) == CUDA_SUCCESS && ms >= 0) {
        *at = ms;
        return 1;
    }
    if (DRV->event_elapsed(&ms, e, b->ev_open) == CUDA_SUCCESS && ms >= 0) {
        *at = -ms;
        return 1;
    }
    return 0;
}

/* A batch on several streams, each measured (first_ms: its first stream's span): the union of
 * the streams' spans (their kernels may run at once, and the card is busy while any runs), at
 * most their sum (streams one after another, with idle time between them). ns; 0 when an event
 * pair cannot be read, unless `partial` (a lower bound: the pairs that can be read). */
static uint64_t streams_span(const struct vgpu_batch *b, float first_ms, int partial)
{
    double sum = first_ms, lo = 0, hi = first_ms;
    for (int i = 0; i < b->nxs; i++) {
        float start = 0, len = -1;
        if (!b->xs_close[i] || !offset_ms(b, b->xs_open[i], &start) ||
            DRV->event_elapsed(&len, b->xs_open[i], b->xs_close[i]) != CUDA_SUCCESS || len < 0) {
            if (partial)
                continue;
            return 0;
        }
        sum += len;
        lo = start < lo ? start : lo;
        hi = start + len > hi ? start + len : hi;
    }
    double ms = hi - lo < sum ? hi - lo : sum;
    return (uint64_t)(ms * 1e6);
}

/* ------------------------------------------------------------------ time charged twice
 *
 * A batch opened on an idle stream starts while the work of another stream, measured in the
 * batch before, still runs: two threads on streams of their own close each other's batches, so
 * the time their kernels ran at once was counted by two batches (a likely reason why threads at
 * 30 % got 25-27 % of the H200). The gate keeps the latest stretch of GPU time it charged, between two events of
 * its context: one stream's span of a settled batch, or two that meet, joined. Every instant of
 * it was charged (at cov_pm per mille: a span charged at the gap ratio's share, or capped),
 * so the part of a later batch's span inside it is taken off that batch's charge. Only the part
 * of one span: a batch's streams may overlap each other and the stretch alike, and the most any
 * one of them holds is never more than their union does. */

/* Where the stretch lies after batch b's ev_open, in ms: 0 when there is none, or b is another
 * context's, or an event cannot be read. */
static int cov_at(const struct vgpu_gate *g, const struct vgpu_batch *b, float *c0, float *c1)
{
    return g->cov_close && b->ctx == g->ev_ctx && b->ev_open && offset_ms(b, g->cov_open, c0) &&
           offset_ms(b, g->cov_close, c1) && *c1 > *c0;
}

uint64_t vgpu_measure_twice(struct vgpu_gate *g, const struct vgpu_batch *b, const struct vgpu_span *sp, int n,
                            uint64_t cap)
{
    float c0, c1;
    uint64_t most = 0;
    /* (uncapped high priority publishes its demand, the whole span: see vgpu_track_settle) */
    if (g->measure_only || !n || !cov_at(g, b, &c0, &c1))
        return 0;
    for (int i = 0; i < n; i++) {
        float lo = sp[i].s > c0 ? sp[i].s : c0, hi = sp[i].e < c1 ? sp[i].e : c1;
        uint64_t ns = hi > lo ? (uint64_t)((double)(hi - lo) * 1e6) : 0;
        most = ns > most ? ns : most;
    }
    most = most * g->cov_pm / 1000;
    most = most < cap ? most : cap;
#ifdef VGPU_STATS
    g->st_twice += most;
#endif
#ifdef VGPU_CHARGE_TWICE /* the earlier rule, for same-call A/B runs */
    most = 0;
#endif
    return most;
}

static void cov_drop(struct vgpu_gate *g)
{
    vgpu_measure_put(g, g->cov_open);
    vgpu_measure_put(g, g->cov_close);
    g->cov_open = g->cov_close = NULL;
}

void vgpu_measure_cover(struct vgpu_gate *g, struct vgpu_batch *b, const struct vgpu_span *sp, int n, uint32_t pm)
{
    const struct vgpu_span *last = NULL; /* the span that ends last */
    for (int i = 0; i < n; i++)
        if (*sp[i].open && *sp[i].close && sp[i].e > sp[i].s && (!last || sp[i].e > last->e))
            last = &sp[i];
    float c0, c1;
    if (!last || b->ctx != g->ev_ctx)
        return;
    int have = cov_at(g, b, &c0, &c1);
    if (have && last->e <= c1)
        return; /* it ends inside the stretch, or before it: the stretch stays */
    pm = pm > 1000 ? 1000 : pm;
    if (have && c0 <= last->s && last->s <= c1) { /* they meet: the stretch runs on to its end */
        vgpu_measure_put(g, g->cov_close);
        g->cov_close = *last->close, *last->close = NULL;
        g->cov_pm = pm < g->cov_pm ? pm : g->cov_pm;
        return;
    }
    cov_drop(g);
    g->cov_open = *last->open, g->cov_close = *last->close, *last->open = *last->close = NULL;
    g->cov_pm = pm;
}

/* Batch b's stream spans, ms after its ev_open (first_ms: its first stream's, which ends at
 * *first_close); those whose events cannot be read are left out. Returns how many. */
static int batch_spans(struct vgpu_batch *b, float first_ms, void **first_close, struct vgpu_span *sp)
{
    int n = 0;
    sp[n++] = (struct vgpu_span){&b->ev_open, first_close, 0, first_ms};
    for (int i = 0; i < b->nxs; i++) {
        float start = 0, len = -1;
        if (b->xs_close[i] && offset_ms(b, b->xs_open[i], &start) &&
            DRV->event_elapsed(&len, b->xs_open[i], b->xs_close[i]) == CUDA_SUCCESS && len >= 0)
            sp[n++] = (struct vgpu_span){&b->xs_open[i], &b->xs_close[i], start, start + len};
    }
    return n;
}

/* Charge a measured batch (vgpu_gate_settle's `measured`, never 0) its span less the time an
 * earlier batch charged already; the stretch moves on past it unless the span may hold idle
 * time the charge left out (an upper bound) or misses work (a lower bound). */
static void settle_once(struct vgpu_gate *g, struct vgpu_batch *b, uint64_t n_launch, uint64_t span, int measured,
                        float first_ms, void **first_close)
{
    struct vgpu_span sp[VGPU_BATCH_STREAMS];
    int n = batch_spans(b, first_ms, first_close, sp);
    uint64_t twice = vgpu_measure_twice(g, b, sp, n, span);
    uint64_t charged = vgpu_gate_settle(g, n_launch, b->prov_ns, span, twice, measured);
    if (measured != 2 && measured != 4 && span > twice)
        vgpu_measure_cover(g, b, sp, n, (uint32_t)(charged * 1000 / (span - twice)));
}

/* Settle batch b, whose end was queried (r): its GPU time replaces its provisional charge. */
static void batch_settle(struct vgpu_gate *g, struct vgpu_batch *b, CUresult r)
{
    if (b->tracked) {
        vgpu_track_settle(g, b, r == CUDA_SUCCESS);
        return;
    }
    float ms = -1, pm = -1;
    int ok = r == CUDA_SUCCESS && DRV->event_elapsed(&ms, b->ev_open, b->ev_close) == CUDA_SUCCESS && ms >= 0;
    uint64_t n = b->launches & ~(UPPER_BOUND | LOWER_BOUND);
    if (ok && b->nxs && !(b->launches & LOWER_BOUND)) {
        uint64_t span = streams_span(b, ms, 0);
        if (span && b->untracked) /* as below */
            vgpu_gate_tracked(g, span, span, (uint32_t)b->untracked);
        if (span)
            settle_once(g, b, n, span, b->untracked ? 3 : 5, ms, &b->ev_close);
        else
            vgpu_gate_settle(g, n, b->prov_ns, 0, 0, 0);
        return;
    }
    float first = ms; /* the first stream's span */
    if (ok && b->nxs) { /* a lower bound: the streams whose spans can be read count too */
        uint64_t span = streams_span(b, ms, 1);
        ms = span > (uint64_t)((double)ms * 1e6) ? (float)((double)span / 1e6) : ms;
    }
    /* The first kernel's own time (opened right before it, probed right after it), or a
     * batch of one kernel closed behind it: a sample of GPU time with no gaps. */
    void **end = &b->ev_close;
    if (ok && b->ev_probe && DRV->event_elapsed(&pm, b->ev_open, b->ev_probe) == CUDA_SUCCESS && pm >= 0) {
        vgpu_gate_sample(g, (uint64_t)((double)pm * 1e6));
        /* its only kernel: the probe is its end (uncapped high priority publishes its
         * demand, the span, see above) */
        if (n == 1 && !(b->launches & LOWER_BOUND) && !g->measure_only) {
            ms = first = pm, end = &b->ev_probe;
            b->launches = 1;
        }
    } else if (ok && !b->ev_probe && b->launches == 1)
        vgpu_gate_sample(g, (uint64_t)((double)ms * 1e6));
    /* bits 63 and 62 of `launches` flag an upper or a lower bound; the count is the rest */
    /* An abandoned tracking: the whole span, exact as measured (3), not a share of it; and into
     * the gap ratio as all busy (a tracked batch was a random pick: dropped, it would leave the
     * ratio to the batches the tenant lets be tracked). */
    uint64_t span = ok ? (uint64_t)((double)ms * 1e6) : 0;
    if (span && b->untracked && !(b->launches & (LOWER_BOUND | UPPER_BOUND)))
        vgpu_gate_tracked(g, span, span, (uint32_t)b->untracked);
    /* not ok: its events cannot be read (an error, or a close recorded into a capture) */
    if (!ok)
        vgpu_gate_settle(g, n, b->prov_ns, 0, 0, 0);
    else
        settle_once(g, b, n, span, b->launches & LOWER_BOUND ? 4 : b->launches & UPPER_BOUND ? 2 : b->untracked ? 3 : 1,
                    first, end);
}

/* Given-up batches (still running when the ring needed their room) wait in the overflow with
 * their events and are settled whenever they complete; one pushed out of a full overflow is
 * charged VGPU_BUCKET_MAX_NS of GPU time (vgpu_gate_forfeit): its work is unknown, and a
 * tenant that keeps batches running behind a wait it releases later would otherwise have them
 * go at the estimate. */
static void overflow_push(struct vgpu_gate *g, struct vgpu_batch *b)
{
    if (g->nover == VGPU_BATCH_OVERFLOW) {
        batch_free(g, &g->over[0], 1);
        vgpu_gate_forfeit(g);
        memmove(&g->over[0], &g->over[1], sizeof g->over[0] * (VGPU_BATCH_OVERFLOW - 1));
        g->nover--;
    }
    g->over[g->nover++] = *b;
}

static void overflow_poll(struct vgpu_gate *g)
{
    for (int i = 0; i < g->nover;) {
        CUresult r = batch_query(&g->over[i]);
        if (r == CU_NOT_READY) {
            i++;
            continue;
        }
        batch_settle(g, &g->over[i], r);
        batch_free(g, &g->over[i], 0);
        g->over[i] = g->over[--g->nover];
    }
}

/* The overflow's batches of context ctx, which goes: settled if they completed, else forfeited. */
static void overflow_ctx_gone(struct vgpu_gate *g, CUcontext ctx)
{
    overflow_poll(g);
    for (int i = 0; i < g->nover;) {
        if (g->over[i].ctx != (void *)ctx) {
            i++;
            continue;
        }
        batch_free(g, &g->over[i], 1);
        vgpu_gate_forfeit(g);
        g->over[i] = g->over[--g->nover];
    }
}

/* Settle completed batches, oldest first. `wait` (VGPU_WAIT_FIRST, VGPU_WAIT_ROOM): wait for the
 * oldest one, at most VGPU_MEASURE_WAIT_NS; one still running then is given up (it moves to the
 * overflow, settled when it completes) and the ring moves on. After that the gate never waits
 * again: the process has shown that its work can wait for its own later calls (a persistent
 * kernel, a stream waiting for a value), and a second's wait at each such batch would slow it to
 * a launch a second. So VGPU_WAIT_FIRST then passes at once (launches before the first estimate
 * are charged nothing until a batch completes), and VGPU_WAIT_ROOM gives the oldest batch up at
 * once; every batch that completes is still measured. */
void vgpu_measure_poll(struct vgpu_gate *g, int wait)
{
    if (g->nover)
        overflow_poll(g);
    while (g->ring_len) {
        struct vgpu_batch *b = &g->ring[g->ring_head];
        CUresult r = batch_query(b);
        if (r == CU_NOT_READY && wait) {
            int room = wait == VGPU_WAIT_ROOM;
            wait = 0;
            if (!g->wait_gave_up)
                r = wait_end(b);
            if (r == CU_NOT_READY && (!g->wait_gave_up || room)) {
                if (!g->wait_gave_up)
                    vgpu_log(2, "gate d%d: a batch of %llu launches still runs after %llu ms: given up; no "
                                "more waits for the GPU", (int)(g - vgpu.gate),
                             (unsigned long long)(b->launches & ~(UPPER_BOUND | LOWER_BOUND)),
                             (unsigned long long)(VGPU_MEASURE_WAIT_NS / VGPU_MS));
                g->wait_gave_up = 1;
                overflow_push(g, b); /* settled when it completes */
                ring_pop(g);
                continue;
            }
        }
        if (r == CU_NOT_READY)
            break;
        batch_settle(g, b, r);
        batch_release(g, b, 0);
    }
}

/* Where a batch's stream s is closed: on itself, but another thread's per-thread stream
 * (`foreign`) on the legacy stream, which follows it. */
static CUstream closing_stream(void *s, int foreign)
{
    return foreign && s == VGPU_STREAM_PER_THREAD ? NULL : (CUstream)s;
}

/* Close the open batch behind its work (before a slow-path launch, after a long kernel, or
 * at_sync: the application waits for it next, so the close marks its end, or the stream is
 * idle and the host time before the wait follows: the one-kernel batch's probe, above). */
static void close_batch(struct vgpu_gate *g, int at_sync, int inflight)
{
    /* Behind the batch's work: on its first stream (whatever stream the caller waits on: a wait
     * on another stream must not close it where its kernels are not) and on each other stream
     * it launched on. Past VGPU_BATCH_STREAMS streams (or an event that failed), on the legacy
     * stream, which follows every blocking stream but not the non-blocking ones, so the span is
     * then only a lower bound. */
    int multi = g->multi_stream;
    g->multi_stream = 0;
    /* Closed by another thread than the one whose per-thread stream it measures: the handle
     * names this thread's stream here. The legacy stream follows every per-thread one (they are
     * blocking streams), so that stream's close goes there (at or after its end: never less);
     * the batch's other streams close on themselves as always. */
    int foreign = g->cur.pt_owner && g->cur.pt_owner != vgpu_thread_token();
    VGPU_POKE(g->cur.pt_owner, 0);
    if (inflight)
        VGPU_POKE(g->tracking, 0); /* what is still in flight misses its tails too: a plain batch */
    uint64_t n = atomic_exchange(&g->batch_n, 0);
    struct vgpu_batch b = {.ev_open = g->cur.ev_open, .ctx = g->ev_ctx, .launches = n, .prov_ns = n * g->est_ns,
                           .ev_probe = g->cur.ev_probe, .nxs = g->cur.nxs, .untracked = g->cur.untracked};
    g->cur.untracked = 0;
    for (int i = 0; i < b.nxs; i++)
        b.xs_open[i] = g->cur.xs_open[i], g->cur.xs_open[i] = NULL;
    VGPU_POKE(g->cur.nxs, 0);
    VGPU_POKE(g->cur.ev_open, NULL);
    g->cur.ev_probe = NULL;
    VGPU_POKE(g->probe_pending, 0);
    if (g->tracking && !multi) { /* exact: closed right behind the last launch on each stream */
        for (int i = 0; i < g->ntails; i++)
            if (g->tail_set[i])
                b.tails[b.ntails++] = g->tail[i], g->tail[i] = NULL;
        if (b.ntails) {
            b.ev_seg = g->cur.ev_seg, b.seg_busy_ns = g->cur.seg_busy_ns, b.tracked = g->tracking;
            b.seg_ovh_ns = g->cur.seg_ovh_ns;
            b.track_gap_ns = g->cur.track_gap_ns;
            g->cur.ev_seg = NULL;
        }
    }
    vgpu_track_stop(g);
    if (g->ring_len == VGPU_BATCH_RING)
        vgpu_measure_poll(g, VGPU_WAIT_ROOM); /* leaves room: waits, or gives the oldest up */
    if (b.tracked) {
        if (n) {
            g->ring[(g->ring_head + g->ring_len) % VGPU_BATCH_RING] = b;
            VGPU_POKE(g->ring_len, g->ring_len + 1);
            return;
        }
        vgpu_measure_put(g, b.ev_seg);
        for (int i = 0; i < b.ntails; i++)
            vgpu_measure_put(g, b.tails[i]);
        b.ev_seg = NULL, b.ntails = 0, b.tracked = 0;
    }
    /* every stream it measures is closed, also when the batch is only a lower bound: the spans
     * that can be read then raise it (the legacy stream's close misses non-blocking streams) */
    for (int i = 0; i < b.nxs && n; i++)
        if ((b.xs_close[i] = vgpu_measure_event(g)) == NULL ||
            DRV->event_record(b.xs_close[i], closing_stream(g->cur.xs[i], foreign)) != CUDA_SUCCESS) {
            event_failed(b.xs_close[i]);
            b.xs_close[i] = NULL;
            multi = 1;
        }
    CUstream s = multi ? NULL : closing_stream(g->cur.stream, foreign);
    int idle = !at_sync && !foreign && !b.nxs && DRV->stream_query && DRV->stream_query(s) == CUDA_SUCCESS;
    if (n && g->ring_len < VGPU_BATCH_RING && (b.ev_close = vgpu_measure_event(g)) &&
        DRV->event_record(b.ev_close, s) == CUDA_SUCCESS) {
        if (multi || inflight)
            b.launches |= LOWER_BOUND; /* the close may not follow every stream it used, or
                                        * every launch it counted */
        else if (idle)
            b.launches |= UPPER_BOUND; /* the stream was idle before the close */
        g->ring[(g->ring_head + g->ring_len) % VGPU_BATCH_RING] = b;
        VGPU_POKE(g->ring_len, g->ring_len + 1);
        return;
    }
    /* No close could be recorded (an event that failed): its work stays unknown, and its
     * provisional charge at the estimate is what a tenant that keeps the estimate low would
     * want. Charged a bucket of GPU time on top, as a given-up batch: measurement that fails
     * throttles, it never frees. */
    if (n)
        vgpu_gate_forfeit(g);
    event_failed(b.ev_close); /* made, so its record failed */
    vgpu_measure_put(g, b.ev_open);
    vgpu_measure_put(g, b.ev_probe);
    for (int i = 0; i < b.nxs; i++) {
        vgpu_measure_put(g, b.xs_open[i]);
        vgpu_measure_put(g, b.xs_close[i]);
    }
}

/* Make the gate's context current on this thread when another one is: 1 if it was pushed
 * (leave() pops it). */
static int enter(struct vgpu_gate *g)
{
    CUcontext cur = NULL;
    if (!g->ev_ctx || !DRV->ctx_push || !DRV->ctx_pop || !DRV->ctx_get_current ||
        DRV->ctx_get_current(&cur) != CUDA_SUCCESS || cur == g->ev_ctx)
        return 0;
    return DRV->ctx_push((CUcontext)g->ev_ctx) == CUDA_SUCCESS;
}

static void leave(int pushed)
{
    CUcontext c;
    if (pushed)
        DRV->ctx_pop(&c);
}

/* Close the open batch. Launches other threads have counted may not have reached the driver yet
 * (g->inflight): the close stops the fast path, and a batch closed with launches in flight is
 * only a lower bound (its provisional charge stands). The lock is never released here: a wait
 * with it released let another thread close and reopen meanwhile. */
void vgpu_measure_close(struct vgpu_gate *g, int at_sync)
{
    if (!g->cur.ev_open)
        return;
    atomic_store(&g->open_until, 0);
    int inflight = atomic_load(&g->inflight) != 0;
    int pushed = enter(g); /* a wait, or a launch, in another context may close it */
    close_batch(g, at_sync, inflight);
    leave(pushed);
}

void vgpu_measure_follow(struct vgpu_gate *g, CUcontext ctx)
{
    if (!ctx || !g->ev_ctx || ctx == g->ev_ctx)
        return;
    vgpu_measure_close(g, 0);
    cov_drop(g); /* its events are the old context's, like the pool's */
    while (g->npool)
        DRV->event_destroy(g->pool[--g->npool]);
    VGPU_POKE(g->ev_ctx, (void *)ctx);
    atomic_store(&g->open_until, 0); /* no launch passes before a batch opens in ctx */
}

void vgpu_measure_ctx_gone(struct vgpu_gate *g, CUcontext ctx)
{
    int mine = g->ev_ctx == (void *)ctx;
    if (mine)
        vgpu_measure_close(g, 0);
    /* its work runs to its end anyway (cuCtxDestroy waits for it): each batch is waited for
     * (bounded) and settled, or given up at its provisional charge; every call empties at least
     * one slot of the ring, so none is left */
    for (unsigned k = g->ring_len; k > 0 && g->ring_len; k--)
        vgpu_measure_poll(g, VGPU_WAIT_ROOM);
    overflow_ctx_gone(g, ctx);
    if (!mine)
        return;
    cov_drop(g);
    while (g->npool)
        DRV->event_destroy(g->pool[--g->npool]);
    VGPU_POKE(g->ev_ctx, NULL);
    atomic_store(&g->open_until, 0);
}

/* A launch on stream s (not capturing) while the batch is open and the launch may pass (under
 * the gate's lock): s joins the batch's streams, with an event before its first launch there.
 * 0 when no batch is open to join, or s would be one stream more than a batch measures: the slow
 * path then closes the batch and opens the next on s (a lower bound at the estimate instead let
 * a tenant that kept the estimate low run heavy kernels on many streams nearly free). */
int vgpu_measure_join(struct vgpu_gate *g, CUstream s)
{
    if (!g->cur.ev_open)
        return 0;
    if (g->multi_stream || vgpu_gate_measures(g, (void *)s))
        return 1;
    /* another thread's per-thread stream, or one stream too many: a batch of its own */
    if (g->cur.nxs == VGPU_BATCH_STREAMS - 1 || ((void *)s == VGPU_STREAM_PER_THREAD && g->cur.pt_owner))
        return 0;
    CUevent e = vgpu_measure_event(g);
    if (e && DRV->event_record(e, s) == CUDA_SUCCESS) {
        if ((void *)s == VGPU_STREAM_PER_THREAD)
            VGPU_POKE(g->cur.pt_owner, vgpu_thread_token());
        VGPU_POKE(g->cur.xs[g->cur.nxs], (void *)s); /* peeked by the fast path */
        g->cur.xs_open[g->cur.nxs] = e;
        VGPU_POKE(g->cur.nxs, g->cur.nxs + 1);
    } else {
        event_failed(e);
        g->multi_stream = 1; /* no event: a lower bound (vgpu_measure_close) */
    }
    return 1;
}

int vgpu_measure_open(struct vgpu_gate *g, CUstream s)
{
    if (g->cur.ev_open)
        return 1;
    CUevent e = vgpu_measure_event(g);
    if (e && DRV->event_record(e, s) != CUDA_SUCCESS) {
        event_failed(e);
        e = NULL;
    }
    VGPU_POKE(g->cur.pt_owner, (void *)s == VGPU_STREAM_PER_THREAD ? vgpu_thread_token() : 0);
    VGPU_POKE(g->cur.ev_open, e);
    VGPU_POKE(g->cur.stream, (void *)s);
    g->cur.untracked = 0;
    atomic_store(&g->batch_n, 0);
    vgpu_track_start(g, s);
    return e != NULL;
}

