/*
 * vgpu_mem_module.c - modules and libraries as memory: cuModuleLoad, cuModuleLoadData(Ex),
 * cuModuleLoadFatBinary, cuLibraryLoadData, cuLibraryLoadFromFile, their unloads, and the calls
 * that load a lazily loaded module into a context (cuLibraryGetModule, cuLibraryGetGlobal,
 * cuLibraryGetManaged, cuKernelGetFunction, cuKernelGetAttribute: watched once per library or
 * kernel and context, and card for the last; a function's first launch, from the launch hooks:
 * vgpu_launch_watch_begin/end).
 *
 * A module's __device__ and __constant__ variables and its code are device memory the driver
 * takes when it loads the module into a context, in sizes no call tells (a 2 GiB __device__
 * array took 2048 MiB at cuModuleLoadData on an H100). After every load the container is
 * reconciled from NVML (one process query: loads are rare, and NVML's per-process figure is
 * the one a free elsewhere on the card cannot hide), and a load that leaves it over its limit
 * is unloaded again and refused with CUDA_ERROR_OUT_OF_MEMORY. Under lazy loading (CUDA's
 * default; cuModuleGetLoadingMode) a library's load takes nothing in a context and is not
 * watched: its module comes in at a get above or at a kernel's first launch (cudart's way; a
 * 1 GiB __device__ array came in there on an H100, with the local memory the driver grows for
 * the kernel). Those cannot be undone (the launch is queued, the library in use elsewhere), and
 * they are far more frequent than loads, so the card's free memory is read around them instead
 * (the driver's cuMemGetInfo_v2, no NVML query) and what it dropped by summed per card: when
 * the sum reaches VGPU_MODULE_RECONCILE or what the slice has left, the container is
 * reconciled at once (charged; ACTIVE_OOM_KILLER acts when that is over the limit), and so it
 * is when a free of the container's during the call may have hidden the drop, or when a
 * launch's stream is another card's than the current context's. Another tenant's free during
 * such a call can still hide its drop: the memory is then charged by the next reconciliation
 * (before any allocation near the limit, every 10 ms). A load or get is watched on the current
 * context's card: a library loaded eagerly while this process has contexts on other cards of
 * the claim is charged there by their next reconciliation. An unload, and a refused load's,
 * reconciles every card this process has a context on at once (what the module held went with
 * it, and a sibling's reconciliation never lowers this process's charge); an unload or a
 * context's end forgets which launches and libraries were watched (the driver may hand their
 * handles out again).
 */
#include "vgpu_mem.h"

/* Drops (bytes) not reconciled yet, per region card: atomic. */
static uint64_t unseen[VGPU_MAX_DEV];

/* Watch card d (-1: none) for a call: its free memory when it is the current context's card
 * (else the call is reconciled unconditionally: `blind`), the container's charge and this
 * process's uncharges, which tell a free that may hide the call's drop. */
static void watch_begin(struct vgpu_load_watch *w, int d)
{
    size_t f = 0, t = 0;
    w->d = -1, w->blind = 0;
    if (d < 0 || !vgpu.region.r->dev[d].limit)
        return;
    w->frees = __atomic_load_n(&vgpu_uncharges, __ATOMIC_RELAXED);
    w->used = vgpu_region_used(vgpu.region.r, d);
    w->d = d;
    if (d != vgpu_cur_dev() || REAL_FN(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS)
        w->blind = 1;
    w->free_b = f;
}

/* After the call: 1 when it asks for a reconciliation now: the card's drop since watch_begin
 * (with the drops not reconciled yet) reached VGPU_MODULE_RECONCILE or what the slice has left,
 * or a free of the container's (this process's or a sibling's charge fell) may have hidden it,
 * or the card's free memory could not be read. */
static int watch_due(const struct vgpu_load_watch *w)
{
    size_t f = 0, t = 0;
    if (w->d < 0)
        return 0;
    struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[w->d].limit, used = vgpu_region_used(r, w->d);
    int masked = used < w->used || __atomic_load_n(&vgpu_uncharges, __ATOMIC_RELAXED) != w->frees;
    if (w->blind || REAL_FN(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS)
        return 1;
    uint64_t drop = f < w->free_b ? (uint64_t)(w->free_b - f) : 0;
    if (!drop && !masked)
        return 0;
    uint64_t sum = __atomic_add_fetch(&unseen[w->d], drop, __ATOMIC_RELAXED);
    if (!masked && sum < VGPU_MODULE_RECONCILE && used + sum <= lim)
        return 0;
    __atomic_store_n(&unseen[w->d], 0, __ATOMIC_RELAXED);
    return 1;
}

/* After a load on card d (-1: not watched): 0 keep it, 1 it took the container over its limit
 * (the caller unloads it). */
static int load_over(int d, CUresult rc)
{
    if (rc != CUDA_SUCCESS || d < 0 || !vgpu_reconcile_over(d))
        return 0;
    vgpu_log(1, "device %d: module load refused: with what NVML shows it took the container is "
                "over its limit", d);
    return 1;
}

/* What an unload gave back (a refused load's, or the program's): this process's charge is
 * settled now on every card it has a context on (the module's may not be the current one), and
 * the watched handles are forgotten. */
static void after_unload(void)
{
    unsigned cards = atomic_load(&vgpu_ctx_cards);
    int cur = vgpu_cur_dev();
    vgpu_module_forget();
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if ((cards >> d & 1u) || d == cur)
            vgpu_reconcile(d, 3);
        else
            vgpu_reconcile_soon(d);
}

static CUresult module_refused(CUmodule *m)
{
    if (*m)
        REAL_FN(cuModuleUnload)(*m);
    *m = NULL;
    after_unload();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult library_refused(CUlibrary *lib)
{
    if (*lib)
        REAL_FN(cuLibraryUnload)(*lib);
    *lib = NULL;
    after_unload();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult unloaded(CUresult rc)
{
    if (rc == CUDA_SUCCESS && mode() == M_LIMITED)
        after_unload();
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

/* After a get call or a first launch: what it loaded is charged now (ACTIVE_OOM_KILLER may act
 * on it), whatever the driver answered (it may have loaded the module before it failed). */
static CUresult got(const struct vgpu_load_watch *w, CUresult rc)
{
    if (watch_due(w))
        vgpu_reconcile(w->d, 3);
    return rc;
}

/* 1 when the driver loads modules lazily (cuModuleGetLoadingMode, asked once): a library's
 * load then takes no memory in a context (on an H100, a 2 GiB global's library loaded with
 * nothing taken; its first get took it), so its load is not watched. */
static int lazy_loading(void)
{
    static int mode_v; /* atomic: 0 not asked, 1 eager or unknown, 2 lazy */
    int m = __atomic_load_n(&mode_v, __ATOMIC_RELAXED);
    if (!m) {
        int answer = 0;
        CUresult (*ask)(int *) = vgpu_cuda_drv()->module_loading_mode;
        m = ask && ask(&answer) == CUDA_SUCCESS && answer == CU_MODULE_LAZY_LOADING ? 2 : 1;
        __atomic_store_n(&mode_v, m, __ATOMIC_RELAXED);
    }
    return m == 2;
}

/* The card a load is watched on: the current context's, limited; -1 none (`lib` under lazy
 * loading: a library's load takes nothing). */
static int load_card(int lib)
{
    if (mode() != M_LIMITED || (lib && lazy_loading()))
        return -1;
    int d = vgpu_cur_dev();
    return d >= 0 && vgpu.region.r->dev[d].limit ? d : -1;
}

/* A load: `call` made, then reconciled; `refused(out)` when it is over the limit. */
#define LOAD(call, refused, out, lib)                                                           \
    do {                                                                                        \
        BROKEN_GUARD();                                                                         \
        int d_ = load_card(lib);                                                                \
        CUresult rc = (call);                                                                   \
        return load_over(d_, rc) ? refused(out) : rc;                                           \
    } while (0)
#define MODULE_LOAD(call, m) LOAD(call, module_refused, m, 0)
#define LIBRARY_LOAD(call, lib) LOAD(call, library_refused, lib, 1)

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

/* The key of (handle, current context) a get or a launch is watched once under: 0 when there is
 * no handle or no context current, never 0 otherwise. A get call on a library or kernel
 * already measured in the current context loads nothing more (cudart may ask for a kernel's
 * function or a symbol at every use). */
static uint64_t ctx_key(uint64_t h)
{
    CUcontext c = NULL;
    CUresult (*cur)(CUcontext *) = vgpu.drv.ctx_get_current;
    if (!h || !cur || cur(&c) != CUDA_SUCCESS || !c)
        return 0;
    uint64_t k = (h * 0x9e3779b97f4a7c15ull) ^ (uint64_t)(uintptr_t)c;
    return k ? k : 1;
}

/* A get that may load a module on region card `d` (-1: none of the claim's): watched once per
 * (h, current context), h the handle (or a value naming it and the card), `call` made either way.
 * (Its locals end in _: `call` names the hook's parameters, a CUdevice `dev` among them.) */
#define LAZY_GET_ON(h, d, call)                                                                 \
    do {                                                                                        \
        BROKEN_GUARD();                                                                         \
        uint64_t key_ = mode() == M_LIMITED ? ctx_key(h) : 0, size_;                            \
        int dev_;                                                                               \
        if (!key_ || vgpu_tab_get(K_LOADED, key_, &size_, &dev_))                               \
            return (call);                                                                      \
        struct vgpu_load_watch w_;                                                              \
        watch_begin(&w_, (d));                                                                  \
        CUresult rc_ = got(&w_, (call));                                                        \
        if (rc_ == CUDA_SUCCESS)                                                                \
            vgpu_tab_put(K_LOADED, key_, 0, -1);                                                \
        return rc_;                                                                             \
    } while (0)
#define LAZY_GET(h, call) LAZY_GET_ON((uintptr_t)(h), vgpu_cur_dev(), call)

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

VGPU_API CUresult cuLibraryGetManaged(CUdeviceptr *p, size_t *bytes, CUlibrary lib, const char *name)
{
    LAZY_GET(lib, REAL_FN(cuLibraryGetManaged)(p, bytes, lib, name));
}

/* A kernel's attribute on a device (cudaFuncGetAttributes' way) loads it there: watched on that
 * device's card (read blind, so reconciled, when it is not the current context's), keyed by
 * the kernel, the card and the current context (d + 3 > 0 for every card or none, -1 and -2:
 * never the plain handle, cuKernelGetFunction's key for the current context). */
VGPU_API CUresult cuKernelGetAttribute(int *pi, int attrib, CUkernel k, CUdevice dev)
{
    int d = vgpu_map_cuda_device(dev);
    LAZY_GET_ON(k ? (uintptr_t)k ^ (uint64_t)(d + 3) << 56 : 0, d,
                REAL_FN(cuKernelGetAttribute)(pi, attrib, k, dev));
}

/* ------------------------------------------------------------------ first launches */

/* Launches recorded: (function, context) keys (0: empty), open addressing. A launch looks its
 * key up (the current context, a hash, a load or two); a key is recorded only after a launch the
 * driver accepted in a watched context, so a launch that fails, or one made where nothing is
 * watched, leaves the next one watched. When a key's probe run is full its launches are all
 * watched (a program with thousands of functions pays two free-memory reads a launch for the
 * rest: only its own time). */
#define SEEN_KEYS 16384u
#define SEEN_PROBES 32u
static uint64_t seen_keys[SEEN_KEYS]; /* atomic */

static uint32_t seen_slot(uint64_t k)
{
    return (uint32_t)((k * 0xff51afd7ed558ccdull) >> 40) & (SEEN_KEYS - 1);
}

static int seen_has(uint64_t k)
{
    for (uint32_t n = 0, i = seen_slot(k); n < SEEN_PROBES; n++, i = (i + 1) & (SEEN_KEYS - 1)) {
        uint64_t v = __atomic_load_n(&seen_keys[i], __ATOMIC_RELAXED);
        if (v == k)
            return 1;
        if (!v)
            return 0;
    }
    return 0;
}

static void seen_add(uint64_t k)
{
    for (uint32_t n = 0, i = seen_slot(k); n < SEEN_PROBES; n++, i = (i + 1) & (SEEN_KEYS - 1)) {
        uint64_t v = __atomic_load_n(&seen_keys[i], __ATOMIC_RELAXED);
        if (v == k || (!v && (__atomic_compare_exchange_n(&seen_keys[i], &v, k, 0, __ATOMIC_RELAXED,
                                                          __ATOMIC_RELAXED) || v == k)))
            return;
    }
}

void vgpu_module_forget(void)
{
    for (uint32_t i = 0; i < SEEN_KEYS; i++)
        __atomic_store_n(&seen_keys[i], 0, __ATOMIC_RELAXED);
    vgpu_tab_drop_kind(K_LOADED);
}

int vgpu_launch_watch_begin(CUfunction f, CUstream s, struct vgpu_load_watch *w)
{
    uint64_t k = ctx_key((uintptr_t)f);
    w->d = -1;
    if (!k || seen_has(k))
        return 0;
    int d = vgpu_stream_dev(s);
    if (d == -2) /* the stream's context unknown (the driver refuses such a launch) */
        return 0;
    watch_begin(w, d);
    w->key = k;
    if (w->d < 0) /* a card without a memory limit: nothing to watch there */
        seen_add(k);
    return w->d >= 0;
}

void vgpu_launch_watch_end(const struct vgpu_load_watch *w, CUresult rc)
{
    got(w, rc);
    if (rc == CUDA_SUCCESS)
        seen_add(w->key);
}
