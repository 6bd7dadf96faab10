/*
 * vgpu_mem_vmm.c - virtual memory management (cuMemCreate and its mappings).
 *
 * cuMemCreate charges the handle's bytes before the driver is asked. The driver frees the
 * memory only when the handle's last reference is released (the create's own, one more per
 * cuMemRetainAllocationHandle) AND its last cuMemMap mapping is unmapped, so the charge is
 * returned then, not at the first cuMemRelease: a handle released while still mapped holds
 * its memory (a loop of create, map, release took the whole card within one reconciliation
 * period). Per tracked handle (K_HANDLE in the table) the table keeps its live mappings
 * (K_HMAPS) and references (K_HREFS, absent = the create's one); per mapping its length
 * (K_MAPLEN) and handle (K_MAPH), keyed by its address. A handle mapped into a sparse array
 * (cuMemMapArrayAsync) is held by the array likewise: see "sparse arrays" below. All under
 * vgpu_vmm_mu, cuMemCreate included (a handle is in the table before another thread can map or
 * release it).
 */
#include "vgpu_mem.h"

#include <stdlib.h>
#include <string.h>

/* The table's entry of (kind, key), left in place: 1 with its value, 0 if there is none. */
static int peek(int kind, uint64_t key, uint64_t *v)
{
    int d;
    return vgpu_tab_get(kind, key, v, &d);
}

/* A count of (kind, key) set to n (n == 0 and `drop`: removed). */
static void set_count(int kind, uint64_t key, uint64_t n, int drop)
{
    uint64_t old;
    int od;
    vgpu_tab_take(kind, key, &old, &od);
    if (n || !drop)
        vgpu_tab_put(kind, key, n, 0);
}

static uint64_t refs_of(uint64_t h)
{
    uint64_t r;
    return peek(K_HREFS, h, &r) ? r : 1;
}

/* Counts left for handle value h (none for a handle the driver just made). */
static void forget(uint64_t h)
{
    uint64_t n;
    int d;
    vgpu_tab_take(K_HREFS, h, &n, &d);
    vgpu_tab_take(K_HMAPS, h, &n, &d);
}

/* The handle's memory is gone (no reference, no mapping): its charge returns. */
static void handle_gone(uint64_t h)
{
    uint64_t size;
    int d;
    if (vgpu_release_begin(K_HANDLE, h, &size, &d))
        vgpu_release_end(CUDA_SUCCESS, K_HANDLE, h, size, d);
    forget(h);
}

/* One of handle h's mappings is gone: with its last one and no reference left, its charge. */
static void mapping_gone(uint64_t h)
{
    uint64_t maps;
    if (!peek(K_HMAPS, h, &maps))
        return;
    maps = maps ? maps - 1 : 0;
    if (!maps && !refs_of(h))
        handle_gone(h);
    else
        set_count(K_HMAPS, h, maps, 1);
}

/* A mapping of handle h begins (a handle the shim did not charge: nothing to follow). */
static int mapping_new(uint64_t h)
{
    uint64_t v, maps = 0;
    if (!peek(K_HANDLE, h, &v))
        return 0;
    peek(K_HMAPS, h, &maps);
    set_count(K_HMAPS, h, maps + 1, 0);
    return 1;
}

VGPU_API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                              unsigned long long flags)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemCreate real = REAL_FN(cuMemCreate);
    if (mode() != M_LIMITED || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(h, size, prop, flags);
    int d = vgpu_map_cuda_device(prop->location.id);
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    vgpu_lock(&vgpu_vmm_mu);
    CUresult rc = real(h, size, prop, flags);
    if (rc == CUDA_SUCCESS && h)
        forget(*h); /* a handle value the driver gives again: nothing of the old one applies */
    rc = vgpu_alloc_end(rc, h != NULL, K_HANDLE, rc == CUDA_SUCCESS && h ? *h : 0, size, d);
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

VGPU_API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemRelease real = REAL_FN(cuMemRelease);
    uint64_t v, maps = 0;
    if (mode() != M_LIMITED)
        return real(h);
    vgpu_lock(&vgpu_vmm_mu);
    if (!peek(K_HANDLE, h, &v)) {
        vgpu_unlock(&vgpu_vmm_mu);
        return real(h);
    }
    CUresult rc = real(h);
    if (rc == CUDA_SUCCESS) {
        uint64_t refs = refs_of(h);
        refs = refs ? refs - 1 : 0;
        if (!refs && !(peek(K_HMAPS, h, &maps) && maps))
            handle_gone(h);
        else
            set_count(K_HREFS, h, refs, 0); /* kept for its mappings or other references */
    }
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

VGPU_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemRetainAllocationHandle real = REAL_FN(cuMemRetainAllocationHandle);
    if (mode() != M_LIMITED)
        return real(h, addr);
    vgpu_lock(&vgpu_vmm_mu);
    uint64_t v;
    CUresult rc = real(h, addr);
    if (rc == CUDA_SUCCESS && h && peek(K_HANDLE, *h, &v))
        set_count(K_HREFS, *h, refs_of(*h) + 1, 0);
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

VGPU_API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                           unsigned long long flags)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemMap real = REAL_FN(cuMemMap);
    if (mode() != M_LIMITED)
        return real(va, size, offset, h, flags);
    vgpu_lock(&vgpu_vmm_mu);
    CUresult rc = real(va, size, offset, h, flags);
    if (rc == CUDA_SUCCESS && mapping_new(h)) {
        vgpu_tab_put(K_MAPLEN, va, size, 0); /* replaces what an earlier mapping there left */
        vgpu_tab_put(K_MAPH, va, h, 0);
    }
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

/* The driver unmaps whole mappings: each one in [va, va + size) is walked from va. */
VGPU_API CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemUnmap real = REAL_FN(cuMemUnmap);
    if (mode() != M_LIMITED)
        return real(va, size);
    vgpu_lock(&vgpu_vmm_mu);
    CUresult rc = real(va, size);
    uint64_t at = va, len, h;
    int d;
    while (rc == CUDA_SUCCESS && at < va + size && vgpu_tab_take(K_MAPLEN, at, &len, &d) && len) {
        if (vgpu_tab_take(K_MAPH, at, &h, &d))
            mapping_gone(h);
        at += len;
    }
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

/* ------------------------------------------------------------------ sparse arrays */

/* cuMemMapArrayAsync maps handles into a sparse array's tile ranges or mip tail; the array then
 * holds the handle's memory as a cuMemMap mapping does. Its unmap names the subresource, not the
 * handle, so each such mapping is kept with its whole descriptor: an unmap of exactly that
 * subresource ends it, and so does the array's destruction. An unmap of another extent (part of
 * a mapped range, or several at once) ends nothing: the handle stays charged, at most until the
 * process exits, never less than the driver holds. A call the driver fails may have done some of
 * its operations: its maps count, its unmaps do not. Under vgpu_vmm_mu. */
static CUarrayMapInfo *amap; /* each mapping's operation: its place, and its handle (memHandle) */
static size_t namap, camap;
static _Atomic size_t amap_live; /* namap, read without the lock (array destroys) */

static int same_place(const CUarrayMapInfo *a, const CUarrayMapInfo *b)
{
    if (a->resourceType != b->resourceType || a->resource != b->resource || a->subresourceType != b->subresourceType)
        return 0;
    if (a->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL)
        return a->subresource.miptail.layer == b->subresource.miptail.layer &&
               a->subresource.miptail.offset == b->subresource.miptail.offset &&
               a->subresource.miptail.size == b->subresource.miptail.size;
    return memcmp(a->subresource.sparseLevel, b->subresource.sparseLevel, sizeof a->subresource.sparseLevel) == 0;
}

static void amap_drop(size_t i)
{
    uint64_t h = amap[i].memHandle;
    amap[i] = amap[--namap];
    atomic_store(&amap_live, namap);
    mapping_gone(h);
}

static void array_op(const CUarrayMapInfo *op, int done)
{
    if (op->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP) {
        if (!done)
            return;
        for (size_t i = 0; i < namap; i++)
            if (same_place(&amap[i], op)) {
                amap_drop(i);
                return;
            }
        return;
    }
    if (op->memOperationType != CU_MEM_OPERATION_TYPE_MAP || op->memHandleType != CU_MEM_HANDLE_TYPE_GENERIC ||
        !op->resource || !mapping_new(op->memHandle))
        return;
    if (namap == camap) {
        size_t ncap = camap ? camap * 2 : 64;
        CUarrayMapInfo *n = realloc(amap, ncap * sizeof *n);
        if (!n)
            return; /* counted, never ended: the handle stays charged */
        amap = n, camap = ncap;
    }
    amap[namap++] = *op;
    atomic_store(&amap_live, namap);
}

static CUresult map_array(vgpu_fn_cuMemMapArrayAsync real, CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED || !ops)
        return real(ops, n, s);
    vgpu_lock(&vgpu_vmm_mu);
    CUresult rc = real(ops, n, s);
    for (unsigned i = 0; i < n; i++)
        array_op(&ops[i], rc == CUDA_SUCCESS);
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

VGPU_API CUresult cuMemMapArrayAsync(CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    BROKEN_GUARD();
    return map_array(REAL_FN(cuMemMapArrayAsync), ops, n, s);
}

VGPU_API CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    BROKEN_GUARD();
    return map_array(REAL_FN(cuMemMapArrayAsync_ptsz), ops, n, s);
}

void vgpu_vmm_array_gone(const void *res)
{
    if (!atomic_load(&amap_live))
        return;
    vgpu_lock(&vgpu_vmm_mu);
    for (size_t i = 0; i < namap;)
        if (amap[i].resource == res)
            amap_drop(i);
        else
            i++;
    vgpu_unlock(&vgpu_vmm_mu);
}
