/*
 * vgpu_cuda.h - what the CUDA hook units share (vgpu_cuda.c: devices, cuInit, the hook table;
 * vgpu_cuda_mem.c and vgpu_mem_*.c: the memory hooks, see vgpu_mem.h; vgpu_launch.c and
 * vgpu_waits.c: launches, waits, the compute limit's CUDA side). Internal to those units.
 */
#ifndef VGPU_CUDA_H
#define VGPU_CUDA_H

#include "vgpu_hooks.h"

/* Driver constants and types of the graph and context hooks (CUDA driver API reference, cuda.h
 * 12/13; CUgraph, CUgraphNode: vgpu_hooks.h). */
#define CU_GRAPH_NODE_TYPE_GRAPH 5
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH 3
#define CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT 4
#define CU_MODULE_LAZY_LOADING 2 /* CUmoduleLoadingMode */
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39
typedef struct {
    CUmemPoolProps poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps layout");
_Static_assert(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS layout");

/* mode of this process: decided once after vgpu_init (vgpu_cuda.c) */
enum { M_UNSET, M_PASS, M_LIMITED, M_BROKEN };
extern int vgpu_cuda_mode_v;
int vgpu_cuda_mode_slow(void);
static inline int mode(void)
{
    int m = VGPU_PEEK(vgpu_cuda_mode_v);
    if (__builtin_expect(m == M_UNSET, 0))
        return vgpu_cuda_mode_slow();
    return m;
}

#define BROKEN_GUARD()                                                                          \
    do {                                                                                        \
        if (__builtin_expect(mode() == M_BROKEN, 0))                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
    } while (0)

#define CU_STREAM_PER_THREAD ((CUstream)VGPU_STREAM_PER_THREAD) /* each thread's own stream */

/* The card's free memory around a driver call that may load a module (vgpu_mem_module.c). */
struct vgpu_load_watch {
    int d;          /* region card watched, -1: none (not limited, no context, no answer) */
    int blind;      /* the card is not the current context's: its free memory is not read */
    size_t free_b;  /* the card's free bytes before the call */
    uint64_t used;  /* the container's charge there before the call */
    uint64_t frees; /* this process's uncharges before the call (vgpu_uncharges) */
    uint64_t key;   /* a launch's (function, context) */
};
/* A launch of f on stream s: 1 when it is f's first in the current context (the driver loads a
 * lazily loaded module and grows the context's local memory then) and its card is watched in
 * *w; then vgpu_launch_watch_end after the driver's answer charges what the launch took and, if
 * the launch succeeded, records it. */
int vgpu_launch_watch_begin(CUfunction f, CUstream s, struct vgpu_load_watch *w);
void vgpu_launch_watch_end(const struct vgpu_load_watch *w, CUresult rc);
/* The driver's launch `call` of function f on stream s (a CUresult expression), its first
 * launch in a context watched. */
#define VGPU_WATCHED_LAUNCH(f, s, call)                                                         \
    ({                                                                                          \
        struct vgpu_load_watch w_;                                                              \
        int on_ = mode() == M_LIMITED && vgpu_launch_watch_begin((f), (s), &w_);                \
        CUresult r_ = (call);                                                                   \
        if (on_)                                                                                \
            vgpu_launch_watch_end(&w_, r_);                                                     \
        r_;                                                                                     \
    })
int vgpu_cur_dev(void);               /* region device of the current context, -1/-2 */
int vgpu_stream_dev(CUstream s);      /* region device of stream s's context (vgpu_cuda.c) */
extern int vgpu_single_gate;          /* the only card with a compute gate, or -1 */
extern _Atomic unsigned vgpu_ctx_cards; /* bit d: this process made a context on region card d */
/* Whether a launch on stream s runs in the context the gate measures in (or the gate has none
 * yet), peeked: a created stream the open batch measures is one of that context's (a kernel
 * runs only on a stream of the current context), while the legacy and per-thread handles name
 * the current context's stream, so for them the current context is asked. */
static inline int vgpu_in_gate_ctx(struct vgpu_gate *g, CUstream s)
{
    void *want = VGPU_PEEK(g->ev_ctx);
    CUcontext cur = NULL;
    if ((uintptr_t)s > (uintptr_t)VGPU_STREAM_PER_THREAD || !want || !vgpu.drv.ctx_get_current)
        return 1;
    return vgpu.drv.ctx_get_current(&cur) == CUDA_SUCCESS && cur == want;
}

/* The card whose gate this thread's current context launches through, or -1 (no gate). */
static inline int vgpu_gate_of_current(void)
{
    int d = vgpu_single_gate;
    if (d < 0) {
        d = vgpu_cur_dev();
        if (d < 0 || !vgpu.gate[d].active)
            return -1;
    }
    return d;
}

/* The card whose gate a launch on stream s passes, or -1 (none). While the process has contexts
 * on one card only, the current context's (vgpu_gate_of_current: every stream is on that card).
 * With contexts on several, a created stream's own context names it (a stream made in another
 * card's context runs its kernels there, whichever context is current), and the legacy and
 * per-thread handles the current context's: each card's work passes its own card's gate, none on
 * an uncapped card. */
static inline int vgpu_gate_of_stream(CUstream s)
{
    unsigned cards = atomic_load_explicit(&vgpu_ctx_cards, memory_order_relaxed);
    if (__builtin_expect(!(cards & (cards - 1)), 1))
        return vgpu_gate_of_current();
    int d = (uintptr_t)s > (uintptr_t)CU_STREAM_PER_THREAD ? vgpu_stream_dev(s) : vgpu_cur_dev();
    if (d == -2) /* a stream whose card the driver does not tell */
        return vgpu_gate_of_current();
    return d >= 0 && vgpu.gate[d].active ? d : -1;
}

/* The memory units' locks across fork (vgpu_mem_table.c): 0 lock primary_mu, 1 lock join_mu,
 * 2 lock tab_mu, 3 unlock all three (parent), 4 re-initialise them and forget the parent's
 * allocations (child). */
void vgpu_cuda_mem_fork_lock(int op);
/* The memory side of cuGraphLaunch(_ptsz) in a limited process (after the compute gate). */
CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s);

/* The compute limiter's GPU time (vgpu_measure.c), for its gate (vgpu_launch.c); every
 * function taking a gate runs under its mutex. */
#define CU_NOT_READY 600
/* A batch's launch count with this bit set: closed when its stream had gone idle, its span an
 * upper bound. */
#define UPPER_BOUND (1ull << 63)
/* ... this bit: it launched on several streams, its span only a lower bound. */
#define LOWER_BOUND (1ull << 62)
CUevent vgpu_measure_event(struct vgpu_gate *g);          /* from the pool, or new; NULL: none */
void vgpu_measure_put(struct vgpu_gate *g, void *event);  /* back to the pool */
/* One stream's span of a settled batch: its events (moved out by vgpu_measure_cover) and where
 * they lie, ms after the batch's ev_open. */
struct vgpu_span { void **open, **close; float s, e; };
/* GPU ns of the spans that an earlier batch charged already (the most any one of them holds,
 * at the per mille it was charged at), at most cap; 0 for a gate that only measures:
 * vgpu_measure.c, "time charged twice". */
uint64_t vgpu_measure_twice(struct vgpu_gate *g, const struct vgpu_batch *b, const struct vgpu_span *sp, int n,
                            uint64_t cap);
/* The spans of batch b, settled and charged at pm per mille of their time: the one that ends
 * last becomes the stretch charged already, or extends it where they meet. */
void vgpu_measure_cover(struct vgpu_gate *g, struct vgpu_batch *b, const struct vgpu_span *sp, int n, uint32_t pm);
/* A batch starts before this launch: 1, or 0 when its opening event failed (nothing measures it). */
int vgpu_measure_open(struct vgpu_gate *g, CUstream s);
/* ... ends behind the last. Launches other threads have counted but not yet handed to the
 * driver would land behind the close's events, unmeasured, in a batch settled without them: a
 * batch closed with launches in flight is only a lower bound. */
void vgpu_measure_close(struct vgpu_gate *g, int at_sync);
/* Settle completed batches; `wait`: 0, or wait for the oldest one (bounded, see the function) */
#define VGPU_WAIT_FIRST 1 /* ... before a capped gate without an estimate queues more */
#define VGPU_WAIT_ROOM 2  /* ... to make room in a full ring */
void vgpu_measure_poll(struct vgpu_gate *g, int wait);
int vgpu_measure_join(struct vgpu_gate *g, CUstream s); /* another stream joins the open batch */
/* A slow-path launch in context ctx (the current one; a kernel runs only on a stream of the
 * current context): the gate measures in one context at a time, so a launch in another one
 * closes the open batch (in its own context) and makes ctx the gate's. */
void vgpu_measure_follow(struct vgpu_gate *g, CUcontext ctx);
/* Context ctx is about to be destroyed: batches and events of it are released first. */
void vgpu_measure_ctx_gone(struct vgpu_gate *g, CUcontext ctx);
/* Gap tracking (vgpu_track.c): a batch opened (tracked at random), ended or given up, settled
 * (done: all its events completed). */
void vgpu_track_start(struct vgpu_gate *g, CUstream s);
void vgpu_track_stop(struct vgpu_gate *g);
void vgpu_track_settle(struct vgpu_gate *g, struct vgpu_batch *b, int done);
void vgpu_track_before(struct vgpu_gate *g, CUstream s);  /* gap tracking around a launch */
void vgpu_track_after(struct vgpu_gate *g, CUstream s);
int vgpu_stream_capturing(CUstream s);                    /* 1: s is capturing a graph */
uint64_t vgpu_stream_capture_id(CUstream s);              /* its capture's id, 0: none */

/* ACTIVE_OOM_KILLER: after a reconciliation of device d (vgpu_nvml.c), end the process with the
 * most memory in the container if the container is over its limit (vgpu_mem_table.c). */
void vgpu_oom_check(int d);

/* The hooks' prototypes and the REAL / REAL_FN accessors: vgpu_hooks.h. */

#endif
