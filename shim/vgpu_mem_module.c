/*
 * vgpu_mem_module.c - modules and libraries as memory: cuModuleLoad, cuModuleLoadData(Ex),
 * cuModuleLoadFatBinary, cuLibraryLoadData, cuLibraryLoadFromFile, and the calls that load a
 * lazily loaded module into the current context (cuLibraryGetModule, cuLibraryGetGlobal,
 * cuKernelGetFunction: measured once per library or kernel and context).
 *
 * A module's __device__ and __constant__ variables and its code are device memory the driver
 * takes when it loads the module into a context, in sizes no call tells (a 2 GiB __device__
 * array took 2048 MiB at cuModuleLoadData on an H100). Around each of these calls the shim reads
 * the card's free memory (the driver's cuMemGetInfo_v2: no NVML query). What it dropped by is
 * summed per card until the next reconciliation; when that sum reaches VGPU_MODULE_RECONCILE or
 * more than the slice has left, the container is reconciled from NVML at once (one query: a
 * drop another tenant's allocation caused costs that query, never a refusal, as NVML tells the
 * container's own processes apart). A load that leaves the container over its limit is unloaded
 * again and refused with CUDA_ERROR_OUT_OF_MEMORY. A get call cannot be undone (the library stays
 * in use elsewhere): what it made the driver load is charged at once, and ACTIVE_OOM_KILLER acts
 * when that takes the container over (vgpu_reconcile). Only the current context's card is
 * watched: a library loaded eagerly while this process has contexts on other cards of the claim
 * is charged there by their next reconciliation. Memory a lazily loaded module takes at a
 * kernel's first launch is left to the next reconciliation (a launch reads no free memory).
 * An unload makes the next allocation reconcile first (what the module held went with it).
 */
#include "vgpu_mem.h"

/* Drops (bytes) not reconciled yet, per region card: atomic. */
static uint64_t unseen[VGPU_MAX_DEV];

struct load_watch {
    int d;          /* region card watched, -1: none (not limited, no context, no answer) */
    size_t free_b;  /* the card's free bytes before the call */
};

static void watch_begin(struct load_watch *w)
{
    size_t f = 0, t = 0;
    w->d = -1, w->free_b = 0;
    if (mode() != M_LIMITED)
        return;
    int d = vgpu_cur_dev();
    if (d < 0 || !vgpu.region.r->dev[d].limit || REAL_FN(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS)
        return;
    w->d = d, w->free_b = f;
}

/* After a call that succeeded: 1 when what the card lost since watch_begin (with the drops not
 * reconciled yet) asks for a reconciliation now. */
static int watch_due(const struct load_watch *w)
{
    size_t f = 0, t = 0;
    if (w->d < 0 || REAL_FN(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS)
        return 0;
    uint64_t drop = f < w->free_b ? (uint64_t)(w->free_b - f) : 0;
    if (!drop)
        return 0;
    uint64_t sum = __atomic_add_fetch(&unseen[w->d], drop, __ATOMIC_RELAXED);
    const struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[w->d].limit, used = vgpu_region_used(r, w->d);
    if (sum < VGPU_MODULE_RECONCILE && used + sum <= lim)
        return 0;
    __atomic_store_n(&unseen[w->d], 0, __ATOMIC_RELAXED);
    return 1;
}

/* After a load: 0 keep it, 1 it took the container over its limit (the caller unloads it). */
static int load_over(const struct load_watch *w, CUresult rc)
{
    if (rc != CUDA_SUCCESS || !watch_due(w) || !vgpu_reconcile_over(w->d))
        return 0;
    vgpu_log(1, "device %d: module load refused: with what NVML shows it took the container is "
                "over its limit", w->d);
    return 1;
}

static CUresult module_refused(const struct load_watch *w, CUmodule *m)
{
    if (*m)
        REAL_FN(cuModuleUnload)(*m);
    *m = NULL;
    vgpu_reconcile_soon(w->d);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult library_refused(const struct load_watch *w, CUlibrary *lib)
{
    if (*lib)
        REAL_FN(cuLibraryUnload)(*lib);
    *lib = NULL;
    vgpu_reconcile_soon(w->d);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* An unload gives memory back that a reconciliation charged: the next allocation on any card
 * reconciles first instead of being refused on the stale figure. */
static CUresult unloaded(CUresult rc)
{
    for (int d = 0; rc == CUDA_SUCCESS && d < VGPU_MAX_DEV; d++)
        vgpu_reconcile_soon(d);
    return rc;
}

VGPU_API CUresult cuModuleUnload(CUmodule m)
{
    BROKEN_GUARD();
    return unloaded(REAL_FN(cuModuleUnload)(m));
}

VGPU_API CUresult cuLibraryUnload(CUlibrary lib)
{
    BROKEN_GUARD();
    return unloaded(REAL_FN(cuLibraryUnload)(lib));
}

/* After a get call: what it loaded is charged now (ACTIVE_OOM_KILLER may act on it). */
static CUresult got(const struct load_watch *w, CUresult rc)
{
    if (rc == CUDA_SUCCESS && watch_due(w))
        vgpu_reconcile(w->d, 3);
    return rc;
}

/* A load: `call` made with the card watched, `refused(&w, out)` when it is over the limit. */
#define LOAD(call, refused, out)                                                                \
    do {                                                                                        \
        BROKEN_GUARD();                                                                         \
        struct load_watch w;                                                                    \
        watch_begin(&w);                                                                        \
        CUresult rc = (call);                                                                   \
        return load_over(&w, rc) ? refused(&w, (out)) : rc;                                     \
    } while (0)
#define MODULE_LOAD(call, m) LOAD(call, module_refused, m)
#define LIBRARY_LOAD(call, lib) LOAD(call, library_refused, lib)

VGPU_API CUresult cuModuleLoad(CUmodule *m, const char *fname)
{
    MODULE_LOAD(REAL_FN(cuModuleLoad)(m, fname), m);
}

VGPU_API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    MODULE_LOAD(REAL_FN(cuModuleLoadData)(m, image), m);
}

VGPU_API CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, int *opts, void **vals)
{
    MODULE_LOAD(REAL_FN(cuModuleLoadDataEx)(m, image, n, opts, vals), m);
}

VGPU_API CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin)
{
    MODULE_LOAD(REAL_FN(cuModuleLoadFatBinary)(m, fatbin), m);
}

VGPU_API CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, int *jit_opts, void **jit_vals,
                                    unsigned n_jit, int *lib_opts, void **lib_vals, unsigned n_lib)
{
    LIBRARY_LOAD(REAL_FN(cuLibraryLoadData)(lib, code, jit_opts, jit_vals, n_jit, lib_opts, lib_vals, n_lib), lib);
}

VGPU_API CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *fname, int *jit_opts, void **jit_vals,
                                        unsigned n_jit, int *lib_opts, void **lib_vals, unsigned n_lib)
{
    LIBRARY_LOAD(REAL_FN(cuLibraryLoadFromFile)(lib, fname, jit_opts, jit_vals, n_jit, lib_opts, lib_vals, n_lib),
                 lib);
}

/* A get call on a library or kernel already measured in the current context loads nothing more
 * (cudart may ask for a kernel's function or a symbol at every use): the key of (handle, context),
 * 0 when no context is current. */
static uint64_t loaded_key(const void *h)
{
    CUcontext c = NULL;
    CUresult (*cur)(CUcontext *) = vgpu_cuda_drv()->ctx_get_current;
    if (!cur || cur(&c) != CUDA_SUCCESS || !c)
        return 0;
    return ((uint64_t)(uintptr_t)h * 0x9e3779b97f4a7c15ull) ^ (uint64_t)(uintptr_t)c;
}

#define LAZY_GET(h, call)                                                                       \
    do {                                                                                        \
        BROKEN_GUARD();                                                                         \
        uint64_t key = mode() == M_LIMITED ? loaded_key(h) : 0, size;                           \
        int dev;                                                                                \
        if (!key || vgpu_tab_get(K_LOADED, key, &size, &dev))                                   \
            return (call);                                                                      \
        struct load_watch w;                                                                    \
        watch_begin(&w);                                                                        \
        CUresult rc = got(&w, (call));                                                          \
        if (rc == CUDA_SUCCESS)                                                                 \
            vgpu_tab_put(K_LOADED, key, 0, -1);                                                 \
        return rc;                                                                              \
    } while (0)

VGPU_API CUresult cuLibraryGetModule(CUmodule *m, CUlibrary lib)
{
    LAZY_GET(lib, REAL_FN(cuLibraryGetModule)(m, lib));
}

VGPU_API CUresult cuLibraryGetGlobal(CUdeviceptr *p, size_t *bytes, CUlibrary lib, const char *name)
{
    LAZY_GET(lib, REAL_FN(cuLibraryGetGlobal)(p, bytes, lib, name));
}

VGPU_API CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{
    LAZY_GET(k, REAL_FN(cuKernelGetFunction)(f, k));
}
