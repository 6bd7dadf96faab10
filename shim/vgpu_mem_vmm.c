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
 * (K_MAPLEN) and handle (K_MAPH), keyed by its address. An exported handle keeps one reference
 * more until the process ends (cuMemExportToShareableHandle, below). A handle mapped into a sparse array
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
    vgpu_tab_take(K_HEXP, h, &n, &d);
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

static void forget_places(uint64_t h);
static void settle_unmaps(void);

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
    if (mode() != M_LIMITED || !prop)
        return real(h, size, prop, flags);
    /* the driver gets the shim's copy: what it reads is what was charged, whatever another thread
     * writes meanwhile. Pinned memory of the host's is not charged; a card's is, and a location of
     * a kind the shim does not know is charged to the current card (refused without one). */
    CUmemAllocationProp own = *prop;
    prop = &own;
    if (own.type == CU_MEM_ALLOCATION_TYPE_PINNED && own.location.type >= CU_MEM_LOCATION_TYPE_HOST &&
        own.location.type <= CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
        return real(h, size, prop, flags);
    int d = own.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? vgpu_map_cuda_device(own.location.id) : vgpu_cur_dev();
    if (d == -1 && own.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        d = -2;
    if (vgpu_charge(d, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    vgpu_lock(&vgpu_vmm_mu);
    settle_unmaps();
    CUresult rc = real(h, size, prop, flags);
    if (rc == CUDA_SUCCESS && h)
        forget(*h), forget_places(*h); /* a handle value the driver gives again: nothing of the old one applies */
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
    settle_unmaps();
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
    settle_unmaps();
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
    settle_unmaps();
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
    settle_unmaps();
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
 * holds the handle's memory as a cuMemMap mapping does. An unmap names a region of the array,
 * not a handle, so each mapping is kept with its place: an unmap ends the mappings whose place
 * lies wholly inside its region (one it covers in part stays counted: part of it is still
 * mapped), and the array's destroy ends them all. The operations run in stream order, so an
 * unmap ends mappings only once an event recorded behind it has completed (looked at on every
 * VMM call), and only mappings made before it: a tenant holding its stream back keeps paying.
 * The driver is given a copy of the operations the bookkeeping reads. A call the driver fails
 * may have done some of its operations: its maps count, its unmaps do not, and an unmap with no
 * event ends nothing (the handle stays charged until the array goes). Under vgpu_vmm_mu. */
struct array_map {
    CUarrayMapInfo at; /* its place, and its handle (memHandle) */
    uint64_t seq;      /* order among the process's map and unmap operations */
};
struct array_unmaps {  /* the unmaps of one call, waiting for their event */
    struct array_map *ops;
    unsigned n;
    CUevent done;
};
static struct array_map *amap;
static size_t namap, camap;
static struct array_unmaps *apend;
static size_t napend, capend;
static _Atomic size_t apend_n; /* napend, read without the lock by vgpu_vmm_settle */
static uint64_t aseq;

/* 1 when place m lies wholly inside region u of the same array, level or mip tail, and layer. */
static int inside(const CUarrayMapInfo *m, const CUarrayMapInfo *u)
{
    typedef unsigned __int128 u128;
    if (m->resourceType != u->resourceType || m->resource != u->resource || m->subresourceType != u->subresourceType)
        return 0;
    if (m->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL)
        return m->subresource.miptail.layer == u->subresource.miptail.layer &&
               m->subresource.miptail.offset >= u->subresource.miptail.offset &&
               (u128)m->subresource.miptail.offset + m->subresource.miptail.size <=
                   (u128)u->subresource.miptail.offset + u->subresource.miptail.size;
    const unsigned *a = m->subresource.sparseLevel, *b = u->subresource.sparseLevel; /* level, layer, x y z, w h d */
    if (a[0] != b[0] || a[1] != b[1])
        return 0;
    for (int k = 2; k < 5; k++)
        if (a[k] < b[k] || (uint64_t)a[k] + a[k + 3] > (uint64_t)b[k] + b[k + 3])
            return 0;
    return 1;
}

static void amap_drop(size_t i)
{
    uint64_t h = amap[i].at.memHandle;
    amap[i] = amap[--namap];
    mapping_gone(h);
}

/* The unmaps whose event has completed end the mappings made before them. */
static void settle_unmaps(void)
{
    for (size_t i = 0; i < napend;) {
        struct array_unmaps *u = &apend[i];
        if (vgpu.drv.event_query(u->done) == CU_NOT_READY) {
            i++;
            continue;
        }
        vgpu.drv.event_destroy(u->done);
        for (unsigned j = 0; j < u->n; j++)
            for (size_t k = 0; k < namap;)
                if (amap[k].seq < u->ops[j].seq && inside(&amap[k].at, &u->ops[j].at))
                    amap_drop(k);
                else
                    k++;
        free(u->ops);
        apend[i] = apend[--napend];
    }
    atomic_store(&apend_n, napend);
}

void vgpu_vmm_settle(void)
{
    if (!atomic_load(&apend_n))
        return;
    vgpu_lock(&vgpu_vmm_mu);
    settle_unmaps();
    vgpu_unlock(&vgpu_vmm_mu);
}

static int grow(void **v, size_t *cap, size_t n, size_t size)
{
    if (n < *cap)
        return 0;
    size_t ncap = *cap ? *cap * 2 : 64;
    void *p = realloc(*v, ncap * size);
    if (!p)
        return -1;
    *v = p, *cap = ncap;
    return 0;
}

/* op, the operation with sequence number seq (its place among the process's operations). */
static void record_map(const CUarrayMapInfo *op, uint64_t seq)
{
    if (op->memHandleType != CU_MEM_HANDLE_TYPE_GENERIC || !op->resource || !mapping_new(op->memHandle))
        return;
    if (grow((void **)&amap, &camap, namap, sizeof *amap))
        return; /* counted, never ended: the handle stays charged */
    amap[namap].at = *op, amap[namap].seq = seq;
    namap++;
}

/* The unmaps of a call the driver did (ops[i] numbered base + 1 + i), ending the mappings made
 * before each once event `done` (behind them) completes. */
static void record_unmaps(const CUarrayMapInfo *ops, unsigned n, CUevent done, uint64_t base)
{
    struct array_unmaps u = {calloc(n, sizeof *u.ops), 0, done};
    if (!u.ops || grow((void **)&apend, &capend, napend, sizeof *apend)) {
        free(u.ops);
        vgpu.drv.event_destroy(done); /* they end nothing: the handles stay charged */
        return;
    }
    for (unsigned i = 0; i < n; i++)
        if (ops[i].memOperationType == CU_MEM_OPERATION_TYPE_UNMAP)
            u.ops[u.n].at = ops[i], u.ops[u.n++].seq = base + 1 + i;
    apend[napend++] = u;
    atomic_store(&apend_n, napend);
}

/* An event behind the call's operations on stream s (NULL: none could be made). */
static CUevent behind(CUstream s, int ptsz)
{
    const struct vgpu_drv *f = vgpu_cuda_drv();
    CUevent e = NULL;
    if (!f->event_create || !f->event_record || !f->event_query || !f->event_destroy ||
        f->event_create(&e, 2 /* CU_EVENT_DISABLE_TIMING */) != CUDA_SUCCESS)
        return NULL;
    if (f->event_record(e, ptsz && !s ? VGPU_STREAM_PER_THREAD : s) != CUDA_SUCCESS) {
        f->event_destroy(e);
        return NULL;
    }
    return e;
}

static CUresult map_array(vgpu_fn_cuMemMapArrayAsync real, CUarrayMapInfo *ops, unsigned n, CUstream s, int ptsz)
{
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED || !ops || !n)
        return real(ops, n, s);
    CUarrayMapInfo local[8], *own = n <= 8 ? local : malloc((size_t)n * sizeof *own);
    if (!own)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(own, ops, (size_t)n * sizeof *own); /* what the driver does is what is counted */
    vgpu_lock(&vgpu_vmm_mu);
    settle_unmaps();
    CUresult rc = real(own, n, s);
    int unmaps = 0;
    uint64_t base = aseq; /* numbered in call order: a map after an unmap is not ended by it */
    aseq += n;
    for (unsigned i = 0; i < n; i++)
        if (own[i].memOperationType == CU_MEM_OPERATION_TYPE_MAP)
            record_map(&own[i], base + 1 + i);
        else
            unmaps += own[i].memOperationType == CU_MEM_OPERATION_TYPE_UNMAP;
    CUevent done = rc == CUDA_SUCCESS && unmaps ? behind(s, ptsz) : NULL;
    if (done)
        record_unmaps(own, n, done, base);
    vgpu_unlock(&vgpu_vmm_mu);
    if (own != local)
        free(own);
    return rc;
}

VGPU_API CUresult cuMemMapArrayAsync(CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    BROKEN_GUARD();
    return map_array(REAL_FN(cuMemMapArrayAsync), ops, n, s, 0);
}

VGPU_API CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    BROKEN_GUARD();
    return map_array(REAL_FN(cuMemMapArrayAsync_ptsz), ops, n, s, 1);
}

void vgpu_vmm_array_gone(const void *res)
{
    settle_unmaps();
    for (size_t i = 0; i < namap;)
        if (amap[i].at.resource == res)
            amap_drop(i);
        else
            i++;
}

/* A handle value the driver gives again: the places the old one was kept at are not its. */
static void forget_places(uint64_t h)
{
    for (size_t i = 0; i < namap;)
        if (amap[i].at.memHandle == h)
            amap[i] = amap[--namap];
        else
            i++;
}

void vgpu_vmm_fork_child(void)
{
    free(amap);
    for (size_t i = 0; i < napend; i++)
        free(apend[i].ops); /* their events are the parent's */
    free(apend);
    amap = NULL, apend = NULL;
    namap = camap = napend = capend = 0;
    atomic_store(&apend_n, 0);
}

/* Exported (a POSIX file descriptor, a fabric handle): what was exported keeps the memory after
 * every handle of it is released and unmapped, until it is closed, here or in a process it was
 * sent to, and NVML's process list stops showing it at the creator's release (on the H200,
 * driver 580: bench/gpu/reset_probe.py). The shim cannot see a descriptor's end, so an exported
 * handle keeps one reference more, which only the process's end drops: its charge stays until
 * then (an over-charge for a program that exports, releases and closes while it runs). */
VGPU_API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                               unsigned long long flags)
{
    BROKEN_GUARD();
    vgpu_fn_cuMemExportToShareableHandle real = REAL_FN(cuMemExportToShareableHandle);
    if (mode() != M_LIMITED)
        return real(out, h, type, flags);
    vgpu_lock(&vgpu_vmm_mu);
    settle_unmaps();
    uint64_t v;
    CUresult rc = real(out, h, type, flags);
    if (rc == CUDA_SUCCESS && peek(K_HANDLE, h, &v) && !peek(K_HEXP, h, &v)) {
        set_count(K_HREFS, h, refs_of(h) + 1, 0);
        vgpu_tab_put(K_HEXP, h, 1, 0);
    }
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}
