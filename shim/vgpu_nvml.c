/*
 * vgpu_nvml.c - what NVML (and so nvidia-smi) shows inside the container, and the
 * reconciliation of the shim's counters with NVML's per-process usage.
 *
 * nvmlDeviceGetMemoryInfo / _v2 (NVML API reference, nvmlMemory_t / nvmlMemory_v2_t): for a
 * device of the claim with a memory limit, total = min(limit, physical), used = the
 * container's charge (capped at total), free = total - used, reserved (v2) = 0. Devices are
 * matched by UUID (nvmlDeviceGetUUID), never by index, except in HAMi index mode.
 *
 * Reconciliation: NVML's usedGpuMemory for a process covers what no hook sees (context,
 * modules, local memory, library internals, pool caches, graph memory, 2 MiB rounding). For
 * every process of the container NVML lists (this one and its siblings, so an idle sibling's
 * hidden memory counts when any process asks), the difference to its counted allocations
 * becomes its overhead charge in the region (in full, even past the limit: then every
 * allocation and graph launch is refused). A process is found by PID: its slot's host_pid when
 * the node agent filled it, else getpid() for this process, and a sibling's own PID when both
 * are in the host's PID namespace. A sibling's overhead is only raised (vgpu_region_reconcile).
 * Rate: at most every 200 ms on allocation paths, every 10 ms near the limit, and always
 * before an allocation is refused.
 *
 * Busy calibration (vgpu_calibrate.c): the card's utilization samples (nvmlDeviceGetSamples) and
 * whether this process is the card's only compute process, read when a limited launch waits.
 */
#include "vgpu_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static int nvml_broken(void)
{
    vgpu_init();
    return vgpu.cfg.broken;
}

static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER; /* vgpu.nvml_* */

void vgpu_nvml_fork_lock(int op)
{
    if (op == 0)
        pthread_mutex_lock(&nvml_mu);
    else if (op == 1)
        pthread_mutex_unlock(&nvml_mu);
    else
        pthread_mutex_init(&nvml_mu, NULL);
}

/* The shim's own nvmlInit_v2 (once; the result is kept). Under nvml_mu. */
static nvmlReturn_t own_nvml_init_locked(void)
{
    if (!vgpu.nvml_inited) {
        nvmlReturn_t (*init)(void) = vgpu_nvml_drv()->nvml_init_v2;
        VGPU_ST_T0(t0);
        vgpu.nvml_init_rc = init ? init() : NVML_ERROR_UNINITIALIZED;
        VGPU_ST_ADD(VGPU_ST_NVML_INIT, t0);
        vgpu.nvml_inited = 1;
    }
    return vgpu.nvml_init_rc;
}

/* Region device index of an NVML handle, -1 if none. Small cache: handles are stable. */
static int nvml_map(nvmlDevice_t h)
{
    vgpu_lock(&nvml_mu);
    for (int i = 0; i < vgpu.nvml_nmap; i++)
        if (vgpu.nvml_map[i].h == h) {
            int d = vgpu.nvml_map[i].d;
            vgpu_unlock(&nvml_mu);
            return d;
        }
    vgpu_unlock(&nvml_mu);
    int d = -1;
    const struct vgpu_drv *drv = vgpu_nvml_drv();
    if (vgpu.cfg.source == VGPU_SRC_HAMI) {
        unsigned i;
        if (drv->nvml_device_index && drv->nvml_device_index(h, &i) == NVML_SUCCESS && (int)i < vgpu.cfg.ndev)
            d = (int)i;
    } else {
        char s[VGPU_UUID_LEN];
        if (drv->nvml_device_uuid && drv->nvml_device_uuid(h, s, sizeof s) == NVML_SUCCESS)
            d = vgpu_map_uuid(s);
    }
    vgpu_lock(&nvml_mu);
    if (vgpu.nvml_nmap < VGPU_MAX_DEV) {
        vgpu.nvml_map[vgpu.nvml_nmap].h = h, vgpu.nvml_map[vgpu.nvml_nmap].d = d;
        vgpu.nvml_nmap++;
    }
    vgpu_unlock(&nvml_mu);
    return d;
}

static nvmlDevice_t handle_of(int d)
{
    vgpu_lock(&nvml_mu);
    nvmlDevice_t h = vgpu.nvml_handle[d];
    if (!h && own_nvml_init_locked() == NVML_SUCCESS) {
        const char *uuid = vgpu.region.r->dev[d].uuid;
        nvmlReturn_t (*by_uuid)(const char *, nvmlDevice_t *) = vgpu_nvml_drv()->nvml_handle_by_uuid;
        if (uuid[0] && by_uuid && by_uuid(uuid, &h) == NVML_SUCCESS)
            vgpu.nvml_handle[d] = h;
        else
            h = NULL;
    }
    vgpu_unlock(&nvml_mu);
    return h;
}

/* This process's PID as NVML lists it: the slot's host_pid when the node agent filled it, else
 * getpid() (same PID namespace). */
static unsigned own_pid(void)
{
    int slot = vgpu.region.slot;
    return slot >= 0 && vgpu.region.r->slot[slot].host_pid ? (unsigned)vgpu.region.r->slot[slot].host_pid
                                                            : (unsigned)getpid();
}

#define VGPU_CARD_PROCS 128

/* The compute processes NVML lists on card d, *n entries: in buf (VGPU_CARD_PROCS entries), or in
 * a malloc'd array when the card lists more (a tenant can start them, and a process left out would
 * never have its hidden memory reconciled): the caller frees what is not buf. NULL with *n = 0
 * when NVML cannot tell. */
static struct vgpu_nvml_proc *card_procs(int d, struct vgpu_nvml_proc *buf, unsigned *n)
{
    *n = 0;
    nvmlDevice_t h = handle_of(d);
    nvmlReturn_t (*procs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *) = vgpu_nvml_drv()->nvml_running_procs;
    if (!h || !procs)
        return NULL;
    nvmlProcessInfo_t stack[VGPU_CARD_PROCS], *info = stack, *heap = NULL;
    unsigned got = VGPU_CARD_PROCS;
    VGPU_ST_T0(t0);
    nvmlReturn_t rc = procs(h, &got, info);
    for (int tries = 0; rc == NVML_ERROR_INSUFFICIENT_SIZE && tries < 4; tries++) {
        unsigned want = got + 64;
        nvmlProcessInfo_t *bigger = realloc(heap, want * sizeof *bigger);
        if (!bigger)
            break;
        info = heap = bigger, got = want;
        rc = procs(h, &got, info);
    }
    VGPU_ST_ADD(VGPU_ST_NVML_PROCS, t0);
    struct vgpu_nvml_proc *out = NULL;
    if (rc == NVML_SUCCESS && got)
        out = got <= VGPU_CARD_PROCS ? buf : malloc(got * sizeof *out);
    for (unsigned i = 0; out && i < got; i++)
        if (info[i].usedGpuMemory != ~0ull) /* NVML_VALUE_NOT_AVAILABLE */
            out[(*n)++] = (struct vgpu_nvml_proc){info[i].pid, info[i].usedGpuMemory};
    free(heap);
    return out;
}

uint64_t vgpu_nvml_process_used(int d, int *found)
{
    struct vgpu_nvml_proc buf[VGPU_CARD_PROCS];
    unsigned n, pid = own_pid();
    struct vgpu_nvml_proc *p = card_procs(d, buf, &n);
    uint64_t used = 0;
    *found = 0;
    for (unsigned i = 0; i < n && !*found; i++)
        if (p[i].pid == pid)
            *found = 1, used = p[i].used;
    if (p != buf)
        free(p);
    return used;
}

static double sample_value(int type, nvmlValue_t v)
{
    switch (type) {
    case 0: return v.dVal;
    case 1: return v.uiVal;
    case 2: return (double)v.ulVal;
    default: return (double)v.ullVal;
    }
}

int vgpu_nvml_card_busy(int d, unsigned long long *seen_us, unsigned long long *from_us, uint64_t *busy_ns,
                        int *alone, unsigned *procs)
{
    *busy_ns = 0;
    *alone = 0;
    *procs = 0;
    nvmlDevice_t h = handle_of(d);
    const struct vgpu_drv *drv = vgpu_nvml_drv();
    if (!h || !drv->nvml_samples || !drv->nvml_running_procs)
        return 0;
    nvmlProcessInfo_t info[8];
    unsigned n = 8;
    nvmlReturn_t rc = drv->nvml_running_procs(h, &n, info);
    *procs = rc == NVML_SUCCESS ? n : rc == NVML_ERROR_INSUFFICIENT_SIZE ? 8 : 0; /* more than 8: 8 */
    *alone = rc == NVML_SUCCESS && n == 1 && info[0].pid == own_pid();
    nvmlSample_t smp[128];
    unsigned cnt = 128;
    int type = 1;
    unsigned long long prev = *seen_us;
    if (drv->nvml_samples(h, NVML_GPU_UTILIZATION_SAMPLES, prev, &type, &cnt, smp) != NVML_SUCCESS)
        return 0;
    if (cnt > 128)
        cnt = 128;
    for (unsigned i = 1; i < cnt; i++) /* oldest first (insertion sort: a few samples) */
        for (unsigned j = i; j > 0 && smp[j - 1].timeStamp > smp[j].timeStamp; j--) {
            nvmlSample_t t = smp[j];
            smp[j] = smp[j - 1], smp[j - 1] = t;
        }
    *from_us = prev;
    for (unsigned i = 0; i < cnt; i++) {
        unsigned long long ts = smp[i].timeStamp;
        if (ts <= prev)
            continue;
        double pct = sample_value(type, smp[i].sampleValue);
        *busy_ns += (uint64_t)((pct < 0 ? 0 : pct > 100 ? 100 : pct) * (double)(ts - prev) * 10.0);
        prev = ts;
    }
    int first = !*seen_us;
    *seen_us = prev;
    return !first && prev > *from_us;
}

/* 1 when this thread may act on a rate-limited timer `*last` (now - last >= gap, or never set):
 * it moved the time forward; racing threads: one wins. */
static int take_turn(uint64_t *last, uint64_t now, uint64_t gap)
{
    uint64_t l = __atomic_load_n(last, __ATOMIC_RELAXED);
    if (l && now - l < gap)
        return 0;
    return __atomic_compare_exchange_n(last, &l, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

/* Dead processes leave the view: their slots are reaped at most every VGPU_REAP_NS. */
static void reap_rate_limited(uint64_t now)
{
    if (take_turn(&vgpu.last_reap_ns, now, VGPU_REAP_NS))
        vgpu_region_reap(vgpu.region.r);
}

/* One reconciliation of the container on d: VGPU_RECON_* flags (0 when NVML tells nothing). */
static int reconcile_pass(int d)
{
    vgpu_ensure_slot();
    uint64_t before[VGPU_MAX_SLOTS];
    vgpu_region_counted(vgpu.region.r, d, before);
    struct vgpu_nvml_proc buf[VGPU_CARD_PROCS];
    unsigned n;
    struct vgpu_nvml_proc *p = card_procs(d, buf, &n);
    int f = n ? vgpu_region_reconcile(&vgpu.region, d, before, p, n, vgpu_pidns_self()) : 0;
    if (p != buf)
        free(p);
    return f;
}

void vgpu_reconcile(int d, int force)
{
    if (d < 0 || !vgpu.region.r)
        return;
    uint64_t now = vgpu_now_ns();
    uint64_t min_gap = force == 1 ? VGPU_RECONCILE_REFUSE_NS : force == 2 ? VGPU_RECONCILE_NEAR_NS : VGPU_RECONCILE_NS;
    if (!take_turn(&vgpu.last_reconcile_ns[d], now, min_gap) && force != 3)
        return;
    reap_rate_limited(now);
    /* ACTIVE_OOM_KILLER: over the limit with memory the shim could not refuse; not on figures a
     * racing allocation may have inflated (the next reconciliation looks again) */
    if (reconcile_pass(d) == VGPU_RECON_OWN)
        vgpu_oom_check(d);
}

int vgpu_reconcile_over(int d)
{
    struct vgpu_region *r = vgpu.region.r;
    if (d < 0 || d >= VGPU_MAX_DEV || !r || !r->dev[d].limit)
        return 0;
    for (int pass = 0; pass < 2; pass++) {
        int f = reconcile_pass(d);
        __atomic_store_n(&vgpu.last_reconcile_ns[d], vgpu_now_ns(), __ATOMIC_RELAXED);
        if (vgpu_region_used(r, d) <= r->dev[d].limit)
            return 0;
        if (!(f & VGPU_RECON_MOVED))
            return 1;
    }
    return 1;
}

void vgpu_reconcile_soon(int d)
{
    if (d >= 0 && d < VGPU_MAX_DEV)
        __atomic_store_n(&vgpu.last_reconcile_ns[d], 0, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ hooks */

VGPU_API nvmlReturn_t nvmlInit_v2(void)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL_FN(nvmlInit_v2)();
}

VGPU_API nvmlReturn_t nvmlInit(void)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL_FN(nvmlInit)();
}

VGPU_API nvmlReturn_t nvmlInitWithFlags(unsigned flags)
{
    if (nvml_broken())
        return NVML_ERROR_UNINITIALIZED;
    return NREAL_FN(nvmlInitWithFlags)(flags);
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
    reap_rate_limited(vgpu_now_ns()); /* nvidia-smi: no stale usage */
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
    nvmlReturn_t rc = NREAL_FN(nvmlDeviceGetMemoryInfo)(h, m);
    if (rc == NVML_SUCCESS && m)
        slice(h, &m->total, &m->used, &m->free);
    return rc;
}

VGPU_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
    nvmlReturn_t rc = NREAL_FN(nvmlDeviceGetMemoryInfo_v2)(h, m);
    if (rc == NVML_SUCCESS && m && slice(h, &m->total, &m->used, &m->free))
        m->reserved = 0;
    return rc;
}

/* One entry per hook of VGPU_NVML_HOOKS (vgpu_hooks.h), at its index. */
struct vgpu_hook vgpu_nvml_hooks[N_COUNT] = {VGPU_NVML_HOOKS(VGPU_HOOK_ENTRY)};
