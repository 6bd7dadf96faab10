/*
 * vgpu_mem_ctx.c - contexts as memory: cuCtxCreate* (the CUDA < 3.2 name too), the first
 * cuDevicePrimaryCtxRetain of a card, cuGreenCtxCreate and cuCtxSetLimit are charged what they
 * take on the card; cuCtxDestroy_v2 and cuGreenCtxDestroy return it.
 * Destroying a context (cuCtxDestroy(_v2), a primary context's reset or last release) first hands
 * the compute limiter's events of it back, and once it is gone returns the charges of the memory
 * it owned (linear and managed allocations and arrays made in it: the driver frees them with it)
 * and of its limits; a primary context's own charge stays (below).
 */
#include "vgpu_mem.h"

#include <string.h>

/* ------------------------------------------------------------------ contexts */

/* A context costs device memory (a few hundred MiB on a large card: the context itself, local
 * memory for every resident thread, the printf FIFO, the malloc heap) that no allocation hook
 * sees. Every context this process creates (cuCtxCreate*, the first cuDevicePrimaryCtxRetain
 * of a card) is charged: before the driver is asked, the per-context charge learnt from this
 * process's first context on that card (0 before one was measured), refused when it does not
 * fit; after it, settled to what NVML shows the creation took (the process's usage after minus
 * before), refused (the context destroyed again) when that does not fit. The charge is part of
 * the counted allocations, so reconciliation does not charge the context a second time. The
 * first size measured is kept in the region, so the container's later processes charge it up
 * front too: a newcomer of a container at its limit is refused before the driver makes (and
 * then destroys) its context, 0.5 s on the H200 against 0.05 s. */

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
    VGPU_ST_T0(t0);
    vgpu_ensure_slot();
    VGPU_ST_ADD(VGPU_ST_SLOT, t0);
    *before = vgpu_nvml_process_used(d, &found);
    *est = __atomic_load_n(&vgpu.ctx_learnt[d], __ATOMIC_RELAXED);
    if (!*est)
        *est = atomic_load_explicit(&vgpu.region.r->dev[d].ctx_bytes, memory_order_relaxed);
    VGPU_ST_T0(t1);
    int refused = vgpu_charge(d, *est);
    VGPU_ST_ADD(VGPU_ST_CHARGE, t1);
    if (refused) {
        vgpu_log(1, "device %d: context refused: a context takes about %llu MiB, %llu of %llu MiB are "
                    "charged", d, (unsigned long long)(*est >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return -1;
    }
    return 0;
}

/* After the driver made the context: settle the charge to NVML's figure (`learn`: and keep the
 * first one as a context's size). 0 ok with the bytes charged in *charged; -1: it does not fit
 * (nothing is charged any more). */
static int ctx_end(int d, uint64_t est, uint64_t before, uint64_t *charged, int learn)
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
    if (learn) {
        __atomic_compare_exchange_n(&vgpu.ctx_learnt[d], &zero, took, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        zero = 0;
        atomic_compare_exchange_strong_explicit(&vgpu.region.r->dev[d].ctx_bytes, &zero, took,
                                                memory_order_relaxed, memory_order_relaxed);
    }
    /* reserve, not vgpu_charge(): a reconciliation now would see the new context in NVML before it
     * is counted and charge it twice */
    VGPU_ST_T0(t0);
    int refused = took > est && vgpu_region_reserve(&vgpu.region, d, took - est);
    VGPU_ST_ADD(VGPU_ST_CHARGE, t0);
    if (refused) {
        vgpu_uncharge(d, est);
        vgpu_log(1, "device %d: context refused: it took %llu MiB, %llu of %llu MiB are charged", d,
                 (unsigned long long)(took >> 20), (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return -1;
    }
    if (took < est)
        vgpu_uncharge(d, est - took);
    *charged = took;
    return 0;
}

static CUresult ctx_destroy_real(CUcontext c)
{
    return REAL_FN(cuCtxDestroy_v2)(c);
}

/* What a context's end returns, taken out of the table before the driver is asked (an entry
 * recorded after that, in a context that got the same handle back meanwhile, is not the ended
 * context's): its own charge (created contexts only), its limits, and the token its owned
 * objects were marked with (vgpu_tab_mark_ctx). */
struct ctx_end {
    CUcontext c;
    uint64_t token;
    int have[1 + 3], dev[1 + 3], have_base[3], base_dev[3];
    uint64_t size[1 + 3], base[3];
};

static void ctx_end_begin(struct ctx_end *e, CUcontext c, int own_charge)
{
    uint64_t key = (uint64_t)(uintptr_t)c;
    memset(e, 0, sizeof *e);
    e->c = c;
    if (own_charge)
        e->have[0] = vgpu_tab_take(K_CTX, key, &e->size[0], &e->dev[0]);
    for (int l = 0; l < 3; l++) {
        e->have[1 + l] = vgpu_tab_take(K_LIM + l, key, &e->size[1 + l], &e->dev[1 + l]);
        e->have_base[l] = vgpu_tab_take(K_LIMBASE + l, key, &e->base[l], &e->base_dev[l]);
    }
    e->token = vgpu_tab_mark_ctx(key);
}

/* gone: the driver ended the context (its memory and limits with it): the charges return;
 * otherwise everything goes back as it was. */
static void ctx_end_finish(const struct ctx_end *e, int gone)
{
    uint64_t key = (uint64_t)(uintptr_t)e->c;
    vgpu_tab_end_mark(e->token, key, gone);
    if (gone)
        vgpu_module_forget();
    for (int i = 0; i < 4; i++)
        if (e->have[i] && gone)
            vgpu_uncharge(e->dev[i], e->size[i]);
        else if (e->have[i])
            vgpu_tab_put(i ? K_LIM + i - 1 : K_CTX, key, e->size[i], e->dev[i]);
    for (int l = 0; l < 3; l++)
        if (e->have_base[l] && !gone)
            vgpu_tab_put(K_LIMBASE + l, key, e->base[l], e->base_dev[l]);
}

/* A handle the process retained as a card's primary context (never destroyed through
 * cuCtxDestroy here: its charge stays, and its objects go only with its reset or last release). */
static int is_primary(CUcontext c)
{
    for (int i = 0; c && i < VGPU_MAX_DEV; i++)
        if (__atomic_load_n(&vgpu.primary_ctx[i], __ATOMIC_ACQUIRE) == (void *)c)
            return 1;
    return 0;
}

/* After the driver call that makes a context (charged `est` by ctx_begin): on success, settle the
 * charge to NVML's figure (ctx_end) and record it; when that does not fit, the context is undone
 * (destroyed, or for a primary one released) and the call refused. On failure, the charge
 * returns. */
static CUresult ctx_commit(CUresult rc, CUcontext *pctx, int d, uint64_t est, uint64_t before, CUdevice dev,
                           int primary)
{
    if (rc != CUDA_SUCCESS || !pctx) {
        vgpu_uncharge(d, est);
        return rc;
    }
    uint64_t got;
    if (ctx_end(d, est, before, &got, 1)) {
        CUresult (*rel)(CUdevice) = vgpu_cuda_drv()->primary_ctx_release;
        if (!primary)
            ctx_destroy_real(*pctx);
        else if (rel)
            rel(dev);
        *pctx = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (d >= 0) {
        vgpu_tab_put(K_CTX, (uint64_t)(uintptr_t)*pctx, got, d);
        atomic_fetch_or(&vgpu_ctx_cards, 1u << d); /* launches then find their card's gate */
    }
    return rc;
}

/* cuCtxCreate_v2 and its CUDA < 3.2 name (same arguments) through the driver's `real`. */
static CUresult ctx_create_with(vgpu_fn_cuCtxCreate_v2 real, CUcontext *pctx, unsigned flags, CUdevice dev)
{
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED)
        return real(pctx, flags, dev);
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return ctx_commit(real(pctx, flags, dev), pctx, d, est, before, dev, 0);
}

VGPU_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    return ctx_create_with(REAL_FN(cuCtxCreate_v2), pctx, flags, dev);
}

VGPU_API CUresult cuCtxCreate(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    return ctx_create_with(REAL_FN(cuCtxCreate), pctx, flags, dev);
}

VGPU_API CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice dev)
{
    BROKEN_GUARD();
    vgpu_fn_cuCtxCreate_v3 real = REAL_FN(cuCtxCreate_v3);
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
    vgpu_fn_cuCtxCreate_v4 real = REAL_FN(cuCtxCreate_v4);
    if (mode() != M_LIMITED)
        return real(pctx, params, flags, dev);
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return ctx_commit(real(pctx, params, flags, dev), pctx, d, est, before, dev, 0);
}

/* Only a context this process created through the shim (its charge is in the table) returns
 * anything: a handle the shim did not make (a green context's, cuCtxFromGreenCtx) shares another
 * context's memory, which its end does not free. */
static CUresult ctx_destroy_with(CUresult (*real)(CUcontext), CUcontext c)
{
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    uint64_t size;
    int d, ours = mode() == M_LIMITED && c && !is_primary(c) && vgpu_tab_get(K_CTX, (uint64_t)(uintptr_t)c, &size, &d);
    struct ctx_end e;
    if (ours)
        ctx_end_begin(&e, c, 1);
    vgpu_compute_ctx_destroy(c); /* the compute limiter's events of c */
    CUresult rc = real(c);
    vgpu_compute_ctx_destroyed(c);
    if (ours)
        ctx_end_finish(&e, rc == CUDA_SUCCESS);
    return rc;
}

VGPU_API CUresult cuCtxDestroy_v2(CUcontext c)
{
    BROKEN_GUARD();
    return ctx_destroy_with(REAL_FN(cuCtxDestroy_v2), c);
}

/* The CUDA < 4.0 name, still exported: the same destruction. */
VGPU_API CUresult cuCtxDestroy(CUcontext c)
{
    BROKEN_GUARD();
    return ctx_destroy_with(REAL_FN(cuCtxDestroy), c);
}

/* ------------------------------------------------------------------ green contexts */

/* A green context (cuGreenCtxCreate, CUDA 12.4: a context on a partition of the card's SMs,
 * which a program may make many of) takes device memory of its own that no allocation hook sees.
 * Charged what NVML shows its creation took, nothing up front (it is not a full context: a
 * context's learnt size would refuse what fits), and refused, destroyed again, when that does not
 * fit; returned at cuGreenCtxDestroy. Where NVML cannot see the process, reconciliation has
 * nothing to go on either: then it goes uncharged. */
VGPU_API CUresult cuGreenCtxCreate(CUgreenCtx *phctx, void *desc, CUdevice dev, unsigned flags)
{
    BROKEN_GUARD();
    vgpu_fn_cuGreenCtxCreate real = REAL_FN(cuGreenCtxCreate);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED)
        return real(phctx, desc, dev, flags);
    int d = vgpu_map_cuda_device(dev), found = 0;
    if (d == -2) {
        vgpu_log(1, "green context on a device outside the claim refused");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t before = 0, got = 0;
    if (d >= 0) {
        vgpu_ensure_slot();
        before = vgpu_nvml_process_used(d, &found);
    }
    CUresult rc = real(phctx, desc, dev, flags);
    if (rc != CUDA_SUCCESS || d < 0 || !phctx)
        return rc;
    if (ctx_end(d, 0, before, &got, 0)) {
        vgpu_fn_cuGreenCtxDestroy destroy = REAL_FN(cuGreenCtxDestroy);
        if (destroy)
            destroy(*phctx);
        *phctx = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_tab_put(K_GREEN, (uint64_t)(uintptr_t)*phctx, got, d);
    return rc;
}

VGPU_API CUresult cuGreenCtxDestroy(CUgreenCtx h)
{
    BROKEN_GUARD();
    vgpu_fn_cuGreenCtxDestroy real = REAL_FN(cuGreenCtxDestroy);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    uint64_t size;
    int d;
    if (mode() != M_LIMITED || !vgpu_release_begin(K_GREEN, (uint64_t)(uintptr_t)h, &size, &d))
        return real(h);
    return vgpu_release_end(real(h), K_GREEN, (uint64_t)(uintptr_t)h, size, d);
}

/* A retain's handle and count (the compute limiter's events of it go when it is reset or
 * released for the last time, below). */
static CUresult primary_retained(CUresult rc, CUcontext *pctx, CUdevice dev)
{
    if (rc == CUDA_SUCCESS && pctx && dev >= 0 && dev < VGPU_MAX_DEV) {
        __atomic_store_n(&vgpu.primary_ctx[dev], (void *)*pctx, __ATOMIC_RELEASE);
        __atomic_add_fetch(&vgpu.primary_refs[dev], 1, __ATOMIC_ACQ_REL);
    }
    return rc;
}

/* The primary context of a card is charged once per process, at its first retain (policy: it
 * stays charged until the process exits; a released primary context is cheap to retain again
 * and the driver may keep it). */
VGPU_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    BROKEN_GUARD();
    vgpu_fn_cuDevicePrimaryCtxRetain real = REAL_FN(cuDevicePrimaryCtxRetain);
    if (mode() != M_LIMITED || dev < 0 || dev >= VGPU_MAX_DEV ||
        __atomic_load_n(&vgpu.primary_charged[dev], __ATOMIC_ACQUIRE))
        return primary_retained(real(pctx, dev), pctx, dev);
    vgpu_lock(&vgpu_primary_mu);
    if (vgpu.primary_charged[dev]) {
        vgpu_unlock(&vgpu_primary_mu);
        return primary_retained(real(pctx, dev), pctx, dev);
    }
    int d = vgpu_map_cuda_device(dev);
    uint64_t est, before;
    if (ctx_begin(d, &est, &before)) {
        vgpu_unlock(&vgpu_primary_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    VGPU_ST_T0(t0);
    CUresult rc = real(pctx, dev);
    VGPU_ST_ADD(VGPU_ST_CTX_DRIVER, t0);
    rc = ctx_commit(rc, pctx, d, est, before, dev, 1);
    if (rc == CUDA_SUCCESS && pctx)
        __atomic_store_n(&vgpu.primary_charged[dev], 1, __ATOMIC_RELEASE);
    vgpu_unlock(&vgpu_primary_mu);
    return primary_retained(rc, pctx, dev);
}

/* The card's primary context no longer exists: the driver says it is inactive (the shim's own
 * count of retains is not trusted for this: a retain it did not see keeps the context, and its
 * memory, alive). */
static int primary_gone(CUdevice dev)
{
    unsigned flags = 0;
    int active = 1;
    CUresult (*state)(CUdevice, unsigned *, int *) = vgpu_cuda_drv()->primary_ctx_get_state;
    return state && state(dev, &flags, &active) == CUDA_SUCCESS && !active;
}

/* Before a reset (cudaDeviceReset) or the last release of a card's primary context, which
 * destroy it: the compute limiter releases its events and batches while it exists (the driver
 * may hand back the same handle at the next retain, and a pooled event of the old context would
 * then fail, or worse, be a freed handle). The count is the shim's own (a retain it did not see
 * makes it release the events early, which only costs new ones). */
static CUresult primary_end(CUresult (*real)(CUdevice), CUdevice dev, int reset)
{
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (dev < 0 || dev >= VGPU_MAX_DEV)
        return real(dev);
    int last = reset || __atomic_sub_fetch(&vgpu.primary_refs[dev], 1, __ATOMIC_ACQ_REL) <= 0;
    CUcontext c = (CUcontext)__atomic_load_n(&vgpu.primary_ctx[dev], __ATOMIC_ACQUIRE);
    int ending = last && c && mode() == M_LIMITED;
    struct ctx_end e;
    if (ending)
        ctx_end_begin(&e, c, 0); /* its own charge stays (the next retain is not charged) */
    if (last)
        vgpu_compute_ctx_destroy(c);
    CUresult rc = real(dev);
    if (last)
        vgpu_compute_ctx_destroyed(c);
    if (rc != CUDA_SUCCESS && !reset)
        __atomic_add_fetch(&vgpu.primary_refs[dev], 1, __ATOMIC_ACQ_REL);
    if (ending)
        ctx_end_finish(&e, rc == CUDA_SUCCESS && (reset || primary_gone(dev)));
    return rc;
}

#define PRIMARY_END_HOOK(name, reset)                                                              \
    VGPU_API CUresult name(CUdevice dev)                                                          \
    {                                                                                             \
        BROKEN_GUARD();                                                                           \
        return primary_end(REAL_FN(name), dev, reset);                                            \
    }
PRIMARY_END_HOOK(cuDevicePrimaryCtxRelease_v2, 0)
PRIMARY_END_HOOK(cuDevicePrimaryCtxRelease, 0)
PRIMARY_END_HOOK(cuDevicePrimaryCtxReset_v2, 1)
PRIMARY_END_HOOK(cuDevicePrimaryCtxReset, 1)

/* The device runtime's limits (sync depth, pending launch count) make the driver reserve device
 * memory for device-side launches in sizes it does not tell: raised, the container is reconciled
 * from NVML right after, and the old value is set again and the call refused when that takes it
 * over its limit. (Memory the driver reserves only at a later launch is reconciled then.) */
static CUresult runtime_limit(vgpu_fn_cuCtxSetLimit real, int limit, size_t value)
{
    CUresult (*get_limit)(size_t *, int) = vgpu_cuda_drv()->ctx_get_limit;
    int d = vgpu_cur_dev();
    size_t old = 0;
    if (d == -2)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (d < 0 || !vgpu.region.r->dev[d].limit || !get_limit || get_limit(&old, limit) != CUDA_SUCCESS ||
        value <= old)
        return real(limit, value);
    CUresult rc = real(limit, value);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!vgpu_reconcile_over(d))
        return rc;
    real(limit, old);
    vgpu_reconcile(d, 3); /* what it reserved went back: this process's charge settled now */
    vgpu_log(1, "device %d: cuCtxSetLimit(%d, %zu) refused: with what NVML shows it reserved the "
                "container is over its limit", d, limit, value);
    return CUDA_ERROR_OUT_OF_MEMORY;
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
    vgpu_fn_cuCtxSetLimit real = REAL_FN(cuCtxSetLimit);
    if (mode() == M_LIMITED && (limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH ||
                                limit == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT))
        return runtime_limit(real, limit, value);
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
    if (!vgpu_tab_take(K_LIMBASE + limit, key, &base, &bd)) {
        size_t cur = 0;
        base = get_limit(&cur, limit) == CUDA_SUCCESS ? cur : 0;
    }
    vgpu_tab_put(K_LIMBASE + limit, key, base, d);
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
    int had = vgpu_tab_take(K_LIM + limit, key, &old, &bd);
    if (want > old && vgpu_charge(d, want - old)) {
        if (had)
            vgpu_tab_put(K_LIM + limit, key, old, d);
        vgpu_log(1, "device %d: cuCtxSetLimit(%d, %zu) refused: %llu MiB more do not fit, %llu of %llu "
                    "MiB are charged", d, limit, value, (unsigned long long)((want - old) >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real(limit, value);
    uint64_t keep = rc == CUDA_SUCCESS ? want : old;
    if (rc == CUDA_SUCCESS && want < old)
        vgpu_uncharge(d, old - want);
    if (rc != CUDA_SUCCESS && want > old)
        vgpu_uncharge(d, want - old);
    if (keep)
        vgpu_tab_put(K_LIM + limit, key, keep, d);
    return rc;
}
