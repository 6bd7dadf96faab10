/*
 * vgpu_cuda_mem.c - CUDA driver API memory hooks: allocation paths, memory info, graph memory.
 * (Split out of vgpu_cuda.c; the hook table and the device map stay there.)
 *
 * Accounting rule (per device of the claim, in bytes): every allocation is reserved in the
 * shared region *before* the driver is asked (vgpu_region_reserve: atomic against all the
 * container's processes), then committed to a per-process table (pointer/handle -> bytes,
 * device) or rolled back if the driver fails. Frees look the table up; a pointer that is
 * not in it is passed through untouched (never an error). Paths and the amount charged:
 *
 *   cuMemAlloc_v2, cuMemAllocAsync(_ptsz), cuMemAllocFromPoolAsync(_ptsz): the size asked
 *   cuMemAllocPitch_v2: pitch returned by the driver x height (estimate reserved first)
 *   cuMemAllocManaged: the size asked, on the current device (policy: managed memory may
 *       migrate to the host, but it can always fault back, so it counts in full)
 *   cuMemCreate (location type device): the size asked, on prop->location.id
 *   cuArrayCreate_v2, cuArray3DCreate_v2, cuMipmappedArrayCreate: the driver's memory
 *       requirements (cu*GetMemoryRequirements), an element-size estimate reserved first
 *   graph memory nodes, context, modules, pool caches, allocator rounding: through the
 *       NVML reconciliation (vgpu_nvml.c), which sets this process's overhead charge
 *
 * Reported values (CUDA driver API reference semantics kept; NULL out-pointers are passed to
 * the driver as given, so the driver decides what NULL means):
 *   total = min(limit, physical total); free = min(max(total - used, 0), physical free)
 */
#include "vgpu_cuda.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ allocation table */

enum {
    K_PTR = 1, K_HANDLE = 2, K_ARRAY = 3, K_MIPMAP = 4, K_GRAPH = 5, /* K_GRAPH: exec launched once */
    K_CTX = 6,          /* a context this process created (or a primary one): its charge */
    K_LIM = 8,          /* + CU_LIMIT_*: bytes charged for a context's limit above its base */
    K_LIMBASE = 12,     /* + CU_LIMIT_*: the driver's value before our first change */
    K_GPEND = 32,       /* + region device: graph memory of an exec, known, not yet charged */
    K_GCHG = 48,        /* + region device: graph memory of an exec, charged */
    K_TOMB = -1
};
struct aent { uint64_t key; uint64_t size; int32_t dev; int32_t kind; };
static struct aent *tab;
static size_t tab_cap, tab_used; /* used counts live + tombstones */
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t slot_of(uint64_t key, int kind, size_t cap)
{
    return (size_t)(((key ^ ((uint64_t)kind << 56)) * 0x9e3779b97f4a7c15ull) >> 17) & (cap - 1);
}

static void tab_grow(void)
{
    size_t ncap = tab_cap ? tab_cap * 2 : 1024;
    struct aent *n = calloc(ncap, sizeof *n);
    if (!n)
        return;
    size_t live = 0;
    for (size_t i = 0; i < tab_cap; i++) {
        if (tab[i].kind <= 0)
            continue;
        size_t j = slot_of(tab[i].key, tab[i].kind, ncap);
        while (n[j].kind)
            j = (j + 1) & (ncap - 1);
        n[j] = tab[i];
        live++;
    }
    free(tab);
    tab = n, tab_cap = ncap, tab_used = live;
}

static void tab_put(int kind, uint64_t key, uint64_t size, int dev)
{
    pthread_mutex_lock(&tab_mu);
    if ((tab_used + 1) * 2 >= tab_cap)
        tab_grow();
    if (tab_cap) {
        size_t j = slot_of(key, kind, tab_cap);
        while (tab[j].kind > 0 && !(tab[j].kind == kind && tab[j].key == key))
            j = (j + 1) & (tab_cap - 1);
        if (tab[j].kind == 0)
            tab_used++;
        tab[j] = (struct aent){key, size, dev, kind};
    }
    pthread_mutex_unlock(&tab_mu);
}

static int tab_take(int kind, uint64_t key, uint64_t *size, int *dev)
{
    int found = 0;
    pthread_mutex_lock(&tab_mu);
    if (tab_cap) {
        size_t j = slot_of(key, kind, tab_cap);
        while (tab[j].kind) {
            if (tab[j].kind == kind && tab[j].key == key) {
                *size = tab[j].size, *dev = tab[j].dev;
                tab[j].kind = K_TOMB;
                found = 1;
                break;
            }
            j = (j + 1) & (tab_cap - 1);
        }
    }
    pthread_mutex_unlock(&tab_mu);
    return found;
}

static pthread_mutex_t join_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER; /* first primary-context retain */

void vgpu_cuda_mem_fork_lock(int op)
{
    switch (op) {
    case 0: pthread_mutex_lock(&primary_mu); break;
    case 1: pthread_mutex_lock(&join_mu); break;
    case 2: pthread_mutex_lock(&tab_mu); break;
    case 3:
        pthread_mutex_unlock(&tab_mu);
        pthread_mutex_unlock(&join_mu);
        pthread_mutex_unlock(&primary_mu);
        break;
    case 4:
        pthread_mutex_init(&primary_mu, NULL);
        pthread_mutex_init(&join_mu, NULL);
        pthread_mutex_init(&tab_mu, NULL);
        free(tab);
        tab = NULL, tab_cap = tab_used = 0;
        memset(vgpu.primary_charged, 0, sizeof vgpu.primary_charged);
        break;
    }
}

/* ------------------------------------------------------------------ charging */

void vgpu_ensure_slot(void)
{
    if (__atomic_load_n(&vgpu.region.slot, __ATOMIC_ACQUIRE) >= 0)
        return;
    pthread_mutex_lock(&join_mu);
    if (vgpu.region.slot < 0) {
        int32_t pid = (int32_t)getpid();
        static int told; /* under join_mu */
        if (vgpu_region_join(&vgpu.region, pid, vgpu_proc_start_time(pid)) < 0 && !told++)
            vgpu_log(0, "shared region has no free slot (%d processes): allocations are refused",
                     VGPU_MAX_SLOTS);
    }
    pthread_mutex_unlock(&join_mu);
}

/* 0: charged (or nothing to charge), -1: refuse with CUDA_ERROR_OUT_OF_MEMORY. */
static int charge(int d, uint64_t bytes)
{
    if (d == -1)
        return 0;
    if (d == -2) {
        vgpu_log(1, "allocation on a device outside the claim refused");
        return -1;
    }
    vgpu_ensure_slot();
    if (vgpu.region.slot < 0)
        return -1; /* no slot: this process could not be counted, so it gets nothing */
    struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[d].limit, used = vgpu_region_used(r, d);
    if (lim)
        vgpu_reconcile(d, used + bytes > lim - lim / 10 ? 2 : 0);
    if (vgpu_region_reserve(&vgpu.region, d, bytes) == 0)
        return 0;
    vgpu_reconcile(d, 1);
    if (vgpu_region_reserve(&vgpu.region, d, bytes) == 0)
        return 0;
    vgpu_log(2, "device %d: out of memory: %llu MiB asked, %llu of %llu MiB charged", d,
             (unsigned long long)(bytes >> 20), (unsigned long long)(vgpu_region_used(r, d) >> 20),
             (unsigned long long)(lim >> 20));
    return -1;
}

static void uncharge(int d, uint64_t bytes)
{
    if (d >= 0)
        vgpu_region_release(&vgpu.region, d, bytes);
}

/* Every free/destroy path: a tracked object leaves the table before the driver call (so an
 * address the driver hands out again at once is never confused with it) and is uncharged when
 * the call succeeds; when it fails, the object goes back. release_begin is 0 for objects the
 * shim does not track (limits off, or allocated before it), which then pass straight through. */
static int release_begin(int kind, uint64_t key, uint64_t *size, int *d)
{
    return mode() == M_LIMITED && tab_take(kind, key, size, d);
}

static CUresult release_end(CUresult rc, int kind, uint64_t key, uint64_t size, int d)
{
    if (rc == CUDA_SUCCESS)
        uncharge(d, size);
    else
        tab_put(kind, key, size, d);
    return rc;
}

/* Every create path charges before the driver call (charge()); after it, alloc_end commits the
 * object to the table when the driver made it (rc success, an object to record: `made`, `key`)
 * on a device of the claim, and otherwise returns the charge. */
static CUresult alloc_end(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d)
{
    if (rc == CUDA_SUCCESS && d >= 0 && made)
        tab_put(kind, key, size, d);
    else
        uncharge(d, size);
    return rc;
}

/* Paths that charge an estimate first (pitch, arrays): once the object exists, settle the charge
 * to the driver's figure `actual`. 0: `actual` is charged; -1: the difference does not fit and
 * nothing is charged any more (the caller destroys the object and refuses). */
static int settle(int d, uint64_t est, uint64_t actual)
{
    if (actual > est && charge(d, actual - est)) {
        uncharge(d, est);
        return -1;
    }
    if (actual < est)
        uncharge(d, est - actual);
    return 0;
}
/* ------------------------------------------------------------------ memory info */

VGPU_API CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    BROKEN_GUARD();
    size_t f = 0, t = 0;
    CUresult rc = REAL(H_GETINFO, CUresult(*)(size_t *, size_t *))(free_b ? &f : NULL, total_b ? &t : NULL);
    if (rc != CUDA_SUCCESS || mode() != M_LIMITED) {
        if (rc == CUDA_SUCCESS) {
            if (free_b) *free_b = f;
            if (total_b) *total_b = t;
        }
        return rc;
    }
    int d = vgpu_cur_dev();
    uint64_t lim = d >= 0 ? vgpu.region.r->dev[d].limit : 0;
    if (lim) {
        vgpu_reconcile(d, 0);
        uint64_t phys = total_b ? t : vgpu.cuda_total[d];
        uint64_t T = phys && phys < lim ? phys : lim;
        uint64_t used = vgpu_region_used(vgpu.region.r, d);
        uint64_t F = used >= T ? 0 : T - used;
        if (free_b && F > f)
            F = f;
        f = F, t = T;
    }
    if (free_b) *free_b = f;
    if (total_b) *total_b = t;
    return rc;
}

VGPU_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_TOTALMEM, CUresult(*)(size_t *, CUdevice))(bytes, dev);
    if (rc == CUDA_SUCCESS && bytes && mode() == M_LIMITED) {
        int d = vgpu_map_cuda_device(dev);
        uint64_t lim = d >= 0 ? vgpu.region.r->dev[d].limit : 0;
        if (lim && lim < *bytes)
            *bytes = lim;
    }
    return rc;
}
/* ------------------------------------------------------------------ linear allocations */

VGPU_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    BROKEN_GUARD();
    CUresult (*real)(CUdeviceptr *, size_t) = REAL(H_ALLOC, CUresult(*)(CUdeviceptr *, size_t));
    if (mode() != M_LIMITED)
        return real(dptr, size);
    int d = vgpu_cur_dev();
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size);
    return alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags)
{
    BROKEN_GUARD();
    CUresult (*real)(CUdeviceptr *, size_t, unsigned) = REAL(H_MANAGED, CUresult(*)(CUdeviceptr *, size_t, unsigned));
    if (mode() != M_LIMITED)
        return real(dptr, size, flags);
    int d = vgpu_cur_dev();
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, flags);
    return alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                     unsigned elem)
{
    BROKEN_GUARD();
    CUresult (*real)(CUdeviceptr *, size_t *, size_t, size_t, unsigned) =
        REAL(H_PITCH, CUresult(*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned));
    if (mode() != M_LIMITED)
        return real(dptr, pitch, width, height, elem);
    int d = vgpu_cur_dev();
    uint64_t est = ((width + 511) & ~(size_t)511) * (uint64_t)height;
    if (charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, pitch, width, height, elem);
    if (rc != CUDA_SUCCESS || d < 0 || !dptr || !pitch) {
        uncharge(d, est);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (settle(d, est, actual)) {
        REAL(H_FREE, CUresult(*)(CUdeviceptr))(*dptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tab_put(K_PTR, *dptr, actual, d);
    return rc;
}

VGPU_API CUresult cuMemFree_v2(CUdeviceptr p)
{
    BROKEN_GUARD();
    CUresult (*real)(CUdeviceptr) = REAL(H_FREE, CUresult(*)(CUdeviceptr));
    uint64_t size;
    int d;
    if (!release_begin(K_PTR, p, &size, &d))
        return real(p);
    return release_end(real(p), K_PTR, p, size, d);
}

/* The CUDA < 3.2 ABI (32-bit sizes and pointers), still reachable through cuGetProcAddress
 * with an old cudaVersion: limited too, so it is no way around the quota. */
VGPU_API CUresult cuMemAlloc(unsigned *dptr, unsigned size)
{
    BROKEN_GUARD();
    CUresult (*real)(unsigned *, unsigned) = REAL(H_ALLOC_V1, CUresult(*)(unsigned *, unsigned));
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED)
        return real(dptr, size);
    int d = vgpu_cur_dev();
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size);
    return alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemFree(unsigned p)
{
    BROKEN_GUARD();
    CUresult (*real)(unsigned) = REAL(H_FREE_V1, CUresult(*)(unsigned));
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    uint64_t size;
    int d;
    if (!release_begin(K_PTR, p, &size, &d))
        return real(p);
    return release_end(real(p), K_PTR, p, size, d);
}

/* ------------------------------------------------------------------ stream-ordered */

/* 1 when s is capturing a graph: an allocation there is not made now but becomes a memory node
 * of the graph (stream capture), which the graph's launch charges (see "graph memory"). */
static int capturing(CUstream s)
{
    CUresult (*is_cap)(CUstream, int *) = vgpu_cuda_drv()->stream_is_capturing;
    int st = 0;
    return is_cap && is_cap(s, &st) == CUDA_SUCCESS && st == CU_STREAM_CAPTURE_STATUS_ACTIVE;
}

static CUresult alloc_async(int idx, CUdeviceptr *dptr, size_t size, CUstream s)
{
    CUresult (*real)(CUdeviceptr *, size_t, CUstream) = REAL(idx, CUresult(*)(CUdeviceptr *, size_t, CUstream));
    if (mode() != M_LIMITED)
        return real(dptr, size, s);
    if (capturing(s))
        return real(dptr, size, s); /* a graph memory node: charged when its graph is launched */
    int d = vgpu_cur_dev();
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, s);
    return alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s)
{
    BROKEN_GUARD();
    return alloc_async(H_ASYNC, dptr, size, s);
}

VGPU_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s)
{
    BROKEN_GUARD();
    return alloc_async(H_ASYNC_PTSZ, dptr, size, s);
}

static CUresult alloc_pool(int idx, CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream) =
        REAL(idx, CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream));
    if (mode() != M_LIMITED)
        return real(dptr, size, pool, s);
    if (capturing(s))
        return real(dptr, size, pool, s); /* a graph memory node: charged at the graph's launch */
    int d = vgpu_cur_dev(); /* policy: the pool is charged to the current context's device */
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, pool, s);
    return alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    BROKEN_GUARD();
    return alloc_pool(H_POOL, dptr, size, pool, s);
}

VGPU_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    BROKEN_GUARD();
    return alloc_pool(H_POOL_PTSZ, dptr, size, pool, s);
}

static CUresult free_async(int idx, CUdeviceptr p, CUstream s)
{
    CUresult (*real)(CUdeviceptr, CUstream) = REAL(idx, CUresult(*)(CUdeviceptr, CUstream));
    uint64_t size;
    int d;
    if (!release_begin(K_PTR, p, &size, &d))
        return real(p, s);
    /* uncharged at once: the pool keeps the pages for reuse; NVML reconciliation sees them */
    return release_end(real(p, s), K_PTR, p, size, d);
}

VGPU_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    BROKEN_GUARD();
    return free_async(H_FREEASYNC, p, s);
}

VGPU_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    BROKEN_GUARD();
    return free_async(H_FREEASYNC_PTSZ, p, s);
}

/* ------------------------------------------------------------------ virtual memory (VMM) */

VGPU_API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                              unsigned long long flags)
{
    BROKEN_GUARD();
    CUresult (*real)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long) =
        REAL(H_CREATE, CUresult(*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long));
    if (mode() != M_LIMITED || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(h, size, prop, flags);
    int d = vgpu_map_cuda_device(prop->location.id);
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(h, size, prop, flags);
    return alloc_end(rc, h != NULL, K_HANDLE, rc == CUDA_SUCCESS && h ? *h : 0, size, d);
}

VGPU_API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    BROKEN_GUARD();
    CUresult (*real)(CUmemGenericAllocationHandle) = REAL(H_RELEASE, CUresult(*)(CUmemGenericAllocationHandle));
    uint64_t size;
    int d;
    if (!release_begin(K_HANDLE, h, &size, &d))
        return real(h);
    return release_end(real(h), K_HANDLE, h, size, d);
}

/* ------------------------------------------------------------------ arrays */

static uint64_t elem_bytes(int fmt)
{
    switch (fmt) {
    case 0x01: case 0x08: return 1;              /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;   /* INT16, HALF */
    default: return 4;                           /* INT32, FLOAT, others: corrected below */
    }
}

static uint64_t array_est(size_t w, size_t h, size_t dpt, int fmt, unsigned ch)
{
    return (uint64_t)w * (h ? h : 1) * (dpt ? dpt : 1) * elem_bytes(fmt) * (ch ? ch : 1);
}

/* After the driver call of an array path that charged the estimate `est`: on success (`arr` the
 * array made, NULL when the caller passed no out-pointer), settle the charge to the driver's own
 * figure (cu*GetMemoryRequirements on the current context's device; the estimate when it has
 * none) and record the array; when that does not fit, the array is destroyed again and the call
 * refused. On failure, the charge returns. */
static CUresult array_end(CUresult rc, int kind, void *arr, int made, uint64_t est, int d)
{
    if (rc != CUDA_SUCCESS || d < 0 || !made) {
        uncharge(d, est);
        return rc;
    }
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*q)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice) =
        kind == K_MIPMAP ? drv->mipmap_mem_req : drv->array_mem_req;
    CUdevice dev = 0;
    if (drv->ctx_get_device)
        drv->ctx_get_device(&dev);
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    uint64_t actual = est;
    if (q && q(&req, arr, dev) == CUDA_SUCCESS && req.size)
        actual = req.size;
    if (settle(d, est, actual)) {
        if (kind == K_MIPMAP)
            REAL(H_MIPMAPDESTROY, CUresult(*)(CUmipmappedArray))(arr);
        else
            REAL(H_ARRAYDESTROY, CUresult(*)(CUarray))(arr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tab_put(kind, (uint64_t)(uintptr_t)arr, actual, d);
    return rc;
}

static CUresult array_common(CUarray *arr, const void *desc, int three_d)
{
    int idx = three_d ? H_ARRAY3D : H_ARRAY;
    CUresult (*real)(CUarray *, const void *) = REAL(idx, CUresult(*)(CUarray *, const void *));
    if (mode() != M_LIMITED || !desc)
        return real(arr, desc);
    uint64_t est;
    if (three_d) {
        const CUDA_ARRAY3D_DESCRIPTOR *a = desc;
        est = array_est(a->Width, a->Height, a->Depth, a->Format, a->NumChannels);
    } else {
        const CUDA_ARRAY_DESCRIPTOR *a = desc;
        est = array_est(a->Width, a->Height, 1, a->Format, a->NumChannels);
    }
    int d = vgpu_cur_dev();
    if (charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(arr, desc);
    return array_end(rc, K_ARRAY, rc == CUDA_SUCCESS && arr ? (void *)*arr : NULL, arr != NULL, est, d);
}

VGPU_API CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    BROKEN_GUARD();
    return array_common(arr, desc, 0);
}

VGPU_API CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    BROKEN_GUARD();
    return array_common(arr, desc, 1);
}

VGPU_API CUresult cuArrayDestroy(CUarray arr)
{
    BROKEN_GUARD();
    CUresult (*real)(CUarray) = REAL(H_ARRAYDESTROY, CUresult(*)(CUarray));
    uint64_t size;
    int d;
    if (!release_begin(K_ARRAY, (uint64_t)(uintptr_t)arr, &size, &d))
        return real(arr);
    return release_end(real(arr), K_ARRAY, (uint64_t)(uintptr_t)arr, size, d);
}

VGPU_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                         unsigned levels)
{
    BROKEN_GUARD();
    CUresult (*real)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned) =
        REAL(H_MIPMAP, CUresult(*)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned));
    if (mode() != M_LIMITED || !desc)
        return real(arr, desc, levels);
    uint64_t base = array_est(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels);
    uint64_t est = levels > 1 ? base * 2 : base; /* upper bound of the level sum */
    int d = vgpu_cur_dev();
    if (charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(arr, desc, levels);
    return array_end(rc, K_MIPMAP, rc == CUDA_SUCCESS && arr ? (void *)*arr : NULL, arr != NULL, est, d);
}

VGPU_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr)
{
    BROKEN_GUARD();
    CUresult (*real)(CUmipmappedArray) = REAL(H_MIPMAPDESTROY, CUresult(*)(CUmipmappedArray));
    uint64_t size;
    int d;
    if (!release_begin(K_MIPMAP, (uint64_t)(uintptr_t)arr, &size, &d))
        return real(arr);
    return release_end(real(arr), K_MIPMAP, (uint64_t)(uintptr_t)arr, size, d);
}

/* ------------------------------------------------------------------ graph memory */

/* Graph memory nodes (cuGraphAddMemAllocNode, cudaGraphAddMemAllocNode, or cuMemAllocAsync in a
 * capturing stream) are not allocations the hooks see: the driver reserves their memory in the
 * graph pool at the executable graph's first launch (or cuGraphUpload). So at instantiation the
 * graph is walked (child graphs too) and the bytes of its memory nodes are recorded per card
 * (K_GPEND); the first launch or upload charges them before the driver is asked and is refused
 * with CUDA_ERROR_OUT_OF_MEMORY when they do not fit; the charge (K_GCHG) lasts until
 * cuGraphExecDestroy. Policy: every executable graph is charged its own nodes in full, although
 * the driver may let graphs share physical pages (safe side: never under the real use). */

static void graph_walk(CUgraph g, uint64_t *per_dev, int depth)
{
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*nodes)(CUgraph, CUgraphNode *, size_t *) = (CUresult(*)(CUgraph, CUgraphNode *, size_t *))drv->graph_get_nodes;
    CUresult (*type)(CUgraphNode, int *) = (CUresult(*)(CUgraphNode, int *))drv->graph_node_type;
    CUresult (*params)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *) =
        (CUresult(*)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *))drv->graph_mem_alloc_params;
    CUresult (*child)(CUgraphNode, CUgraph *) = (CUresult(*)(CUgraphNode, CUgraph *))drv->graph_child_graph;
    size_t n = 0;
    if (!nodes || !type || !g || depth > 8 || nodes(g, NULL, &n) != CUDA_SUCCESS || !n)
        return;
    CUgraphNode *v = calloc(n, sizeof *v);
    if (!v || nodes(g, v, &n) != CUDA_SUCCESS) {
        free(v);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        int t = -1;
        if (type(v[i], &t) != CUDA_SUCCESS)
            continue;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraph sub;
        if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC && params) {
            memset(&p, 0, sizeof p);
            if (params(v[i], &p) != CUDA_SUCCESS || p.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
                continue;
            int d = vgpu_map_cuda_device(p.poolProps.location.id);
            if (d >= 0)
                per_dev[d] += p.bytesize;
        } else if (t == CU_GRAPH_NODE_TYPE_GRAPH && child && child(v[i], &sub) == CUDA_SUCCESS) {
            graph_walk(sub, per_dev, depth + 1);
        }
    }
    free(v);
}

static void graph_record(CUgraphExec e, CUgraph g)
{
    uint64_t per_dev[VGPU_MAX_DEV] = {0};
    graph_walk(g, per_dev, 0);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (per_dev[d]) {
            tab_put(K_GPEND + d, (uint64_t)(uintptr_t)e, per_dev[d], d);
            vgpu_log(3, "graph exec %p: %llu MiB of memory nodes on device %d", (void *)e,
                     (unsigned long long)(per_dev[d] >> 20), d);
        }
}

/* Charge the pending graph memory of e (first launch or upload). 0 ok (or nothing pending),
 * -1 refused: nothing is charged and it stays pending. */
static int graph_reserve(CUgraphExec e)
{
    uint64_t key = (uint64_t)(uintptr_t)e, size[VGPU_MAX_DEV] = {0};
    int dev, got = 0;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (tab_take(K_GPEND + d, key, &size[d], &dev))
            got = 1;
    if (!got)
        return 0;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++) {
        if (!size[d] || charge(d, size[d]) == 0)
            continue;
        vgpu_log(1, "device %d: graph launch refused: its memory nodes need %llu MiB, %llu of %llu MiB "
                    "are charged", d, (unsigned long long)(size[d] >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        for (int k = 0; k < d; k++)
            if (size[k])
                uncharge(k, size[k]);
        for (int k = 0; k < vgpu.cfg.ndev && k < VGPU_MAX_DEV; k++)
            if (size[k])
                tab_put(K_GPEND + k, key, size[k], k);
        return -1;
    }
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (size[d])
            tab_put(K_GCHG + d, key, size[d], d);
    return 0;
}

/* A launch or upload that failed after graph_reserve: the charge goes back to pending. */
static void graph_unreserve(CUgraphExec e)
{
    uint64_t key = (uint64_t)(uintptr_t)e, size;
    int dev;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (tab_take(K_GCHG + d, key, &size, &dev)) {
            uncharge(d, size);
            tab_put(K_GPEND + d, key, size, d);
        }
}

CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s)
{
    CUresult (*real)(CUgraphExec, CUstream) = REAL(idx, CUresult(*)(CUgraphExec, CUstream));
    /* A graph launch while the container is already over its limit is refused; the memory
     * nodes recorded at instantiation are charged at the first launch (graph_reserve), and
     * whatever else the launch makes the driver reserve is reconciled right after it. */
    int d = vgpu_cur_dev();
    if (d >= 0 && vgpu.region.r->dev[d].limit) {
        vgpu_reconcile(d, 0);
        if (vgpu_region_used(vgpu.region.r, d) > vgpu.region.r->dev[d].limit)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (graph_reserve(g))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t seen_size;
    int seen_dev, first = !tab_take(K_GRAPH, (uint64_t)(uintptr_t)g, &seen_size, &seen_dev);
    tab_put(K_GRAPH, (uint64_t)(uintptr_t)g, 0, d);
    CUresult rc = real(g, s);
    if (rc != CUDA_SUCCESS && first) {
        graph_unreserve(g);
        tab_take(K_GRAPH, (uint64_t)(uintptr_t)g, &seen_size, &seen_dev);
    }
    if (rc == CUDA_SUCCESS && first && d >= 0)
        vgpu_reconcile(d, 1);
    return rc;
}

typedef CUresult (*inst_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);

/* After every instantiation: the new exec's memory nodes become pending charges. */
static CUresult graph_instantiated(CUresult rc, CUgraphExec *e, CUgraph g)
{
    if (rc == CUDA_SUCCESS && e && mode() == M_LIMITED)
        graph_record(*e, g);
    return rc;
}

VGPU_API CUresult cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_GINST, inst_fn)(e, g, err, log, n);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_GINST_V2, inst_fn)(e, g, err, log, n);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_GINST_FLAGS, CUresult(*)(CUgraphExec *, CUgraph, unsigned long long))(e, g, flags);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, void *params)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_GINST_PARAMS, CUresult(*)(CUgraphExec *, CUgraph, void *))(e, g, params);
    return graph_instantiated(rc, e, g);
}

static CUresult graph_upload(int idx, CUgraphExec e, CUstream s)
{
    CUresult (*real)(CUgraphExec, CUstream) = REAL(idx, CUresult(*)(CUgraphExec, CUstream));
    if (mode() != M_LIMITED)
        return real(e, s);
    if (graph_reserve(e))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(e, s);
    if (rc != CUDA_SUCCESS)
        graph_unreserve(e);
    return rc;
}

VGPU_API CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    BROKEN_GUARD();
    return graph_upload(H_GUPLOAD, e, s);
}

VGPU_API CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    BROKEN_GUARD();
    return graph_upload(H_GUPLOAD_PTSZ, e, s);
}

VGPU_API CUresult cuGraphExecDestroy(CUgraphExec e)
{
    BROKEN_GUARD();
    CUresult rc = REAL(H_GEXEC_DESTROY, CUresult(*)(CUgraphExec))(e);
    if (rc != CUDA_SUCCESS || mode() != M_LIMITED)
        return rc;
    uint64_t key = (uint64_t)(uintptr_t)e, size;
    int dev;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++) {
        if (tab_take(K_GCHG + d, key, &size, &dev))
            uncharge(d, size); /* a pool the driver keeps cached is reconciled from NVML */
        tab_take(K_GPEND + d, key, &size, &dev);
    }
    tab_take(K_GRAPH, key, &size, &dev);
    return rc;
}

/* ------------------------------------------------------------------ contexts */

/* A context costs device memory (a few hundred MiB on a large card: the context itself, local
 * memory for every resident thread, the printf FIFO, the malloc heap) that no allocation hook
 * sees. Every context this process creates (cuCtxCreate*, the first cuDevicePrimaryCtxRetain
 * of a card) is charged: before the driver is asked, the per-context charge learnt from this
 * process's first context on that card (0 before one was measured), refused when it does not
 * fit; after it, settled to what NVML shows the creation took (the process's usage after minus
 * before), refused (the context destroyed again) when that does not fit. The charge is part of
 * the counted allocations, so reconciliation does not charge the context a second time. */

static int ctx_begin(int d, uint64_t *est, uint64_t *before)
{
    *est = 0, *before = 0;
    if (d == -1)
        return 0;
    if (d == -2) {
        vgpu_log(1, "context on a device outside the claim refused");
        return -1;
    }
    int found = 0;
    vgpu_ensure_slot();
    *before = vgpu_nvml_process_used(d, &found);
    *est = __atomic_load_n(&vgpu.ctx_learnt[d], __ATOMIC_RELAXED);
    if (charge(d, *est)) {
        vgpu_log(1, "device %d: context refused: a context takes about %llu MiB, %llu of %llu MiB are "
                    "charged", d, (unsigned long long)(*est >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return -1;
    }
    return 0;
}

/* After the driver made the context: settle the charge to NVML's figure. 0 ok with the bytes
 * charged in *charged; -1: it does not fit (nothing is charged any more). */
static int ctx_end(int d, uint64_t est, uint64_t before, uint64_t *charged)
{
    *charged = est;
    if (d < 0)
        return 0;
    int found = 0;
    uint64_t after = vgpu_nvml_process_used(d, &found);
    if (!found || after <= before)
        return 0;
    uint64_t took = after - before;
    uint64_t zero = 0;
    __atomic_compare_exchange_n(&vgpu.ctx_learnt[d], &zero, took, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    /* reserve, not charge(): a reconciliation now would see the new context in NVML before it
     * is counted and charge it twice */
    if (took > est && vgpu_region_reserve(&vgpu.region, d, took - est)) {
        uncharge(d, est);
        vgpu_log(1, "device %d: context refused: it took %llu MiB, %llu of %llu MiB are charged", d,
                 (unsigned long long)(took >> 20), (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return -1;
    }
    if (took < est)
        uncharge(d, est - took);
    *charged = took;
    return 0;
}

static CUresult ctx_destroy_real(CUcontext c)
{
    return REAL(H_CTX_DESTROY, CUresult(*)(CUcontext))(c);
}

/* Charges held for context c (the context itself and its limits) leave with it. */
static void ctx_forget(CUcontext c)
{
    uint64_t key = (uint64_t)(uintptr_t)c, size;
    int d;
    if (tab_take(K_CTX, key, &size, &d))
        uncharge(d, size);
    for (int l = 0; l < 3; l++) {
        if (tab_take(K_LIM + l, key, &size, &d))
            uncharge(d, size);
        tab_take(K_LIMBASE + l, key, &size, &d);
    }
}

/* After the driver call that makes a context (charged `est` by ctx_begin): on success, settle the
 * charge to NVML's figure (ctx_end) and record it; when that does not fit, the context is undone
 * (destroyed, or for a primary one released) and the call refused. On failure, the charge
 * returns. */
static CUresult ctx_commit(CUresult rc, CUcontext *pctx, int d, uint64_t est, uint64_t before, CUdevice dev,
                           int primary)
{
    if (rc != CUDA_SUCCESS || !pctx) {
        uncharge(d, est);
        return rc;
    }
    uint64_t got;
    if (ctx_end(d, est, before, &got)) {
        CUresult (*rel)(CUdevice) = vgpu_cuda_drv()->primary_ctx_release;
        if (!primary)
            ctx_destroy_real(*pctx);
        else if (rel)
            rel(dev);
        *pctx = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (d >= 0)
        tab_put(K_CTX, (uint64_t)(uintptr_t)*pctx, got, d);
    return rc;
}

VGPU_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    CUresult (*real)(CUcontext *, unsigned, CUdevice) = REAL(H_CTX_CREATE, CUresult(*)(CUcontext *, unsigned, CUdevice));
    if (mode() != M_LIMITED)
        return real(pctx, flags, dev);
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return ctx_commit(real(pctx, flags, dev), pctx, d, est, before, dev, 0);
}

VGPU_API CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    CUresult (*real)(CUcontext *, void *, int, unsigned, CUdevice) =
        REAL(H_CTX_CREATE_V3, CUresult(*)(CUcontext *, void *, int, unsigned, CUdevice));
    if (mode() != M_LIMITED)
        return real(pctx, params, n, flags, dev);
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return ctx_commit(real(pctx, params, n, flags, dev), pctx, d, est, before, dev, 0);
}

VGPU_API CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    CUresult (*real)(CUcontext *, void *, unsigned, CUdevice) =
        REAL(H_CTX_CREATE_V4, CUresult(*)(CUcontext *, void *, unsigned, CUdevice));
    if (mode() != M_LIMITED)
        return real(pctx, params, flags, dev);
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return ctx_commit(real(pctx, params, flags, dev), pctx, d, est, before, dev, 0);
}

VGPU_API CUresult cuCtxDestroy_v2(CUcontext c)
{
    BROKEN_GUARD();
    CUresult rc = ctx_destroy_real(c);
    if (rc == CUDA_SUCCESS && mode() == M_LIMITED)
        ctx_forget(c);
    return rc;
}

/* The primary context of a card is charged once per process, at its first retain (policy: it
 * stays charged until the process exits; a released primary context is cheap to retain again
 * and the driver may keep it). */
VGPU_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    BROKEN_GUARD();
    CUresult (*real)(CUcontext *, CUdevice) = REAL(H_PRIMARY_RETAIN, CUresult(*)(CUcontext *, CUdevice));
    if (mode() != M_LIMITED || dev < 0 || dev >= VGPU_MAX_DEV ||
        __atomic_load_n(&vgpu.primary_charged[dev], __ATOMIC_ACQUIRE))
        return real(pctx, dev);
    pthread_mutex_lock(&primary_mu);
    if (vgpu.primary_charged[dev]) {
        pthread_mutex_unlock(&primary_mu);
        return real(pctx, dev);
    }
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before)) {
        pthread_mutex_unlock(&primary_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = ctx_commit(real(pctx, dev), pctx, d, est, before, dev, 1);
    if (rc == CUDA_SUCCESS && pctx)
        __atomic_store_n(&vgpu.primary_charged[dev], 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

/* cuCtxSetLimit: the malloc heap (device malloc), the printf FIFO and the per-thread stack are
 * device memory of the context. Raising one above the driver's value at our first look (its
 * default, part of the context's measured size) is charged before the driver is asked: the
 * heap and FIFO by their size, the stack by size x resident threads of the card (SMs x threads
 * per SM); refused with CUDA_ERROR_OUT_OF_MEMORY when it does not fit. Lowering it returns the
 * charge. (Policy: charged at the call, although the driver may reserve the heap only at the
 * first launch of a kernel that uses it.) */
VGPU_API CUresult cuCtxSetLimit(int limit, size_t value)
{
    BROKEN_GUARD();
    CUresult (*real)(int, size_t) = REAL(H_CTX_SET_LIMIT, CUresult(*)(int, size_t));
    if (mode() != M_LIMITED || limit < CU_LIMIT_STACK_SIZE || limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return real(limit, value);
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*get_limit)(size_t *, int) = drv->ctx_get_limit;
    CUresult (*get_ctx)(CUcontext *) = drv->ctx_get_current;
    CUresult (*get_dev)(CUdevice *) = drv->ctx_get_device;
    CUcontext c = NULL;
    CUdevice dev = 0;
    int d = vgpu_cur_dev();
    if (d < 0 || !get_limit || !get_ctx || get_ctx(&c) != CUDA_SUCCESS || !c || !get_dev ||
        get_dev(&dev) != CUDA_SUCCESS)
        return d == -2 ? CUDA_ERROR_OUT_OF_MEMORY : real(limit, value);
    uint64_t key = (uint64_t)(uintptr_t)c, base, old = 0, per = 1;
    int bd;
    if (!tab_take(K_LIMBASE + limit, key, &base, &bd)) {
        size_t cur = 0;
        base = get_limit(&cur, limit) == CUDA_SUCCESS ? cur : 0;
    }
    tab_put(K_LIMBASE + limit, key, base, d);
    if (limit == CU_LIMIT_STACK_SIZE) {
        CUresult (*attr)(int *, int, CUdevice) = drv->device_get_attribute;
        int sms = 0, threads = 0;
        if (attr && attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) == CUDA_SUCCESS &&
            attr(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) == CUDA_SUCCESS &&
            sms > 0 && threads > 0)
            per = (uint64_t)sms * (uint64_t)threads;
        else
            per = 2048ull * 256ull; /* unknown card: a large one */
    }
    uint64_t want = value > base ? (value - base) * per : 0;
    int had = tab_take(K_LIM + limit, key, &old, &bd);
    if (want > old && charge(d, want - old)) {
        if (had)
            tab_put(K_LIM + limit, key, old, d);
        vgpu_log(1, "device %d: cuCtxSetLimit(%d, %zu) refused: %llu MiB more do not fit, %llu of %llu "
                    "MiB are charged", d, limit, value, (unsigned long long)((want - old) >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real(limit, value);
    uint64_t keep = rc == CUDA_SUCCESS ? want : old;
    if (rc == CUDA_SUCCESS && want < old)
        uncharge(d, old - want);
    if (rc != CUDA_SUCCESS && want > old)
        uncharge(d, want - old);
    if (keep)
        tab_put(K_LIM + limit, key, keep, d);
    return rc;
}

/* ------------------------------------------------------------------ ACTIVE_OOM_KILLER */

/* What the shim cannot refuse (memory NVML shows and no hook saw: device malloc beyond what was
 * charged, lazily loaded modules, library workspaces, pool caches) can still take the container
 * over its limit. With ACTIVE_OOM_KILLER=true, a reconciliation that finds the container over its
 * limit by more than the allocator's rounding between two reconciliations (1 % of the limit,
 * at least 8 MiB) ends the process with the most memory on that card in the container (itself,
 * or a sibling: same PID namespace, checked against its start time), with SIGKILL, logged and
 * counted in the region (the node agent reports it: a pod Event and a metric). */
void vgpu_oom_check(int d)
{
    if (!vgpu.cfg.oom_killer || d < 0 || !vgpu.region.r)
        return;
    struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[d].limit;
    if (!lim || vgpu_region_used(r, d) <= lim)
        return;
    uint64_t slack = lim / 100 > 8 * VGPU_MIB ? lim / 100 : 8 * VGPU_MIB, bytes = 0, start = 0;
    int32_t pid = 0;
    if (vgpu_region_oom_victim(r, d, slack, &pid, &start, &bytes) != 1)
        return;
    uint64_t used = vgpu_region_used(r, d);
    int self = pid == (int32_t)getpid();
    vgpu_log(0, "device %d: the container is over its memory limit (%llu of %llu MiB charged, memory "
                "the shim could not refuse); ACTIVE_OOM_KILLER: killing %sPID %d, which holds %llu MiB",
             d, (unsigned long long)(used >> 20), (unsigned long long)(lim >> 20), self ? "this process, " : "",
             (int)pid, (unsigned long long)(bytes >> 20));
    if (!self && vgpu_proc_start_time(pid) != start)
        return; /* gone meanwhile: its slot is reaped, the charge returns */
    vgpu_region_oom_record(r, d, pid, bytes);
    if (self) {
        raise(SIGKILL);
        return;
    }
    if (kill(pid, SIGKILL) != 0) {
        vgpu_log(0, "device %d: could not kill PID %d: %m (the node agent's check is the backstop)", d,
                 (int)pid);
        return;
    }
    /* The caller is usually an allocation that would otherwise be refused: give the victim up
     * to 100 ms to go, then return its charge (its slot is reaped once it is gone). */
    for (uint64_t t = 0; t < VGPU_OOM_GRACE_NS && vgpu_proc_start_time(pid) == start;
         t += VGPU_OOM_POLL_US * 1000ull)
        usleep(VGPU_OOM_POLL_US);
    vgpu_region_reap(r);
}
