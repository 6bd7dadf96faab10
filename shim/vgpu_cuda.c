/*
 * vgpu_cuda.c - CUDA driver API hooks: the device map, cuInit and the hook table. The memory
 * hooks are in vgpu_cuda_mem.c and vgpu_mem_*.c (vgpu_mem.h), the launch hooks (the compute
 * limit's CUDA side) in vgpu_launch.c, the wait, stream-end and context-end hooks in vgpu_waits.c.
 */
#include "vgpu_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>


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
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        pthread_mutex_init(&vgpu.gate[d].mu, NULL);
        atomic_store(&vgpu.gate[d].inflight, 0); /* the other threads' launches stayed behind */
    }
    atomic_store(&vgpu_ctx_cards, 0); /* a child has none of its parent's contexts */
    vgpu_nvml_fork_lock(2);
    vgpu_cuda_mem_fork_lock(4);
}

/* ------------------------------------------------------------------ devices */

int vgpu_single_gate = -1;
_Atomic unsigned vgpu_ctx_cards;

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
    vgpu_fn_cuDeviceTotalMem_v2 total = REAL_FN(cuDeviceTotalMem_v2);
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
    vgpu_lock(&map_mu);
    if (!vgpu.cuda_mapped)
        map_devices_locked();
    vgpu_unlock(&map_mu);
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

/* A created stream belongs to the context it was made in, whichever is current when it is used:
 * stream-ordered memory on it is allocated on that context's card. The legacy and per-thread
 * handles, and every stream where the driver has no cuStreamGetCtx, are the current context's;
 * a created stream whose context the driver does not tell (an invalid handle, or one destroyed
 * meanwhile) is -2: nothing on it is charged to a card it may not be on. */
int vgpu_stream_dev(CUstream s)
{
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUcontext cur = NULL, own = NULL, prev = NULL;
    if ((uintptr_t)s <= (uintptr_t)CU_STREAM_PER_THREAD || !drv->stream_get_ctx || !drv->ctx_push || !drv->ctx_pop)
        return vgpu_cur_dev();
    if (drv->stream_get_ctx(s, &own) != CUDA_SUCCESS || !own)
        return -2;
    if (drv->ctx_get_current && drv->ctx_get_current(&cur) == CUDA_SUCCESS && own == cur)
        return vgpu_cur_dev();
    if (drv->ctx_push(own) != CUDA_SUCCESS)
        return -2;
    int d = vgpu_cur_dev();
    drv->ctx_pop(&prev);
    return d;
}
/* ------------------------------------------------------------------ init and info */

VGPU_API CUresult cuInit(unsigned flags)
{
    if (mode() == M_BROKEN)
        return CUDA_ERROR_NOT_INITIALIZED;
    VGPU_ST_T0(t0);
    CUresult rc = REAL_FN(cuInit)(flags);
    VGPU_ST_ADD(VGPU_ST_CUINIT, t0);
    if (rc == CUDA_SUCCESS && mode() == M_LIMITED) {
        VGPU_ST_T0(t1);
        map_devices();
        VGPU_ST_ADD(VGPU_ST_MAP, t1);
    }
    return rc;
}
/* ------------------------------------------------------------------ the table */

/* One entry per hook of VGPU_CUDA_HOOKS (vgpu_hooks.h), at its index. */
struct vgpu_hook vgpu_cuda_hooks[H_COUNT] = {VGPU_CUDA_HOOKS(VGPU_HOOK_ENTRY)};
