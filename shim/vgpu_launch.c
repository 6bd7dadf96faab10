/*
 * vgpu_launch.c - the launch hooks and the gate of the compute limiter (arithmetic:
 * vgpu_compute.c; its setup and its inputs from outside the process, the agent's schedule and
 * the card's busy samples: vgpu_gate_inputs.c; measuring the GPU time: vgpu_measure.c; the
 * hooks that close a batch before a wait, a stream's destroy or capture, or a context's
 * destroy: vgpu_waits.c).
 *
 * Launch hooks (cuLaunchKernel(_ptsz), cuLaunchKernelEx(_ptsz), cuLaunchCooperativeKernel
 * (_ptsz), cuLaunchCooperativeKernelMultiDevice, cuGraphLaunch(_ptsz), the pre-4.0 cuLaunch,
 * cuLaunchGrid(Async)) pass through vgpu_compute_gate; a graph launch then goes
 * through vgpu_mem_graph_launch (graph memory, vgpu_mem_graph.c).
 */
#include "vgpu_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* The driver's event, stream and context functions (vgpu.drv, resolved at bind time) and the
 * real cuEventSynchronize (the hook table's). */
#define DRV (&vgpu.drv)

/* ------------------------------------------------------------------ the gate */

static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / VGPU_SEC), (long)(t % VGPU_SEC)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* The gate (index + 1) this thread's current launch was counted in and is in flight for, from
 * its count to the driver's return (compute_after): 0 = none. */
static __thread int launch_in_flight;

/* Count a passing launch as in flight before it is charged (a close that comes between must
 * see it: vgpu_measure_close). */
static inline void flight_begin(struct vgpu_gate *g)
{
    atomic_fetch_add(&g->inflight, 1);
}

/* The context this thread pushed for its current launch (launch_ctx), popped after the driver's
 * return (compute_after): NULL = none. */
static __thread CUcontext launch_pushed;

/* The gate (index + 1) that let this thread's current launch pass ungated because its stream
 * was capturing, and that capture's id: 0 = none. Checked again after the driver's return
 * (compute_after). */
static __thread int launch_captured;
/* The gate (index + 1) this thread's current launch passed, or 0: compute_after works on the same
 * one (the stream's card, asked again, could be another if the stream were remade meanwhile). */
static __thread int launch_gate;
static __thread uint64_t launch_capture_id;

/* The context a launch on s runs in, made current for it if it is not: a created stream's own
 * (the driver takes a CUkernel launch's context from its stream, and the batch's events, made
 * in the current context, cannot be recorded on another context's stream), else the current
 * one. NULL where the driver cannot tell. */
static CUcontext launch_ctx(CUstream s)
{
    CUcontext cur = NULL, own = NULL;
    if (!DRV->ctx_get_current || DRV->ctx_get_current(&cur) != CUDA_SUCCESS)
        return NULL;
    if ((uintptr_t)s <= (uintptr_t)CU_STREAM_PER_THREAD || !DRV->stream_get_ctx || !DRV->ctx_push ||
        !DRV->ctx_pop || DRV->stream_get_ctx(s, &own) != CUDA_SUCCESS || !own || own == cur)
        return cur;
    if (DRV->ctx_push(own) != CUDA_SUCCESS)
        return cur;
    launch_pushed = own;
    return own;
}

/* 1 when the launch is counted (it passes), 0 when it is not gated (a capturing stream). */
static int gate_slow(int d, CUstream s)
{
    vgpu_symbols_bind();
    struct vgpu_gate *g = &vgpu.gate[d];
    vgpu_lock(&g->mu);
    CUcontext ctx = launch_ctx(s);
    if (ctx)
        vgpu_measure_follow(g, ctx); /* a launch in another context: the gate follows it */
    /* its context is being destroyed by another thread: wait for the driver's return (bounded) */
    for (int i = 0; ctx && g->ctx_dying == (void *)ctx && i < VGPU_DYING_WAITS; i++) {
        vgpu_unlock(&g->mu);
        sleep_until(vgpu_now_ns() + VGPU_DYING_PAUSE_NS);
        vgpu_lock(&g->mu);
        vgpu_measure_follow(g, ctx);
    }
    uint64_t now = vgpu_now_ns();
    flight_begin(g);
    if (vgpu_gate_fast(g, now, now, s)) { /* another thread opened it meanwhile */
        vgpu_unlock(&g->mu);
        return 1;
    }
    atomic_fetch_sub(&g->inflight, 1);
    if ((launch_capture_id = vgpu_stream_capture_id(s)) != 0) {
        vgpu_unlock(&g->mu); /* captured work does not run now: not gated */
        return 0;
    }
    if (vgpu_gate_open_at(g, now, now) && vgpu_measure_join(g, s)) {
        if (!g->measure_only)
            vgpu_gate_clamp(g, now);
        flight_begin(g);
        vgpu_gate_count(g); /* a launch on another stream of the open batch: it passes */
        vgpu_unlock(&g->mu);
        return 1;
    }
    vgpu_measure_close(g, 0);
#ifdef VGPU_STATS
    if (!g->st_sec0)
        g->st_sec0 = now;
    if ((now - g->st_sec0) / VGPU_SEC < 64) /* the latest V seen in this second */
        g->st_sec_vt[(now - g->st_sec0) / VGPU_SEC] = atomic_load(g->vt);
#endif
    if (!g->est_ns && g->ring_len) /* no estimate yet: measure before queuing more */
        vgpu_measure_poll(g, VGPU_WAIT_FIRST);
    for (;;) {
        now = vgpu_now_ns();
        vgpu_gate_refresh_schedule(d, now);
        /* A container's ratio below a lone process's floor is checked again every VGPU_CAL_NS
         * whether or not the launch waits: a process that the discount keeps from waiting (its
         * siblings idle now, or the ratio driven down by a forged credit clock) would otherwise
         * never be calibrated again, and ran at 1 / ratio of its share for good (99 % under
         * 30 % on the stub). Not held back, the step only raises it. */
        if (!g->measure_only && g->cal_container && g->cal_pm < VGPU_CAL_MIN_PM && g->cal_last_ns &&
            now - g->cal_last_ns >= VGPU_CAL_NS)
            vgpu_gate_calibrate_now(d, g, now);
        /* Launched and not yet run: what the co-tenant window must still hold. Settled first
         * (a wait for the window leaves the previous window's batches unpolled, and counting
         * them would shrink this window by their time); the oldest one is running: half of it. */
        vgpu_measure_poll(g, 0);
        vgpu_gate_cal_note(g, now);
        g->queued_ns = 0;
        for (unsigned i = 0; i < g->ring_len; i++)
            g->queued_ns += g->ring[(g->ring_head + i) % VGPU_BATCH_RING].prov_ns >> (i == 0);
        uint64_t wake = vgpu_gate_decide(g, now);
        if (!wake)
            break;
        g->throttles++;
#ifdef VGPU_STATS
        if (now >= g->st_sec0 && (now - g->st_sec0) / VGPU_SEC < 64)
            g->st_sec_wait[(now - g->st_sec0) / VGPU_SEC] += wake - now;
#endif
        /* Calibration matters only while the limit binds, and its NVML calls (up to ms under
         * contention) then cost little: the launch waits anyway. The waits are summed: a
         * saturating tenant of short kernels waits one launch's cost at a time (0.3 ms for
         * 100 us kernels at 30 %), so a single wait of 2 ms never came and it was never
         * calibrated. At most one reading every VGPU_CAL_NS. */
        uint64_t nap = wake - now > VGPU_GATE_MAX_SLEEP_NS ? VGPU_GATE_MAX_SLEEP_NS : wake - now;
        g->cal_waited_ns += nap; /* the time it will sleep, not the whole wait at each pass */
        if (!g->measure_only && g->cal_waited_ns >= VGPU_CAL_MIN_WAIT_NS &&
            (!g->cal_last_ns || now - g->cal_last_ns >= VGPU_CAL_NS))
            vgpu_gate_calibrate_now(d, g, now);
        if (vgpu.cfg.log_level >= 3)
            vgpu_log(3, "gate d%d: wait %llu us (credit %lld us, gaps %u pm, est %llu ns/launch, window %llu+%llu us of %llu, co-tenants %d)",
                     d, (unsigned long long)((wake - now) / 1000),
                     ((long long)now - (long long)atomic_load(g->vt)) / 1000, g->gap_pm, (unsigned long long)g->est_ns,
                     (unsigned long long)(g->offset_ns / 1000), (unsigned long long)(g->len_ns / 1000),
                     (unsigned long long)(g->period_ns / 1000), g->cotenants);
        /* Wake at least every 100 ms: the schedule may change, and the agent needs our heartbeat. */
        sleep_until(now + nap);
        vgpu_measure_poll(g, 0);
    }
    /* The decision opened the gate (open_until); the batch opens before the fast path may pass
     * again: a launch counted in between (no batch: any stream passed) went unmeasured. */
    uint64_t until = atomic_exchange(&g->open_until, 0);
    if (vgpu_measure_open(g, s))
        atomic_store(&g->open_until, until);
    else if (!g->measure_only) /* nothing measures it: a bucket, and the next launch asks again */
        vgpu_gate_forfeit(g);
    /* Long kernels: one launch per batch. No estimate yet (a capped gate): the next launch takes
     * the slow path, which waits for this one's measurement; the fast path charges nothing
     * without an estimate, so a first burst of ten 100 ms kernels ran back to back. */
    if (g->est_ns >= LONG_KERNEL_NS || (!g->est_ns && !g->measure_only))
        atomic_store(&g->open_until, 0);
    else if (g->cur.ev_open)
        VGPU_POKE(g->probe_pending, 1); /* an event right after this launch: its kernel's own time */
    /* This launch: charged and counted like one of the fast path. */
    flight_begin(g);
    vgpu_gate_count(g);
    vgpu_unlock(&g->mu);
    return 1;
}

static inline void compute_gate_at(CUstream s, int d);

void vgpu_compute_gate(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    compute_gate_at(s, vgpu_gate_of_stream(s));
}

/* A graph's kernel nodes may run in other cards' contexts than its stream's (a capture forked
 * onto another card's stream, kernel nodes given a context), so a graph on the stream of a card
 * without a gate passes the claim's only gated card's gate, or else the current context's card's:
 * a capped card's work cannot ride an uncapped card's graph launch. */
static void graph_gate(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = vgpu_gate_of_stream(s);
    if (d < 0)
        d = vgpu_single_gate >= 0 ? vgpu_single_gate : vgpu_gate_of_current();
    compute_gate_at(s, d);
}

/* The launch on s passes gate d (-1: none). */
static inline void compute_gate_at(CUstream s, int d)
{
    launch_gate = d + 1;
    if (d < 0)
        return;
    /* The coarse clock (a few ns) decides while the batch is clearly open and the credit
     * clearly there; otherwise the precise clock (tens of ns in a VM) does. */
    uint64_t margin = vgpu.coarse_margin; /* set with the device map, before any gate is active */
    struct vgpu_gate *g = &vgpu.gate[d];
    uint64_t c = vgpu_coarse_ns();
    int counted = vgpu_in_gate_ctx(g, s);
    flight_begin(g); /* before the count: a close that sees the count sees this too */
    if (counted && __builtin_expect(!vgpu_gate_fast(g, c, c + margin, s), 0)) {
        uint64_t now = vgpu_now_ns();
        counted = vgpu_gate_fast(g, now, now, s);
    }
    if (__builtin_expect(!counted, 0)) {
        atomic_fetch_sub(&g->inflight, 1);
        counted = gate_slow(d, s);
    }
    if (counted)
        launch_in_flight = d + 1;
    else
        launch_captured = d + 1;
    if (VGPU_PEEK(g->tracking)) { /* a hint, re-checked under the lock */
        vgpu_lock(&g->mu);
        vgpu_track_before(g, s);
        vgpu_unlock(&g->mu);
    }
}

static inline void compute_after_in_ctx(CUstream s);

/* A launch let through ungated into a capturing stream, whose stream is no longer in that
 * capture now: another thread ended it between the check and the driver (and maybe began
 * another), so the launch may have run. Its work is unknown: a bucket of GPU time, as a batch
 * whose measurement failed (a program does not race its own capture; a tenant doing so on
 * purpose pays for it). */
static void capture_recheck(CUstream s)
{
    int d = launch_captured - 1;
    launch_captured = 0;
    if (vgpu_stream_capture_id(s) == launch_capture_id)
        return;
    struct vgpu_gate *g = &vgpu.gate[d];
    vgpu_lock(&g->mu);
    vgpu_gate_forfeit(g);
    vgpu_unlock(&g->mu);
    vgpu_log(2, "gate d%d: a capture ended while a launch into it passed: charged a bucket", d);
}

/* After a launch: long kernels close their one-launch batch right behind it; a context pushed
 * for the launch (launch_ctx) is popped. */
static inline void compute_after(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    if (__builtin_expect(launch_captured != 0, 0))
        capture_recheck(s);
    compute_after_in_ctx(s);
    if (__builtin_expect(launch_pushed != NULL, 0)) {
        CUcontext popped = NULL;
        launch_pushed = NULL;
        DRV->ctx_pop(&popped);
    }
}

static inline void compute_after_in_ctx(CUstream s)
{
    /* It reached the driver: no longer in flight, once its tail (gap tracking) is recorded, so
     * that a close that sees none in flight also sees its tail. */
    int held = launch_in_flight;
    launch_in_flight = 0;
    int d = launch_gate - 1;
    launch_gate = 0;
    struct vgpu_gate *g = d < 0 ? NULL : &vgpu.gate[d];
    /* unlocked peeks: the common case (nothing to do) costs no lock; re-checked under it */
    if (!g || (!VGPU_PEEK(g->probe_pending) && !VGPU_PEEK(g->tracking) &&
               (VGPU_PEEK(g->est_ns) < LONG_KERNEL_NS || !VGPU_PEEK(g->cur.ev_open)))) {
        if (held)
            atomic_fetch_sub(&vgpu.gate[held - 1].inflight, 1);
        return;
    }
    vgpu_lock(&g->mu);
    vgpu_track_after(g, s);
    if (g->probe_pending) {
        VGPU_POKE(g->probe_pending, 0);
        CUevent e;
        if (g->cur.ev_open && !g->cur.ev_probe && (e = vgpu_measure_event(g))) {
            if (DRV->event_record(e, s) == CUDA_SUCCESS)
                g->cur.ev_probe = e;
            else
                vgpu_measure_put(g, e);
        }
    } else if (g->est_ns >= LONG_KERNEL_NS && g->cur.ev_open && !vgpu_stream_capturing(s)) {
        if (held) /* its own launch, behind which the close goes */
            atomic_fetch_sub(&g->inflight, 1), held = 0;
        vgpu_measure_close(g, 0);
    }
    if (held)
        atomic_fetch_sub(&g->inflight, 1);
    vgpu_unlock(&g->mu);
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
    CUresult rc = VGPU_WATCHED_LAUNCH(f, s, REAL(H_LAUNCH, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e));
    compute_after(s);
    return rc;
}

VGPU_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                      unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, s ? s : CU_STREAM_PER_THREAD, REAL(H_LAUNCH_PTSZ, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e));
    compute_after(s ? s : CU_STREAM_PER_THREAD);
    return rc;
}

/* cuLaunchKernelEx(_ptsz): the driver is given a copy of the config the gate read, so another
 * thread rewriting its stream after the gate's checks cannot move the launch elsewhere. */
VGPU_API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    CUlaunchConfig own;
    if (c)
        own = *c, c = &own;
    CUstream st = c ? c->hStream : NULL;
    vgpu_compute_gate(st);
    CUresult rc = VGPU_WATCHED_LAUNCH(
        f, st, REAL(H_LAUNCHEX, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e));
    compute_after(st);
    return rc;
}

VGPU_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    CUlaunchConfig own;
    if (c)
        own = *c, c = &own;
    CUstream st = c && c->hStream ? c->hStream : CU_STREAM_PER_THREAD;
    vgpu_compute_gate(st);
    CUresult rc = VGPU_WATCHED_LAUNCH(
        f, st, REAL(H_LAUNCHEX_PTSZ, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e));
    compute_after(st);
    return rc;
}

VGPU_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                            unsigned by, unsigned bz, unsigned shm, CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, s, REAL(H_COOP, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p));
    compute_after(s);
    return rc;
}

VGPU_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                 unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                                 CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, s ? s : CU_STREAM_PER_THREAD, REAL(H_COOP_PTSZ, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p));
    compute_after(s ? s : CU_STREAM_PER_THREAD);
    return rc;
}

/* One launch of a multi-device launch, in its stream's context (the gate is the current
 * context's card): before the driver (gate; *held = what it counted in flight) or after it
 * (compute_after for that count). A context that cannot be made current: the caller's. */
struct multi_held {
    int flight;         /* launch_in_flight of its gate */
    CUcontext pushed;   /* launch_pushed of its gate */
    int captured;       /* launch_captured of its gate */
    uint64_t cap_id;    /* launch_capture_id */
    int gate;           /* launch_gate */
};

static void multi_one(CUstream s, int after, struct multi_held *held)
{
    CUcontext c = NULL, prev = NULL;
    int pushed = DRV->stream_get_ctx && DRV->ctx_push && DRV->ctx_pop &&
                 DRV->stream_get_ctx(s, &c) == CUDA_SUCCESS && c && DRV->ctx_push(c) == CUDA_SUCCESS;
    if (!after) {
        vgpu_compute_gate(s);
        held->flight = launch_in_flight, held->pushed = launch_pushed, held->captured = launch_captured;
        held->cap_id = launch_capture_id, held->gate = launch_gate;
        launch_in_flight = 0, launch_pushed = NULL, launch_captured = 0, launch_gate = 0;
    } else {
        launch_in_flight = held->flight, launch_pushed = held->pushed, launch_captured = held->captured;
        launch_capture_id = held->cap_id, launch_gate = held->gate;
        compute_after(s);
    }
    if (pushed)
        DRV->ctx_pop(&prev);
}

/* Deprecated since CUDA 11.3, still exported: a cooperative kernel on several devices, one
 * launch per device (at most one per card, so at most VGPU_MAX_DEV). Each passes its card's
 * gate; a longer list is refused before the driver sees it. The deprecated hooks answer
 * CUDA_ERROR_NOT_FOUND where the driver no longer has the function (dlsym still names ours). */
VGPU_API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *l, unsigned n, unsigned flags)
{
    BROKEN_GUARD();
    typedef CUresult (*multi_fn)(CUDA_LAUNCH_PARAMS *, unsigned, unsigned);
    multi_fn real = REAL(H_COOP_MULTI, multi_fn);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    struct multi_held held[VGPU_MAX_DEV] = {{0, NULL, 0, 0, 0}};
    CUDA_LAUNCH_PARAMS own[VGPU_MAX_DEV]; /* the driver gets the list the gates read */
    int gated = vgpu.compute_limited && l;
    if (gated && n > VGPU_MAX_DEV)
        return CUDA_ERROR_INVALID_VALUE;
    if (gated)
        memcpy(own, l, n * sizeof *l), l = own;
    for (unsigned i = 0; gated && i < n; i++)
        multi_one(l[i].hStream, 0, &held[i]);
    CUresult rc = real(l, n, flags);
    for (unsigned i = 0; gated && i < n; i++)
        multi_one(l[i].hStream, 1, &held[i]);
    return rc;
}

/* The pre-4.0 launches: the legacy stream (cuLaunch, cuLaunchGrid) or a stream; one block of a
 * shape set by cuFuncSetBlockShape (cuLaunch), a grid of w x h blocks. */
VGPU_API CUresult cuLaunch(CUfunction f)
{
    BROKEN_GUARD();
    CUresult (*real)(CUfunction) = REAL(H_LAUNCH_V0, CUresult(*)(CUfunction));
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    vgpu_compute_gate(NULL);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, NULL, real(f));
    compute_after(NULL);
    return rc;
}

VGPU_API CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    BROKEN_GUARD();
    CUresult (*real)(CUfunction, int, int) = REAL(H_LAUNCHGRID, CUresult(*)(CUfunction, int, int));
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    vgpu_compute_gate(NULL);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, NULL, real(f, w, h));
    compute_after(NULL);
    return rc;
}

VGPU_API CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    BROKEN_GUARD();
    typedef CUresult (*grid_async_fn)(CUfunction, int, int, CUstream);
    grid_async_fn real = REAL(H_LAUNCHGRID_ASYNC, grid_async_fn);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    vgpu_compute_gate(s);
    CUresult rc = VGPU_WATCHED_LAUNCH(f, s, real(f, w, h, s));
    compute_after(s);
    return rc;
}

static CUresult graph_launch(int idx, CUgraphExec g, CUstream s)
{
    graph_gate(s);
    CUresult rc = mode() != M_LIMITED ? REAL(idx, CUresult(*)(CUgraphExec, CUstream))(g, s)
                                      : vgpu_mem_graph_launch(idx, g, s); /* graph memory: vgpu_mem_graph.c */
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
