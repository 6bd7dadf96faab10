/*
 * suite_cu - the driver-API workloads of the GPU suite (bench/gpu/suite.py runs them).
 * No CUDA headers: the few types are declared here and every entry point is looked up with
 * dlsym in libcuda.so.1 by its exported (versioned) name, so an LD_PRELOAD shim sees the
 * calls as it sees any client's. Kernels are PTX text, JIT-compiled by the driver.
 * Output: one JSON object on stdout. Times: "t0"/"t1" are CLOCK_REALTIME seconds.
 *
 *   suite_cu spin ITERS SECS SYNC_EVERY     kernels of ITERS dependent FMAs, one 32-thread block
 *                                           per SM; sync every SYNC_EVERY kernels; ITERS 0:
 *                                           calibrate ITERS for a 100 ms kernel first
 *   suite_cu spingrid ITERS SECS SYNC_EVERY the same through the pre-4.0 launch (cuFuncSetBlockShape,
 *                                           cuParamSetv, cuLaunchGridAsync: deprecated, still exported)
 *   suite_cu ctx2 ITERS SECS                five kernels of ITERS FMAs (0: calibrated for 2 ms), one
 *                                           block per SM, in a second context, after a tiny kernel in
 *                                           the primary one, each round waited for (spin's output)
 *   suite_cu ptds ITERS SECS                five kernels of ITERS FMAs (0: calibrated for 2 ms), one
 *                                           block per SM, on a second thread's per-thread default
 *                                           stream, while the main thread launches tiny kernels on
 *                                           its own, each waited for (spin's output)
 *   suite_cu graphmem BYTES CHUNK MAXN HOLD graph with one memory-alloc node of BYTES, launched,
 *                                           then cuMemAlloc CHUNK until refused (or MAXN)
 *   suite_cu heap HEAP PER_THREAD NCTX CHUNK MAXN HOLD
 *                                           CU_LIMIT_MALLOC_HEAP_SIZE=HEAP, a kernel whose 4224
 *                                           threads malloc PER_THREAD each, NCTX more contexts,
 *                                           then cuMemAlloc CHUNK until refused (or MAXN)
 *   suite_cu green N CHUNK MAXN HOLD        N green contexts on the card's whole SM resource (each
 *                                           made current for a 2 MiB allocation), then cuMemAlloc
 *                                           CHUNK in the primary context until refused (or MAXN)
 *   suite_cu racer CHUNK CAP SECS GO_FILE RESERVE
 *                                           after GO_FILE exists: allocate CHUNK until refused, CAP
 *                                           bytes, or cuMemGetInfo's free below RESERVE bytes (room
 *                                           kept for a newcomer's context), free all, repeat for SECS
 *   suite_cu newcomer SPAWN_T CHUNK         times cuInit, the context, the first cuMemAlloc
 *   suite_cu evlat ITERS N                  one-block kernels of ITERS FMAs: their time back to
 *                                           back and bracketed one by one by an event pair on an
 *                                           idle stream, an empty pair, a record's, a query's and a
 *                                           cuCtxGetCurrent's CPU cost
 *   suite_cu trackcost ITERS N              the CPU cost per launch of gap tracking's parts: N
 *                                           launches of ITERS-FMA one-block kernels alone, each with
 *                                           a timing event recorded behind it, with a query of the
 *                                           last one before it too, the same with an event without
 *                                           timing; and a cuStreamIsCapturing
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUfunction, *CUmodule, *CUevent, *CUgraph, *CUgraphNode, *CUgraphExec;

/* CUDA_MEM_ALLOC_NODE_PARAMS with CUmemPoolProps (88 bytes: allocType, handleTypes, location,
 * win32SecurityAttributes, maxSize, usage, reserved[54]) */
typedef struct {
    int allocType, handleTypes, locType, locId;
    void *win32;
    unsigned char rest[64];
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} MemAllocNodeParams;

#define ATTR_SM_COUNT 16
#define LIMIT_MALLOC_HEAP_SIZE 2

static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxGetCurrent)(CUcontext *);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuCtxSetLimit)(int, size_t);
static CUresult (*p_cuCtxCreate_v4)(CUcontext *, void *, unsigned, CUdevice);
static CUresult (*p_cuCtxCreate_v2)(CUcontext *, unsigned, CUdevice);
static CUresult (*p_cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree_v2)(CUdeviceptr);
static CUresult (*p_cuMemGetInfo_v2)(size_t *, size_t *);
static CUresult (*p_cuMemsetD32_v2)(CUdeviceptr, unsigned, size_t);
static CUresult (*p_cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuModuleLoadData)(CUmodule *, const void *);
static CUresult (*p_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void **, void **);
static CUresult (*p_cuFuncSetBlockShape)(CUfunction, int, int, int);
static CUresult (*p_cuParamSetv)(CUfunction, int, void *, unsigned);
static CUresult (*p_cuParamSetSize)(CUfunction, unsigned);
static CUresult (*p_cuLaunchGridAsync)(CUfunction, int, int, CUstream);
static CUresult (*p_cuEventCreate)(CUevent *, unsigned);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventQuery)(CUevent);
static CUresult (*p_cuEventSynchronize)(CUevent);
static CUresult (*p_cuEventElapsedTime)(float *, CUevent, CUevent);
static CUresult (*p_cuGraphCreate)(CUgraph *, unsigned);
static CUresult (*p_cuGraphAddMemAllocNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                            MemAllocNodeParams *);
static CUresult (*p_cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
static CUresult (*p_cuGraphLaunch)(CUgraphExec, CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuStreamIsCapturing)(CUstream, int *);
static CUresult (*p_cuDeviceGetDevResource)(CUdevice, void *, int);
static CUresult (*p_cuDevResourceGenerateDesc)(void **, void *, unsigned);
static CUresult (*p_cuGreenCtxCreate)(void **, void *, CUdevice, unsigned);
static CUresult (*p_cuCtxFromGreenCtx)(CUcontext *, void *);

#define MISSING 990 /* our code for "the driver does not export it" */
#define CALL(fn, ...) (p_##fn ? p_##fn(__VA_ARGS__) : MISSING)

static void resolve(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        printf("{\"error\": \"dlopen libcuda.so.1: %s\"}\n", dlerror());
        exit(3);
    }
#define R(fn) *(void **)&p_##fn = dlsym(h, #fn)
    R(cuInit); R(cuDeviceGet); R(cuDeviceGetAttribute); R(cuDevicePrimaryCtxRetain); R(cuCtxSetCurrent); R(cuCtxGetCurrent);
    R(cuCtxSynchronize); R(cuCtxSetLimit); R(cuCtxCreate_v4); R(cuCtxCreate_v2); R(cuMemAlloc_v2);
    R(cuMemFree_v2); R(cuMemGetInfo_v2); R(cuMemsetD32_v2); R(cuMemcpyDtoH_v2); R(cuModuleLoadData); R(cuModuleGetFunction);
    R(cuLaunchKernel); R(cuEventCreate); R(cuEventRecord); R(cuEventQuery); R(cuEventSynchronize);
    R(cuEventElapsedTime); R(cuGraphCreate); R(cuGraphAddMemAllocNode); R(cuGraphInstantiateWithFlags);
    R(cuGraphLaunch); R(cuStreamSynchronize); R(cuStreamIsCapturing);
    R(cuFuncSetBlockShape); R(cuParamSetv); R(cuParamSetSize); R(cuLaunchGridAsync);
    R(cuDeviceGetDevResource); R(cuDevResourceGenerateDesc); R(cuGreenCtxCreate); R(cuCtxFromGreenCtx);
#undef R
}

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".extern .func (.param .b64 func_retval0) malloc\n(\n\t.param .b64 malloc_param_0\n)\n;\n"
    ".visible .entry spin(\n\t.param .u64 spin_param_0,\n\t.param .u64 spin_param_1\n)\n{\n"
    "\t.reg .pred %p<2>;\n\t.reg .f32 %f<4>;\n\t.reg .b64 %rd<5>;\n"
    "\tld.param.u64 %rd1, [spin_param_0];\n"
    "\tld.param.u64 %rd2, [spin_param_1];\n"
    "\tmov.f32 %f1, 0f3F800000;\n"
    "\tmov.f32 %f2, 0f3F7FFFF0;\n"
    "\tmov.u64 %rd3, 0;\n"
    "$L_loop:\n"
    "\tfma.rn.f32 %f1, %f1, %f2, 0f38D1B717;\n"
    "\tadd.s64 %rd3, %rd3, 1;\n"
    "\tsetp.lt.u64 %p1, %rd3, %rd1;\n"
    "\t@%p1 bra $L_loop;\n"
    "\tcvta.to.global.u64 %rd4, %rd2;\n"
    "\tst.global.f32 [%rd4], %f1;\n"
    "\tret;\n}\n"
    ".visible .entry dmalloc(\n\t.param .u64 dmalloc_param_0,\n\t.param .u64 dmalloc_param_1\n)\n{\n"
    "\t.reg .pred %p<2>;\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<6>;\n"
    "\tld.param.u64 %rd1, [dmalloc_param_0];\n"
    "\tld.param.u64 %rd5, [dmalloc_param_1];\n"
    "\t{\n\t.param .b64 param0;\n\tst.param.b64 [param0+0], %rd1;\n\t.param .b64 retval0;\n"
    "\tcall.uni (retval0), malloc, (param0);\n\tld.param.b64 %rd2, [retval0+0];\n\t}\n"
    "\tsetp.eq.s64 %p1, %rd2, 0;\n"
    "\t@%p1 bra $L_done;\n"
    "\tmov.u32 %r1, 1;\n"
    "\tst.u32 [%rd2], %r1;\n"
    "\tcvta.to.global.u64 %rd3, %rd5;\n"
    "\tatom.global.add.u32 %r2, [%rd3], 1;\n"
    "$L_done:\n"
    "\tret;\n}\n";

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double wall(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static CUdevice dev0;
static CUcontext primary;

static void setup(void)
{
    CUresult rc;
    resolve();
    if ((rc = CALL(cuInit, 0))) { printf("{\"error\": \"cuInit\", \"rc\": %d}\n", rc); exit(3); }
    if ((rc = CALL(cuDeviceGet, &dev0, 0))) { printf("{\"error\": \"cuDeviceGet\", \"rc\": %d}\n", rc); exit(3); }
    if ((rc = CALL(cuDevicePrimaryCtxRetain, &primary, dev0)) || (rc = CALL(cuCtxSetCurrent, primary))) {
        printf("{\"error\": \"context\", \"rc\": %d}\n", rc);
        exit(3);
    }
}

static CUfunction function(const char *name)
{
    static CUmodule m;
    CUfunction f = NULL;
    CUresult rc = 0;
    if (!m)
        rc = CALL(cuModuleLoadData, &m, PTX);
    if (!rc)
        rc = CALL(cuModuleGetFunction, &f, m, name);
    if (rc) { printf("{\"error\": \"module %s\", \"rc\": %d}\n", name, rc); exit(3); }
    return f;
}

static int sm_count(void)
{
    int n = 0;
    if (CALL(cuDeviceGetAttribute, &n, ATTR_SM_COUNT, dev0) || n <= 0)
        n = 132;
    return n;
}

/* ------------------------------------------------------------------ long kernels, small grid */

static int legacy_launch; /* spingrid: spin's kernels through cuLaunchGridAsync */

static CUresult spin_launch_on(CUfunction f, int grid, unsigned long long iters, CUdeviceptr out, CUstream s)
{
    if (legacy_launch) { /* the parameters as the pre-4.0 API sets them: bytes at their offsets */
        CUresult rc = CALL(cuFuncSetBlockShape, f, 32, 1, 1);
        if (!rc)
            rc = CALL(cuParamSetv, f, 0, &iters, sizeof iters);
        if (!rc)
            rc = CALL(cuParamSetv, f, 8, &out, sizeof out);
        if (!rc)
            rc = CALL(cuParamSetSize, f, 16);
        return rc ? rc : CALL(cuLaunchGridAsync, f, grid, 1, s);
    }
    void *args[] = {&iters, &out};
    return CALL(cuLaunchKernel, f, grid, 1, 1, 32, 1, 1, 0, s, args, NULL);
}

static CUresult spin_launch(CUfunction f, int grid, unsigned long long iters, CUdeviceptr out)
{
    return spin_launch_on(f, grid, iters, out, NULL);
}

#define MAXK 4096

/* ITERS for a kernel of about target_ms (one block per SM): 2e6 iterations timed, then twice
 * rescaled and timed (ev[0], ev[1]); *ms: the last one's time. */
static unsigned long long calibrate(CUfunction f, int grid, CUdeviceptr out, double target_ms, CUevent *ev,
                                    double *ms_out)
{
    unsigned long long it = 2000000ull;
    for (int round = 0; round < 3; round++) {
        float ms = 0;
        CALL(cuEventRecord, ev[0], NULL);
        spin_launch(f, grid, it, out);
        CALL(cuEventRecord, ev[1], NULL);
        CALL(cuEventSynchronize, ev[1]);
        CALL(cuEventElapsedTime, &ms, ev[0], ev[1]);
        if (ms <= 0)
            ms = 1;
        *ms_out = ms;
        if (round < 2)
            it = (unsigned long long)((double)it * target_ms / ms);
    }
    return it ? it : 1;
}

static int spin_report(unsigned long long iters, int grid, double calib_ms, long n, CUresult rc, double t0,
                       CUevent *ev);

static int cmd_spin(unsigned long long iters, double secs, long sync_every)
{
    setup();
    CUfunction f = function("spin");
    int grid = sm_count();
    CUdeviceptr out = 0;
    CUresult rc = CALL(cuMemAlloc_v2, &out, 64);
    if (rc) { printf("{\"error\": \"cuMemAlloc\", \"rc\": %d}\n", rc); return 3; }
    static CUevent ev[MAXK + 1];
    for (int i = 0; i <= MAXK; i++)
        if ((rc = CALL(cuEventCreate, &ev[i], 0))) { printf("{\"error\": \"cuEventCreate\", \"rc\": %d}\n", rc); return 3; }
    double calib_ms = 0;
    if (iters == 0)
        iters = calibrate(f, grid, out, 100.0, ev, &calib_ms);
    /* ev[0] marks the start on the GPU's timeline, ev[i] the end of kernel i */
    CALL(cuCtxSynchronize);
    double t0 = wall(), m0 = mono();
    CALL(cuEventRecord, ev[0], NULL);
    long n = 0;
    while (n < MAXK && mono() - m0 < secs) {
        if ((rc = spin_launch(f, grid, iters, out)))
            break;
        CALL(cuEventRecord, ev[n + 1], NULL);
        n++;
        if (n % sync_every == 0)
            CALL(cuCtxSynchronize);
    }
    return spin_report(iters, grid, calib_ms, n, rc, t0, ev);
}

/* The spin output: completed kernels' ends on the GPU's timeline (ev[0] its start). Kernels
 * still queued after the window are not waited for (with a 10 % limit and a sync every 10
 * kernels that could take seconds): only completed kernels count. */
static int spin_report(unsigned long long iters, int grid, double calib_ms, long n, CUresult rc, double t0,
                       CUevent *ev)
{
    double t1 = wall();
    usleep(200000);
    printf("{\"kind\": \"spin\", \"unit\": \"kernels\", \"iters\": %llu, \"grid\": %d, \"calib_ms\": %.3f, "
           "\"launched\": %ld, \"rc\": %d, \"t0\": %.6f, \"t1\": %.6f, \"done_ms\": [",
           iters, grid, calib_ms, n, rc, t0, t1);
    long done = 0;
    for (long i = 1; i <= n; i++) {
        float ms = 0;
        if (CALL(cuEventQuery, ev[i]) != 0)
            break;
        if (CALL(cuEventElapsedTime, &ms, ev[0], ev[i]))
            break;
        printf("%s%.3f", done ? ", " : "", ms);
        done++;
    }
    printf("], \"completed\": %ld}\n", done);
    fflush(stdout);
    if (getenv("SUITE_CU_EXIT")) /* the exit handlers too: a statistics build's lines (at exit) */
        exit(0);
    _exit(0);
}

/* ------------------------------------------------------------------ a second context */

/* A tenant that keeps the limiter's per-launch estimate low in one context and does its work in
 * another: each round a one-iteration kernel in the primary context, waited for, then five
 * kernels of ITERS FMAs (0: calibrated for 2 ms) on one block per SM in a second context of the
 * card (cuCtxCreate), waited for. Output as spin's (the events are the second context's). */
static int cmd_ctx2(unsigned long long iters, double secs)
{
    setup();
    CUfunction fa = function("spin"), fb = NULL;
    CUdeviceptr outa = 0, outb = 0;
    CUcontext b = NULL;
    CUmodule mb = NULL;
    static CUevent ev[MAXK + 1];
    CUresult rc = CALL(cuMemAlloc_v2, &outa, 64);
    if (!rc) /* CUDA 13's cuCtxCreate is _v4 (params may be NULL); older drivers: _v2 */
        rc = p_cuCtxCreate_v4 && !p_cuCtxCreate_v4(&b, NULL, 0, dev0) ? 0 : CALL(cuCtxCreate_v2, &b, 0, dev0);
    if (!rc)
        rc = CALL(cuModuleLoadData, &mb, PTX);
    if (!rc)
        rc = CALL(cuModuleGetFunction, &fb, mb, "spin");
    if (!rc)
        rc = CALL(cuMemAlloc_v2, &outb, 64);
    for (int i = 0; i <= MAXK && !rc; i++)
        rc = CALL(cuEventCreate, &ev[i], 0);
    if (rc) { printf("{\"error\": \"second context\", \"rc\": %d}\n", rc); return 3; }
    int grid = sm_count();
    double calib_ms = 0;
    if (iters == 0)
        iters = calibrate(fb, grid, outb, 2.0, ev, &calib_ms);
    CALL(cuCtxSynchronize);
    double t0 = wall(), m0 = mono();
    CALL(cuEventRecord, ev[0], NULL);
    long n = 0;
    while (n + 5 <= MAXK && mono() - m0 < secs && !rc) {
        CALL(cuCtxSetCurrent, primary);
        if ((rc = spin_launch(fa, 1, 1, outa)) || (rc = CALL(cuCtxSynchronize)))
            break;
        CALL(cuCtxSetCurrent, b);
        for (int k = 0; k < 5 && !rc; k++)
            if (!(rc = spin_launch(fb, grid, iters, outb)))
                CALL(cuEventRecord, ev[++n], NULL);
        if (!rc)
            rc = CALL(cuCtxSynchronize);
    }
    CALL(cuCtxSetCurrent, b);
    return spin_report(iters, grid, calib_ms, n, rc, t0, ev);
}

/* ------------------------------------------------------------------ per-thread default streams */

#define PER_THREAD ((CUstream)0x2) /* CU_STREAM_PER_THREAD: each thread's own default stream */

/* A tenant that keeps the limiter's estimate low on one thread's per-thread default stream and
 * works on another thread's (CU_STREAM_PER_THREAD is one handle for both): the main thread
 * launches a one-iteration kernel on its per-thread stream and waits for that stream, over and
 * over; a second thread launches five kernels of ITERS FMAs (0: calibrated for 2 ms, one block
 * per SM) on its own per-thread stream and waits for it, each round. Output as spin's (the
 * second thread's events). */
struct ptds {
    CUfunction f;
    int grid;
    unsigned long long iters;
    CUdeviceptr out;
    double end;
    long n;
    CUresult rc;
    CUevent *ev;
};

static void *ptds_worker(void *arg)
{
    struct ptds *p = arg;
    p->rc = CALL(cuCtxSetCurrent, primary);
    if (!p->rc)
        p->rc = CALL(cuEventRecord, p->ev[0], PER_THREAD);
    while (!p->rc && p->n + 5 <= MAXK && mono() < p->end) {
        for (int k = 0; k < 5 && !p->rc; k++)
            if (!(p->rc = spin_launch_on(p->f, p->grid, p->iters, p->out, PER_THREAD)))
                CALL(cuEventRecord, p->ev[++p->n], PER_THREAD);
        if (!p->rc)
            p->rc = CALL(cuStreamSynchronize, PER_THREAD);
    }
    return NULL;
}

static int cmd_ptds(unsigned long long iters, double secs)
{
    setup();
    static CUevent ev[MAXK + 1];
    struct ptds w = {.f = function("spin"), .grid = sm_count(), .ev = ev};
    CUdeviceptr tiny = 0;
    CUresult rc = CALL(cuMemAlloc_v2, &w.out, 64);
    if (!rc)
        rc = CALL(cuMemAlloc_v2, &tiny, 64);
    for (int i = 0; i <= MAXK && !rc; i++)
        rc = CALL(cuEventCreate, &ev[i], 0);
    if (rc) { printf("{\"error\": \"set-up\", \"rc\": %d}\n", rc); return 3; }
    double calib_ms = 0;
    w.iters = iters ? iters : calibrate(w.f, w.grid, w.out, 2.0, ev, &calib_ms);
    CALL(cuCtxSynchronize);
    double t0 = wall();
    w.end = mono() + secs;
    pthread_t t;
    if (pthread_create(&t, NULL, ptds_worker, &w)) { printf("{\"error\": \"pthread_create\"}\n"); return 3; }
    while (!rc && mono() < w.end)
        if (!(rc = spin_launch_on(w.f, 1, 1, tiny, PER_THREAD)))
            rc = CALL(cuStreamSynchronize, PER_THREAD);
    pthread_join(t, NULL);
    return spin_report(w.iters, w.grid, calib_ms, w.n, rc ? rc : w.rc, t0, ev);
}

/* ------------------------------------------------------------------ memory cases */

static long fill(size_t chunk, long maxn, CUresult *last)
{
    long n = 0;
    CUdeviceptr p;
    *last = 0;
    while (maxn <= 0 || n < maxn) {
        if ((*last = CALL(cuMemAlloc_v2, &p, chunk)))
            break;
        CALL(cuMemsetD32_v2, p, 0, 1024); /* touch it */
        n++;
    }
    return n;
}

static void meminfo_json(const char *key)
{
    size_t f = 0, t = 0;
    CUresult rc = CALL(cuMemGetInfo_v2, &f, &t);
    printf("\"%s\": {\"rc\": %d, \"free_mib\": %.1f, \"total_mib\": %.1f}", key, rc, f / 1048576.0, t / 1048576.0);
}

static int cmd_graphmem(size_t bytes, size_t chunk, long maxn, double hold)
{
    setup();
    double t0 = wall();
    CUgraph g = NULL;
    CUgraphNode node = NULL;
    CUgraphExec ge = NULL;
    MemAllocNodeParams prm;
    memset(&prm, 0, sizeof prm);
    prm.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prm.locType = 1;   /* CU_MEM_LOCATION_TYPE_DEVICE */
    prm.locId = dev0;
    prm.bytesize = bytes;
    CUresult rc_create = CALL(cuGraphCreate, &g, 0);
    CUresult rc_node = rc_create ? -1 : CALL(cuGraphAddMemAllocNode, &node, g, NULL, 0, &prm);
    CUresult rc_inst = rc_node ? -1 : CALL(cuGraphInstantiateWithFlags, &ge, g, 0);
    CUresult rc_launch = rc_inst ? -1 : CALL(cuGraphLaunch, ge, NULL);
    CUresult rc_sync = CALL(cuCtxSynchronize);
    CUresult last;
    long n = fill(chunk, maxn, &last);
    printf("{\"kind\": \"graphmem\", \"t0\": %.6f, \"graph_mib\": %.0f, \"create_rc\": %d, \"node_rc\": %d, "
           "\"instantiate_rc\": %d, \"launch_rc\": %d, \"sync_rc\": %d, \"chunks\": %ld, \"chunk_mib\": %.0f, "
           "\"last_rc\": %d, ",
           t0, bytes / 1048576.0, rc_create, rc_node, rc_inst, rc_launch, rc_sync, n, chunk / 1048576.0, last);
    meminfo_json("meminfo");
    printf(", \"t1\": %.6f}\n", wall());
    fflush(stdout);
    usleep((useconds_t)(hold * 1e6));
    return 0;
}

static int cmd_green(int n, size_t chunk, long maxn, double hold)
{
    setup();
    double t0 = wall();
    unsigned char res[1024]; /* CUdevResource: 144 bytes in CUDA 12.4, room for later ones */
    void *desc = NULL;
    CUresult rc_desc = CALL(cuDeviceGetDevResource, dev0, res, 1); /* CU_DEV_RESOURCE_TYPE_SM */
    if (!rc_desc)
        rc_desc = CALL(cuDevResourceGenerateDesc, &desc, res, 1);
    int made = 0;
    CUresult rc_green = rc_desc;
    for (int i = 0; i < n && !rc_green; i++) {
        void *g = NULL;
        CUcontext c = NULL;
        CUdeviceptr p;
        if ((rc_green = CALL(cuGreenCtxCreate, &g, desc, dev0, 1))) /* CU_GREEN_CTX_DEFAULT_STREAM */
            break;
        made++;
        if (!CALL(cuCtxFromGreenCtx, &c, g) && !CALL(cuCtxSetCurrent, c))
            CALL(cuMemAlloc_v2, &p, 2 << 20); /* make its memory real, as a program's first use does */
    }
    CALL(cuCtxSetCurrent, primary);
    CUresult last;
    long k = fill(chunk, maxn, &last);
    printf("{\"kind\": \"green\", \"t0\": %.6f, \"desc_rc\": %d, \"contexts\": %d, \"ctx_rc\": %d, "
           "\"chunks\": %ld, \"chunk_mib\": %.0f, \"last_rc\": %d, ",
           t0, rc_desc, made, rc_green, k, chunk / 1048576.0, last);
    meminfo_json("meminfo");
    printf(", \"t1\": %.6f}\n", wall());
    fflush(stdout);
    usleep((useconds_t)(hold * 1e6));
    return 0;
}

static int cmd_heap(size_t heap, unsigned long long per_thread, int nctx, size_t chunk, long maxn, double hold)
{
    setup();
    double t0 = wall();
    CUresult rc_limit = CALL(cuCtxSetLimit, LIMIT_MALLOC_HEAP_SIZE, heap);
    CUfunction f = function("dmalloc");
    CUdeviceptr cnt = 0;
    CUresult rc = CALL(cuMemAlloc_v2, &cnt, 64);
    if (!rc)
        rc = CALL(cuMemsetD32_v2, cnt, 0, 16);
    void *args[] = {&per_thread, &cnt};
    int grid = sm_count();
    CUresult rc_kernel = rc ? rc : CALL(cuLaunchKernel, f, grid, 1, 1, 32, 1, 1, 0, NULL, args, NULL);
    CUresult rc_ksync = CALL(cuCtxSynchronize);
    unsigned got = 0;
    CUresult rc_copy = CALL(cuMemcpyDtoH_v2, &got, cnt, sizeof got);
    int made = 0;
    CUresult rc_ctx = 0;
    for (int i = 0; i < nctx; i++) {
        CUcontext c = NULL;
        rc_ctx = p_cuCtxCreate_v4 ? p_cuCtxCreate_v4(&c, NULL, 0, dev0) : MISSING;
        if (rc_ctx) /* CUDA 13's cuCtxCreate is _v4 (params may be NULL); older drivers: _v2 */
            rc_ctx = CALL(cuCtxCreate_v2, &c, 0, dev0);
        if (rc_ctx)
            break;
        CUdeviceptr p;
        CALL(cuMemAlloc_v2, &p, 2 << 20); /* make the context's memory real */
        made++;
    }
    CALL(cuCtxSetCurrent, primary);
    CUresult last;
    long n = fill(chunk, maxn, &last);
    printf("{\"kind\": \"heap\", \"t0\": %.6f, \"heap_mib\": %.0f, \"limit_rc\": %d, \"kernel_rc\": %d, "
           "\"kernel_sync_rc\": %d, \"threads\": %d, \"per_thread\": %llu, \"mallocs_ok\": %d, \"contexts\": %d, \"ctx_rc\": %d, "
           "\"chunks\": %ld, \"chunk_mib\": %.0f, \"last_rc\": %d, ",
           t0, heap / 1048576.0, rc_limit, rc_kernel, rc_ksync, grid * 32, per_thread, rc_copy ? -1 : (int)got, made, rc_ctx, n,
           chunk / 1048576.0, last);
    meminfo_json("meminfo");
    printf(", \"t1\": %.6f}\n", wall());
    fflush(stdout);
    usleep((useconds_t)(hold * 1e6));
    return 0;
}

/* ------------------------------------------------------------------ start-up under contention */

static int racer_room(size_t reserve)
{
    size_t f = 0, t = 0;
    return reserve == 0 || CALL(cuMemGetInfo_v2, &f, &t) != 0 || f >= reserve;
}

static int cmd_racer(size_t chunk, size_t cap, double secs, const char *go, size_t reserve)
{
    setup();
    printf("{\"ready\": %.6f}\n", wall());
    fflush(stdout);
    while (access(go, F_OK) != 0)
        usleep(500);
    static CUdeviceptr held[4096];
    long cycles = 0, allocs = 0, refused = 0;
    double m0 = mono();
    while (mono() - m0 < secs) {
        long n = 0;
        while (n < 4096 && (size_t)(n + 1) * chunk <= cap && racer_room(reserve + chunk)) {
            if (CALL(cuMemAlloc_v2, &held[n], chunk)) {
                refused++;
                break;
            }
            n++;
        }
        allocs += n;
        for (long i = 0; i < n; i++)
            CALL(cuMemFree_v2, held[i]);
        cycles++;
    }
    printf("{\"kind\": \"racer\", \"cycles\": %ld, \"allocs\": %ld, \"refused\": %ld}\n", cycles, allocs, refused);
    return 0;
}

static int cmd_newcomer(double spawn_t, size_t chunk)
{
    double tm = wall();
    double a = mono();
    resolve();
    CUresult rc_init = CALL(cuInit, 0);
    double b = mono();
    CUresult rc_ctx = CALL(cuDeviceGet, &dev0, 0);
    if (!rc_ctx)
        rc_ctx = CALL(cuDevicePrimaryCtxRetain, &primary, dev0);
    if (!rc_ctx)
        rc_ctx = CALL(cuCtxSetCurrent, primary);
    CUdeviceptr p = 0;
    double c = mono();
    /* a refused context is the first answer then (no allocation is tried: it could only fail) */
    CUresult rc_alloc = rc_ctx ? -1 : CALL(cuMemAlloc_v2, &p, chunk);
    double d = mono();
    printf("{\"kind\": \"newcomer\", \"spawn_to_main_s\": %.4f, \"init_s\": %.4f, \"ctx_s\": %.4f, "
           "\"init_ctx_s\": %.4f, \"first_alloc_s\": %.4f, \"to_first_answer_s\": %.4f, \"init_rc\": %d, "
           "\"ctx_rc\": %d, \"alloc_rc\": %d}\n",
           tm - spawn_t, b - a, c - b, c - a, d - c, (tm - spawn_t) + (d - a), rc_init, rc_ctx, rc_alloc);
    return 0;
}

/* ------------------------------------------------------------------ event latency (gap tracking) */

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* What an event pair around one kernel on an idle stream adds to the kernel's own time (the
 * shim's gap tracker pays it once per busy segment), and the CPU cost of a record and a query:
 * `evlat ITERS N` with spin kernels of ITERS loop steps on one block. */
/* The context, the spin kernel and the 4 KiB it writes its result to (*out). */
static CUfunction spin_setup(CUdeviceptr *out)
{
    setup();
    *out = 0;
    CALL(cuMemAlloc_v2, out, 4096);
    return function("spin");
}

static int cmd_evlat(unsigned long long iters, int n)
{
    CUdeviceptr out;
    CUfunction f = spin_setup(&out);
    CUevent a, b;
    CALL(cuEventCreate, &a, 0);
    CALL(cuEventCreate, &b, 0);
    static float br[4096], pair[4096];
    if (n > 4096)
        n = 4096;
    for (int i = 0; i < 20; i++)
        spin_launch(f, 1, iters, out);
    CALL(cuCtxSynchronize);
    float back = 0;
    CALL(cuEventRecord, a, NULL);
    for (int i = 0; i < n; i++)
        spin_launch(f, 1, iters, out);
    CALL(cuEventRecord, b, NULL);
    CALL(cuEventSynchronize, b);
    CALL(cuEventElapsedTime, &back, a, b);
    for (int i = 0; i < n; i++) {
        CALL(cuEventRecord, a, NULL);
        spin_launch(f, 1, iters, out);
        CALL(cuEventRecord, b, NULL);
        CALL(cuEventSynchronize, b);
        CALL(cuEventElapsedTime, &br[i], a, b);
        CALL(cuEventRecord, a, NULL);
        CALL(cuEventRecord, b, NULL);
        CALL(cuEventSynchronize, b);
        CALL(cuEventElapsedTime, &pair[i], a, b);
    }
    qsort(br, (size_t)n, sizeof br[0], cmp_f);
    qsort(pair, (size_t)n, sizeof pair[0], cmp_f);
    double t0 = mono();
    for (int i = 0; i < 10000; i++)
        CALL(cuEventRecord, a, NULL);
    double rec = (mono() - t0) / 10000;
    CALL(cuCtxSynchronize);
    t0 = mono();
    for (int i = 0; i < 10000; i++)
        CALL(cuEventQuery, a);
    double qry = (mono() - t0) / 10000;
    CUcontext c; /* what the shim's fast path asks on launches on the legacy or per-thread stream */
    t0 = mono();
    for (int i = 0; i < 1000000; i++)
        CALL(cuCtxGetCurrent, &c);
    double cur = (mono() - t0) / 1000000;
    printf("{\"iters\": %llu, \"kernel_us\": %.3f, \"bracketed_p50_us\": %.3f, \"bracketed_p10_us\": %.3f, "
           "\"pair_p50_us\": %.3f, \"record_cpu_us\": %.3f, \"query_cpu_us\": %.3f, \"ctx_get_current_ns\": %.1f}\n",
           iters, back * 1e3 / n, br[n / 2] * 1e3, br[n / 10] * 1e3, pair[n / 2] * 1e3, rec * 1e6, qry * 1e6, cur * 1e9);
    return 0;
}

#define EVENT_DISABLE_TIMING 2

/* us of CPU per launch of N launches, each followed by what `mode` asks: 0 nothing, 1 a record
 * of ev, 2 a query of ev before the launch and a record of it after */
static double per_launch_us(CUfunction f, unsigned long long iters, CUdeviceptr out, int n, int mode, CUevent ev)
{
    CALL(cuCtxSynchronize);
    double t0 = mono();
    for (int i = 0; i < n; i++) {
        if (mode == 2)
            CALL(cuEventQuery, ev);
        spin_launch(f, 1, iters, out);
        if (mode)
            CALL(cuEventRecord, ev, NULL);
    }
    double us = (mono() - t0) * 1e6 / n;
    CALL(cuCtxSynchronize);
    return us;
}

/* `trackcost ITERS N`: what gap tracking adds to a launch, part by part (legacy stream). */
static int cmd_trackcost(unsigned long long iters, int n)
{
    CUdeviceptr out;
    CUfunction f = spin_setup(&out);
    CUevent timed, plain;
    CALL(cuEventCreate, &timed, 0);
    CALL(cuEventCreate, &plain, EVENT_DISABLE_TIMING);
    per_launch_us(f, iters, out, n / 10 + 1, 2, timed); /* warm-up */
    double alone = per_launch_us(f, iters, out, n, 0, NULL);
    double rec = per_launch_us(f, iters, out, n, 1, timed);
    double both = per_launch_us(f, iters, out, n, 2, timed);
    double plain_both = per_launch_us(f, iters, out, n, 2, plain);
    double alone2 = per_launch_us(f, iters, out, n, 0, NULL);
    int st = 0;
    double t0 = mono();
    for (int i = 0; i < 1000000; i++)
        CALL(cuStreamIsCapturing, NULL, &st);
    double cap = (mono() - t0) * 1e3; /* ns per call over 1e6 calls */
    printf("{\"iters\": %llu, \"n\": %d, \"launch_us\": %.3f, \"launch_again_us\": %.3f, "
           "\"launch_record_us\": %.3f, \"launch_query_record_us\": %.3f, "
           "\"launch_query_record_untimed_us\": %.3f, \"is_capturing_ns\": %.1f}\n",
           iters, n, alone, alone2, rec, both, plain_both, cap);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOFBF, 1 << 20);
    if (argc < 2) { fprintf(stderr, "usage: see the header of suite_cu.c\n"); return 2; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "spingrid") && argc >= 5)
        legacy_launch = 1, cmd = "spin";
    if (!strcmp(cmd, "spin") && argc >= 5)
        return cmd_spin(strtoull(argv[2], NULL, 0), atof(argv[3]), atol(argv[4]) > 0 ? atol(argv[4]) : 1);
    if (!strcmp(cmd, "ctx2") && argc >= 4)
        return cmd_ctx2(strtoull(argv[2], NULL, 0), atof(argv[3]));
    if (!strcmp(cmd, "ptds") && argc >= 4)
        return cmd_ptds(strtoull(argv[2], NULL, 0), atof(argv[3]));
    if (!strcmp(cmd, "trackcost") && argc >= 4)
        return cmd_trackcost(strtoull(argv[2], NULL, 0), atoi(argv[3]));
    if (!strcmp(cmd, "evlat") && argc >= 4)
        return cmd_evlat(strtoull(argv[2], NULL, 0), atoi(argv[3]));
    if (!strcmp(cmd, "graphmem") && argc >= 6)
        return cmd_graphmem(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), atol(argv[4]), atof(argv[5]));
    if (!strcmp(cmd, "green") && argc >= 6)
        return cmd_green(atoi(argv[2]), strtoull(argv[3], NULL, 0), atol(argv[4]), atof(argv[5]));
    if (!strcmp(cmd, "heap") && argc >= 8)
        return cmd_heap(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), atoi(argv[4]),
                        strtoull(argv[5], NULL, 0), atol(argv[6]), atof(argv[7]));
    if (!strcmp(cmd, "racer") && argc >= 6)
        return cmd_racer(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), atof(argv[4]), argv[5],
                         argc >= 7 ? strtoull(argv[6], NULL, 0) : 0);
    if (!strcmp(cmd, "newcomer") && argc >= 4)
        return cmd_newcomer(atof(argv[2]), strtoull(argv[3], NULL, 0));
    fprintf(stderr, "bad command\n");
    return 2;
}
