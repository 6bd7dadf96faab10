/*
 * vgpu_cuda.c - CUDA driver API hooks: the device map, cuInit and the hook table. The memory
 * hooks are in vgpu_cuda_mem.c and vgpu_mem_*.c (vgpu_mem.h), the launch and wait hooks (the compute limit's
 * CUDA side) in vgpu_launch.c.
 */
#include "vgpu_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const int vgpu_idx_gpa = H_GPA, vgpu_idx_gpa_v2 = H_GPA2;

int vgpu_cuda_mode_v; /* atomic (relaxed): every thread computes the same value */
int vgpu_cuda_mode_slow(void)
{
    vgpu_init();
    int m = vgpu.cfg.broken ? M_BROKEN : (vgpu.limited && !vgpu.cfg.disabled) ? M_LIMITED : M_PASS;
    VGPU_POKE(vgpu_cuda_mode_v, m);
    return m;
}

static pthread_mutex_t map_mu = PTHREAD_MUTEX_INITIALIZER;

/* Lock order (every path takes them in this order, never the reverse): primary_mu (context
 * retain) -> map_mu -> gate[d].mu -> join_mu -> nvml_mu -> tab_mu. The region's lock is
 * process-shared and robust: it is not taken across fork (its holder may be another process). */
void vgpu_cuda_fork_prepare(void)
{
    vgpu_cuda_mem_fork_lock(0);     /* primary_mu */
    pthread_mutex_lock(&map_mu);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        pthread_mutex_lock(&vgpu.gate[d].mu);
    vgpu_cuda_mem_fork_lock(1);     /* join_mu */
    vgpu_nvml_fork_lock(0);
    vgpu_cuda_mem_fork_lock(2);     /* tab_mu */
}

void vgpu_cuda_fork_parent(void)
{
    vgpu_cuda_mem_fork_lock(3);
    vgpu_nvml_fork_lock(1);
    for (int d = VGPU_MAX_DEV - 1; d >= 0; d--)
        pthread_mutex_unlock(&vgpu.gate[d].mu);
    pthread_mutex_unlock(&map_mu);
}

void vgpu_cuda_fork_child(void)
{
    /* The forking thread holds every lock (prepare): nothing is half-updated, and the child,
     * single-threaded, starts with fresh locks. */
    pthread_mutex_init(&map_mu, NULL);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        pthread_mutex_init(&vgpu.gate[d].mu, NULL);
    vgpu_nvml_fork_lock(2);
    vgpu_cuda_mem_fork_lock(4);
}

/* ------------------------------------------------------------------ devices */

int vgpu_single_gate = -1;

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
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*count)(int *) = drv->device_get_count;
    CUresult (*get)(CUdevice *, int) = drv->device_get;
    CUresult (*guuid)(CUuuid *, CUdevice) = drv->device_get_uuid;
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
    vgpu.coarse_margin = vgpu_coarse_margin();
    vgpu_single_gate = active == 1 ? last : -1;
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
    CUresult (*f)(CUdevice *) = vgpu_cuda_drv()->ctx_get_device;
    CUdevice dev;
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
    [H_STREAMSYNC] = HK(cuStreamSynchronize, "cuStreamSynchronize", 2000, 0),
    [H_STREAMSYNC_PTSZ] = HK(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, 1),
    [H_CTXSYNC] = HK(cuCtxSynchronize, "cuCtxSynchronize", 2000, 0),
    [H_EVENTSYNC] = HK(cuEventSynchronize, "cuEventSynchronize", 2000, 0),
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
