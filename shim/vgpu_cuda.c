/*
 * vgpu_cuda.c - CUDA driver API hooks: the device map, cuInit, the compute gate, launches and
 * the hook table. The memory paths and memory info are in vgpu_cuda_mem.c.
 *
 * Launch hooks (cuLaunchKernel(_ptsz), cuLaunchKernelEx(_ptsz), cuLaunchCooperativeKernel
 * (_ptsz), cuGraphLaunch(_ptsz)) pass through vgpu_compute_gate (vgpu_compute.c); a graph
 * launch then goes through vgpu_mem_graph_launch (graph memory).
 */
#include "vgpu_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const int vgpu_idx_gpa = H_GPA, vgpu_idx_gpa_v2 = H_GPA2;

int vgpu_cuda_mode_v;
int vgpu_cuda_mode_slow(void)
{
    vgpu_init();
    vgpu_cuda_mode_v = vgpu.cfg.broken ? M_BROKEN : (vgpu.limited && !vgpu.cfg.disabled) ? M_LIMITED : M_PASS;
    return vgpu_cuda_mode_v;
}

static pthread_mutex_t map_mu = PTHREAD_MUTEX_INITIALIZER;

void vgpu_cuda_after_fork(void)
{
    /* A thread of the parent may have held any of these at fork time. */
    pthread_mutex_init(&map_mu, NULL);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        pthread_mutex_init(&vgpu.gate[d].mu, NULL);
    vgpu_cuda_mem_after_fork();
}

/* ------------------------------------------------------------------ devices */

static int single_gate = -1;

void vgpu_format_uuid(const CUuuid *u, char *out, size_t n)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

int vgpu_map_uuid(const char *uuid)
{
    /* "GPU-"/"MIG-" prefixes differ between CUDA and NVML for MIG: compare what follows. */
    if (strlen(uuid) < 5)
        return -1;
    for (int d = 0; d < vgpu.cfg.ndev; d++) {
        const char *c = vgpu.cfg.source == VGPU_SRC_HAMI && vgpu.region.r ? vgpu.region.r->dev[d].uuid
                                                                          : vgpu.cfg.dev[d].uuid;
        if (strlen(c) >= 5 && strcasecmp(c + 4, uuid + 4) == 0)
            return d;
    }
    return -1;
}

static void map_devices_locked(void)
{
    CUresult (*count)(int *) = (CUresult(*)(int *))vgpu_cuda_sym("cuDeviceGetCount");
    CUresult (*get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))vgpu_cuda_sym("cuDeviceGet");
    CUresult (*guuid)(CUuuid *, CUdevice) = (CUresult(*)(CUuuid *, CUdevice))vgpu_cuda_sym("cuDeviceGetUuid_v2");
    if (!guuid)
        guuid = (CUresult(*)(CUuuid *, CUdevice))vgpu_cuda_sym("cuDeviceGetUuid");
    CUresult (*total)(size_t *, CUdevice) = REAL(H_TOTALMEM, CUresult(*)(size_t *, CUdevice));
    int n = 0;
    if (!count || !get || !guuid || count(&n) != CUDA_SUCCESS)
        return;
    int active = 0, last = -1;
    if (vgpu.cfg.source != VGPU_SRC_HAMI) /* claim mode: a card we cannot identify is refused */
        for (int i = 0; i < VGPU_MAX_DEV; i++)
            vgpu.cuda_map[i] = -2;
    for (int ord = 0; ord < n && ord < VGPU_MAX_DEV; ord++) {
        CUdevice dev;
        CUuuid u;
        char s[VGPU_UUID_LEN];
        if (get(&dev, ord) != CUDA_SUCCESS || dev < 0 || dev >= VGPU_MAX_DEV ||
            guuid(&u, dev) != CUDA_SUCCESS)
            continue;
        vgpu_format_uuid(&u, s, sizeof s);
        int d;
        if (vgpu.cfg.source == VGPU_SRC_HAMI) {
            /* HAMi index mode: limit i belongs to the i-th visible device. */
            d = ord < vgpu.cfg.ndev ? ord : -1;
            if (d >= 0 && vgpu.region.r)
                snprintf(vgpu.region.r->dev[d].uuid, VGPU_UUID_LEN, "%s", s);
        } else {
            d = vgpu_map_uuid(s);
            if (d < 0) {
                vgpu_log(1, "CUDA device %d (%s) is not in the claim: allocations on it are refused", ord, s);
                d = -2;
            }
        }
        vgpu.cuda_map[dev] = d;
        if (d >= 0) {
            size_t t = 0;
            if (total && total(&t, dev) == CUDA_SUCCESS)
                vgpu.cuda_total[d] = t;
            vgpu_compute_setup(d, dev);
            if (vgpu.gate[d].active)
                active++, last = d;
        }
    }
    single_gate = active == 1 ? last : -1;
    __atomic_store_n(&vgpu.cuda_mapped, 1, __ATOMIC_RELEASE);
}

static void map_devices(void)
{
    if (__atomic_load_n(&vgpu.cuda_mapped, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&map_mu);
    if (!vgpu.cuda_mapped)
        map_devices_locked();
    pthread_mutex_unlock(&map_mu);
}

int vgpu_map_cuda_device(CUdevice dev)
{
    map_devices();
    if (dev < 0 || dev >= VGPU_MAX_DEV)
        return vgpu.cfg.source == VGPU_SRC_HAMI ? -1 : -2;
    return vgpu.cuda_map[dev];
}

int vgpu_cur_dev(void)
{
    static CUresult (*f)(CUdevice *);
    CUdevice dev;
    if (!f)
        f = (CUresult(*)(CUdevice *))vgpu_cuda_sym("cuCtxGetDevice");
    if (!f || f(&dev) != CUDA_SUCCESS)
        return -1;
    return vgpu_map_cuda_device(dev);
}
/* ------------------------------------------------------------------ init and info */

VGPU_API CUresult cuInit(unsigned flags)
{
    if (mode() == M_BROKEN)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = REAL(H_INIT, CUresult(*)(unsigned))(flags);
    if (rc == CUDA_SUCCESS && mode() == M_LIMITED)
        map_devices();
    return rc;
}
/* ------------------------------------------------------------------ compute gate */

#define CU_STREAM_PER_THREAD ((CUstream)0x2)

void vgpu_compute_setup(int d, CUdevice dev)
{
    (void)dev;
    struct vgpu_gate *g = &vgpu.gate[d];
    int cores = vgpu.cfg.policy == VGPU_POLICY_DISABLE ? 0 : (int)vgpu.region.r->dev[d].cores;
    vgpu_gate_init(g, cores, vgpu.cfg.period_ns);
    if (!vgpu.region.private_map) {
        g->shared_win_id = &vgpu.region.r->dev[d].win_id;
        g->shared_win_used = &vgpu.region.r->dev[d].win_used;
    }
}

/* Every 250 ms on the slow path: stamp the container's activity in its own region (the agent
 * reads it) and read the window the agent laid out for this card. A missing, short or garbage
 * schedule, or one that does not list us yet: our own share at offset 0 (capped, as alone). A
 * window is never longer than our own share. Not listed yet: retried on every slow path. */
static void refresh_schedule(int d, uint64_t now)
{
    struct vgpu_gate *g = &vgpu.gate[d];
    if (g->last_sched_ns && now - g->last_sched_ns < 250000000ull)
        return;
    struct vgpu_region_dev *rd = &vgpu.region.r->dev[d];
    uint64_t hb = atomic_load_explicit(&rd->sched_heartbeat_ns, memory_order_relaxed);
    if (!hb || hb > now || now - hb >= VGPU_SCHED_STALE_NS)
        atomic_store_explicit(&rd->sched_joined_ns, now, memory_order_relaxed); /* (re)joins at the end */
    atomic_store_explicit(&rd->sched_heartbeat_ns, now, memory_order_relaxed);
    uint64_t own = g->period_ns * (rd->cores ? rd->cores : 100) / 100;
    uint32_t off = 0, len = 0;
    if (vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] &&
        vgpu_sched_read(vgpu.cfg.sched_dir, rd->uuid, vgpu.cfg.claim, &off, &len) == 0 && len) {
        g->last_sched_ns = now;
        g->offset_ns = g->period_ns * off / 1000;
        g->len_ns = g->period_ns * len / 1000;
        if (g->len_ns > own)
            g->len_ns = own;
        return;
    }
    g->last_sched_ns = vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] ? 0 : now;
    g->offset_ns = 0;
    g->len_ns = own;
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static void gate_slow(int d, CUstream s)
{
    static CUresult (*sync)(CUstream), (*capturing)(CUstream, int *);
    if (!sync) {
        capturing = (CUresult(*)(CUstream, int *))vgpu_cuda_sym("cuStreamIsCapturing");
        sync = (CUresult(*)(CUstream))vgpu_cuda_sym("cuStreamSynchronize");
    }
    struct vgpu_gate *g = &vgpu.gate[d];
    pthread_mutex_lock(&g->mu);
    uint64_t now = vgpu_now_ns();
    if (g->win_start && now < g->win_start) {
        sleep_until(g->win_start);
        now = vgpu_now_ns();
    }
    if (g->win_start && vgpu_gate_fast(g, now)) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    if (g->win_start) {
        int st = 0;
        if (capturing && capturing(s, &st) == CUDA_SUCCESS && st != 0) {
            pthread_mutex_unlock(&g->mu); /* captured work does not run now: not gated */
            return;
        }
        if (sync)
            sync(s);
        uint64_t drained = vgpu_now_ns(), ws = g->win_start, n = atomic_load(&g->win_launches);
        vgpu_gate_close(g, now, drained);
        g->throttles++;

        if (vgpu.cfg.log_level >= 3)
            vgpu_log(3, "gate d%d: window %llu us budget %llu us: %llu launches, detected +%llu us, "
                        "drained +%llu us, est %llu ns, debt %llu us", d,
                     (unsigned long long)(ws / 1000), (unsigned long long)(g->win_budget / 1000),
                     (unsigned long long)n, (unsigned long long)((now - ws) / 1000),
                     (unsigned long long)((drained - ws) / 1000), (unsigned long long)g->kernel_ns_est,
                     (unsigned long long)(g->debt_ns / 1000));
    }
    now = vgpu_now_ns();
    refresh_schedule(d, now);
    if (vgpu_gate_plan(g, now))
        sleep_until(g->win_start);
    atomic_fetch_add_explicit(g->shared_win_used, g->kernel_ns_est, memory_order_relaxed);
    atomic_fetch_add_explicit(&g->win_launches, 1, memory_order_relaxed);
    pthread_mutex_unlock(&g->mu);
}

void vgpu_compute_gate(CUstream s)
{
    if (__builtin_expect(!vgpu.compute_limited, 1))
        return;
    int d = single_gate;
    if (d < 0) {
        d = vgpu_cur_dev();
        if (d < 0 || !vgpu.gate[d].active)
            return;
    }
    /* The coarse clock (a few ns) decides while the window is clearly open; near its edges
     * the precise clock (tens of ns in a VM) does. */
    static uint64_t margin;
    if (__builtin_expect(!margin, 0))
        margin = vgpu_coarse_margin();
    int r = vgpu_gate_fast_coarse(&vgpu.gate[d], vgpu_coarse_ns(), margin);
    if (__builtin_expect(r == 1, 1))
        return;
    if (r < 0 && vgpu_gate_fast(&vgpu.gate[d], vgpu_now_ns()))
        return;
    gate_slow(d, s);
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
    return REAL(H_LAUNCH, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e);
}

VGPU_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                      unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    return REAL(H_LAUNCH_PTSZ, launch_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p, e);
}

VGPU_API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(c ? c->hStream : NULL);
    return REAL(H_LAUNCHEX, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e);
}

VGPU_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
{
    BROKEN_GUARD();
    vgpu_compute_gate(c && c->hStream ? c->hStream : CU_STREAM_PER_THREAD);
    return REAL(H_LAUNCHEX_PTSZ, CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))(c, f, p, e);
}

VGPU_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                            unsigned by, unsigned bz, unsigned shm, CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s);
    return REAL(H_COOP, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p);
}

VGPU_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                 unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                                 CUstream s, void **p)
{
    BROKEN_GUARD();
    vgpu_compute_gate(s ? s : CU_STREAM_PER_THREAD);
    return REAL(H_COOP_PTSZ, coop_fn)(f, gx, gy, gz, bx, by, bz, shm, s, p);
}

static CUresult graph_launch(int idx, CUgraphExec g, CUstream s)
{
    vgpu_compute_gate(s);
    if (mode() != M_LIMITED)
        return REAL(idx, CUresult(*)(CUgraphExec, CUstream))(g, s);
    return vgpu_mem_graph_launch(idx, g, s); /* graph memory: vgpu_cuda_mem.c */
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

/* ------------------------------------------------------------------ the table */

extern CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
extern CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);

#define HK(name, base, ver, ptds) {#name, base, ver, ptds, (void *)name, NULL}
struct vgpu_hook vgpu_cuda_hooks[] = {
    [H_GPA] = HK(cuGetProcAddress, "cuGetProcAddress", 11030, 0),
    [H_GPA2] = HK(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0),
    [H_INIT] = HK(cuInit, "cuInit", 2000, 0),
    [H_ALLOC] = HK(cuMemAlloc_v2, "cuMemAlloc", 3020, 0),
    [H_PITCH] = HK(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0),
    [H_MANAGED] = HK(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0),
    [H_FREE] = HK(cuMemFree_v2, "cuMemFree", 3020, 0),
    [H_ASYNC] = HK(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0),
    [H_ASYNC_PTSZ] = HK(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1),
    [H_POOL] = HK(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0),
    [H_POOL_PTSZ] = HK(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1),
    [H_FREEASYNC] = HK(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0),
    [H_FREEASYNC_PTSZ] = HK(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1),
    [H_CREATE] = HK(cuMemCreate, "cuMemCreate", 10020, 0),
    [H_RELEASE] = HK(cuMemRelease, "cuMemRelease", 10020, 0),
    [H_ARRAY] = HK(cuArrayCreate_v2, "cuArrayCreate", 3020, 0),
    [H_ARRAY3D] = HK(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0),
    [H_ARRAYDESTROY] = HK(cuArrayDestroy, "cuArrayDestroy", 2000, 0),
    [H_MIPMAP] = HK(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0),
    [H_MIPMAPDESTROY] = HK(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0),
    [H_GETINFO] = HK(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0),
    [H_TOTALMEM] = HK(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0),
    [H_LAUNCH] = HK(cuLaunchKernel, "cuLaunchKernel", 4000, 0),
    [H_LAUNCH_PTSZ] = HK(cuLaunchKernel_ptsz, "cuLaunchKernel", 4000, 1),
    [H_LAUNCHEX] = HK(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0),
    [H_LAUNCHEX_PTSZ] = HK(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, 1),
    [H_COOP] = HK(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0),
    [H_COOP_PTSZ] = HK(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, 1),
    [H_GRAPH] = HK(cuGraphLaunch, "cuGraphLaunch", 10000, 0),
    [H_GRAPH_PTSZ] = HK(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 1),
    [H_ALLOC_V1] = HK(cuMemAlloc, "cuMemAlloc", 2000, 0),
    [H_FREE_V1] = HK(cuMemFree, "cuMemFree", 2000, 0),
    [H_GINST] = HK(cuGraphInstantiate, "cuGraphInstantiate", 10000, 0),
    [H_GINST_V2] = HK(cuGraphInstantiate_v2, "cuGraphInstantiate", 11000, 0),
    [H_GINST_FLAGS] = HK(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040, 0),
    [H_GINST_PARAMS] = HK(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, 0),
    [H_GUPLOAD] = HK(cuGraphUpload, "cuGraphUpload", 11010, 0),
    [H_GUPLOAD_PTSZ] = HK(cuGraphUpload_ptsz, "cuGraphUpload", 11010, 1),
    [H_GEXEC_DESTROY] = HK(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, 0),
    [H_CTX_CREATE] = HK(cuCtxCreate_v2, "cuCtxCreate", 3020, 0),
    [H_CTX_CREATE_V3] = HK(cuCtxCreate_v3, "cuCtxCreate", 11040, 0),
    [H_CTX_CREATE_V4] = HK(cuCtxCreate_v4, "cuCtxCreate", 12050, 0),
    [H_CTX_DESTROY] = HK(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0),
    [H_PRIMARY_RETAIN] = HK(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, 0),
    [H_CTX_SET_LIMIT] = HK(cuCtxSetLimit, "cuCtxSetLimit", 3010, 0),
};
const int vgpu_cuda_nhooks = H_COUNT;
