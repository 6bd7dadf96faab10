/*
 * vgpu_waits.c - the hooks that close the compute limiter's open batch before the application
 * waits for its work (cuStreamSynchronize(_ptsz), cuCtxSynchronize, cuEventSynchronize: the
 * batch is then measured exactly, and settled after), destroys one of its streams or begins a
 * capture on it (cuStreamDestroy(_v2), cuStreamBeginCapture*), or destroys a context (called
 * from the context hooks, vgpu_cuda.c). The gate itself is vgpu_launch.c.
 */
#include "vgpu_cuda.h"

/* ------------------------------------------------------------------ the open batch */

void vgpu_compute_sync(CUstream s, int whole_ctx)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = whole_ctx ? vgpu_gate_of_current() : vgpu_gate_of_stream(s);
    if (d < 0 || !VGPU_PEEK(vgpu.gate[d].cur.ev_open)) /* a hint, re-checked under the lock */
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    vgpu_symbols_bind();
    vgpu_lock(&g->mu);
    /* a wait in another context than the batch's does not wait for the batch */
    if (!vgpu_stream_capturing(whole_ctx ? NULL : s) && vgpu_in_gate_ctx(g, whole_ctx ? NULL : s)) {
        vgpu_measure_close(g, 1);
        atomic_store(&g->open_until, 0); /* the next launch opens a new batch */
    }
    vgpu_unlock(&g->mu);
}

void vgpu_compute_synced(void)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = vgpu_gate_of_current();
    if (d < 0 || !VGPU_PEEK(vgpu.gate[d].ring_len)) /* a hint */
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    vgpu_lock(&g->mu);
    vgpu_measure_poll(g, 0);
    vgpu_unlock(&g->mu);
}

/* Stream s is about to be destroyed, or to begin capturing: an open batch that measures it
 * closes first, while its events can still be recorded there (after the destroy the close would
 * fail, and the handle may name the next stream created; during a capture the close would be
 * captured, never run, and the batch unreadable). Its work runs on to its end, and the close
 * follows it. The gate that closed stays locked until the driver has returned (stream_gone_end),
 * so no launch joins the batch on it meanwhile. */
static struct vgpu_gate *stream_gone(CUstream s)
{
    if (!vgpu.compute_limited || (uintptr_t)s < (uintptr_t)CU_STREAM_PER_THREAD)
        return NULL; /* the legacy stream is neither destroyed nor captured */
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct vgpu_gate *g = &vgpu.gate[d];
        if (!g->active || !VGPU_PEEK(g->cur.ev_open) || !vgpu_gate_measures(g, s)) /* hints */
            continue;
        vgpu_lock(&g->mu);
        if (g->cur.ev_open && vgpu_gate_measures(g, s)) {
            vgpu_measure_close(g, 0);
            atomic_store(&g->open_until, 0);
            return g; /* a stream is one context's: no other gate measures it */
        }
        vgpu_unlock(&g->mu);
    }
    return NULL;
}

static void stream_gone_end(struct vgpu_gate *g)
{
    if (g)
        vgpu_unlock(&g->mu);
}

/* fn(g, c) on every active gate, under its lock. */
static void each_gate(void (*fn)(struct vgpu_gate *, CUcontext), CUcontext c)
{
    if (!vgpu.compute_limited || !c)
        return;
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct vgpu_gate *g = &vgpu.gate[d];
        if (!g->active)
            continue;
        vgpu_lock(&g->mu);
        fn(g, c);
        vgpu_unlock(&g->mu);
    }
}

static void ctx_dying(struct vgpu_gate *g, CUcontext c)
{
    /* its batches first, while events can still be made in it (the mark refuses them) */
    vgpu_measure_ctx_gone(g, c);
    VGPU_POKE(g->ctx_dying, (void *)c);
}

static void ctx_dead(struct vgpu_gate *g, CUcontext c)
{
    if (g->ctx_dying == (void *)c)
        VGPU_POKE(g->ctx_dying, NULL);
}

/* Before cuCtxDestroy(c): the gates' batches and events of c are released while it exists, and
 * c is marked dying until vgpu_compute_ctx_destroyed(c): another thread's launch in c meanwhile
 * would make events in it that the driver then destroys (the slow path waits for the mark to
 * go, vgpu_measure_event refuses it). */
void vgpu_compute_ctx_destroy(CUcontext c)
{
    each_gate(ctx_dying, c);
}

void vgpu_compute_ctx_destroyed(CUcontext c)
{
    each_gate(ctx_dead, c);
}

/* ------------------------------------------------------------------ waits */

/* An application's wait: the open batch closes before it (measured exactly: the application
 * waits for its end), and what completed settles after. `ws`: the stream waited for (NULL and
 * `whole` 1: the whole context). */
#define WAIT_HOOK(idx, name, params, args, ws, whole)                                 \
    VGPU_API CUresult name params                                                     \
    {                                                                                 \
        BROKEN_GUARD();                                                               \
        vgpu_compute_sync(ws, whole);                                                 \
        CUresult rc = REAL(idx, CUresult(*) params) args;                             \
        vgpu_compute_synced();                                                        \
        return rc;                                                                    \
    }

WAIT_HOOK(H_STREAMSYNC, cuStreamSynchronize, (CUstream s), (s), s, 0)
WAIT_HOOK(H_STREAMSYNC_PTSZ, cuStreamSynchronize_ptsz, (CUstream s), (s), s ? s : CU_STREAM_PER_THREAD, 0)
WAIT_HOOK(H_CTXSYNC, cuCtxSynchronize, (void), (), NULL, 1)
WAIT_HOOK(H_EVENTSYNC, cuEventSynchronize, (CUevent e), (e), NULL, 1)

/* ------------------------------------------------------------------ stream lifetime */

/* A stream destroyed, or beginning a capture: an open batch that measures it closes first
 * (stream_gone), and the gate stays locked until the driver returns. `ptsz`: a NULL stream is the
 * calling thread's per-thread one. */
#define STREAM_HOOK(idx, name, ptsz, params, args)                                    \
    VGPU_API CUresult name params                                                     \
    {                                                                                 \
        BROKEN_GUARD();                                                               \
        struct vgpu_gate *g = stream_gone(ptsz && !s ? CU_STREAM_PER_THREAD : s);     \
        CUresult rc = REAL(idx, CUresult(*) params) args;                             \
        stream_gone_end(g);                                                           \
        return rc;                                                                    \
    }

STREAM_HOOK(H_STREAM_DESTROY, cuStreamDestroy_v2, 0, (CUstream s), (s))
STREAM_HOOK(H_STREAM_DESTROY_V1, cuStreamDestroy, 0, (CUstream s), (s))
STREAM_HOOK(H_CAPTURE, cuStreamBeginCapture, 0, (CUstream s), (s))
STREAM_HOOK(H_CAPTURE_PTSZ, cuStreamBeginCapture_ptsz, 1, (CUstream s), (s))
STREAM_HOOK(H_CAPTURE_V2, cuStreamBeginCapture_v2, 0, (CUstream s, int cmode), (s, cmode))
STREAM_HOOK(H_CAPTURE_V2_PTSZ, cuStreamBeginCapture_v2_ptsz, 1, (CUstream s, int cmode), (s, cmode))
STREAM_HOOK(H_CAPTURE_TO_GRAPH, cuStreamBeginCaptureToGraph, 0,
            (CUstream s, void *graph, const void *deps, const void *data, size_t n, int cmode),
            (s, graph, deps, data, n, cmode))
STREAM_HOOK(H_CAPTURE_TO_GRAPH_PTSZ, cuStreamBeginCaptureToGraph_ptsz, 1,
            (CUstream s, void *graph, const void *deps, const void *data, size_t n, int cmode),
            (s, graph, deps, data, n, cmode))
