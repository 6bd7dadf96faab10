/*
 * vgpu_track.c - gap tracking, for the compute limiter's measurement (vgpu_measure.c).
 *
 * Alone on the card, a batch's span counts the GPU's idle time between launches that come
 * slower than their kernels (launch-bound training: the H200 was 48 % busy natively). In a
 * tracked batch (one in VGPU_TRACK_EVERY at random, one in VGPU_TRACK_UNDER_EVERY well under the
 * share: vgpu_gate_track_every; on up to VGPU_BATCH_STREAMS streams) an
 * event per stream, its `tail`, is re-recorded behind every launch there, and the tails are
 * queried before the next launch: all complete means the GPU has run everything and is idle,
 * so the busy segment ended at the latest tail (its time, from the segment's start event, is
 * added up) and a new segment starts with an event before this launch. The batch's GPU time is
 * then the sum of its segments, exact to the launch latency; the other batches are charged
 * their span (several streams: the union of their spans) times the busy share the tracked ones
 * found (gap_pm).
 *
 * The tracking's own CPU time (recording tail, about 1.5 us a launch on the H200, and the query)
 * delays each launch, and where the GPU was idle for that launch it lengthens the gap: on a host
 * that feeds the card fast (kernels of 12-17 us every ~20 us) a tracked batch's busy share came
 * out below an untracked one's, which were then charged too little. So the tracking's CPU time
 * before each launch that found the GPU idle is counted (track_gap_ns) and taken off the span
 * the share is taken over. */
#include "vgpu_cuda.h"

#define DRV (&vgpu.drv)

/* An event pair around a busy segment on an idle stream adds the GPU's time from the event to
 * its first kernel and after its last one: 4.9-5.3 us over the kernels' back-to-back time on the
 * H200 with driver 580 (bench/gpu/suite_cu.c evlat: 10.0 us kernels bracketed 14.9 us, 43.3 ->
 * 48.1, 209.9 -> 215.2), an empty pair 1.3 us. Launch-bound training has a segment per kernel
 * or two, so this is taken off each segment (never more than half of it). */
#define SEG_OVERHEAD_NS 4500ull

static uint64_t segment_ns(float ms, uint64_t *ovh)
{
    uint64_t ns = (uint64_t)((double)ms * 1e6), busy = ns > 2 * SEG_OVERHEAD_NS ? ns - SEG_OVERHEAD_NS : ns / 2;
    *ovh += ns - busy; /* what the calibration may give back (vgpu_gate_cal_raise) */
    return busy;
}

/* The GPU time from event `from` to the latest of the tails (those with set[i], or all when set
 * is NULL), in ms; 0 when all lie before it: a tail before `from` (its stream ran ahead) ends
 * nothing after it. -1: an event failed. */
static float tails_end_ms(void *from, void *const *tails, const int *set, int n, int *latest)
{
    float end = 0;
    for (int i = 0; i < n; i++) {
        float ms = 0;
        if (set && !set[i])
            continue;
        if (DRV->event_elapsed(&ms, from, tails[i]) != CUDA_SUCCESS)
            return -1;
        if (ms > end && latest)
            *latest = i;
        end = ms > end ? ms : end;
    }
    return end;
}

/* A gap-tracked batch (done: all its events completed): the busy segments' own time, exact;
 * its busy share is taken over the span an untracked batch would have had (less the tracking's
 * CPU time in its gaps). */
void vgpu_track_settle(struct vgpu_gate *g, struct vgpu_batch *b, int done)
{
    int latest = -1;
    float ms = done ? tails_end_ms(b->ev_open, b->tails, NULL, b->ntails, NULL) : -1;
    float seg = ms < 0 ? -1 : tails_end_ms(b->ev_seg ? b->ev_seg : b->ev_open, b->tails, NULL, b->ntails, &latest);
    if (seg < 0) { /* its events cannot be read */
        vgpu_gate_settle(g, b->launches, b->prov_ns, 0, 0, 0);
        return;
    }
    uint64_t ovh = b->seg_ovh_ns, last = segment_ns(seg, &ovh);
    uint64_t busy = b->seg_busy_ns + last, span = (uint64_t)((double)ms * 1e6);
    /* Its last busy segment, with no idle gap in it, is what an earlier batch may have charged
     * already (vgpu_measure.c, "time charged twice"). Where the earlier segments lay is not kept:
     * a batch that went idle after its start, where the overlap with the batch before lies,
     * is charged it again (too much, never too little). */
    struct vgpu_span sp = {b->ev_seg ? &b->ev_seg : &b->ev_open, latest >= 0 ? &b->tails[latest] : NULL,
                           ms - seg, ms};
    uint64_t twice = latest >= 0 ? vgpu_measure_twice(g, b, &sp, 1, busy) : 0;
    uint64_t idle = span > busy ? span - busy : 0, cpu = b->track_gap_ns < idle ? b->track_gap_ns : idle;
#ifdef VGPU_TRACK_CPU_IN_GAPS
    cpu = 0; /* the earlier rule, for same-call A/B runs */
#endif
#ifdef VGPU_STATS
    g->st_tspan += span, g->st_tcpu += cpu;
#endif
    vgpu_gate_tracked(g, busy, span - cpu, (uint32_t)b->tracked);
    vgpu_gate_seg_overhead(g, busy, ovh);
    /* Uncapped high priority publishes its demand (work queued or running: the span), not its
     * GPU time alone: time-sliced beside low priority its kernels wait, and its GPU time would
     * hand that wait to the low-priority tenant. */
    vgpu_gate_settle(g, b->launches, b->prov_ns, g->measure_only ? span : busy, twice, 3);
    if (latest >= 0 && seg > 0)
        vgpu_measure_cover(g, b, &sp, 1, (uint32_t)(last * 1000 / (uint64_t)((double)seg * 1e6 + 1)));
}

void vgpu_track_stop(struct vgpu_gate *g)
{
    for (int i = 0; i < g->ntails; i++)
        vgpu_measure_put(g, g->tail[i]), g->tail[i] = NULL, g->tail_set[i] = 0;
    g->ntails = 0;
    vgpu_measure_put(g, g->cur.ev_seg);
    g->cur.ev_seg = NULL;
    g->cur.seg_busy_ns = g->cur.seg_ovh_ns = g->cur.track_gap_ns = 0;
    VGPU_POKE(g->tracking, 0);
}

void vgpu_track_start(struct vgpu_gate *g, CUstream s)
{
    uint32_t x = g->track_rng ? g->track_rng : (uint32_t)vgpu_now_ns() | 1u;
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    g->track_rng = x;
    if (g->cotenants || g->est_ns >= LONG_KERNEL_NS || !g->cur.ev_open)
        return;
    /* the fast path clamps the credit at the coarse clock plus its margin, or at the precise
     * clock where the coarse one is unusable (its margin then UINT64_MAX / 4) */
    uint64_t margin = vgpu.coarse_margin < VGPU_SEC ? vgpu.coarse_margin : 0;
    uint32_t every = vgpu_gate_track_every(g, vgpu_now_ns() + margin);
    if (x % every)
        return;
    if (!(g->tail[0] = vgpu_measure_event(g)))
        return;
    g->tail_stream[0] = s, g->tail_set[0] = 0, g->ntails = 1;
    g->cur.seg_busy_ns = g->cur.seg_ovh_ns = g->cur.track_gap_ns = 0;
    /* the batches it stands for, at the normal rate (vgpu_gate_tracked's weight) */
    VGPU_POKE(g->tracking, every > VGPU_TRACK_EVERY ? (int)(every / VGPU_TRACK_EVERY) : 1);
}

/* The tracked batch's tail on stream s: found, or a new one (-1: one stream too many, no event,
 * or another thread's per-thread stream: the handle names the calling thread's own stream, so
 * a tail kept by handle would move between streams; such a launch, counted before the batch
 * changed hands and reaching its after-hook now, is not this batch's). */
static int track_tail(struct vgpu_gate *g, CUstream s)
{
    if ((void *)s == VGPU_STREAM_PER_THREAD && g->cur.pt_owner != vgpu_thread_token())
        return -1;
    for (int i = 0; i < g->ntails; i++)
        if (g->tail_stream[i] == s)
            return i;
    if (g->ntails == VGPU_BATCH_STREAMS || !(g->tail[g->ntails] = vgpu_measure_event(g)))
        return -1;
    g->tail_stream[g->ntails] = s, g->tail_set[g->ntails] = 0;
    return g->ntails++;
}

/* Tracking stops mid-batch: the batch is charged its whole span (vgpu_measure.c), never the gap
 * ratio's share. A tenant could otherwise stop it in its dense batches (one launch into a stream
 * it keeps capturing) and leave only its idle ones tracked, lowering the ratio its dense batches
 * are charged by. */
static void abandon(struct vgpu_gate *g)
{
    g->cur.untracked = g->tracking ? g->tracking : 1; /* the tracked batches it stood for */
    vgpu_track_stop(g);
}

/* A stream being captured (torch.cuda.graph warms up on its side stream, then captures on
 * it): querying its work would invalidate the capture, and what is captured does not run now. */
int vgpu_stream_capturing(CUstream s)
{
    int st = 0;
    return DRV->stream_is_capturing && DRV->stream_is_capturing(s, &st) == CUDA_SUCCESS && st != 0;
}

/* The id of the capture stream s is in (never 0; 1 where the driver has no
 * cuStreamGetCaptureInfo), 0 when it captures nothing. */
uint64_t vgpu_stream_capture_id(CUstream s)
{
    int st = 0;
    cuuint64_t id = 0;
    if (DRV->stream_capture_info && DRV->stream_capture_info(s, &st, &id) == CUDA_SUCCESS)
        return st ? (id ? id : 1) : 0;
    return vgpu_stream_capturing(s);
}

/* Before a launch of a tracked batch (under the gate's lock). */
void vgpu_track_before(struct vgpu_gate *g, CUstream s)
{
    if (!g->tracking)
        return;
    uint64_t t0 = vgpu_now_ns();
    if (vgpu_stream_capturing(s) || track_tail(g, s) < 0) {
        abandon(g); /* more streams than tracked, or an event failed */
        return;
    }
    int set = 0;
    for (int i = 0; i < g->ntails; i++)
        if (g->tail_set[i] && ++set && DRV->event_query(g->tail[i]) != CUDA_SUCCESS)
            return; /* the GPU is still busy with what came before: no gap */
    if (!set)
        return;
    void *start = g->cur.ev_seg ? g->cur.ev_seg : g->cur.ev_open;
    float ms = tails_end_ms(start, g->tail, g->tail_set, g->ntails, NULL);
    if (ms < 0 || (!g->cur.ev_seg && !(g->cur.ev_seg = vgpu_measure_event(g))) ||
        DRV->event_record(g->cur.ev_seg, s) != CUDA_SUCCESS) {
        abandon(g); /* an event failed */
        return;
    }
    g->cur.seg_busy_ns += segment_ns(ms, &g->cur.seg_ovh_ns);
    /* the GPU waited for this launch, and for the tracking's CPU time behind the last one and
     * before this one */
    g->cur.track_gap_ns += g->track_after_ns + (vgpu_now_ns() - t0);
    for (int i = 0; i < g->ntails; i++)
        g->tail_set[i] = 0;
}

/* After a launch of a tracked batch (under the gate's lock). */
void vgpu_track_after(struct vgpu_gate *g, CUstream s)
{
    if (!g->tracking)
        return;
    uint64_t t0 = vgpu_now_ns();
    int k = track_tail(g, s);
    if (k < 0 || DRV->event_record(g->tail[k], s) != CUDA_SUCCESS)
        abandon(g);
    else
        g->tail_set[k] = 1, g->track_after_ns = vgpu_now_ns() - t0;
}
