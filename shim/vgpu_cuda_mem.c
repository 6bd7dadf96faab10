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

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ allocation table */

enum { K_PTR = 1, K_HANDLE = 2, K_ARRAY = 3, K_MIPMAP = 4, K_GRAPH = 5, K_TOMB = -1 };
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

void vgpu_cuda_mem_after_fork(void)
{
    /* A thread of the parent may have held any of these at fork time. */
    pthread_mutex_init(&join_mu, NULL);
    pthread_mutex_init(&tab_mu, NULL);
    free(tab);
    tab = NULL, tab_cap = tab_used = 0;
}

/* ------------------------------------------------------------------ charging */

void vgpu_ensure_slot(void)
{
    if (vgpu.region.slot >= 0)
        return;
    pthread_mutex_lock(&join_mu);
    if (vgpu.region.slot < 0) {
        int32_t pid = (int32_t)getpid();
        static int told;
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
    if (rc == CUDA_SUCCESS && d >= 0 && dptr)
        tab_put(K_PTR, *dptr, size, d);
    else
        uncharge(d, size);
    return rc;
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
    if (rc == CUDA_SUCCESS && d >= 0 && dptr)
        tab_put(K_PTR, *dptr, size, d);
    else
        uncharge(d, size);
    return rc;
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
    if (actual > est && charge(d, actual - est)) {
        REAL(H_FREE, CUresult(*)(CUdeviceptr))(*dptr);
        uncharge(d, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < est)
        uncharge(d, est - actual);
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
    if (rc == CUDA_SUCCESS && d >= 0 && dptr)
        tab_put(K_PTR, *dptr, size, d);
    else
        uncharge(d, size);
    return rc;
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

static CUresult alloc_async(int idx, CUdeviceptr *dptr, size_t size, CUstream s)
{
    CUresult (*real)(CUdeviceptr *, size_t, CUstream) = REAL(idx, CUresult(*)(CUdeviceptr *, size_t, CUstream));
    if (mode() != M_LIMITED)
        return real(dptr, size, s);
    int d = vgpu_cur_dev();
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, s);
    if (rc == CUDA_SUCCESS && d >= 0 && dptr)
        tab_put(K_PTR, *dptr, size, d);
    else
        uncharge(d, size);
    return rc;
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
    int d = vgpu_cur_dev(); /* policy: the pool is charged to the current context's device */
    if (charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, pool, s);
    if (rc == CUDA_SUCCESS && d >= 0 && dptr)
        tab_put(K_PTR, *dptr, size, d);
    else
        uncharge(d, size);
    return rc;
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
    if (rc == CUDA_SUCCESS && d >= 0 && h)
        tab_put(K_HANDLE, *h, size, d);
    else
        uncharge(d, size);
    return rc;
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

/* Charge the driver's own figure once the array exists (estimate already reserved). */
static int settle_array(int d, uint64_t est, uint64_t *actual, void *arr, int mip, CUdevice dev)
{
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    CUresult (*q)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice) =
        (CUresult(*)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice))vgpu_cuda_sym(
            mip ? "cuMipmappedArrayGetMemoryRequirements" : "cuArrayGetMemoryRequirements");
    *actual = est;
    if (!q || q(&req, arr, dev) != CUDA_SUCCESS || !req.size)
        return 0;
    if (req.size > est && charge(d, req.size - est))
        return -1;
    if (req.size < est)
        uncharge(d, est - req.size);
    *actual = req.size;
    return 0;
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
    if (rc != CUDA_SUCCESS || d < 0 || !arr) {
        uncharge(d, est);
        return rc;
    }
    CUdevice dev = 0;
    CUresult (*gd)(CUdevice *) = (CUresult(*)(CUdevice *))vgpu_cuda_sym("cuCtxGetDevice");
    if (gd)
        gd(&dev);
    uint64_t actual;
    if (settle_array(d, est, &actual, *arr, 0, dev)) {
        REAL(H_ARRAYDESTROY, CUresult(*)(CUarray))(*arr);
        uncharge(d, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tab_put(K_ARRAY, (uint64_t)(uintptr_t)*arr, actual, d);
    return rc;
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
    if (rc != CUDA_SUCCESS || d < 0 || !arr) {
        uncharge(d, est);
        return rc;
    }
    CUdevice dev = 0;
    CUresult (*gd)(CUdevice *) = (CUresult(*)(CUdevice *))vgpu_cuda_sym("cuCtxGetDevice");
    if (gd)
        gd(&dev);
    uint64_t actual;
    if (settle_array(d, est, &actual, *arr, 1, dev)) {
        REAL(H_MIPMAPDESTROY, CUresult(*)(CUmipmappedArray))(*arr);
        uncharge(d, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tab_put(K_MIPMAP, (uint64_t)(uintptr_t)*arr, actual, d);
    return rc;
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

CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s)
{
    CUresult (*real)(CUgraphExec, CUstream) = REAL(idx, CUresult(*)(CUgraphExec, CUstream));
    /* Graph memory nodes reserve their pool at an executable graph's first launch; NVML
     * reconciliation charges it right after that launch. A graph launch while the container
     * is already over its limit is refused. */
    int d = vgpu_cur_dev();
    if (d < 0 || !vgpu.region.r->dev[d].limit)
        return real(g, s);
    vgpu_reconcile(d, 0);
    if (vgpu_region_used(vgpu.region.r, d) > vgpu.region.r->dev[d].limit)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t seen_size;
    int seen_dev, first = !tab_take(K_GRAPH, (uint64_t)(uintptr_t)g, &seen_size, &seen_dev);
    tab_put(K_GRAPH, (uint64_t)(uintptr_t)g, 0, d);
    CUresult rc = real(g, s);
    if (rc == CUDA_SUCCESS && first)
        vgpu_reconcile(d, 1);
    return rc;
}
