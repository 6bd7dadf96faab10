/*
 * vgpu_cuda_mem.c - CUDA driver API memory hooks: memory info, and the linear, stream-ordered
 * and virtual-memory allocation paths. Arrays, graph memory and contexts have their own units,
 * the allocation table and charging theirs (vgpu_mem.h lists them); the rule below is all of
 * theirs.
 *
 * Accounting rule (per device of the claim, in bytes): every allocation is reserved in the
 * shared region *before* the driver is asked (vgpu_region_reserve: atomic against all the
 * container's processes), then committed to a per-process table (pointer/handle -> bytes,
 * device) or rolled back if the driver fails. Frees look the table up; a pointer that is
 * not in it is passed through untouched (never an error). Paths and the amount charged:
 *
 *   cuMemAlloc_v2: the size asked, on the current context's card
 *   cuMemAllocAsync(_ptsz), cuMemAllocFromPoolAsync(_ptsz): the size asked, on the card of the
 *       stream's context or of the pool (pool_dev below; a host pool: the stream's card)
 *   cuMemAllocPitch_v2: pitch returned by the driver x height (estimate reserved first)
 *   the CUDA < 3.2 entry points (32-bit: cuMemAlloc, cuMemAllocPitch, cuArrayCreate,
 *       cuArray3DCreate, cuCtxCreate; a program reaches them through cuGetProcAddress with an
 *       old cudaVersion): charged as their v2 forms; cuMemGetInfo and cuDeviceTotalMem v1
 *       report the v2 figures cut to 4 GiB - 1
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
#include "vgpu_mem.h"

/* ------------------------------------------------------------------ memory info */

VGPU_API CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    BROKEN_GUARD();
    size_t f = 0, t = 0;
    CUresult rc = REAL_FN(cuMemGetInfo_v2)(free_b ? &f : NULL, total_b ? &t : NULL);
    if (rc != CUDA_SUCCESS || mode() != M_LIMITED) {
        if (rc == CUDA_SUCCESS) {
            if (free_b) *free_b = f;
            if (total_b) *total_b = t;
        }
        return rc;
    }
    vgpu_vmm_settle(); /* sparse-array unmaps the GPU has done since */
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
    CUresult rc = REAL_FN(cuDeviceTotalMem_v2)(bytes, dev);
    if (rc == CUDA_SUCCESS && bytes && mode() == M_LIMITED) {
        int d = vgpu_map_cuda_device(dev);
        uint64_t lim = d >= 0 ? vgpu.region.r->dev[d].limit : 0;
        if (lim && lim < *bytes)
            *bytes = lim;
    }
    return rc;
}

/* The CUDA < 3.2 ABI (32-bit sizes): the same figures as the v2 entry points, cut to 4 GiB - 1. */
static unsigned clamp32(size_t v) { return v > 0xffffffffu ? 0xffffffffu : (unsigned)v; }

VGPU_API CUresult cuMemGetInfo(unsigned *free_b, unsigned *total_b)
{
    BROKEN_GUARD();
    if (mode() != M_LIMITED) {
        vgpu_fn_cuMemGetInfo real = REAL_FN(cuMemGetInfo);
        return real ? real(free_b, total_b) : CUDA_ERROR_NOT_FOUND;
    }
    size_t f = 0, t = 0;
    CUresult rc = cuMemGetInfo_v2(free_b ? &f : NULL, total_b ? &t : NULL);
    if (rc == CUDA_SUCCESS) {
        if (free_b) *free_b = clamp32(f);
        if (total_b) *total_b = clamp32(t);
    }
    return rc;
}

VGPU_API CUresult cuDeviceTotalMem(unsigned *bytes, CUdevice dev)
{
    BROKEN_GUARD();
    if (mode() != M_LIMITED) {
        vgpu_fn_cuDeviceTotalMem real = REAL_FN(cuDeviceTotalMem);
        return real ? real(bytes, dev) : CUDA_ERROR_NOT_FOUND;
    }
    size_t t = 0;
    CUresult rc = cuDeviceTotalMem_v2(bytes ? &t : NULL, dev);
    if (rc == CUDA_SUCCESS && bytes)
        *bytes = clamp32(t);
    return rc;
}

/* ------------------------------------------------------------------ linear allocations */

VGPU_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemAlloc_v2 real = REAL_FN(cuMemAlloc_v2);
    if (mode() != M_LIMITED)
        return real(dptr, size);
    int d = vgpu_cur_dev();
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size);
    return vgpu_alloc_end_owned(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemAllocManaged real = REAL_FN(cuMemAllocManaged);
    if (mode() != M_LIMITED)
        return real(dptr, size, flags);
    int d = vgpu_cur_dev();
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, flags);
    /* the context owns it: its end frees it (on the H200, bench/gpu/reset_probe.py) */
    return vgpu_alloc_end_owned(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

/* A pitched allocation's estimate: rows of `width` rounded up to 512 B. */
static uint64_t pitch_est(uint64_t width, uint64_t height) { return ((width + 511) & ~(uint64_t)511) * height; }

/* After a pitched allocation that charged `est` (`made`: it succeeded and gave its pointer and
 * pitch): settle the charge to `actual` = pitch x height and record `ptr`; when that does not fit
 * the memory is freed again (`v1`: through the 32-bit cuMemFree) and the call refused. On failure
 * the charge returns. */
static CUresult pitch_end(CUresult rc, int d, uint64_t est, int made, uint64_t ptr, uint64_t actual, int v1)
{
    if (!made || d < 0) {
        vgpu_uncharge(d, est);
        return rc;
    }
    if (vgpu_settle(d, est, actual)) {
        vgpu_fn_cuMemFree free_v1 = v1 ? REAL_FN(cuMemFree) : NULL;
        if (free_v1)
            free_v1((unsigned)ptr);
        else
            REAL_FN(cuMemFree_v2)(ptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_tab_put_owned(K_PTR, ptr, actual, d);
    return rc;
}

VGPU_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                     unsigned elem)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemAllocPitch_v2 real = REAL_FN(cuMemAllocPitch_v2);
    if (mode() != M_LIMITED)
        return real(dptr, pitch, width, height, elem);
    int d = vgpu_cur_dev();
    uint64_t est = pitch_est(width, height);
    if (vgpu_charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, pitch, width, height, elem);
    int made = rc == CUDA_SUCCESS && dptr && pitch;
    return pitch_end(rc, d, est, made, made ? *dptr : 0, made ? (uint64_t)*pitch * height : 0, 0);
}

VGPU_API CUresult cuMemFree_v2(CUdeviceptr p)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemFree_v2 real = REAL_FN(cuMemFree_v2);
    uint64_t size;
    int d;
    if (!vgpu_release_begin(K_PTR, p, &size, &d))
        return real(p);
    return vgpu_release_end(real(p), K_PTR, p, size, d);
}

/* The CUDA < 3.2 ABI (32-bit sizes and pointers), still reachable through cuGetProcAddress
 * with an old cudaVersion: limited too, so it is no way around the quota. */
VGPU_API CUresult cuMemAlloc(unsigned *dptr, unsigned size)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemAlloc real = REAL_FN(cuMemAlloc);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED)
        return real(dptr, size);
    int d = vgpu_cur_dev();
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size);
    return vgpu_alloc_end_owned(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
}

VGPU_API CUresult cuMemFree(unsigned p)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemFree real = REAL_FN(cuMemFree);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    uint64_t size;
    int d;
    if (!vgpu_release_begin(K_PTR, p, &size, &d))
        return real(p);
    return vgpu_release_end(real(p), K_PTR, p, size, d);
}

VGPU_API CUresult cuMemAllocPitch(unsigned *dptr, unsigned *pitch, unsigned width, unsigned height, unsigned elem)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemAllocPitch real = REAL_FN(cuMemAllocPitch);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED)
        return real(dptr, pitch, width, height, elem);
    int d = vgpu_cur_dev();
    uint64_t est = pitch_est(width, height);
    if (vgpu_charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, pitch, width, height, elem);
    int made = rc == CUDA_SUCCESS && dptr && pitch;
    return pitch_end(rc, d, est, made, made ? *dptr : 0, made ? (uint64_t)*pitch * height : 0, 1);
}

/* ------------------------------------------------------------------ stream-ordered */

/* An allocation into a capturing stream (cap: its capture's id, vgpu_stream_capture_id) is not
 * made now but becomes a memory node of the graph, which the graph's launch charges (see "graph
 * memory"). When the stream is no longer in that capture once the driver returned, another
 * thread ended it between the check and the driver, so the memory may have been made now: it is
 * charged as an allocation of its own to card d_of(s), or freed again and refused when it does
 * not fit. (A program does not race its own capture; one that does pays at worst a node charged
 * as memory.) */
static CUresult captured_end(CUresult rc, CUdeviceptr *dptr, size_t size, CUstream s, uint64_t cap, int d)
{
    if (rc != CUDA_SUCCESS || !dptr || vgpu_stream_capture_id(s) == cap)
        return rc;
    if (vgpu_charge(d, size) == 0)
        return vgpu_alloc_end(rc, 1, K_PTR, *dptr, size, d);
    REAL_FN(cuMemFree_v2)(*dptr);
    vgpu_log(1, "device %d: an allocation of %llu MiB made while its stream's capture ended refused", d,
             (unsigned long long)(size >> 20));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult alloc_async(int idx, CUdeviceptr *dptr, size_t size, CUstream s)
{
    vgpu_fn_cuMemAllocAsync real = REAL(idx, vgpu_fn_cuMemAllocAsync);
    if (mode() != M_LIMITED)
        return real(dptr, size, s);
    uint64_t cap = vgpu_stream_capture_id(s);
    if (cap) {
        CUresult rc = real(dptr, size, s);
        return captured_end(rc, dptr, size, s, cap, rc == CUDA_SUCCESS ? vgpu_stream_dev(s) : -1);
    }
    int d = vgpu_stream_dev(s); /* the pool current to the stream's card */
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, s);
    return vgpu_alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
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

/* Memory pools by location, so an allocation from one is charged where its memory is: a pool
 * made here on a card (cuMemPoolCreate with a device location) or handed out for a card (its
 * default or current pool). Any other pool (a host or managed one, one handed out by a getter the
 * shim does not hook) is charged to the stream's card: no pool is taken to be free of charge, so
 * a pool whose handle a tenant re-labels or re-makes at worst moves a charge between its cards.
 * The driver gets the shim's own copies of the properties and of the handle, so what is recorded
 * is what the driver was asked and gave, whatever another thread writes meanwhile. */
static CUresult pool_note(CUresult rc, CUmemoryPool *out, CUmemoryPool pool, CUdevice ordinal)
{
    if (rc == CUDA_SUCCESS && pool && mode() == M_LIMITED)
        vgpu_tab_put(K_POOL, (uint64_t)(uintptr_t)pool, 0, vgpu_map_cuda_device(ordinal));
    if (rc == CUDA_SUCCESS)
        *out = pool;
    return rc;
}

static int pool_dev(CUmemoryPool pool, CUstream s)
{
    uint64_t v;
    int d;
    return vgpu_tab_get(K_POOL, (uint64_t)(uintptr_t)pool, &v, &d) ? d : vgpu_stream_dev(s);
}

VGPU_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemPoolCreate real = REAL_FN(cuMemPoolCreate);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (!pool || !props)
        return real(pool, props);
    CUmemPoolProps own = *props;
    CUmemoryPool made = NULL;
    CUresult rc = real(&made, &own);
    if (own.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        if (rc == CUDA_SUCCESS)
            *pool = made;
        return rc;
    }
    return pool_note(rc, pool, made, own.location.id);
}

VGPU_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemPoolDestroy real = REAL_FN(cuMemPoolDestroy);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real(pool);
    uint64_t v;
    int d;
    if (rc == CUDA_SUCCESS && mode() == M_LIMITED)
        vgpu_tab_take(K_POOL, (uint64_t)(uintptr_t)pool, &v, &d);
    return rc;
}

/* A card's default or current pool, handed out by `get` (the driver's getter of either). */
static CUresult card_pool(CUresult (*get)(CUmemoryPool *, CUdevice), CUmemoryPool *pool, CUdevice dev)
{
    CUmemoryPool got = NULL;
    if (!pool)
        return get(pool, dev);
    CUresult rc = get(&got, dev);
    return pool_note(rc, pool, got, dev);
}

VGPU_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    BROKEN_GUARD();
    vgpu_fn_cuDeviceGetDefaultMemPool real = REAL_FN(cuDeviceGetDefaultMemPool);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    return card_pool(real, pool, dev);
}

VGPU_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    BROKEN_GUARD();
    vgpu_fn_cuDeviceGetMemPool real = REAL_FN(cuDeviceGetMemPool);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    return card_pool(real, pool, dev);
}

static CUresult alloc_pool(int idx, CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    vgpu_fn_cuMemAllocFromPoolAsync real = REAL(idx, vgpu_fn_cuMemAllocFromPoolAsync);
    if (mode() != M_LIMITED)
        return real(dptr, size, pool, s);
    uint64_t cap = vgpu_stream_capture_id(s);
    if (cap) { /* a graph memory node: charged at the graph's launch */
        CUresult rc = real(dptr, size, pool, s);
        return captured_end(rc, dptr, size, s, cap, rc == CUDA_SUCCESS ? pool_dev(pool, s) : -1);
    }
    int d = pool_dev(pool, s);
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, pool, s);
    return vgpu_alloc_end(rc, dptr != NULL, K_PTR, rc == CUDA_SUCCESS && dptr ? *dptr : 0, size, d);
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
    vgpu_fn_cuMemFreeAsync real = REAL(idx, vgpu_fn_cuMemFreeAsync);
    uint64_t size;
    int d;
    if (!vgpu_release_begin(K_PTR, p, &size, &d))
        return real(p, s);
    /* Into a capturing stream the free is a node of the graph: the memory lives on until (and
     * unless) the graph runs, so it stays charged, also when a capture began on the stream
     * while the driver was asked. Otherwise uncharged at once: the pool keeps the pages for
     * reuse; NVML reconciliation sees them. */
    if (vgpu_stream_capture_id(s)) {
        vgpu_release_end(CUDA_ERROR_NOT_SUPPORTED, K_PTR, p, size, d); /* back in the table */
        return real(p, s);
    }
    CUresult rc = real(p, s);
    int node = rc == CUDA_SUCCESS && vgpu_stream_capture_id(s);
    vgpu_release_end(node ? CUDA_ERROR_NOT_SUPPORTED : rc, K_PTR, p, size, d);
    return rc;
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
