/*
 * vgpu_late.c - launches a close left behind (the compute limiter's measurement: vgpu_measure.c).
 *
 * A thread that closes the open batch while launches counted in it have not reached the driver
 * yet (other threads', between their gate and the driver's return) records the close events
 * before those launches land: the span misses their kernels, and the batch is only a lower
 * bound, charged at least its provisional charge, the per-launch estimate each, for what may be
 * long kernels among short ones (two threads on streams of their own ran 2-3 points over their
 * limit so on the stub). Each such launch knows it: the gate's flight word counts launches in
 * flight in its low half and closes in its high half, so a launch whose return finds another
 * close number than its count did was in flight across a close, and that close counted it.
 * Its thread records an event behind its launch on its own stream at once and posts it here,
 * without the gate's lock (its holder may be waiting out a throttle); under the lock the batch
 * takes it as that stream's close. A batch waits for the word of every launch it closed out
 * (at most VGPU_LATE_MAX_NS) before it is settled: with all of it, it is measured in full; else
 * it stays a lower bound.
 */
#include "vgpu_cuda.h"

#define DRV (&vgpu.drv)

/* A new event of the current context (*ctx) for a late close; NULL: none, or a context is being
 * destroyed (vgpu_waits.c marks it dying, then counts ctx_gen up: an event made after a mark was
 * seen to be gone is in a live context; one made before it is never used after it). Never kept
 * for the next post: a context released and made again may come back with the same handle. */
static CUevent late_event(struct vgpu_gate *g, CUcontext *ctx, uint32_t *gen)
{
    CUcontext cur = NULL;
    CUevent e = NULL;
    *gen = atomic_load(&g->ctx_gen);
    if (VGPU_PEEK(g->ctx_dying) || !DRV->ctx_get_current || !DRV->event_create ||
        DRV->ctx_get_current(&cur) != CUDA_SUCCESS || !cur || DRV->event_create(&e, 0) != CUDA_SUCCESS)
        return NULL;
    *ctx = cur;
    return e;
}

void vgpu_late_post(struct vgpu_gate *g, CUstream s, uint32_t from, uint32_t to, int launched)
{
    CUcontext ctx = NULL;
    uint32_t gen = 0;
    CUevent e = launched ? late_event(g, &ctx, &gen) : NULL;
    if (e && (!DRV->event_record || DRV->event_record(e, s) != CUDA_SUCCESS)) {
        DRV->event_destroy(e);
        e = NULL;
    }
    for (int i = 0; i < VGPU_LATE_NOTES; i++) {
        struct vgpu_late_note *n = &g->late[i];
        int expect = 0;
        if (!atomic_compare_exchange_strong(&n->state, &expect, 1))
            continue;
        n->from = from, n->to = to, n->stream = s, n->owner = vgpu_thread_token();
        n->launched = launched, n->ev = e, n->ctx = ctx, n->gen = gen;
        atomic_store_explicit(&n->state, 2, memory_order_release);
        return;
    }
    if (e) /* no room: the batches wait it out and stay lower bounds */
        DRV->event_destroy(e);
}

/* Whether the batch's stream bs is the note's (a per-thread stream only its owner's). */
static int same_stream(const struct vgpu_batch *b, void *bs, const struct vgpu_late_note *v)
{
    return bs == v->stream && (bs != VGPU_STREAM_PER_THREAD || b->pt_owner == v->owner);
}

/* Batch b takes event ev, behind its launch on the note's stream, as that stream's close: 1, or
 * 0 when the launch was on none of its streams. The close it replaces may still be owed by the
 * GPU: destroyed, never pooled. */
static int take(struct vgpu_batch *b, const struct vgpu_late_note *v, void *ev)
{
    void **slot = same_stream(b, b->stream, v) ? &b->ev_close : NULL;
    for (int i = 0; !slot && i < b->nxs; i++)
        if (b->xs_close[i] && same_stream(b, b->xs[i], v))
            slot = &b->xs_close[i];
    if (!slot || !*slot)
        return 0;
    DRV->event_destroy(*slot);
    *slot = ev;
    return 1;
}

/* One note: every batch of the ring that closes from..to counted the launch; its own (from)
 * takes its event. */
static void apply(struct vgpu_gate *g, const struct vgpu_late_note *v)
{
    /* made before a context was marked dying: perhaps of that one, destroyed with it (the driver
     * freed it then): never touched */
    void *ev = v->gen == atomic_load(&g->ctx_gen) ? v->ev : NULL;
    for (unsigned k = 0; k < g->ring_len; k++) {
        struct vgpu_batch *b = &g->ring[(g->ring_head + k) % VGPU_BATCH_RING];
        if (!b->late_n || (int32_t)(b->late_seq - v->from) < 0 || (int32_t)(v->to - b->late_seq) < 0)
            continue;
        if (b->late_seq == v->from && v->launched) {
            if (ev && b->ctx == v->ctx && take(b, v, ev))
                ev = NULL;
            else
                b->late_miss = 1;
        }
        if (--b->late_n == 0 && !b->late_miss) /* every launch it closed out is behind its closes */
            b->launches = (b->launches & ~LOWER_BOUND) | (b->late_idle ? UPPER_BOUND : 0);
    }
    if (ev)
        DRV->event_destroy(ev);
}

void vgpu_late_drain(struct vgpu_gate *g)
{
    for (int i = 0; i < VGPU_LATE_NOTES; i++) {
        struct vgpu_late_note *n = &g->late[i];
        if (atomic_load_explicit(&n->state, memory_order_acquire) != 2)
            continue;
        struct vgpu_late_note v = {.from = n->from, .to = n->to, .stream = n->stream, .owner = n->owner,
                                   .launched = n->launched, .ev = n->ev, .ctx = n->ctx, .gen = n->gen};
        atomic_store_explicit(&n->state, 0, memory_order_release);
        apply(g, &v);
    }
}
