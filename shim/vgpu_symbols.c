/*
 * vgpu_symbols.c - how calls reach the shim and how the shim reaches the driver.
 *
 * Three doors, all answered from the hook tables (vgpu_cuda_hooks, vgpu_nvml_hooks):
 *  1. Direct linking: libvgpu.so exports the hooked names (cuMemAlloc_v2, nvmlDeviceGet...),
 *     and LD_PRELOAD puts it first in the global scope.
 *  2. dlsym(handle, "cu..."/"nvml..."): the CUDA runtime and NVML users dlopen the driver and
 *     look names up; our dlsym answers hooked names with the wrapper. dlsym(RTLD_NEXT, ...)
 *     keeps its meaning for every other name: the search starts after the *caller's* object,
 *     not after ours; a hooked name found there (the driver's, for a library loaded after the
 *     shim) is answered with the wrapper as well.
 *  3. cuGetProcAddress / cuGetProcAddress_v2 (CUDA >= 11.3 runtimes get every entry point
 *     this way): the real driver resolves the name for the requested cudaVersion and flags
 *     first; only if the pointer it returns is one of the ABI variants we wrap is it replaced
 *     by our wrapper for that same variant. So a request for an old ABI, a newer _v3, or a
 *     per-thread-default-stream (_ptsz) entry we do not wrap gets the driver's own function.
 *     If the driver hands out pointers that differ from its exported symbols (checked once),
 *     the match falls back to (name, minimum version, ptds flag) from the table.
 * The driver is reached through dlopen("libcuda.so.1") / dlopen("libnvidia-ml.so.1") and the
 * real dlsym (dlvsym(RTLD_NEXT, "dlsym", GLIBC_*)), never through the global scope, so our own
 * exports are never called by mistake.
 */
#include "vgpu_hooks.h"

#include <dlfcn.h>
#include <link.h>
#include <string.h>

/* A sanitizer runtime preloaded before the shim (make check-sanitize) resolves its interceptors
 * through dlsym(RTLD_NEXT, ...) before it has set itself up: the dlsym path must not be
 * instrumented (no effect on the release build). */
#define NO_SANITIZE __attribute__((no_sanitize("address", "thread")))

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_fn;       /* atomic: found once, idempotent */
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;
static int gpa_returns_exports = 1;  /* set in bind_cuda before the table is published */

/* bind_cuda runs inside pthread_once and calls the driver (its cuGetProcAddress probe). A driver
 * that reaches its own exports through the PLT (e.g. a stub built without -Bsymbolic) re-enters
 * our wrappers on the same thread: they then use the driver directly instead of waiting for the
 * once they are inside, which would never finish. */
static void *binding_lib;     /* the libcuda handle while bind_cuda runs, else NULL */
static pthread_t binding_thread;

static int in_bind(void)
{
    return __atomic_load_n(&binding_lib, __ATOMIC_ACQUIRE) != NULL && pthread_equal(binding_thread, pthread_self());
}

NO_SANITIZE static dlsym_fn find_real_dlsym(void)
{
    static const char *const vers[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    dlsym_fn f = NULL;
    for (size_t i = 0; i < sizeof vers / sizeof vers[0] && !f; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", vers[i]);
    __atomic_store_n(&real_dlsym_fn, f, __ATOMIC_RELAXED);
    return f;
}

NO_SANITIZE void *vgpu_real_dlsym(void *handle, const char *name)
{
    dlsym_fn f = __atomic_load_n(&real_dlsym_fn, __ATOMIC_RELAXED);
    if (!f)
        f = find_real_dlsym();
    return f ? f(handle, name) : NULL;
}

/* RTLD_NEXT on behalf of `caller`: the first object after the caller's in load order that
 * itself defines the name (glibc's rule for objects loaded at start-up). */
NO_SANITIZE static void *next_after(const void *caller, const char *name)
{
    Dl_info info;
    struct link_map *me = NULL;
    if (!dladdr1(caller, &info, (void **)&me, RTLD_DL_LINKMAP) || !me)
        return vgpu_real_dlsym(RTLD_NEXT, name);
    for (struct link_map *l = me->l_next; l; l = l->l_next) {
        void *h = dlopen(l->l_name[0] ? l->l_name : NULL, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            continue;
        void *p = vgpu_real_dlsym(h, name);
        dlclose(h);
        struct link_map *owner = NULL;
        if (p && dladdr1(p, &info, (void **)&owner, RTLD_DL_LINKMAP) && owner == l)
            return p;
    }
    return NULL;
}

void *vgpu_hook_for(const char *name)
{
    if (name[0] == 'c' && name[1] == 'u') {
        for (int i = 0; i < H_COUNT; i++)
            if (strcmp(vgpu_cuda_hooks[i].name, name) == 0)
                return vgpu_cuda_hooks[i].hook;
    } else if (strncmp(name, "nvml", 4) == 0) {
        for (int i = 0; i < N_COUNT; i++)
            if (strcmp(vgpu_nvml_hooks[i].name, name) == 0)
                return vgpu_nvml_hooks[i].hook;
    }
    return NULL;
}

NO_SANITIZE VGPU_API void *dlsym(void *handle, const char *symbol)
{
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* Sanitizer test build: the runtime asks before its dlopen/dladdr interceptors work, so
     * RTLD_NEXT is searched after the shim (glibc's own answer), not after the caller. */
    if (handle == RTLD_NEXT)
        return vgpu_real_dlsym(RTLD_NEXT, symbol);
#endif
    const char *sym = symbol;
    __asm__("" : "+r"(sym)); /* callers do pass NULL; keep the checks the compiler would drop */
    if (handle == RTLD_NEXT) {
        /* the next definition of a hooked name after a library loaded behind the shim is the
         * driver's own: that caller gets the wrapper too, as through any other door */
        void *p = next_after(__builtin_return_address(0), symbol);
        void *h = p && sym ? vgpu_hook_for(sym) : NULL;
        if (h && p != h) {
            vgpu_init();
            if (!vgpu.cfg.disabled)
                return h;
        }
        return p;
    }
    if (sym && ((sym[0] == 'c' && symbol[1] == 'u') || strncmp(symbol, "nvml", 4) == 0)) {
        void *h = vgpu_hook_for(symbol);
        if (h) {
            vgpu_init();
            if (!vgpu.cfg.disabled)
                return h;
        }
    }
    return vgpu_real_dlsym(handle, symbol);
}

#define SYM(lib, field, name) (*(void **)&vgpu.drv.field = vgpu_real_dlsym(lib, name))

static void bind_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        vgpu_log(0, "cannot load libcuda.so.1: %s", dlerror());
        return;
    }
    binding_thread = pthread_self();
    __atomic_store_n(&binding_lib, lib, __ATOMIC_RELEASE);
    SYM(lib, device_get_count, "cuDeviceGetCount");
    SYM(lib, device_get, "cuDeviceGet");
    if (!SYM(lib, device_get_uuid, "cuDeviceGetUuid_v2"))
        SYM(lib, device_get_uuid, "cuDeviceGetUuid");
    SYM(lib, device_get_attribute, "cuDeviceGetAttribute");
    SYM(lib, ctx_get_device, "cuCtxGetDevice");
    SYM(lib, ctx_get_current, "cuCtxGetCurrent");
    SYM(lib, ctx_get_limit, "cuCtxGetLimit");
    SYM(lib, ctx_push, "cuCtxPushCurrent_v2");
    SYM(lib, ctx_pop, "cuCtxPopCurrent_v2");
    SYM(lib, primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
    SYM(lib, primary_ctx_get_state, "cuDevicePrimaryCtxGetState");
    SYM(lib, stream_get_ctx, "cuStreamGetCtx");
    SYM(lib, stream_is_capturing, "cuStreamIsCapturing");
    SYM(lib, stream_capture_info, "cuStreamGetCaptureInfo");
    SYM(lib, stream_query, "cuStreamQuery");
    SYM(lib, event_create, "cuEventCreate");
    SYM(lib, event_destroy, "cuEventDestroy_v2");
    SYM(lib, event_record, "cuEventRecord");
    SYM(lib, event_query, "cuEventQuery");
    SYM(lib, event_elapsed, "cuEventElapsedTime");
    SYM(lib, array_mem_req, "cuArrayGetMemoryRequirements");
    SYM(lib, mipmap_mem_req, "cuMipmappedArrayGetMemoryRequirements");
    SYM(lib, module_loading_mode, "cuModuleGetLoadingMode");
    SYM(lib, graph_get_nodes, "cuGraphGetNodes");
    SYM(lib, graph_node_type, "cuGraphNodeGetType");
    SYM(lib, graph_mem_alloc_params, "cuGraphMemAllocNodeGetParams");
    SYM(lib, graph_child_graph, "cuGraphChildGraphNodeGetGraph");
    /* Does the driver's cuGetProcAddress hand out its exported addresses? */
    CUresult (*gpa)(const char *, void **, int, cuuint64_t) =
        (CUresult(*)(const char *, void **, int, cuuint64_t))vgpu_real_dlsym(lib, "cuGetProcAddress");
    void *probe = NULL, *exported = vgpu_real_dlsym(lib, "cuMemAlloc_v2");
    if (gpa && exported && gpa("cuMemAlloc", &probe, 12000, 0) == CUDA_SUCCESS && probe)
        gpa_returns_exports = probe == exported;
    vgpu.libcuda = lib;
    /* Published last (release): a thread that sees a .real sees everything above. */
    for (int i = 0; i < H_COUNT; i++)
        __atomic_store_n(&vgpu_cuda_hooks[i].real, vgpu_real_dlsym(lib, vgpu_cuda_hooks[i].name),
                         __ATOMIC_RELEASE);
    __atomic_store_n(&binding_lib, NULL, __ATOMIC_RELEASE);
    vgpu_log(3, "libcuda bound; cuGetProcAddress returns exported addresses: %d", gpa_returns_exports);
}

static void bind_nvml(void)
{
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        vgpu_log(2, "cannot load libnvidia-ml.so.1: %s", dlerror());
        return;
    }
    SYM(lib, nvml_init_v2, "nvmlInit_v2");
    SYM(lib, nvml_device_index, "nvmlDeviceGetIndex");
    SYM(lib, nvml_device_uuid, "nvmlDeviceGetUUID");
    SYM(lib, nvml_handle_by_uuid, "nvmlDeviceGetHandleByUUID");
    if (!SYM(lib, nvml_running_procs, "nvmlDeviceGetComputeRunningProcesses_v3"))
        SYM(lib, nvml_running_procs, "nvmlDeviceGetComputeRunningProcesses_v2");
    SYM(lib, nvml_samples, "nvmlDeviceGetSamples");
    vgpu.libnvml = lib;
    for (int i = 0; i < N_COUNT; i++)
        __atomic_store_n(&vgpu_nvml_hooks[i].real, vgpu_real_dlsym(lib, vgpu_nvml_hooks[i].name),
                         __ATOMIC_RELEASE);
}

void vgpu_symbols_bind(void)
{
    pthread_once(&cuda_once, bind_cuda);
}

void vgpu_nvml_bind(void)
{
    pthread_once(&nvml_once, bind_nvml);
}

void *vgpu_real_cuda(int idx)
{
    void *p = __atomic_load_n(&vgpu_cuda_hooks[idx].real, __ATOMIC_ACQUIRE);
    if (__builtin_expect(p != NULL, 1))
        return p;
    if (in_bind())
        return vgpu_real_dlsym(binding_lib, vgpu_cuda_hooks[idx].name);
    pthread_once(&cuda_once, bind_cuda);
    return vgpu_cuda_hooks[idx].real;
}

void *vgpu_real_nvml(int idx)
{
    void *p = __atomic_load_n(&vgpu_nvml_hooks[idx].real, __ATOMIC_ACQUIRE);
    if (__builtin_expect(p != NULL, 1))
        return p;
    pthread_once(&nvml_once, bind_nvml);
    return vgpu_nvml_hooks[idx].real;
}

void *vgpu_cuda_sym(const char *name)
{
    if (in_bind())
        return vgpu_real_dlsym(binding_lib, name);
    pthread_once(&cuda_once, bind_cuda);
    return vgpu.libcuda ? vgpu_real_dlsym(vgpu.libcuda, name) : NULL;
}

void *vgpu_nvml_sym(const char *name)
{
    pthread_once(&nvml_once, bind_nvml);
    return vgpu.libnvml ? vgpu_real_dlsym(vgpu.libnvml, name) : NULL;
}

/* Replace a driver pointer returned by cuGetProcAddress with our wrapper of the same ABI. */
static void *translate(const char *symbol, void *p, int ver, cuuint64_t flags)
{
    if (!p || !symbol || in_bind())
        return p;
    vgpu_symbols_bind(); /* the caller got p from the bound driver: orders the reads below */
    for (int i = 0; i < H_COUNT; i++)
        if (vgpu_cuda_hooks[i].real == p)
            return vgpu_cuda_hooks[i].hook;
    if (gpa_returns_exports)
        return p;
    int best = -1, ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (int i = 0; i < H_COUNT; i++) {
        const struct vgpu_hook *h = &vgpu_cuda_hooks[i];
        if (strcmp(h->base, symbol) == 0 && ver >= h->min_version && h->ptds == ptds && h->real &&
            (best < 0 || h->min_version > vgpu_cuda_hooks[best].min_version))
            best = i;
    }
    return best >= 0 ? vgpu_cuda_hooks[best].hook : p;
}

VGPU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags)
{
    vgpu_init();
    vgpu_fn_cuGetProcAddress real = REAL_FN(cuGetProcAddress);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real(symbol, pfn, ver, flags);
    if (rc == CUDA_SUCCESS && pfn && !vgpu.cfg.disabled)
        *pfn = translate(symbol, *pfn, ver, flags);
    return rc;
}

VGPU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                      int *status)
{
    vgpu_init();
    vgpu_fn_cuGetProcAddress_v2 real = REAL_FN(cuGetProcAddress_v2);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real(symbol, pfn, ver, flags, status);
    if (rc == CUDA_SUCCESS && pfn && !vgpu.cfg.disabled)
        *pfn = translate(symbol, *pfn, ver, flags);
    return rc;
}
