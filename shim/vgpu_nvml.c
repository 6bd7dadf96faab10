/*
 * vgpu_nvml.c - what NVML (and so nvidia-smi) shows inside the container, and the
 * reconciliation of the shim's counters with NVML's per-process usage.
 *
 * nvmlDeviceGetMemoryInfo / _v2 (NVML API reference, nvmlMemory_t / nvmlMemory_v2_t): for a
 * device of the claim with a memory limit, total = min(limit, physical), used = the
 * container's charge (capped at total), free = total - used, reserved (v2) = 0. Devices are
 * matched by UUID (nvmlDeviceGetUUID), never by index, except in HAMi index mode.
 *
 * Reconciliation: NVML's usedGpuMemory for this process covers what no hook sees (context,
 * modules, local memory, library internals, pool caches, graph memory, 2 MiB rounding). The
 * difference to this process's counted allocations becomes its overhead charge in the region
 * (in full, even past the limit: then every allocation and graph launch is refused). The process is found by PID:
 * the slot's host_pid when the node agent filled it, else getpid() (same PID namespace).
 * Rate: at most every 200 ms on allocation paths, every 10 ms near the limit, and always
 * before an allocation is refused.
 */
#include "vgpu_cuda.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

enum { N_INIT, N_INIT_V2, N_INIT_FLAGS, N_MEM, N_MEM_V2, N_COUNT };

static int nvml_broken(void)
{
    vgpu_init();
    return vgpu.cfg.broken;
}

static nvmlReturn_t own_nvml_init(void)
{
    static int done;
    static nvmlReturn_t rc = NVML_ERROR_UNINITIALIZED;
    if (!done) {
        nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))vgpu_nvml_sym("nvmlInit_v2");
        rc = init ? init() : NVML_ERROR_UNINITIALIZED;
        done = 1;
    }
    return rc;
}

/* Region device index of an NVML handle, -1 if none. Small cache: handles are stable. */
static int nvml_map(nvmlDevice_t h)
{
    static struct { nvmlDevice_t h; int d; } cache[VGPU_MAX_DEV];
    static int n;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n; i++)
        if (cache[i].h == h) {
            int d = cache[i].d;
            pthread_mutex_unlock(&mu);
            return d;
        }
    pthread_mutex_unlock(&mu);
    int d = -1;
    if (vgpu.cfg.source == VGPU_SRC_HAMI) {
        nvmlReturn_t (*idx)(nvmlDevice_t, unsigned *) =
            (nvmlReturn_t(*)(nvmlDevice_t, unsigned *))vgpu_nvml_sym("nvmlDeviceGetIndex");
        unsigned i;
        if (idx && idx(h, &i) == NVML_SUCCESS && (int)i < vgpu.cfg.ndev)
            d = (int)i;
    } else {
        nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned) =
            (nvmlReturn_t(*)(nvmlDevice_t, char *, unsigned))vgpu_nvml_sym("nvmlDeviceGetUUID");
        char s[VGPU_UUID_LEN];
        if (uuid && uuid(h, s, sizeof s) == NVML_SUCCESS)
            d = vgpu_map_uuid(s);
    }
    pthread_mutex_lock(&mu);
    if (n < VGPU_MAX_DEV)
        cache[n].h = h, cache[n].d = d, n++;
    pthread_mutex_unlock(&mu);
    return d;
}

static nvmlDevice_t handle_of(int d)
{
    static nvmlDevice_t handles[VGPU_MAX_DEV];
    if (handles[d])
        return handles[d];
    if (own_nvml_init() != NVML_SUCCESS)
        return NULL;
    const char *uuid = vgpu.region.r->dev[d].uuid;
    nvmlReturn_t (*by_uuid)(const char *, nvmlDevice_t *) =
        (nvmlReturn_t(*)(const char *, nvmlDevice_t *))vgpu_nvml_sym("nvmlDeviceGetHandleByUUID");
    if (uuid[0] && by_uuid)
        by_uuid(uuid, &handles[d]);
    return handles[d];
}

uint64_t vgpu_nvml_process_used(int d, int *found)
{
    *found = 0;
    nvmlDevice_t h = handle_of(d);
    if (!h)
        return 0;
    nvmlReturn_t (*procs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *) =
        (nvmlReturn_t(*)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *))vgpu_nvml_sym(
            "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!procs)
        procs = (nvmlReturn_t(*)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *))vgpu_nvml_sym(
            "nvmlDeviceGetComputeRunningProcesses_v2");
    if (!procs)
        return 0;
    nvmlProcessInfo_t info[128];
    unsigned n = 128;
    if (procs(h, &n, info) != NVML_SUCCESS)
        return 0;
    int slot = vgpu.region.slot;
    unsigned pid = slot >= 0 && vgpu.region.r->slot[slot].host_pid ? (unsigned)vgpu.region.r->slot[slot].host_pid
                                                                   : (unsigned)getpid();
    for (unsigned i = 0; i < n && i < 128; i++)
        if (info[i].pid == pid && info[i].usedGpuMemory != ~0ull) {
            *found = 1;
            return info[i].usedGpuMemory;
        }
    return 0;
}

void vgpu_reconcile(int d, int force)
{
    if (d < 0 || !vgpu.region.r)
        return;
    uint64_t now = vgpu_now_ns(), last = vgpu.last_reconcile_ns[d];
    uint64_t min_gap = force == 1 ? 0 : force == 2 ? 10000000ull : 200000000ull;
    if (last && now - last < min_gap)
        return;
    vgpu.last_reconcile_ns[d] = now;
    static uint64_t last_reap;
    if (!last_reap || now - last_reap > 1000000000ull) { /* dead processes leave the view */
        last_reap = now;
        vgpu_region_reap(vgpu.region.r);
    }
    vgpu_ensure_slot();
    int found;
    uint64_t used = vgpu_nvml_process_used(d, &found);
    if (!found)
        return;
    int s = vgpu.region.slot;
    uint64_t data = s >= 0 ? vgpu.region.r->slot[s].data[d] : 0;
    vgpu_region_set_overhead(&vgpu.region, d, used > data ? used - data : 0);
    vgpu_oom_check(d); /* ACTIVE_OOM_KILLER: over the limit with memory the shim could not refuse */
}

/* ------------------------------------------------------------------ hooks */

#define NREAL(i, T) ((T)(vgpu_nvml_hooks[i].real ? vgpu_nvml_hooks[i].real : vgpu_nvml_sym(vgpu_nvml_hooks[i].name)))

VGPU_API nvmlReturn_t nvmlInit_v2(void)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL(N_INIT_V2, nvmlReturn_t(*)(void))();
}

VGPU_API nvmlReturn_t nvmlInit(void)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL(N_INIT, nvmlReturn_t(*)(void))();
}

VGPU_API nvmlReturn_t nvmlInitWithFlags(unsigned flags)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL(N_INIT_FLAGS, nvmlReturn_t(*)(unsigned))(flags);
}

/* Apply the slice to (total, used, free); returns 1 if the device is limited. */
static int slice(nvmlDevice_t h, unsigned long long *total, unsigned long long *used, unsigned long long *free_b)
{
    vgpu_init();
    if (!vgpu.limited || vgpu.cfg.disabled)
        return 0;
    int d = nvml_map(h);
    uint64_t lim = d >= 0 ? vgpu.region.r->dev[d].limit : 0;
    if (!lim)
        return 0;
    static uint64_t last_reap;
    uint64_t now = vgpu_now_ns();
    if (!last_reap || now - last_reap > 1000000000ull) { /* nvidia-smi: no stale usage */
        last_reap = now;
        vgpu_region_reap(vgpu.region.r);
    }
    uint64_t T = *total < lim ? *total : lim;
    uint64_t U = vgpu_region_used(vgpu.region.r, d);
    if (U > T)
        U = T;
    uint64_t F = T - U;
    if (F > *free_b) /* other tenants may hold the rest of the card */
        F = *free_b;
    *total = T, *used = U, *free_b = F;
    return 1;
}

VGPU_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m)
{
    nvmlReturn_t rc = NREAL(N_MEM, nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))(h, m);
    if (rc == NVML_SUCCESS && m)
        slice(h, &m->total, &m->used, &m->free);
    return rc;
}

VGPU_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
    nvmlReturn_t rc = NREAL(N_MEM_V2, nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_v2_t *))(h, m);
    if (rc == NVML_SUCCESS && m && slice(h, &m->total, &m->used, &m->free))
        m->reserved = 0;
    return rc;
}

#define NK(name) {#name, #name, 0, 0, (void *)name, NULL}
struct vgpu_hook vgpu_nvml_hooks[] = {
    [N_INIT] = NK(nvmlInit),
    [N_INIT_V2] = NK(nvmlInit_v2),
    [N_INIT_FLAGS] = NK(nvmlInitWithFlags),
    [N_MEM] = NK(nvmlDeviceGetMemoryInfo),
    [N_MEM_V2] = NK(nvmlDeviceGetMemoryInfo_v2),
};
const int vgpu_nvml_nhooks = N_COUNT;
