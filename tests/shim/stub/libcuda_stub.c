/*
 * Stub libcuda.so.1 for the shim's CPU tests: a card of STUB_MEM_MIB MiB whose kernels take
 * STUB_KERNEL_US of simulated GPU time on one FIFO queue shared by all processes (see
 * stub_state.h). Error codes and NULL handling follow the CUDA driver API reference where
 * the tests depend on them. Built with -Wl,-Bsymbolic so its own references bind locally, as
 * the real driver's do.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include "stub_state.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUfunction, *CUarray, *CUmipmappedArray, *CUmemoryPool, *CUgraphExec;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void *w; unsigned char f[8]; } CUmemAllocationProp;
typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
typedef struct { unsigned Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct { unsigned Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR_v1;
typedef struct { size_t size, alignment; unsigned reserved[4]; } CUDA_ARRAY_MEMORY_REQUIREMENTS;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shm; CUstream hStream; void *attrs; unsigned n; } CUlaunchConfig;

#define API __attribute__((visibility("default")))
#define OK 0
#define E_INVALID_VALUE 1
#define E_OOM 2
#define E_NOT_INIT 3
#define E_INVALID_DEVICE 101
#define E_INVALID_CONTEXT 201
#define E_NOT_FOUND 500
#define E_NOT_SUPPORTED 801
#define MIB (1024ull * 1024ull)
#include "stub_hidden.h"

static int inited, nvis, vis[STUB_MAXDEV];
static __thread int cur_ctx = -1; /* physical index of the current context's card */
/* The current context's handle: a card's primary context is 0x1000 + phys, a created one
 * 0x1000 + phys + 16 x serial. Contexts of one card share its timeline (they take turns on a
 * real card); events and created streams belong to the context current when they were made. */
static __thread void *cur_handle;
static __thread void *ctx_stack[16];
static __thread int ctx_depth;
static void set_current(void *c)
{
    cur_handle = c;
    cur_ctx = c ? (int)(((uintptr_t)c - 0x1000) % 16) : -1;
}
static int ctx_made[STUB_MAXDEV];
static _Atomic uint64_t next_addr = 0;

/* ctx: the context whose end frees it (linear allocations, arrays; NULL: pool and VMM memory,
 * which outlive a context here) */
struct ent { uint64_t key; uint64_t size; int phys; int kind; void *ctx; };
static struct ent tab[65536];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int ndev_phys(void) { long n = stub_env("STUB_NDEV", 1); return n < 1 ? 1 : n > STUB_MAXDEV ? STUB_MAXDEV : (int)n; }
static uint64_t mem_total(void) { return (uint64_t)stub_env("STUB_MEM_MIB", 1024) * MIB; }

static void uuid_str(int phys, char *out, size_t n)
{
    unsigned char b[16];
    stub_uuid_bytes(phys, b);
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void parse_visible(void)
{
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    int np = ndev_phys();
    nvis = 0;
    if (!v) {
        for (int i = 0; i < np; i++)
            vis[nvis++] = i;
        return;
    }
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *t = strtok(buf, ","); t && nvis < STUB_MAXDEV; t = strtok(NULL, ",")) {
        int phys = -1;
        if (!strncmp(t, "GPU-", 4)) {
            for (int i = 0; i < np; i++) {
                char u[64];
                uuid_str(i, u, sizeof u);
                if (!strcmp(u, t))
                    phys = i;
            }
        } else {
            phys = atoi(t);
        }
        if (phys < 0 || phys >= np)
            break; /* like the driver: stop at the first invalid entry */
        vis[nvis++] = phys;
    }
}

static int phys_of(CUdevice d) { return (d >= 0 && d < nvis) ? vis[d] : -1; }

static struct ent *find(uint64_t key, int kind, int create)
{
    size_t h = (size_t)((key * 0x9e3779b97f4a7c15ull) >> 48) ^ (size_t)kind;
    for (size_t i = 0; i < 65536; i++) {
        struct ent *e = &tab[(h + i) & 65535];
        if (e->kind == kind && e->key == key)
            return e;
        if (!e->kind && create)
            return e;
        if (!e->kind)
            return NULL;
    }
    return NULL;
}

static void make_ctx(int phys)
{
    if (!ctx_made[phys]) {
        ctx_made[phys] = 1;
        struct stub_proc *me = stub_me();
        if (me)
            atomic_fetch_add(&me->used[phys], (uint64_t)stub_env("STUB_CTX_MIB", 64) * MIB);
    }
}

/* Physical allocation: 2 MiB pages, refused when the card is full. */
static CUresult phys_alloc_in(int phys, uint64_t size, unsigned long long *addr, int kind, uint64_t key_hint, void *ctx)
{
    if (size == 0)
        return E_INVALID_VALUE;
    uint64_t rounded = (size + 2 * MIB - 1) & ~(2 * MIB - 1);
    pthread_mutex_lock(&mu);
    if (stub_dev_used(phys) + rounded > mem_total()) {
        pthread_mutex_unlock(&mu);
        return E_OOM;
    }
    struct stub_proc *me = stub_me();
    atomic_fetch_add(&me->used[phys], rounded);
    uint64_t a = key_hint ? key_hint : ((uint64_t)getpid() << 36) + atomic_fetch_add(&next_addr, rounded) + 0x1000000;
    struct ent *e = find(a, kind, 1);
    *e = (struct ent){a, rounded, phys, kind, ctx};
    pthread_mutex_unlock(&mu);
    *addr = a;
    return OK;
}

/* Memory a context owns: the current one's (cuMemAlloc, pitch, managed, arrays). */
static CUresult phys_alloc(int phys, uint64_t size, unsigned long long *addr, int kind, uint64_t key_hint)
{
    return phys_alloc_in(phys, size, addr, kind, key_hint, cur_handle);
}

static CUresult phys_free(uint64_t key, int kind)
{
    pthread_mutex_lock(&mu);
    struct ent *e = find(key, kind, 0);
    if (!e) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_VALUE;
    }
    atomic_fetch_sub(&stub_me()->used[e->phys], e->size);
    /* backward-shift deletion keeps the probe chains intact */
    size_t i = (size_t)(e - tab);
    e->kind = 0;
    for (size_t j = (i + 1) & 65535; tab[j].kind; j = (j + 1) & 65535) {
        struct ent t = tab[j];
        tab[j].kind = 0;
        *find(t.key, t.kind, 1) = t;
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

/* A context's end (a created one destroyed, a primary one reset or released for the last time)
 * frees the memory it owns, as a driver does. */
static void free_ctx_mem(void *ctx)
{
    static struct { uint64_t key; int kind; } dead[4096];
    int n;
    do {
        n = 0;
        pthread_mutex_lock(&mu);
        for (size_t i = 0; i < 65536 && n < 4096; i++)
            if (tab[i].kind && tab[i].ctx == ctx && ctx)
                dead[n].key = tab[i].key, dead[n++].kind = tab[i].kind;
        pthread_mutex_unlock(&mu);
        for (int i = 0; i < n; i++)
            phys_free(dead[i].key, dead[i].kind);
    } while (n == 4096);
}

#define NEED_CTX() do { if (!inited) return E_NOT_INIT; if (cur_ctx < 0) return E_INVALID_CONTEXT; } while (0)

API CUresult cuInit(unsigned flags) { (void)flags; parse_visible(); inited = 1; stub_me(); return OK; }
API CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 13000; return OK; }
API CUresult cuDeviceGetCount(int *n) { if (!inited) return E_NOT_INIT; if (!n) return E_INVALID_VALUE; *n = nvis; return OK; }
API CUresult cuDeviceGet(CUdevice *d, int ord) { if (!inited) return E_NOT_INIT; if (!d) return E_INVALID_VALUE; if (ord < 0 || ord >= nvis) return E_INVALID_DEVICE; *d = ord; return OK; }
API CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { int p = phys_of(d); if (p < 0) return E_INVALID_DEVICE; stub_uuid_bytes(p, (unsigned char *)u->bytes); return OK; }
API CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }
API CUresult cuDeviceGetName(char *n, int len, CUdevice d) { if (phys_of(d) < 0) return E_INVALID_DEVICE; snprintf(n, (size_t)len, "Stub GPU"); return OK; }
API CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { if (!inited) return E_NOT_INIT; if (!b) return E_INVALID_VALUE; if (phys_of(d) < 0) return E_INVALID_DEVICE; *b = mem_total(); return OK; }
/* A card's primary context keeps its handle (0x1000 + card) across a reset or its last release,
 * as the driver may hand back the same one: its generation tells an event of the old one apart. */
static _Atomic unsigned prim_gen[16];
static _Atomic int prim_refs[16];
static int prim_of(const void *c) { uintptr_t v = (uintptr_t)c; return v >= 0x1000 && v < 0x1000 + 16 ? (int)(v - 0x1000) : -1; }
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { int p = phys_of(d); if (p < 0) return E_INVALID_DEVICE; make_ctx(p); atomic_fetch_add(&prim_refs[p], 1); *c = (CUcontext)(uintptr_t)(0x1000 + p); return OK; }
API CUresult cuCtxCreate_v2(CUcontext *c, unsigned f, CUdevice d) { (void)f; return hidden_ctx_create(c, d); }
API CUresult cuCtxCreate(CUcontext *c, unsigned f, CUdevice d) { return cuCtxCreate_v2(c, f, d); } /* < 3.2 name */
API CUresult cuCtxSetCurrent(CUcontext c) { set_current(c); return OK; }
API CUresult cuCtxGetCurrent(CUcontext *c) { *c = cur_handle; return OK; }
static int ctx_dead(void *c);
API CUresult cuCtxPushCurrent_v2(CUcontext c)
{
    if (!c || ctx_depth == 16) return E_INVALID_VALUE;
    if (ctx_dead(c)) return E_INVALID_CONTEXT;
    ctx_stack[ctx_depth++] = cur_handle;
    set_current(c);
    return OK;
}
API CUresult cuCtxPopCurrent_v2(CUcontext *c)
{
    if (!ctx_depth) return E_INVALID_CONTEXT;
    if (c) *c = cur_handle;
    set_current(ctx_stack[--ctx_depth]);
    return OK;
}
API CUresult cuCtxGetDevice(CUdevice *d)
{
    NEED_CTX();
    for (int i = 0; i < nvis; i++)
        if (vis[i] == cur_ctx) { *d = i; return OK; }
    return E_INVALID_CONTEXT;
}

static _Atomic unsigned long long info_calls;
API unsigned long long stubMemInfoCalls(void) { return info_calls; } /* calls of the next, so far */
API CUresult cuMemGetInfo_v2(size_t *f, size_t *t)
{
    atomic_fetch_add(&info_calls, 1);
    NEED_CTX(); /* NULL out-pointers are accepted, as driver 580 does (measured) */
    uint64_t used = stub_dev_used(cur_ctx), tot = mem_total();
    if (f) *f = used > tot ? 0 : tot - used;
    if (t) *t = tot;
    return OK;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { NEED_CTX(); if (!p) return E_INVALID_VALUE; return phys_alloc(cur_ctx, n, p, 1, 0); }
/* The CUDA 3.1 ABI (32-bit size): what cuGetProcAddress("cuMemAlloc", 3010) resolves to. */
static CUresult low_alloc(unsigned *p, uint64_t n) /* 32-bit addresses for the v1 ABI */
{
    static unsigned next = 0x10000000u;
    NEED_CTX();
    if (!p) return E_INVALID_VALUE;
    unsigned long long a = next;
    CUresult rc = phys_alloc(cur_ctx, n, &a, 1, next);
    if (rc == OK) { *p = (unsigned)a; next += (unsigned)((n + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1)); }
    return rc;
}
API CUresult cuMemAlloc(unsigned *p, unsigned n) { return low_alloc(p, n); }
API CUresult cuMemFree_v2(CUdeviceptr p);
API CUresult cuMemFree(unsigned p) { return cuMemFree_v2(p); }
API CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned fl) { (void)fl; return cuMemAlloc_v2(p, n); }
API CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
    NEED_CTX();
    if (!p || !pitch || (e != 4 && e != 8 && e != 16)) return E_INVALID_VALUE;
    size_t pt = (w + 2047) & ~(size_t)2047; /* this stub pads rows to 2 KiB */
    CUresult rc = phys_alloc(cur_ctx, (uint64_t)pt * h, p, 1, 0);
    if (rc == OK) *pitch = pt;
    return rc;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { if (!inited) return E_NOT_INIT; if (hidden_graph_free(p)) return OK; return phys_free(p, 1); }
/* The CUDA < 3.2 ABI (32-bit): pitch, memory info and total, as a driver still exports them. */
API CUresult cuMemAllocPitch(unsigned *p, unsigned *pitch, unsigned w, unsigned h, unsigned e)
{
    if (!p || !pitch || (e != 4 && e != 8 && e != 16)) return E_INVALID_VALUE;
    unsigned pt = (w + 2047) & ~2047u; /* rows padded to 2 KiB, as cuMemAllocPitch_v2 here */
    CUresult rc = low_alloc(p, (uint64_t)pt * h);
    if (rc == OK) *pitch = pt;
    return rc;
}
API CUresult cuMemGetInfo(unsigned *f, unsigned *t)
{
    size_t F = 0, T = 0;
    CUresult rc = cuMemGetInfo_v2(&F, &T);
    if (rc == OK) { if (f) *f = F > 0xffffffffu ? 0xffffffffu : (unsigned)F; if (t) *t = T > 0xffffffffu ? 0xffffffffu : (unsigned)T; }
    return rc;
}
API CUresult cuDeviceTotalMem(unsigned *b, CUdevice d)
{
    size_t T = 0;
    CUresult rc = cuDeviceTotalMem_v2(b ? &T : NULL, d);
    if (rc == OK && b) *b = T > 0xffffffffu ? 0xffffffffu : (unsigned)T;
    return rc;
}
/* Stream-ordered memory lives on the card of the stream's context (cuMemAllocAsync) or of the
 * pool (cuMemAllocFromPoolAsync: a card's default pool 0x500 + ordinal, a created one 0x600 +
 * physical index; host-located pools are not modelled), whatever context is current. */
static void *ctx_of_stream(CUstream s);
static int stream_phys(CUstream s)
{
    void *c = ctx_of_stream(s);
    return c ? (int)(((uintptr_t)c - 0x1000) % 16) : cur_ctx;
}
static int pool_phys(CUmemoryPool pool, CUstream s)
{
    uintptr_t v = (uintptr_t)pool;
    if (v >= 0x500 && v < 0x500 + STUB_MAXDEV)
        return phys_of((CUdevice)(v - 0x500));
    return v >= 0x600 && v < 0x600 + STUB_MAXDEV ? (int)(v - 0x600) : stream_phys(s);
}
static CUresult stream_alloc(CUdeviceptr *p, size_t n, int phys)
{
    NEED_CTX();
    if (!p) return E_INVALID_VALUE;
    if (phys < 0) return E_INVALID_DEVICE;
    return phys_alloc_in(phys, n, p, 1, 0, NULL);
}
API CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { if (hidden_capturing(s)) return hidden_capture_alloc(s, p, n); return stream_alloc(p, n, stream_phys(s)); }
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    if (!pool) return E_INVALID_VALUE;
    if (hidden_capturing(s)) return hidden_capture_alloc(s, p, n);
    return stream_alloc(p, n, pool_phys(pool, s));
}
API CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props)
{
    const struct { int alloc_type, handle_types, loc_type, loc_id; } *pp = props;
    if (!inited) return E_NOT_INIT;
    if (!pool || !pp) return E_INVALID_VALUE;
    if (pp->loc_type != 1) return E_NOT_SUPPORTED; /* host locations: not modelled */
    int phys = phys_of(pp->loc_id);
    if (phys < 0) return E_INVALID_DEVICE;
    *pool = (CUmemoryPool)(uintptr_t)(0x600 + phys);
    return OK;
}
API CUresult cuMemPoolDestroy(CUmemoryPool pool) { return pool ? OK : E_INVALID_VALUE; }
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) { return cuMemAllocFromPoolAsync(p, n, pool, s); }
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { if (hidden_capturing(s)) return OK; return cuMemFree_v2(p); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }
API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop, unsigned long long fl)
{
    (void)fl;
    if (!inited) return E_NOT_INIT;
    if (!h || !prop || prop->location.type != 1) return E_INVALID_VALUE;
    int p = phys_of(prop->location.id);
    if (p < 0) return E_INVALID_DEVICE;
    if (n % (2 * MIB)) return E_INVALID_VALUE; /* granularity, like the driver */
    return phys_alloc_in(p, n, h, 2, 0, NULL);
}
/* Virtual memory: as on the driver, a handle released while mapped keeps its memory (and its
 * NVML usage) until its last mapping is unmapped. */
#define STUB_MAPS 1024
static struct { uint64_t va, size, h; } maps[STUB_MAPS];
static struct { uint64_t h; int released; } held_handles[STUB_MAPS];
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t next_va = 0x7f0000000000ull;
/* cuMemMapArrayAsync's operations (cuda.h CUarrayMapInfo) and the handles mapped into sparse
 * arrays: held as by cuMemMap until the same subresource is unmapped or the array destroyed. */
typedef struct {
    int resourceType;
    void *resource;
    int subresourceType;
    union { unsigned level[8]; unsigned long long align[4]; } sub;
    int op, htype;
    CUmemGenericAllocationHandle h;
    unsigned long long offset;
    unsigned mask, flags, reserved[2];
} CUarrayMapInfo;
static struct { int used; void *res; int subtype; unsigned char sub[32]; uint64_t h; } amaps[STUB_MAPS];
static int handle_maps(uint64_t h)
{
    int n = 0;
    for (int i = 0; i < STUB_MAPS; i++)
        n += (maps[i].size && maps[i].h == h) + (amaps[i].used && amaps[i].h == h);
    return n;
}
/* Handle h lost a mapping (under vmm_mu): released and now unmapped, it is gone. */
static void unheld(uint64_t h, uint64_t *gone, int *ngone)
{
    for (int k = 0; k < STUB_MAPS; k++)
        if (held_handles[k].released && held_handles[k].h == h && !handle_maps(h))
            held_handles[k].released = 0, gone[(*ngone)++] = h;
}
/* Whether h is a live cuMemCreate handle. */
static int handle_known(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&mu);
    int known = find(h, 2, 0) != NULL;
    pthread_mutex_unlock(&mu);
    return known;
}
API CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long fl)
{
    (void)align, (void)addr, (void)fl;
    if (!inited) return E_NOT_INIT;
    if (!p || !size) return E_INVALID_VALUE;
    *p = atomic_fetch_add(&next_va, (size + 2 * MIB - 1) & ~(2 * MIB - 1));
    return OK;
}
API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { (void)p, (void)size; return inited ? OK : E_NOT_INIT; }
API CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void *desc, size_t n) { (void)p, (void)size, (void)desc, (void)n; return OK; }
API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long fl)
{
    (void)off, (void)fl;
    if (!inited) return E_NOT_INIT;
    if (!handle_known(h) || !size) return E_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    for (int i = 0; i < STUB_MAPS; i++)
        if (!maps[i].size) {
            maps[i].va = va, maps[i].size = size, maps[i].h = h;
            pthread_mutex_unlock(&vmm_mu);
            return OK;
        }
    pthread_mutex_unlock(&vmm_mu);
    return E_OOM;
}
API CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    if (!inited) return E_NOT_INIT;
    uint64_t gone[STUB_MAPS];
    int ngone = 0;
    pthread_mutex_lock(&vmm_mu);
    for (int i = 0; i < STUB_MAPS; i++)
        if (maps[i].size && maps[i].va >= va && maps[i].va < va + size) {
            maps[i].size = 0;
            unheld(maps[i].h, gone, &ngone);
        }
    pthread_mutex_unlock(&vmm_mu);
    for (int i = 0; i < ngone; i++)
        phys_free(gone[i], 2);
    return OK;
}
/* A handle exported as a POSIX file descriptor (type 1; a descriptor of /dev/null here); the stub
 * frees the memory at the handle's release all the same. */
API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long fl)
{
    (void)fl;
    if (!inited) return E_NOT_INIT;
    if (!out || type != 1 || !handle_known(h)) return E_INVALID_VALUE;
    int fd = open("/dev/null", O_RDONLY);
    if (fd < 0) return E_OOM;
    *(int *)out = fd;
    return OK;
}
/* One more reference to the handle mapped at addr: a released one is live again (the stub keeps
 * one extra reference at most). */
API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    if (!inited) return E_NOT_INIT;
    if (!h) return E_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    for (int i = 0; i < STUB_MAPS; i++)
        if (maps[i].size && maps[i].va == (uint64_t)(uintptr_t)addr) {
            *h = maps[i].h;
            for (int k = 0; k < STUB_MAPS; k++)
                if (held_handles[k].released && held_handles[k].h == *h)
                    held_handles[k].released = 0;
            pthread_mutex_unlock(&vmm_mu);
            return OK;
        }
    pthread_mutex_unlock(&vmm_mu);
    return E_INVALID_VALUE;
}
API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&vmm_mu);
    if (handle_maps(h)) {
        for (int k = 0; k < STUB_MAPS; k++)
            if (!held_handles[k].released) {
                held_handles[k].h = h, held_handles[k].released = 1;
                break;
            }
        pthread_mutex_unlock(&vmm_mu);
        return OK;
    }
    pthread_mutex_unlock(&vmm_mu);
    return phys_free(h, 2);
}

static uint64_t arr_bytes(size_t w, size_t h, size_t d, unsigned ch)
{
    uint64_t b = (uint64_t)w * (h ? h : 1) * (d ? d : 1) * 4 * (ch ? ch : 1);
    return (b + 65535) & ~65535ull;
}
API CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    NEED_CTX();
    unsigned long long addr;
    CUresult rc = phys_alloc(cur_ctx, arr_bytes(d->Width, d->Height, 1, d->NumChannels), &addr, 3, 0);
    if (rc == OK) *a = (CUarray)(uintptr_t)addr;
    return rc;
}
/* A sparse or deferred-mapping array (Flags 0x40, 0x80): no memory of its own, as on the driver
 * (its tiles are handles mapped in with cuMemMapArrayAsync). */
static CUresult no_memory(int kind, unsigned long long *addr)
{
    pthread_mutex_lock(&mu);
    uint64_t a = ((uint64_t)getpid() << 36) + atomic_fetch_add(&next_addr, 65536) + 0x1000000;
    *find(a, kind, 1) = (struct ent){a, 0, cur_ctx, kind};
    pthread_mutex_unlock(&mu);
    *addr = a;
    return OK;
}
API CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    NEED_CTX();
    unsigned long long addr;
    CUresult rc = d->Flags & 0xc0 ? no_memory(3, &addr)
                                  : phys_alloc(cur_ctx, arr_bytes(d->Width, d->Height, d->Depth, d->NumChannels), &addr, 3, 0);
    if (rc == OK) *a = (CUarray)(uintptr_t)addr;
    return rc;
}
API CUresult cuArrayCreate(CUarray *a, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!d) return E_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR v2 = {d->Width, d->Height, d->Format, d->NumChannels};
    return cuArrayCreate_v2(a, &v2);
}
API CUresult cuArray3DCreate(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!d) return E_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR v2 = {d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(a, &v2);
}
/* The mappings into array `res` go (its destruction, or an unmap of one subresource `op`). */
static void array_unmap(void *res, const CUarrayMapInfo *op)
{
    uint64_t gone[STUB_MAPS];
    int ngone = 0;
    pthread_mutex_lock(&vmm_mu);
    for (int i = 0; i < STUB_MAPS; i++)
        if (amaps[i].used && amaps[i].res == res &&
            (!op || (amaps[i].subtype == op->subresourceType && !memcmp(amaps[i].sub, &op->sub, 32)))) {
            amaps[i].used = 0;
            unheld(amaps[i].h, gone, &ngone);
        }
    pthread_mutex_unlock(&vmm_mu);
    for (int i = 0; i < ngone; i++)
        phys_free(gone[i], 2);
}
static CUresult map_array_one(const CUarrayMapInfo *op)
{
    if (!op->resource) return E_INVALID_VALUE;
    if (op->op == 2) {
        array_unmap(op->resource, op);
        return OK;
    }
    pthread_mutex_lock(&mu);
    int known = op->op == 1 && op->htype == 0 && find(op->h, 2, 0) != NULL;
    pthread_mutex_unlock(&mu);
    if (!known) return E_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    for (int i = 0; i < STUB_MAPS; i++)
        if (!amaps[i].used) {
            amaps[i].used = 1, amaps[i].res = op->resource, amaps[i].subtype = op->subresourceType, amaps[i].h = op->h;
            memcpy(amaps[i].sub, &op->sub, 32);
            pthread_mutex_unlock(&vmm_mu);
            return OK;
        }
    pthread_mutex_unlock(&vmm_mu);
    return E_OOM;
}
/* Another thread of the tenant rewriting its operations right after the driver read them (made
 * deterministic): the list registered with stub_race_map_ops loses its first resource. */
static CUarrayMapInfo *race_ops;
API void stub_race_map_ops(CUarrayMapInfo *ops) { race_ops = ops; }
API CUresult cuMemMapArrayAsync(CUarrayMapInfo *ops, unsigned n, CUstream s)
{
    (void)s;
    if (!inited) return E_NOT_INIT;
    if (!ops) return E_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++) {
        CUresult rc = map_array_one(&ops[i]);
        if (rc) return rc;
    }
    if (race_ops)
        race_ops->resource = NULL, race_ops = NULL;
    return OK;
}
API CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *ops, unsigned n, CUstream s) { return cuMemMapArrayAsync(ops, n, s); }
API CUresult cuArrayDestroy(CUarray a)
{
    CUresult rc = phys_free((uint64_t)(uintptr_t)a, 3);
    if (rc == OK) array_unmap(a, NULL);
    return rc;
}
/* As the driver: an array's memory requirements are given for a deferred-mapping array only
 * (CUDA_ERROR_INVALID_VALUE for one with memory of its own; STUB_ARRAY_REQ=1: for every array). */
static int req_refused(const struct ent *e) { return !e || (e->size && !stub_env("STUB_ARRAY_REQ", 0)); }
API CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUarray a, CUdevice d)
{
    (void)d;
    pthread_mutex_lock(&mu);
    struct ent *e = find((uint64_t)(uintptr_t)a, 3, 0);
    pthread_mutex_unlock(&mu);
    if (req_refused(e)) return E_INVALID_VALUE;
    r->size = e->size, r->alignment = 65536;
    return OK;
}
API CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    NEED_CTX();
    uint64_t base = arr_bytes(d->Width, d->Height, d->Depth, d->NumChannels);
    unsigned long long addr;
    CUresult rc = d->Flags & 0xc0 ? no_memory(4, &addr) : phys_alloc(cur_ctx, levels > 1 ? base + base / 3 : base, &addr, 4, 0);
    if (rc == OK) *a = (CUmipmappedArray)(uintptr_t)addr;
    return rc;
}
API CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    CUresult rc = phys_free((uint64_t)(uintptr_t)a, 4);
    if (rc == OK) array_unmap(a, NULL);
    return rc;
}
API CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUmipmappedArray a, CUdevice d)
{
    (void)d;
    pthread_mutex_lock(&mu);
    struct ent *e = find((uint64_t)(uintptr_t)a, 4, 0);
    pthread_mutex_unlock(&mu);
    if (req_refused(e)) return E_INVALID_VALUE;
    r->size = e->size, r->alignment = 65536;
    return OK;
}
API CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *v) { (void)d; (void)attr; *(uint64_t *)v = 0; return OK; }

/* ---- execution: one FIFO queue per card, shared by all processes.
 * A kernel takes STUB_KERNEL_US, or with STUB_GRID_US=1 gridDimX microseconds (so a test
 * program picks each launch's duration). Streams: the legacy NULL stream (slot 0), the
 * per-thread stream (1) and created ones (2..); each remembers when its last kernel ends. The
 * legacy stream's work waits for the earlier work of every blocking stream (all but those made
 * CU_STREAM_NON_BLOCKING), and theirs for the legacy stream's earlier kernels and event
 * records. The card still runs one kernel at a time in launch order across streams and processes.
 * STUB_TIMESLICE=1: as a real GPU does with contexts of different processes, each process has
 * its own queue and the card shares its time among the processes that have work (processor
 * sharing, the limit of time slices made small): while k processes have work each one's runs
 * at 1/k of its speed, the one running when another arrives too (its GPU time, stubBusyNs,
 * stays its duration). Times of kernels, events and streams are then values of the card's
 * shared clock (struct stub_ps: the GPU time each busy process has received), mapped back to
 * wall time where one is read (cuEventElapsedTime). So an event pair around a process's kernel
 * measures its siblings' time slices too, as cuEventElapsedTime does on the GPU.
 * STUB_CONCURRENT=1: kernels of small grids, as the GPU runs those of different streams side by
 * side: each starts as soon as its own stream lets it, never waiting for the card; stubDoneNs
 * then counts the time at least one of them ran (overlaps once), as NVML's utilization does.
 * Held streams (cuStreamWaitValue32 below): work queued behind a wait for a value runs only once
 * cuStreamWriteValue32 writes it. */
#define STUB_STREAMS 32
static _Atomic uint64_t last_done[STUB_MAXDEV][STUB_STREAMS];
static _Atomic int next_stream = 2;
/* A destroyed stream's slot is handed out again by the next create (a real driver may hand back
 * the same handle too); meanwhile an event record on it fails (CUDA_ERROR_INVALID_HANDLE). */
static _Atomic int stream_dead[STUB_STREAMS];

static _Atomic int non_blocking[STUB_STREAMS]; /* CU_STREAM_NON_BLOCKING: the legacy stream does not wait for it */
static void *stream_ctx[STUB_STREAMS];          /* the context a created stream belongs to */
static pthread_mutex_t ring_mu = PTHREAD_MUTEX_INITIALIZER;
/* this process's latest kernels; `held`: slot + 1 of the held stream it waits on (end unknown) */
static struct { uint64_t end, dur; int held; } ring[STUB_MAXDEV][4096];
static unsigned ring_n[STUB_MAXDEV];

/* A stream waiting for a value (cuStreamWaitValue32 on host memory, the only kind the stub
 * has): its kernels and events are queued without a time (STUB_PENDING) and get one when
 * cuStreamWriteValue32 writes the value; the card runs the others meanwhile. Under hold_mu,
 * taken before ring_mu. */
#define STUB_PENDING UINT64_MAX
#define STUB_HOLD_GENS 64
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int held[STUB_MAXDEV][STUB_STREAMS];
static struct hold {
    volatile uint32_t *addr;
    uint32_t value, flags;
    uint64_t after;  /* the stream's work queued before the wait ends then */
    uint64_t queued; /* GPU ns queued behind the wait */
    uint32_t gen;    /* waits so far on this stream */
    uint64_t start[STUB_HOLD_GENS]; /* per wait: when its work started (0: not yet) */
} hold[STUB_MAXDEV][STUB_STREAMS];

/* fork (cuprog fork cuda): the stub's locks are not held across it, as a driver's are not.
 * Every one of them: a child forked while a busy parent thread held the graph lock (each
 * cuMemFree takes it) hung in its first cuMemFree (seen as 1 child in 40, rarely). The graph
 * and module locks are defined in stub_hidden.inc, included further down. Taken in the order
 * the stub nests them (mu before vmm_mu, hold_mu before ring_mu; the others are leaves). */
static pthread_mutex_t g_mu, mod_mu;
static pthread_mutex_t *const fork_mus[] = {&mu, &vmm_mu, &hold_mu, &ring_mu, &g_mu, &mod_mu};
#define FORK_MUS (sizeof fork_mus / sizeof fork_mus[0])
static void stub_fork_prepare(void)
{
    for (size_t i = 0; i < FORK_MUS; i++)
        pthread_mutex_lock(fork_mus[i]);
}
static void stub_fork_parent(void)
{
    for (size_t i = FORK_MUS; i-- > 0;)
        pthread_mutex_unlock(fork_mus[i]);
}
static void stub_fork_child(void)
{
    for (size_t i = 0; i < FORK_MUS; i++)
        pthread_mutex_init(fork_mus[i], NULL);
}
__attribute__((constructor)) static void stub_atfork(void)
{
    pthread_atfork(stub_fork_prepare, stub_fork_parent, stub_fork_child);
}

static int null_launch = -1, grid_us = -1, timeslice = -1, concurrent = -1;
static CUstream restart_on = (CUstream)(uintptr_t)-1; /* STUB_CAPTURE_RESTARTS_AROUND_LAUNCH */

/* Each thread's per-thread default stream (CU_STREAM_PER_THREAD) is a stream of its own, a
 * blocking one, taken from the created streams' slots at its first use (slot 1 when they are
 * all taken). */
static __thread int pts_slot;
static int slot_of(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    if (v == 0 || v == 1)
        return 0;
    if (v == 2) {
        if (!pts_slot) {
            int k = atomic_fetch_add(&next_stream, 1);
            pts_slot = k < STUB_STREAMS ? k : 1;
        }
        return pts_slot;
    }
    if (v >= 0x100 && v < 0x100 + STUB_STREAMS)
        return (int)(v - 0x100);
    return 0;
}

static uint64_t stream_done(int phys, CUstream s)
{
    int k = slot_of(s);
    if (k != 0) { /* a blocking stream's work also waits for the legacy stream's before it */
        uint64_t own = atomic_load(&last_done[phys][k]), legacy = atomic_load(&last_done[phys][0]);
        return atomic_load(&non_blocking[k]) || own > legacy ? own : legacy;
    }
    uint64_t t = 0; /* the legacy stream waits for every blocking stream of the context */
    for (int i = 0; i < STUB_STREAMS; i++)
        if (!atomic_load(&non_blocking[i]) && atomic_load(&last_done[phys][i]) > t)
            t = atomic_load(&last_done[phys][i]);
    return t;
}

/* ---- STUB_TIMESLICE: the card's processor-sharing clock (struct stub_ps), under its spin lock
 * (held for a scan of the process rows, never across a call). */
static void ps_lock(struct stub_ps *p)
{
    int z = 0;
    while (!atomic_compare_exchange_weak(&p->lock, &z, 1)) {
        z = 0;
        sched_yield();
    }
}
static void ps_unlock(struct stub_ps *p) { atomic_store(&p->lock, 0); }

/* Processes with work queued past R on card phys; *first: the earliest end of it. */
static uint32_t ps_busy(int phys, uint64_t R, uint64_t *first)
{
    struct stub_state *s = stub_state();
    uint32_t k = 0;
    *first = UINT64_MAX;
    for (int i = 0; i < STUB_MAXPROC; i++) {
        uint64_t e = atomic_load(&s->proc[i].busy_until[phys]);
        if (e > R && atomic_load(&s->proc[i].pid)) {
            k++;
            *first = e < *first ? e : *first;
        }
    }
    return k;
}

/* A rate change at (t, R): k processes busy from then on. */
static void ps_mark(struct stub_ps *p, uint32_t k)
{
    p->k = k;
    uint64_t i = p->nbp++ % STUB_PS_BP;
    p->bp[i].t = p->t, p->bp[i].R = p->R, p->bp[i].k = k;
}

/* The clock moved to wall time now, from one process's end of work to the next. */
static void ps_advance(int phys, struct stub_ps *p, uint64_t now)
{
    if (!p->t) {
        p->t = p->R = now;
        ps_mark(p, 0);
    }
    while (p->t < now) {
        uint64_t first;
        uint32_t k = ps_busy(phys, p->R, &first);
        if (k != p->k)
            ps_mark(p, k);
        uint64_t rate = k ? k : 1;
        if (k && p->t + (first - p->R) * rate <= now) {
            p->t += (first - p->R) * rate, p->R = first;
            continue;
        }
        p->R += (now - p->t) / rate, p->t = now;
    }
}

static uint64_t ps_now(int phys)
{
    struct stub_ps *p = &stub_state()->ps[phys];
    ps_lock(p);
    ps_advance(phys, p, stub_now());
    uint64_t R = p->R;
    ps_unlock(p);
    return R;
}

/* Work of dur GPU ns queued by process me (after its own earlier work and `after`): its end. */
static uint64_t ps_arrive(int phys, struct stub_proc *me, uint64_t after, uint64_t dur)
{
    struct stub_ps *p = &stub_state()->ps[phys];
    ps_lock(p);
    ps_advance(phys, p, stub_now());
    uint64_t own = atomic_load(&me->busy_until[phys]), start = own > p->R ? own : p->R;
    uint64_t end = (start > after ? start : after) + dur, first;
    atomic_store(&me->busy_until[phys], end);
    uint32_t k = ps_busy(phys, p->R, &first);
    if (k != p->k)
        ps_mark(p, k);
    ps_unlock(p);
    return end;
}

/* The wall time at which card phys's clock passed R (R not after the clock's now). */
static uint64_t ps_wall(int phys, uint64_t R)
{
    struct stub_ps *p = &stub_state()->ps[phys];
    ps_lock(p);
    uint64_t n = p->nbp, lo = n > STUB_PS_BP ? n - STUB_PS_BP : 0, t = 0;
    for (uint64_t i = n; i-- > lo;) {
        uint64_t bt = p->bp[i % STUB_PS_BP].t, bR = p->bp[i % STUB_PS_BP].R, bk = p->bp[i % STUB_PS_BP].k;
        if (bR <= R || i == lo) {
            t = bt + (R > bR ? (R - bR) * (bk ? bk : 1) : 0);
            break;
        }
    }
    ps_unlock(p);
    return t;
}

static void stub_modes(void)
{
    if (__builtin_expect(null_launch < 0, 0)) {
        grid_us = stub_env("STUB_GRID_US", 0) != 0;
        timeslice = stub_env("STUB_TIMESLICE", 0) != 0;
        concurrent = stub_env("STUB_CONCURRENT", 0) != 0;
        null_launch = stub_env("STUB_NULL_LAUNCH", 0) != 0;
    }
}

/* Now on card phys's clock: wall time, or with STUB_TIMESLICE its processor-sharing clock. */
static uint64_t clk_now(int phys)
{
    stub_modes();
    return timeslice ? ps_now(phys) : stub_now();
}

/* Card phys's clock value T in wall time (T reached already). */
static uint64_t clk_wall(int phys, uint64_t T)
{
    return timeslice ? ps_wall(phys, T) : T;
}

/* Sleep until card phys's clock reaches T. */
static void clk_wait(int phys, uint64_t T)
{
    for (uint64_t R; (R = clk_now(phys)) < T;) {
        uint64_t ns = T - R < 1000000 ? T - R : 1000000; /* the clock runs at most at wall speed */
        struct timespec ts = {0, (long)(ns > 5000 ? ns : 5000)};
        nanosleep(&ts, NULL);
    }
}

/* STUB_CONCURRENT: the time at least one of this process's kernels ran on each card (what
 * NVML's utilization counts), as kernels of several streams overlap: u_done, the busy time
 * before u_cut, and the merged intervals after it (sorted, disjoint; a new kernel never starts
 * before the clock's now, so what ends before now is final). Under ring_mu. */
#define STUB_UNION_MAX 512
static struct { uint64_t done, cut; unsigned n; uint64_t s[STUB_UNION_MAX], e[STUB_UNION_MAX]; } u[STUB_MAXDEV];

/* Settle what ended by now into u_done (ring_mu held). */
static void union_settle(int phys, uint64_t now)
{
    unsigned k = 0;
    for (unsigned i = 0; i < u[phys].n; i++) {
        if (u[phys].e[i] <= now) {
            u[phys].done += u[phys].e[i] - u[phys].s[i];
            continue;
        }
        u[phys].s[k] = u[phys].s[i], u[phys].e[k] = u[phys].e[i], k++;
    }
    u[phys].n = k;
    u[phys].cut = now > u[phys].cut ? now : u[phys].cut;
}

/* Kernel time [s, e) on card phys, merged into the intervals. */
static void union_add(int phys, uint64_t now, uint64_t s, uint64_t e)
{
    pthread_mutex_lock(&ring_mu);
    union_settle(phys, now);
    s = s > u[phys].cut ? s : u[phys].cut;
    unsigned i = 0, k;
    while (i < u[phys].n && u[phys].e[i] < s)
        i++;
    for (k = i; k < u[phys].n && u[phys].s[k] <= e; k++) { /* [i, k) overlap or touch: one */
        s = u[phys].s[k] < s ? u[phys].s[k] : s;
        e = u[phys].e[k] > e ? u[phys].e[k] : e;
    }
    if (s < e && (k > i || u[phys].n < STUB_UNION_MAX)) {
        unsigned n = u[phys].n - (k - i) + 1;
        memmove(&u[phys].s[i + 1], &u[phys].s[k], (u[phys].n - k) * sizeof u[phys].s[0]);
        memmove(&u[phys].e[i + 1], &u[phys].e[k], (u[phys].n - k) * sizeof u[phys].e[0]);
        u[phys].s[i] = s, u[phys].e[i] = e, u[phys].n = n;
    }
    pthread_mutex_unlock(&ring_mu);
}

/* This process's busy time on card phys by now (ring_mu held). */
static uint64_t union_ns(int phys, uint64_t now)
{
    union_settle(phys, now);
    uint64_t b = u[phys].done;
    if (u[phys].n && u[phys].s[0] < now)
        b += now - u[phys].s[0];
    return b;
}

/* Work of `dur` GPU ns on card phys that may start at `after`: its place on the card (its end,
 * on the card's clock: with STUB_TIMESLICE the clock, not the work, slows while processes share
 * the card). */
static uint64_t run_at(int phys, uint64_t now, uint64_t after, uint64_t dur)
{
    struct stub_state *s = stub_state();
    struct stub_proc *me = stub_me();
    uint64_t start, end;
    if (concurrent) { /* kernels of small grids: each runs as soon as its stream lets it */
        start = now > after ? now : after;
        union_add(phys, now, start, start + dur);
        return start + dur;
    }
    if (timeslice)
        return ps_arrive(phys, me, after, dur); /* `now` is the card's clock already */
    uint64_t bu = atomic_load(&s->busy_until[phys]);
    do {
        start = bu > now ? bu : now;
        if (start < after)
            start = after;
        end = start + dur;
    } while (!atomic_compare_exchange_weak(&s->busy_until[phys], &bu, end));
    return end;
}

/* A kernel on a held stream: queued behind the wait (1), or 0 when the stream is not held. */
static int hold_launch(int phys, int slot, uint64_t dur)
{
    pthread_mutex_lock(&hold_mu);
    int h = atomic_load(&held[phys][slot]);
    if (h) {
        hold[phys][slot].queued += dur;
        pthread_mutex_lock(&ring_mu);
        unsigned i = ring_n[phys]++ % 4096;
        ring[phys][i].end = STUB_PENDING, ring[phys][i].dur = dur, ring[phys][i].held = slot + 1;
        pthread_mutex_unlock(&ring_mu);
    }
    pthread_mutex_unlock(&hold_mu);
    return h;
}

static CUresult launch(CUstream stream, unsigned gx)
{
    stub_modes();
    if (null_launch)
        return OK; /* micro-benchmarks: a launch that costs a function call */
    NEED_CTX();
    int ph = stream_phys(stream); /* the card of the stream's context */
    if (hidden_capturing(stream))
        return OK; /* captured: it runs when its graph is launched */
    struct stub_proc *me = stub_me();
    uint64_t dur = grid_us ? (uint64_t)(gx ? gx : 1) * 1000 : (uint64_t)stub_env("STUB_KERNEL_US", 1000) * 1000;
    if (atomic_load(&held[ph][slot_of(stream)]) && hold_launch(ph, slot_of(stream), dur)) {
        atomic_fetch_add(&me->busy_ns[ph], dur);
        atomic_fetch_add(&me->launches[ph], 1);
        return OK;
    }
    uint64_t now = clk_now(ph);
    uint64_t after = stream_done(ph, stream); /* the legacy stream waits for all streams */
    uint64_t end = run_at(ph, now, after, dur);
    atomic_store(&last_done[ph][slot_of(stream)], end);
    if (restart_on == stream) { /* STUB_CAPTURE_RESTARTS_AROUND_LAUNCH */
        restart_on = (CUstream)(uintptr_t)-1;
        cuStreamBeginCapture_v2(stream, 2);
    }
    pthread_mutex_lock(&ring_mu);
    unsigned i = ring_n[ph]++ % 4096;
    ring[ph][i].end = end, ring[ph][i].dur = dur, ring[ph][i].held = 0;
    pthread_mutex_unlock(&ring_mu);
    atomic_fetch_add(&me->busy_ns[ph], dur);
    atomic_fetch_add(&me->launches[ph], 1);
    uint64_t cap = 200000000ull; /* a full launch queue blocks the caller, as on a GPU */
    if (end > now + cap)
        clk_wait(ph, end - cap);
    return OK;
}

static void sleep_until_ns(uint64_t t)
{
    if (t > stub_now()) {
        struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
    }
}

static CUresult drain(CUstream s)
{
    NEED_CTX();
    int ph = stream_phys(s); /* the card of the stream's context */
    while (stream_done(ph, s) == STUB_PENDING) /* held: until another thread writes the value */
        sleep_until_ns(stub_now() + 1000000);
    clk_wait(ph, stream_done(ph, s));
    return OK;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned shm, CUstream s, void **p, void **x) { CUresult lr = kernel_launch_load(f); if (lr) return lr; return launch(s, a); }
API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned shm, CUstream s, void **p, void **x) { CUresult lr = kernel_launch_load(f); if (lr) return lr; return launch(s ? s : (CUstream)2, a); }
API CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **p, void **x) { CUresult lr = kernel_launch_load(f); if (lr) return lr; if (!cfg) return E_INVALID_VALUE; return launch(cfg->hStream, cfg->gx); }
API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **p, void **x) { return cuLaunchKernelEx(cfg, f, p, x); }
API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned shm, CUstream s, void **p) { return launch(s, a); }
API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned shm, CUstream s, void **p) { return launch(s ? s : (CUstream)2, a); }
API CUresult cuLaunch(CUfunction f) { return launch(NULL, 1); }
API CUresult cuLaunchGrid(CUfunction f, int w, int h) { return launch(NULL, (unsigned)w); }
API CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) { return launch(s, (unsigned)w); }
typedef struct { CUfunction f; unsigned gx, gy, gz, bx, by, bz, shm; CUstream s; void **p; } stub_launch_params;
/* one launch per entry, each on its stream (and so on its stream's card) */
API CUresult cuLaunchCooperativeKernelMultiDevice(stub_launch_params *l, unsigned n, unsigned flags)
{
    if (!l || !n) return E_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++) {
        CUresult rc = launch(l[i].s, l[i].gx);
        if (rc) return rc;
    }
    return OK;
}
static int graph_mem_done;
/* Graph memory nodes: the first launch of a graph reserves STUB_GRAPH_MEM_MIB in the driver's
 * graph pool, visible only through NVML per-process usage (as on a real driver). */
API CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    CUresult hr = hidden_graph_launch(g);
    if (hr) return hr;
    long mib = stub_env("STUB_GRAPH_MEM_MIB", 0);
    if (mib > 0 && !graph_mem_done && cur_ctx >= 0) {
        graph_mem_done = 1;
        atomic_fetch_add(&stub_me()->used[cur_ctx], (uint64_t)mib * MIB);
    }
    return launch(s, (unsigned)stub_env("STUB_GRAPH_US", 1)); /* its work: one kernel (STUB_GRID_US) */
}
API CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return launch(s ? s : (CUstream)2, 1); }
API CUresult cuStreamSynchronize(CUstream s) { return drain(s); }
/* The same wait under a name the shim does not hook: how the CUDA runtime reaches the real
 * driver for cudaDeviceSynchronize (its private export table), which no preload sees. */
API CUresult stubHiddenSync(CUstream s) { return drain(s); }
API CUresult cuCtxSynchronize(void) { return drain(NULL); }
/* Races another thread of the tenant would run, made deterministic: right after a check finds
 * stream s capturing, the config registered with stub_race_config has its stream rewritten
 * (once), and with STUB_CAPTURE_ENDS_AFTER_CHECK the capture ends. */
static CUlaunchConfig *race_cfg;
static CUstream race_to;
API void stub_race_config(CUlaunchConfig *c, CUstream to) { race_cfg = c, race_to = to; }
/* After a check found s capturing. STUB_CAPTURE_RESTARTS_AROUND_LAUNCH: the capture ends, and a
 * new one begins on s right after its next launch ran (another thread's end and begin). */
static void capture_checked(CUstream s)
{
    if (race_cfg && race_cfg->hStream == s)
        race_cfg->hStream = race_to, race_cfg = NULL;
    if (stub_env("STUB_CAPTURE_ENDS_AFTER_CHECK", 0) || stub_env("STUB_CAPTURE_RESTARTS_AROUND_LAUNCH", 0))
        hidden_capture_abandon();
    if (stub_env("STUB_CAPTURE_RESTARTS_AROUND_LAUNCH", 0))
        restart_on = s;
}
API CUresult cuStreamIsCapturing(CUstream s, int *st)
{
    *st = hidden_capturing(s);
    if (*st)
        capture_checked(s);
    return OK;
}
API CUresult cuStreamGetCaptureInfo(CUstream s, int *st, unsigned long long *id)
{
    if (!st) return E_INVALID_VALUE;
    *st = hidden_capturing(s);
    if (id) *id = *st ? hidden_capture_id() : 0;
    if (*st)
        capture_checked(s);
    return OK;
}
API CUresult cuStreamQuery(CUstream s) { NEED_CTX(); if (hidden_capture_unsafe(s)) return 900; int ph = stream_phys(s); return stream_done(ph, s) > clk_now(ph) ? 600 : OK; }

/* Events: recording one notes when the stream's work queued so far ends (the GPU reaches the
 * event then); query, synchronize and elapsed time follow from that timestamp. */
struct stub_event {
    uint64_t t; /* STUB_PENDING: recorded on a held stream, hoff GPU ns into the work of wait hgen */
    int recorded, phys, hslot;
    int captured; /* recorded into a capturing stream: a node of the graph, never reached now */
    uint32_t hgen;
    uint64_t hoff;
    CUstream s;
    void *ctx; /* the context it was made in: it is recorded only on that context's streams */
    unsigned gen; /* a primary context's generation when it was made */
};

/* Destroyed contexts (the last 64): their events are gone with them, as on a real driver, where
 * a later call on such an event touches a freed handle. The stub makes that loud. */
static void *dead_ctx[64];
static _Atomic unsigned ndead;
static int ctx_dead(void *c)
{
    unsigned n = atomic_load(&ndead);
    for (unsigned i = 0; c && i < n && i < 64; i++)
        if (dead_ctx[i] == c)
            return 1;
    return 0;
}
static void check_live(const struct stub_event *ev)
{
    int p = prim_of(ev->ctx);
    if (ctx_dead(ev->ctx) || (p >= 0 && ev->gen != atomic_load(&prim_gen[p]))) {
        fprintf(stderr, "stub: an event of a destroyed context was used\n");
        abort();
    }
}

/* The context stream s belongs to: a created stream's own, the current one for the legacy and
 * per-thread handles. */
static void *ctx_of_stream(CUstream s)
{
    int k = slot_of(s);
    return k >= 2 && stream_ctx[k] ? stream_ctx[k] : cur_handle;
}
API CUresult cuStreamGetCtx(CUstream s, CUcontext *c)
{
    NEED_CTX();
    if (!c) return E_INVALID_VALUE;
    *c = ctx_of_stream(s);
    return OK;
}

/* When the GPU reaches the event (STUB_PENDING while its stream's wait has not been released). */
static uint64_t event_time(struct stub_event *ev)
{
    if (ev->t == STUB_PENDING) {
        pthread_mutex_lock(&hold_mu);
        struct hold *h = &hold[ev->phys][ev->hslot];
        uint64_t start = h->start[ev->hgen % STUB_HOLD_GENS];
        if (start && h->gen - ev->hgen < STUB_HOLD_GENS)
            ev->t = start + ev->hoff;
        pthread_mutex_unlock(&hold_mu);
    }
    return ev->t;
}
API CUresult cuEventCreate(void **e, unsigned fl)
{
    (void)fl;
    NEED_CTX();
    if (!e) return E_INVALID_VALUE;
    struct stub_event *ev = calloc(1, sizeof *ev);
    if (ev) ev->ctx = cur_handle, ev->gen = prim_of(cur_handle) >= 0 ? atomic_load(&prim_gen[prim_of(cur_handle)]) : 0;
    *e = ev;
    return ev ? OK : E_OOM;
}
API CUresult cuEventDestroy_v2(void *e) { if (e) check_live(e); free(e); return OK; }
API CUresult cuEventDestroy(void *e) { return cuEventDestroy_v2(e); }
/* STUB_EVENT_GAP_US=G: an event pair adds G us around the work it brackets, as on the H200 with
 * driver 580 (10.0 us kernels bracketed one by one measure 14.9 us: bench/results/gpu/
 * evlat-h200-2026-12-01.jsonl): an event on an idle stream holds the stream's next kernel back
 * G/2, one behind queued work completes G/2 after it. */
static int64_t event_gap_ns = -1;
/* STUB_EVENT_FAIL=N: every N-th cuEventRecord of the process fails (CUDA_ERROR_UNKNOWN, 999),
 * recording nothing: the shim's measurement must then fall back without losing the limit. */
static long event_fail_every = -1;
static _Atomic unsigned long event_records;

API CUresult cuEventRecord(void *e, CUstream s)
{
    NEED_CTX();
    int ph = stream_phys(s); /* the card of the stream's context */
    struct stub_event *ev = e;
    if (!ev) return E_INVALID_VALUE;
    check_live(ev);
    if (ev->ctx != ctx_of_stream(s)) return 400; /* CUDA_ERROR_INVALID_HANDLE: another context's */
    if (__builtin_expect(event_fail_every < 0, 0))
        event_fail_every = stub_env("STUB_EVENT_FAIL", 0);
    if (event_fail_every > 0 && (atomic_fetch_add(&event_records, 1) + 1) % (unsigned long)event_fail_every == 0)
        return 999;
    if (slot_of(s) >= 2 && atomic_load(&stream_dead[slot_of(s)])) return 400;
    ev->captured = 0;
    if (hidden_capturing(s)) { /* as the driver: the record joins the capture */
        ev->recorded = 1, ev->captured = 1, ev->s = s, ev->phys = ph;
        return OK;
    }
    if (__builtin_expect(event_gap_ns < 0, 0))
        event_gap_ns = (int64_t)stub_env("STUB_EVENT_GAP_US", 0) * 1000;
    int slot = slot_of(s);
    if (atomic_load(&held[ph][slot])) {
        pthread_mutex_lock(&hold_mu);
        int h = atomic_load(&held[ph][slot]);
        if (h) {
            ev->t = STUB_PENDING, ev->recorded = 1, ev->phys = ph, ev->s = s;
            ev->hslot = slot, ev->hgen = hold[ph][slot].gen, ev->hoff = hold[ph][slot].queued;
        }
        pthread_mutex_unlock(&hold_mu);
        if (h)
            return OK;
    }
    uint64_t now = clk_now(ph), t = stream_done(ph, s), half = (uint64_t)event_gap_ns / 2;
    int busy = t > now;
    ev->t = busy ? t + half : now, ev->recorded = 1, ev->phys = ph, ev->s = s;
    if (slot == 0) { /* the legacy stream's record: later work of every blocking stream waits for it */
        _Atomic uint64_t *legacy = &last_done[ph][0];
        uint64_t cur = atomic_load(legacy);
        while (cur < ev->t && !atomic_compare_exchange_weak(legacy, &cur, ev->t))
            ;
    }
    if (half) {
        _Atomic uint64_t *done = &last_done[ph][slot_of(s)];
        uint64_t hold = busy ? ev->t : now + half, cur = atomic_load(done);
        while (cur < hold && !atomic_compare_exchange_weak(done, &cur, hold))
            ;
    }
    return OK;
}
API CUresult cuEventRecord_ptsz(void *e, CUstream s) { return cuEventRecord(e, s ? s : (CUstream)2); }
/* STUB_QUERY_US=Q: cuEventQuery costs Q us of CPU, as a driver call does (a slow host's, scaled
 * up so that the shim's own per-launch calls show against the stub's kernels). */
static long query_us = -1;

API CUresult cuEventQuery(void *e)
{
    struct stub_event *ev = e;
    if (!ev) return E_INVALID_VALUE;
    if (__builtin_expect(query_us < 0, 0))
        query_us = stub_env("STUB_QUERY_US", 0);
    for (uint64_t end = stub_now() + (uint64_t)query_us * 1000; query_us && stub_now() < end;)
        ;
    check_live(ev);
    /* An event recorded into a capture (CUDA_ERROR_CAPTURED_EVENT; querying it while the capture
     * goes on invalidates it); one recorded on the stream before its capture began is work
     * queued outside the capture and may be queried. */
    if (ev->captured) { hidden_capture_unsafe(ev->s); return 907; }
    return !ev->recorded || event_time(ev) <= clk_now(ev->phys) ? OK : 600; /* CUDA_ERROR_NOT_READY */
}
API CUresult cuEventSynchronize(void *e)
{
    struct stub_event *ev = e;
    if (!ev) return E_INVALID_VALUE;
    while (ev->recorded && event_time(ev) == STUB_PENDING) /* until another thread writes the value */
        sleep_until_ns(stub_now() + 1000000);
    if (ev->recorded) clk_wait(ev->phys, ev->t);
    return OK;
}
API CUresult cuEventElapsedTime(float *ms, void *a, void *b)
{
    struct stub_event *x = a, *y = b;
    if (!ms || !x || !y) return E_INVALID_VALUE;
    check_live(x), check_live(y);
    if (!x->recorded || !y->recorded || x->ctx != y->ctx) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    if (x->captured || y->captured) return 907;
    uint64_t now = clk_now(x->phys);
    if (event_time(x) > now || event_time(y) > now) return 600;
    *ms = (float)(((double)clk_wall(x->phys, y->t) - (double)clk_wall(x->phys, x->t)) / 1e6);
    return OK;
}
API CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { return cuEventElapsedTime(ms, a, b); }

/* Stream memory operations on host memory (the address is a host pointer, as a registered
 * buffer's device pointer is under unified addressing): flags CU_STREAM_WAIT_VALUE_GEQ (0) or
 * _EQ (1). A wait whose value is not there yet holds its stream (a created non-blocking one, so
 * the legacy stream never follows it) until cuStreamWriteValue32 writes it; a wait that is
 * satisfied is a no-op, and a host store alone releases nothing. */
static int hold_met(const struct hold *h)
{
    uint32_t v = *h->addr;
    return h->flags == 1 ? v == h->value : v >= h->value;
}

API CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags)
{
    NEED_CTX();
    int ph = stream_phys(s); /* the card of the stream's context */
    int k = slot_of(s);
    if (!addr || flags > 1 || k < 2 || !atomic_load(&non_blocking[k]))
        return E_INVALID_VALUE;
    pthread_mutex_lock(&hold_mu);
    struct hold *h = &hold[ph][k];
    if (atomic_load(&held[ph][k])) { /* one wait at a time */
        pthread_mutex_unlock(&hold_mu);
        return E_INVALID_VALUE;
    }
    h->addr = (volatile uint32_t *)(uintptr_t)addr, h->value = value, h->flags = flags;
    if (!hold_met(h)) {
        h->after = stream_done(ph, s), h->queued = 0;
        h->gen++;
        h->start[h->gen % STUB_HOLD_GENS] = 0;
        atomic_store(&last_done[ph][k], STUB_PENDING);
        atomic_store(&held[ph][k], 1);
    }
    pthread_mutex_unlock(&hold_mu);
    return OK;
}

/* The write lands when the stream's work before it is done (`at`); a held stream whose value
 * is there then runs its queued work as one block on the card, from then on. */
API CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags)
{
    (void)flags;
    NEED_CTX();
    int ph = stream_phys(s); /* the card of the stream's context */
    uint64_t now = clk_now(ph), at = stream_done(ph, s);
    if (!addr || at == STUB_PENDING) /* a write on a held stream would itself wait: not modelled */
        return E_INVALID_VALUE;
    at = at > now ? at : now;
    pthread_mutex_lock(&hold_mu);
    *(volatile uint32_t *)(uintptr_t)addr = value;
    for (int phys = 0; phys < STUB_MAXDEV; phys++)
        for (int k = 0; k < STUB_STREAMS; k++) {
            struct hold *h = &hold[phys][k];
            if (!atomic_load(&held[phys][k]) || !hold_met(h))
                continue;
            uint64_t after = h->after > at ? h->after : at;
            uint64_t end = h->queued ? run_at(phys, now, after, h->queued) : after;
            uint64_t start = end - h->queued, t = start;
            h->start[h->gen % STUB_HOLD_GENS] = start;
            pthread_mutex_lock(&ring_mu);
            unsigned total = ring_n[phys], first = total > 4096 ? total - 4096 : 0;
            for (unsigned i = first; i < total; i++) /* its kernels, in launch order */
                if (ring[phys][i % 4096].held == k + 1) {
                    t += ring[phys][i % 4096].dur;
                    ring[phys][i % 4096].end = t, ring[phys][i % 4096].held = 0;
                }
            pthread_mutex_unlock(&ring_mu);
            atomic_store(&last_done[phys][k], end);
            atomic_store(&held[phys][k], 0);
        }
    pthread_mutex_unlock(&hold_mu);
    return OK;
}
API CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWaitValue32_v2(s, addr, value, flags); }
API CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWriteValue32_v2(s, addr, value, flags); }

/* ---- cuGetProcAddress: the driver's own name -> ABI table (subset) */
static CUresult tramp_alloc(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }
static CUresult tramp_free(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult tramp_info(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }

API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags);
API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status);
struct pa { const char *name; const char *exported; int minver; int ptds; void *fn; void *indirect; };
static const struct pa table[] = {
    {"cuInit", "cuInit", 2000, 0, (void *)cuInit, NULL},
    {"cuGetProcAddress", "cuGetProcAddress", 11030, 0, (void *)cuGetProcAddress, NULL},
    {"cuGetProcAddress", "cuGetProcAddress_v2", 12000, 0, (void *)cuGetProcAddress_v2, NULL},
    {"cuDeviceGet", "cuDeviceGet", 2000, 0, (void *)cuDeviceGet, NULL},
    {"cuDeviceGetCount", "cuDeviceGetCount", 2000, 0, (void *)cuDeviceGetCount, NULL},
    {"cuCtxCreate", "cuCtxCreate", 2000, 0, (void *)cuCtxCreate, NULL},
    {"cuCtxCreate", "cuCtxCreate_v2", 3020, 0, (void *)cuCtxCreate_v2, NULL},
    {"cuMemAlloc", "cuMemAlloc", 2000, 0, (void *)cuMemAlloc, NULL},
    {"cuMemAlloc", "cuMemAlloc_v2", 3020, 0, (void *)cuMemAlloc_v2, (void *)tramp_alloc},
    {"cuMemFree", "cuMemFree", 2000, 0, (void *)cuMemFree, NULL},
    {"cuMemFree", "cuMemFree_v2", 3020, 0, (void *)cuMemFree_v2, (void *)tramp_free},
    {"cuMemGetInfo", "cuMemGetInfo", 2000, 0, (void *)cuMemGetInfo, NULL},
    {"cuMemGetInfo", "cuMemGetInfo_v2", 3020, 0, (void *)cuMemGetInfo_v2, (void *)tramp_info},
    {"cuDeviceTotalMem", "cuDeviceTotalMem", 2000, 0, (void *)cuDeviceTotalMem, NULL},
    {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", 3020, 0, (void *)cuDeviceTotalMem_v2, NULL},
    {"cuMemAllocPitch", "cuMemAllocPitch", 2000, 0, (void *)cuMemAllocPitch, NULL},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", 3020, 0, (void *)cuMemAllocPitch_v2, NULL},
    {"cuArrayCreate", "cuArrayCreate", 2000, 0, (void *)cuArrayCreate, NULL},
    {"cuArrayCreate", "cuArrayCreate_v2", 3020, 0, (void *)cuArrayCreate_v2, NULL},
    {"cuArray3DCreate", "cuArray3DCreate", 2000, 0, (void *)cuArray3DCreate, NULL},
    {"cuArray3DCreate", "cuArray3DCreate_v2", 3020, 0, (void *)cuArray3DCreate_v2, NULL},
    {"cuMemAllocAsync", "cuMemAllocAsync", 11020, 0, (void *)cuMemAllocAsync, NULL},
    {"cuMemAllocAsync", "cuMemAllocAsync_ptsz", 11020, 1, (void *)cuMemAllocAsync_ptsz, NULL},
    {"cuMemFreeAsync", "cuMemFreeAsync", 11020, 0, (void *)cuMemFreeAsync, NULL},
    {"cuLaunchKernel", "cuLaunchKernel", 4000, 0, (void *)cuLaunchKernel, NULL},
    {"cuLaunchKernel", "cuLaunchKernel_ptsz", 4000, 1, (void *)cuLaunchKernel_ptsz, NULL},
    {"cuStreamSynchronize", "cuStreamSynchronize", 2000, 0, (void *)cuStreamSynchronize, NULL},
};

API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status)
{
    int ptds = (flags & 2) != 0, best = -1, indirect = stub_env("STUB_GPA_INDIRECT", 0) != 0;
    if (!sym || !pfn) return E_INVALID_VALUE;
    for (int i = 0; i < (int)(sizeof table / sizeof table[0]); i++)
        if (!strcmp(table[i].name, sym) && ver >= table[i].minver && table[i].ptds == ptds &&
            (best < 0 || table[i].minver > table[best].minver))
            best = i;
    if (best < 0 && ptds) /* no per-thread variant: the plain one */
        for (int i = 0; i < (int)(sizeof table / sizeof table[0]); i++)
            if (!strcmp(table[i].name, sym) && ver >= table[i].minver && !table[i].ptds)
                best = i;
    if (status) *status = best >= 0 ? 0 : 1;
    if (best < 0) { *pfn = NULL; return E_NOT_FOUND; }
    *pfn = indirect && table[best].indirect ? table[best].indirect : table[best].fn;
    return OK;
}
API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags)
{
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}

/* test-only introspection: GPU ns and launches of this process on card `phys` */
API unsigned long long stubBusyNs(int phys) { struct stub_proc *me = stub_me(); return me ? me->busy_ns[phys] : 0; }
API unsigned long long stubLaunches(int phys) { struct stub_proc *me = stub_me(); return me ? me->launches[phys] : 0; }
/* GPU ns of this process's kernels that ran by now (stubBusyNs counts them when launched);
 * with STUB_CONCURRENT the time any of them ran. */
API unsigned long long stubDoneNs(int phys)
{
    struct stub_proc *me = stub_me();
    if (!me) return 0;
    uint64_t now = clk_now(phys), pending = 0;
    if (timeslice) { /* the clock counts each busy process's own GPU time: what is left of its work */
        uint64_t own = atomic_load(&me->busy_until[phys]);
        pending = own > now ? own - now : 0;
    }
    pthread_mutex_lock(&ring_mu);
    if (concurrent) { /* the card's view: overlapping kernels count once */
        uint64_t b = union_ns(phys, now);
        pthread_mutex_unlock(&ring_mu);
        return b;
    }
    unsigned n = ring_n[phys] < 4096 ? ring_n[phys] : 4096;
    for (unsigned i = 0; i < n; i++)
        if (!timeslice && ring[phys][i].end > now) {
            uint64_t left = ring[phys][i].end - now;
            pending += left < ring[phys][i].dur ? left : ring[phys][i].dur;
        }
    pthread_mutex_unlock(&ring_mu);
    uint64_t b = me->busy_ns[phys];
    return b > pending ? b - pending : 0;
}

/* modules: stub_hidden.inc (their functions are all the empty kernel) */
API CUresult cuModuleGetFunction(CUfunction *f, void *m, const char *name) { (void)m; (void)name; *f = (CUfunction)0x78; return OK; }
API CUresult cuStreamCreate(CUstream *s, unsigned fl)
{
    int k = -1;
    for (int i = 2, n = atomic_load(&next_stream); i < n && i < STUB_STREAMS && k < 0; i++) {
        int one = 1;
        if (atomic_compare_exchange_strong(&stream_dead[i], &one, 0))
            k = i;
    }
    if (k < 0)
        k = atomic_fetch_add(&next_stream, 1);
    if (k >= STUB_STREAMS) return E_OOM;
    atomic_store(&non_blocking[k], (fl & 1) != 0);
    stream_ctx[k] = cur_handle;
    *s = (CUstream)(uintptr_t)(0x100 + k);
    return OK;
}
API CUresult cuStreamDestroy_v2(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    if (v < 0x100 + 2 || v >= 0x100 + STUB_STREAMS || atomic_load(&stream_dead[v - 0x100])) return 400;
    atomic_store(&stream_dead[v - 0x100], 1);
    return OK;
}
API CUresult cuStreamDestroy(CUstream s) { return cuStreamDestroy_v2(s); }
API CUresult cuGraphCreate(void **g, unsigned fl) { (void)fl; return hidden_graph_create(g); }
API CUresult cuDeviceGetDefaultMemPool(void **p, CUdevice d) { if (phys_of(d) < 0) return E_INVALID_DEVICE; *p = (void *)(uintptr_t)(0x500 + d); return OK; }
API CUresult cuDeviceGetMemPool(void **p, CUdevice d) { return cuDeviceGetDefaultMemPool(p, d); }
/* A reset destroys the primary context's state (its events with it) whoever retains it; the
 * last release destroys it too. Either way the next retain hands back the same handle. */
API CUresult cuDevicePrimaryCtxReset_v2(CUdevice d)
{
    int p = phys_of(d);
    if (p < 0) return E_INVALID_DEVICE;
    atomic_fetch_add(&prim_gen[p], 1);
    free_ctx_mem((void *)(uintptr_t)(0x1000 + p));
    long race = stub_env("STUB_ALLOC_IN_RESET", 0);
    if (race > 0) { /* another thread retains the context again (same handle) and allocates in it
                     * before the reset returns here, through whatever is first in line (the shim) */
        CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
        void *was = cur_handle;
        CUdeviceptr q;
        set_current((void *)(uintptr_t)(0x1000 + p));
        if (alloc)
            alloc(&q, (size_t)race * MIB);
        set_current(was);
    }
    return OK;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    int p = phys_of(d);
    if (p < 0) return E_INVALID_DEVICE;
    if (atomic_load(&prim_refs[p]) <= 0) return E_INVALID_CONTEXT;
    if (atomic_fetch_sub(&prim_refs[p], 1) == 1) {
        atomic_fetch_add(&prim_gen[p], 1);
        free_ctx_mem((void *)(uintptr_t)(0x1000 + p));
    }
    return OK;
}
/* A retain through a door no hook sees (a runtime's private table): the shim cannot count it. */
API CUresult stub_hidden_retain(CUdevice d)
{
    int p = phys_of(d);
    if (p < 0) return E_INVALID_DEVICE;
    atomic_fetch_add(&prim_refs[p], 1);
    return OK;
}
/* flags are not kept; active: retained by anyone */
API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active)
{
    int p = phys_of(d);
    if (p < 0) return E_INVALID_DEVICE;
    if (flags) *flags = 0;
    if (active) *active = atomic_load(&prim_refs[p]) > 0;
    return OK;
}
API CUresult cuDevicePrimaryCtxReset(CUdevice d) { return cuDevicePrimaryCtxReset_v2(d); }
API CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return cuDevicePrimaryCtxRelease_v2(d); }

#include "stub_hidden.inc"
