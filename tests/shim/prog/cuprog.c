/*
 * cuprog - a CUDA driver API client for the shim's tests (stub driver) and the GPU bench
 * (real driver). Linked directly against libcuda.so.1; it also reaches the driver through
 * dlsym and cuGetProcAddress(_v2) on request, so all three doors of the shim are exercised.
 * Declares the few driver types itself (no CUDA headers). Output: one JSON object per line.
 *
 *   cuprog info [ordinal]                  memory as the process sees it
 *   cuprog null                            NULL out-pointers to cuMemGetInfo_v2
 *   cuprog fill PATH CHUNK [MAX_N] [HOLD_S] allocate CHUNK bytes until failure (or MAX_N)
 *       PATH: alloc managed pitch async pool vmm array array3d array8 (1-byte elements) mipmap
 *       gpa gpa_v1 dlsym v1abi
 *       pitch_v1 array_v1 array3d_v1 (the last four: the CUDA < 3.2 ABI through cuGetProcAddress)
 *   cuprog xdev PATH CHUNK                 card 1's stream-ordered memory with card 0's context
 *   cuprog vmmexport EXPORT CHUNK          cuMemCreate CHUNK, (EXPORT 1) export it as a descriptor
 *                                          kept open, release it; until refused (64 at most)
 *   cuprog ctxend HOW CHUNK                cuMemAlloc (CUPROG_MANAGED=1: cuMemAllocManaged) CHUNK
 *                                          until refused, end the context the
 *                                          memory is in without freeing it (HOW: reset, release:
 *                                          the primary one's reset or last release; destroy: a
 *                                          created one's; release2: a retain the shim does not see
 *                                          first), then fill a new one
 *       current (PATH async: a stream of card 1's context; pool: its default pool; poolmade: a
 *       pool made on it; poolalias: the same, its handle written over the properties' location),
 *       CHUNK bytes until refused
 *   cuprog info_v1                         cuMemGetInfo and cuDeviceTotalMem of the CUDA < 3.2 ABI
 *   cuprog pitch WIDTH HEIGHT              cuMemAllocPitch_v2: pitch and result
 *   cuprog race CHUNK GO_FILE              wait for GO_FILE, fill with cuMemAlloc, hold 1 s
 *   cuprog launch MODE SECONDS SYNC_EVERY  launch loop; MODE kernel ex coop graph ptsz gpa
 *   cuprog bench N                         ns per launch, alloc+free (2 MiB), cuMemGetInfo
 *   cuprog threads T N CHUNK               T threads at once, each N x (alloc CHUNK, launch,
 *       cuMemGetInfo), holding every chunk; charged bytes while held and after all are freed
 *   cuprog fork KIND N [BUSY]              a parent with a CUDA context forks N children while
 *       BUSY threads (default 4) allocate, launch and read NVML; KIND idle: the children do
 *       not touch CUDA (DataLoader workers) and exit; cuda: they call the hooks; exec: they
 *       exec `cuprog fill alloc CHUNK 4` (CHUNK from CUPROG_EXEC_CHUNK). A child stuck for
 *       10 s (a lock held at fork) dies of SIGALRM and is counted as "stuck".
 *   cuprog graphmem N CHUNK                N chunks, two graph launches, then fill to the limit
 *   cuprog relay SECS KERNEL_US N          two threads in turns on their per-thread default streams
 *       (CU_STREAM_PER_THREAD: one handle, each thread's own stream): the main thread launches a
 *       5 us kernel, the second thread then N kernels of KERNEL_US, the main thread waits for its
 *       stream, then the second for its own (after 0.3 s of 5 us kernels, not measured); "busy":
 *       the share of wall time the kernels ran
 *   cuprog ptds SECS KERNEL_US N           two threads on their per-thread default streams, each at
 *       its own pace: the main thread launches a 5 us kernel and waits for its stream, over and
 *       over; the second launches N kernels of KERNEL_US and waits for its stream, each round
 *       (after 0.5 s, not measured); "busy" and "per_sec" as in work
 *   cuprog work sat SECS KERNEL_US SYNC_EVERY [STREAMS]   saturating loop over STREAMS streams
 *   cuprog work gap SECS KERNEL_US GAP_US SYNC_EVERY      launch-bound loop: GAP_US of CPU work
 *       (a spin) after each launch, like a framework whose launches are slower than its kernels
 *       (CUPROG_MIX=1: kernel lengths cycle through 4, 0.25, 0.5, 0.25, 2, 0.25, 1, 1.75 x KERNEL_US)
 *   cuprog work nbwait SECS KERNEL_US N              N kernels on a non-blocking stream, then a
 *       wait on another (idle) stream, then on the non-blocking one
 *   cuprog work capture SECS KERNEL_US               20 launches on a stream, then a capture of 5
 *       more on it, repeated (rc: the first error, e.g. a capture the shim invalidated)
 *   cuprog work req SECS KERNEL_US NKERNELS PERIOD_MS     a request of NKERNELS kernels (then a
 *       stream sync) every PERIOD_MS; latency from the request's arrival to the sync's return
 *   cuprog work waitval SECS KERNEL_US N SYNC_EVERY      first, not measured: stream A waits for
 *       a value (cuStreamWaitValue32) that stream B writes (cuStreamWriteValue32) only after N
 *       kernels on A and one on B, all from this thread, then A is synchronized ("pre_s": how
 *       long that took; the stub takes the value's address as host memory); then a saturating
 *       loop on A
 *   (CUPROG_HIDDEN_SYNC=1: the waits go where the shim cannot see them, like cudart's;
 *   CUPROG_WARMUP_MS=N: a saturating loop for N ms first, not measured;
 *   CUPROG_IDLE_MS=N: light use for N ms first, a kernel every 100 ms, not measured;
 *   CUPROG_PAUSE_MS=N: after those, N ms without any CUDA call;
 *   CUPROG_LINGER_MS=N: after the report, N ms idle before exit, the context kept)
 *   (work: the stub driver with STUB_GRID_US=1 runs each kernel for gridDimX us; it prints the
 *   share of wall time its kernels ran (with STUB_CONCURRENT: any of them, overlaps once), per
 *   second too, from the stub's stubDoneNs: physical card 0's, or CUPROG_DONE_PHYS's;
 *   CUPROG_CTX2_DEV=N puts the second context on ordinal N)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr, CUmemGenericAllocationHandle;
typedef void *CUcontext, *CUstream, *CUfunction, *CUmodule, *CUarray, *CUmipmappedArray, *CUgraphExec;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { int type; int requestedHandleTypes; struct { int type; int id; } location; void *w; unsigned char f[8]; } CUmemAllocationProp;
typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
typedef struct { unsigned Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct { unsigned Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR_v1;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shm; CUstream hStream; void *attrs; unsigned n; } CUlaunchConfig;
typedef struct { /* cuda.h CUarrayMapInfo */
    int resourceType;
    void *resource;
    int subresourceType;
    union { unsigned level[8]; unsigned long long align[4]; } sub; /* level, layer, x, y, z, w, h, d */
    int op, htype;
    CUmemGenericAllocationHandle h;
    unsigned long long offset;
    unsigned mask, flags, reserved[2];
} CUarrayMapInfo;

CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetUuid(CUuuid *, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxDestroy(CUcontext);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, void *, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuDeviceGetDefaultMemPool(void **, CUdevice);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuMemMapArrayAsync(CUarrayMapInfo *, unsigned, CUstream);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuLaunch(CUfunction);
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
typedef struct { CUfunction f; unsigned gx, gy, gz, bx, by, bz, shm; CUstream s; void **p; } launch_params;
CUresult cuLaunchCooperativeKernelMultiDevice(launch_params *, unsigned, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

static const char PTX[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static CUdevice setup(int ord)
{
    CUdevice d;
    CUcontext c;
    CUresult rc = cuInit(0);
    if (rc) { printf("{\"init_rc\": %d}\n", rc); exit(3); }
    if ((rc = cuDeviceGet(&d, ord))) { printf("{\"device_rc\": %d}\n", rc); exit(3); }
    if ((rc = cuDevicePrimaryCtxRetain(&c, d)) || (rc = cuCtxSetCurrent(c))) {
        printf("{\"ctx_rc\": %d}\n", rc);
        exit(3);
    }
    return d;
}

struct held { int kind; unsigned long long v; size_t size; };

/* A sparse 2D array of `bytes` of 1-channel floats, 4096 wide: tiles of 64 KiB (128 x 128) as a
 * real driver lays them out, so its whole level 0 maps one handle of `bytes` (a multiple of
 * 2 MiB). */
#define TILE_ROW_BYTES (4096u * 4u)
static CUresult sparse_array(CUarray *arr, size_t bytes)
{
    CUDA_ARRAY3D_DESCRIPTOR a = {4096, bytes / TILE_ROW_BYTES, 0, 0x20, 1, 0x40 /* CUDA_ARRAY3D_SPARSE */};
    return cuArray3DCreate_v2(arr, &a);
}

/* Map (op 1) or unmap (op 2) handle hd over the first `bytes` of sparse array arr's level 0, or
 * both in one call (op 3: unmap what is there, then map hd in its place);
 * `bad`: a second operation, on no array, fails the call after the first was done; `race`: the
 * list is rewritten right after the driver read it (the stub's stub_race_map_ops: another
 * thread's write). */
static CUresult map_tiles(CUarray arr, size_t bytes, int op, CUmemGenericAllocationHandle hd, int bad, int race)
{
    CUarrayMapInfo m[2];
    memset(m, 0, sizeof m);
    m[0].resource = arr, m[0].sub.level[5] = 4096, m[0].sub.level[6] = (unsigned)(bytes / TILE_ROW_BYTES);
    m[0].sub.level[7] = 1;
    m[0].op = op, m[0].h = op == 1 ? hd : 0, m[0].mask = 1;
    m[1] = m[0], m[1].resource = NULL;
    if (op == 3) {
        m[0].op = 2, m[0].h = 0;
        m[1] = m[0], m[1].op = 1, m[1].h = hd;
        return cuMemMapArrayAsync(m, 2, NULL);
    }
    if (race) {
        void (*reg)(CUarrayMapInfo *) = (void (*)(CUarrayMapInfo *))dlsym(RTLD_DEFAULT, "stub_race_map_ops");
        if (!reg)
            return 999;
        reg(m);
    }
    return cuMemMapArrayAsync(m, bad ? 2 : 1, NULL);
}

static CUresult alloc_one(const char *path, size_t chunk, CUdevice dev, struct held *h)
{
    CUdeviceptr p = 0;
    CUresult rc;
    h->kind = 0;
    if (!strcmp(path, "v1abi")) {
        /* cuMemAlloc as a CUDA 3.1 runtime would get it: 32-bit size and pointer */
        static CUresult (*fn)(unsigned *, unsigned);
        static CUresult (*fr)(unsigned);
        unsigned p32 = 0;
        if (!fn) {
            int st;
            if ((rc = cuGetProcAddress_v2("cuMemAlloc", (void **)&fn, 3010, 0, &st)) || !fn)
                return 900 + rc;
            cuGetProcAddress_v2("cuMemFree", (void **)&fr, 3010, 0, &st);
        }
        rc = fn(&p32, (unsigned)chunk);
        h->kind = 6, h->v = p32;
        (void)fr;
    } else if (!strcmp(path, "pitch_v1")) {
        CUresult (*fn)(unsigned *, unsigned *, unsigned, unsigned, unsigned) = NULL;
        unsigned p32 = 0, pitch = 0;
        if ((rc = cuGetProcAddress("cuMemAllocPitch", (void **)&fn, 3010, 0)) || !fn)
            return 900 + rc;
        rc = fn(&p32, &pitch, (unsigned)(chunk / 64), 64, 4);
        h->kind = 6, h->v = p32;
    } else if (!strcmp(path, "array_v1") || !strcmp(path, "array3d_v1")) {
        CUarray arr = NULL;
        if (path[5] == '_') {
            CUresult (*fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *) = NULL;
            CUDA_ARRAY_DESCRIPTOR_v1 a = {(unsigned)(chunk / 4 / 1024), 1024, 0x20, 1};
            if ((rc = cuGetProcAddress("cuArrayCreate", (void **)&fn, 3010, 0)) || !fn)
                return 900 + rc;
            rc = fn(&arr, &a);
        } else {
            CUresult (*fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *) = NULL;
            CUDA_ARRAY3D_DESCRIPTOR_v1 a = {(unsigned)(chunk / 4 / 1024 / 4), 1024, 4, 0x20, 1, 0};
            if ((rc = cuGetProcAddress("cuArray3DCreate", (void **)&fn, 3010, 0)) || !fn)
                return 900 + rc;
            rc = fn(&arr, &a);
        }
        h->kind = 4, h->v = (uintptr_t)arr;
    } else if (!strcmp(path, "alloc") || !strcmp(path, "gpa") || !strcmp(path, "gpa_v1") || !strcmp(path, "dlsym")) {
        static CUresult (*fn)(CUdeviceptr *, size_t);
        if (!fn) {
            if (!strcmp(path, "gpa")) {
                int st = -1;
                rc = cuGetProcAddress_v2("cuMemAlloc", (void **)&fn, 12000, 0, &st);
                if (rc || !fn) return 900 + rc;
            } else if (!strcmp(path, "gpa_v1")) {
                rc = cuGetProcAddress("cuMemAlloc", (void **)&fn, 11040, 0);
                if (rc || !fn) return 900 + rc;
            } else if (!strcmp(path, "dlsym")) {
                void *lib = dlopen("libcuda.so.1", RTLD_NOW);
                fn = lib ? (CUresult(*)(CUdeviceptr *, size_t))dlsym(lib, "cuMemAlloc_v2") : NULL;
                if (!fn) return 950;
            } else {
                fn = cuMemAlloc_v2;
            }
        }
        rc = fn(&p, chunk);
        h->kind = 1, h->v = p;
    } else if (!strcmp(path, "managed")) {
        rc = cuMemAllocManaged(&p, chunk, 1);
        h->kind = 1, h->v = p;
    } else if (!strcmp(path, "pitch")) {
        size_t pitch;
        rc = cuMemAllocPitch_v2(&p, &pitch, chunk / 64, 64, 4);
        h->kind = 1, h->v = p;
    } else if (!strcmp(path, "async")) {
        rc = cuMemAllocAsync(&p, chunk, NULL);
        h->kind = 2, h->v = p;
    } else if (!strcmp(path, "pool")) {
        static void *pool;
        if (!pool && (rc = cuDeviceGetDefaultMemPool(&pool, dev)))
            return rc;
        rc = cuMemAllocFromPoolAsync(&p, chunk, pool, NULL);
        h->kind = 2, h->v = p;
    } else if (!strcmp(path, "vmm")) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1, prop.location.type = 1, prop.location.id = dev;
        CUmemGenericAllocationHandle hd = 0;
        rc = cuMemCreate(&hd, chunk, &prop, 0);
        h->kind = 3, h->v = hd;
    } else if (!strcmp(path, "vmmmapped")) {
        /* created, mapped, and its handle released at once: the mapping keeps the memory */
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1, prop.location.type = 1, prop.location.id = dev;
        CUmemGenericAllocationHandle hd = 0;
        CUdeviceptr va = 0;
        if (!(rc = cuMemCreate(&hd, chunk, &prop, 0))) {
            if (!(rc = cuMemAddressReserve(&va, chunk, 0, 0, 0)) && !(rc = cuMemMap(va, chunk, 0, hd, 0)))
                rc = cuMemRelease(hd);
            else
                cuMemRelease(hd);
        }
        h->kind = 7, h->v = va, h->size = chunk;
    } else if (!strcmp(path, "vmmretained")) {
        /* created, mapped, released, its handle retained from the mapping, unmapped: the
         * retained reference keeps the memory */
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1, prop.location.type = 1, prop.location.id = dev;
        CUmemGenericAllocationHandle hd = 0, again = 0;
        CUdeviceptr va = 0;
        if (!(rc = cuMemCreate(&hd, chunk, &prop, 0))) {
            if (!(rc = cuMemAddressReserve(&va, chunk, 0, 0, 0)) && !(rc = cuMemMap(va, chunk, 0, hd, 0)) &&
                !(rc = cuMemRelease(hd)) && !(rc = cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)va)))
                rc = cuMemUnmap(va, chunk);
            else
                cuMemRelease(hd);
        }
        h->kind = 3, h->v = again;
    } else if (!strncmp(path, "vmmarray", 8)) {
        /* a sparse array per chunk, the chunk's handle mapped into its tiles and released at
         * once: the array's mapping keeps the memory (freed: the array destroyed, or for
         * vmmarrayunmap its tiles unmapped, the array kept). vmmarraypartial: the map call fails
         * after mapping the tiles; vmmarrayrace: its list is rewritten after the driver read it;
         * vmmarrayremap: then a second handle takes the tiles' place in one call (unmap, map),
         * the first one's memory gone with its mapping, the second's held by the array. */
        int partial = !strcmp(path, "vmmarraypartial");
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1, prop.location.type = 1, prop.location.id = dev;
        prop.f[2] = 1; /* allocFlags.usage = CU_MEM_CREATE_USAGE_TILE_POOL */
        CUmemGenericAllocationHandle hd = 0;
        CUarray arr = NULL;
        if ((rc = sparse_array(&arr, chunk)))
            return rc;
        if (!(rc = cuMemCreate(&hd, chunk, &prop, 0))) {
            if (!(rc = map_tiles(arr, chunk, 1, hd, partial, !strcmp(path, "vmmarrayrace"))) || partial)
                rc = cuMemRelease(hd);
            else
                cuMemRelease(hd);
        }
        if (!rc && !strcmp(path, "vmmarrayremap") && !(rc = cuMemCreate(&hd, chunk, &prop, 0))) {
            CUresult rm = map_tiles(arr, chunk, 3, hd, 0, 0);
            rc = cuMemRelease(hd);
            rc = rm ? rm : rc;
        }
        if (rc)
            cuArrayDestroy(arr);
        h->kind = !strcmp(path, "vmmarrayunmap") ? 9 : 8, h->v = (uintptr_t)arr, h->size = chunk;
    } else if (!strcmp(path, "sparse") || !strcmp(path, "deferred") || !strcmp(path, "sparsemip")) {
        /* an array of the chunk's size whose memory is mapped in later: none of its own */
        CUDA_ARRAY3D_DESCRIPTOR a = {chunk / 4 / 1024, 1024, 0, 0x20, 1, !strcmp(path, "deferred") ? 0x80 : 0x40};
        void *arr = NULL;
        if (!strcmp(path, "sparsemip"))
            rc = cuMipmappedArrayCreate((CUmipmappedArray *)&arr, &a, 1), h->kind = 5;
        else
            rc = cuArray3DCreate_v2((CUarray *)&arr, &a), h->kind = 4;
        h->v = (uintptr_t)arr;
    } else if (!strcmp(path, "array")) {
        CUDA_ARRAY_DESCRIPTOR a = {chunk / 4 / 1024, 1024, 0x20, 1};
        CUarray arr = NULL;
        rc = cuArrayCreate_v2(&arr, &a);
        h->kind = 4, h->v = (uintptr_t)arr;
    } else if (!strcmp(path, "array3d")) {
        CUDA_ARRAY3D_DESCRIPTOR a = {chunk / 4 / 1024 / 4, 1024, 4, 0x20, 1, 0};
        CUarray arr = NULL;
        rc = cuArray3DCreate_v2(&arr, &a);
        h->kind = 4, h->v = (uintptr_t)arr;
    } else if (!strcmp(path, "array8")) { /* 1-byte elements: the stub lays out 4 bytes each */
        CUDA_ARRAY3D_DESCRIPTOR a = {chunk / 4 / 1024 / 4, 1024, 4, 0x01, 1, 0};
        CUarray arr = NULL;
        rc = cuArray3DCreate_v2(&arr, &a);
        h->kind = 4, h->v = (uintptr_t)arr;
    } else if (!strcmp(path, "mipmap")) {
        CUDA_ARRAY3D_DESCRIPTOR a = {chunk / 4 / 1024, 1024, 0, 0x20, 1, 0};
        CUmipmappedArray arr = NULL;
        rc = cuMipmappedArrayCreate(&arr, &a, 1);
        h->kind = 5, h->v = (uintptr_t)arr;
    } else {
        fprintf(stderr, "unknown path %s\n", path);
        exit(2);
    }
    if (rc)
        h->kind = 0;
    return rc;
}

static void free_one(struct held *h)
{
    switch (h->kind) {
    case 1: cuMemFree_v2(h->v); break;
    case 2: cuMemFreeAsync(h->v, NULL); break;
    case 3: cuMemRelease(h->v); break;
    case 7: cuMemUnmap(h->v, h->size); break;
    case 4: cuArrayDestroy((CUarray)(uintptr_t)h->v); break;
    case 5: cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)h->v); break;
    case 9: map_tiles((CUarray)(uintptr_t)h->v, h->size, 2, 0, 0, 0); break; /* the array stays */
    case 8: cuArrayDestroy((CUarray)(uintptr_t)h->v); break;
    case 6: {
        CUresult (*fr)(unsigned) = NULL;
        int st;
        if (!cuGetProcAddress_v2("cuMemFree", (void **)&fr, 3010, 0, &st) && fr)
            fr((unsigned)h->v);
        break;
    }
    }
}

static int cmd_fill(const char *path, size_t chunk, long max_n, double hold)
{
    CUdevice dev = setup(0);
    static struct held held[1 << 16];
    long n = 0;
    CUresult rc = 0;
    while (n < (1 << 16) && (max_n <= 0 || n < max_n)) {
        rc = alloc_one(path, chunk, dev, &held[n]);
        if (rc)
            break;
        n++;
    }
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    printf("{\"n\": %ld, \"bytes\": %llu, \"rc\": %d, \"free\": %zu, \"total\": %zu}\n", n,
           (unsigned long long)n * chunk, rc, f, t);
    fflush(stdout);
    if (hold > 0)
        usleep((useconds_t)(hold * 1e6));
    for (long i = 0; i < n; i++)
        free_one(&held[i]);
    cuMemGetInfo_v2(&f, &t);
    printf("{\"freed\": %ld, \"free\": %zu, \"total\": %zu}\n", n, f, t);
    return 0;
}

CUresult cuMemPoolCreate(void **, const void *);
CUresult cuStreamCreate(CUstream *, unsigned);

/* Stream-ordered memory of card 1 while card 0's context is current: on a stream made in card
 * 1's context (async), from card 1's default pool (pool) or a pool made on card 1 (poolmade),
 * CHUNK bytes until refused; each card's memory as it then reads, and card 1's after the frees. */
static long fill_chunks(size_t chunk, CUresult *rc)
{
    CUdeviceptr p;
    long n = 0;
    int managed = getenv("CUPROG_MANAGED") && atoi(getenv("CUPROG_MANAGED"));
    while (n < 4096 && !(*rc = managed ? cuMemAllocManaged(&p, chunk, 1) : cuMemAlloc_v2(&p, chunk)))
        n++;
    return n;
}

CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);

/* cuMemCreate CHUNK, (EXPORT 1) export it as a POSIX file descriptor kept open, release it:
 * until refused, at most 64 times. */
static int cmd_vmmexport(int export, size_t chunk)
{
    setup(0);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1, prop.location.type = 1, prop.location.id = 0;
    prop.requestedHandleTypes = 1; /* POSIX file descriptor */
    CUresult rc = 0, erc = 0;
    long n = 0;
    for (; n < 64; n++) {
        CUmemGenericAllocationHandle h = 0;
        int fd = -1;
        if ((rc = cuMemCreate(&h, chunk, &prop, 0)))
            break;
        if (export && (erc = cuMemExportToShareableHandle(&fd, h, 1, 0)))
            break;
        cuMemRelease(h);
    }
    printf("{\"n\": %ld, \"rc\": %d, \"export_rc\": %d}\n", n, rc, erc);
    return 0;
}

static int cmd_ctxend(const char *how, size_t chunk)
{
    CUdevice d = setup(0);
    CUcontext c = NULL;
    CUresult rc = 0, rc1 = 0, rc2 = 0, end = 0;
    int created = !strcmp(how, "destroy");
    if (created && (rc = cuCtxCreate_v2(&c, 0, d))) { printf("{\"ctx_rc\": %d}\n", rc); return 3; }
    if (!strcmp(how, "release2")) { /* one more retain the shim does not see (the stub's own door) */
        CUresult (*retain)(CUdevice) = (CUresult(*)(CUdevice))dlsym(RTLD_DEFAULT, "stub_hidden_retain");
        if (!retain || (rc = retain(d))) { printf("{\"ctx_rc\": %d}\n", retain ? rc : -1); return 3; }
    }
    long n1 = fill_chunks(chunk, &rc1);
    if (created)
        end = cuCtxDestroy_v2(c);
    else if (!strcmp(how, "reset"))
        end = cuDevicePrimaryCtxReset_v2(d);
    else
        end = cuDevicePrimaryCtxRelease_v2(d);
    if (created)
        rc = cuCtxCreate_v2(&c, 0, d);
    else if (!(rc = cuDevicePrimaryCtxRetain(&c, d)))
        rc = cuCtxSetCurrent(c);
    long n2 = rc ? -1 : fill_chunks(chunk, &rc2);
    size_t free2 = 0, total2 = 0;
    cuMemGetInfo_v2(&free2, &total2);
    printf("{\"n1\": %ld, \"rc1\": %d, \"end_rc\": %d, \"ctx2_rc\": %d, \"n2\": %ld, \"rc2\": %d, \"free2\": %zu}\n", n1,
           rc1, end, rc, n2, rc2, free2);
    return 0;
}

static int cmd_xdev(const char *path, size_t chunk)
{
    CUdevice d1;
    CUcontext c0, c1;
    CUstream s = NULL;
    void *pool = NULL;
    setup(0);
    cuCtxGetCurrent(&c0);
    CUresult rc = cuDeviceGet(&d1, 1);
    if (!rc)
        rc = cuDevicePrimaryCtxRetain(&c1, d1);
    if (!rc && !strcmp(path, "async") && !(rc = cuCtxSetCurrent(c1)) && !(rc = cuStreamCreate(&s, 1)))
        rc = cuCtxSetCurrent(c0);
    else if (!rc && !strcmp(path, "pool"))
        rc = cuDeviceGetDefaultMemPool(&pool, d1);
    else if (!rc && !strcmp(path, "poolmade")) {
        struct { int alloc_type, handle_types, loc_type, loc_id; void *win32; unsigned char rest[64]; } props;
        memset(&props, 0, sizeof props);
        props.alloc_type = 1, props.loc_type = 1, props.loc_id = d1;
        rc = cuMemPoolCreate(&pool, &props);
    } else if (!rc && !strcmp(path, "poolalias")) { /* the new handle written over the location */
        struct { int alloc_type, handle_types, loc_type, loc_id; void *win32; unsigned char rest[64]; } props;
        memset(&props, 0, sizeof props);
        props.alloc_type = 1, props.loc_type = 1, props.loc_id = d1;
        rc = cuMemPoolCreate((void **)&props.loc_type, &props);
        memcpy(&pool, &props.loc_type, sizeof pool);
    }
    if (rc) { printf("{\"setup_rc\": %d}\n", rc); return 3; }
    static CUdeviceptr held[4096];
    long n = 0;
    while (n < 4096 && !(rc = pool ? cuMemAllocFromPoolAsync(&held[n], chunk, pool, NULL) : cuMemAllocAsync(&held[n], chunk, s)))
        n++;
    size_t f0 = 0, t0 = 0, f1 = 0, t1 = 0, after = 0;
    cuMemGetInfo_v2(&f0, &t0);
    cuCtxSetCurrent(c1);
    cuMemGetInfo_v2(&f1, &t1);
    cuCtxSetCurrent(c0);
    for (long i = 0; i < n; i++)
        cuMemFreeAsync(held[i], s);
    cuCtxSetCurrent(c1);
    cuMemGetInfo_v2(&after, &t1);
    printf("{\"n\": %ld, \"rc\": %d, \"free0\": %zu, \"total0\": %zu, \"free1\": %zu, \"total1\": %zu, "
           "\"free1_after\": %zu}\n", n, rc, f0, t0, f1, t1, after);
    return 0;
}

static CUfunction kernel(void)
{
    CUmodule m;
    CUfunction f;
    CUresult rc = cuModuleLoadData(&m, PTX);
    if (!rc)
        rc = cuModuleGetFunction(&f, m, "empty");
    if (rc) { printf("{\"module_rc\": %d}\n", rc); exit(3); }
    return f;
}

static CUresult launch_once(const char *mode, CUfunction f)
{
    static CUresult (*gpa_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
    if (!strcmp(mode, "kernel"))
        return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    if (!strcmp(mode, "ptsz"))
        return cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    if (!strcmp(mode, "ex")) {
        CUlaunchConfig c = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
        return cuLaunchKernelEx(&c, f, NULL, NULL);
    }
    if (!strcmp(mode, "coop"))
        return cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
    if (!strcmp(mode, "graph"))
        return cuGraphLaunch(NULL, NULL);
    if (!strcmp(mode, "launch0"))
        return cuLaunch(f);
    if (!strcmp(mode, "grid"))
        return cuLaunchGrid(f, 1, 1);
    if (!strcmp(mode, "gridasync"))
        return cuLaunchGridAsync(f, 1, 1, NULL);
    if (!strcmp(mode, "multi")) {
        launch_params l = {f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL};
        return cuLaunchCooperativeKernelMultiDevice(&l, 1, 0);
    }
    if (!strcmp(mode, "gpa")) {
        if (!gpa_launch) {
            int st;
            if (cuGetProcAddress_v2("cuLaunchKernel", (void **)&gpa_launch, 12000, 0, &st))
                return 999;
        }
        return gpa_launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    }
    return 998;
}

static int cmd_launch(const char *mode, double secs, long sync_every)
{
    setup(0);
    CUfunction f = kernel();
    long n = 0;
    double t0 = now_s(), t;
    CUresult rc = 0;
    while ((t = now_s()) - t0 < secs) {
        if ((rc = launch_once(mode, f)))
            break;
        if (++n % sync_every == 0)
            cuStreamSynchronize(NULL);
    }
    cuCtxSynchronize();
    t = now_s() - t0;
    printf("{\"launches\": %ld, \"secs\": %.4f, \"rate\": %.2f, \"rc\": %d}\n", n, t, n / t, rc);
    return rc != 0;
}

CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, void **);
CUresult cuGraphDestroy(void *);
CUresult cuStreamDestroy_v2(CUstream);

static double done_s(void)
{
    static unsigned long long (*done)(int);
    if (!done)
        done = (unsigned long long (*)(int))dlsym(RTLD_DEFAULT, "stubDoneNs");
    static int phys = -1; /* CUPROG_DONE_PHYS=N: the kernels of physical card N (0) */
    if (phys < 0)
        phys = getenv("CUPROG_DONE_PHYS") ? atoi(getenv("CUPROG_DONE_PHYS")) : 0;
    return done ? done(phys) * 1e-9 : 0;
}

/* The GPU time this process's kernels ran in each whole second of a run, read at each second's
 * end by a thread of its own (the stub counts a running kernel's part): a mark taken by the
 * work loop would be late whenever a launch waits in the shim, and count the next second's
 * kernel in this one. */
struct per_sec {
    double t0, d0, v[64];
    _Atomic int n; /* seconds read */
};

static void *per_sec_main(void *arg)
{
    struct per_sec *p = arg;
    double prev = p->d0;
    for (int k = 1; k <= 64; k++) {
        double at = p->t0 + k;
        struct timespec ts = {(time_t)at, (long)((at - (double)(time_t)at) * 1e9)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        double d = done_s();
        p->v[k - 1] = d - prev;
        prev = d;
        atomic_store(&p->n, k);
    }
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* CUPROG_HIDDEN_SYNC=1: wait through the stub's stubHiddenSync, a path the shim does not see
 * (the CUDA runtime's cudaDeviceSynchronize reaches the real driver that way). */
static CUresult work_sync(CUstream s)
{
    static int hidden = -1;
    static CUresult (*fn)(CUstream);
    if (hidden < 0) {
        const char *v = getenv("CUPROG_HIDDEN_SYNC");
        hidden = v && *v == '1';
        if (hidden)
            fn = (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "stubHiddenSync");
    }
    return hidden && fn ? fn(s) : cuStreamSynchronize(s);
}

/* Stream A waits for a value that stream B writes only after the next n + 1 launches, all from
 * this thread (a kernel waiting for a peer's, a persistent kernel stopped later); then A is
 * synchronized. Natively it runs through; a launch that waited for A's work would never return. */
static CUresult wait_value_then_write(CUfunction f, unsigned kus, long n, CUstream *a)
{
    typedef CUresult (*memop_fn)(CUstream, CUdeviceptr, unsigned, unsigned);
    memop_fn wait = (memop_fn)dlsym(RTLD_DEFAULT, "cuStreamWaitValue32_v2");
    memop_fn write = (memop_fn)dlsym(RTLD_DEFAULT, "cuStreamWriteValue32_v2");
    static unsigned value;
    CUstream b;
    CUresult rc;
    if (!wait || !write)
        return 997;
    if ((rc = cuStreamCreate(a, 1)) || (rc = cuStreamCreate(&b, 1)) || /* non-blocking */
        (rc = wait(*a, (CUdeviceptr)(uintptr_t)&value, 1, 0))) /* CU_STREAM_WAIT_VALUE_GEQ */
        return rc;
    for (long i = 0; i < n && !rc; i++)
        rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, *a, NULL, NULL);
    if (!rc)
        rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, b, NULL, NULL);
    if (!rc)
        rc = write(b, (CUdeviceptr)(uintptr_t)&value, 1, 0);
    return rc ? rc : cuStreamSynchronize(*a);
}

/* CUPROG_THREADS=N in sat mode: N - 1 more threads, each launching KERNEL_US kernels on a
 * non-blocking stream of its own (CUPROG_LEAD_KUS first after each sync, a sync every SYNC_EVERY)
 * until `end`, beside the main thread's loop. */
struct sat_thread {
    CUcontext ctx;
    CUfunction f;
    unsigned kus;
    long every, lead;
    double end;
    pthread_t t;
};

/* CUPROG_CTX2=1: a context of its own (cuCtxCreate) instead of the process's primary one. */
static int own_ctx(void)
{
    const char *v = getenv("CUPROG_CTX2");
    return v && *v == '1';
}

/* The card of the work loop's second context: CUPROG_CTX2_DEV=N, ordinal N (0: the same card). */
static CUdevice ctx2_dev(void)
{
    CUdevice d = 0;
    const char *v = getenv("CUPROG_CTX2_DEV");
    if (v && cuDeviceGet(&d, atoi(v)))
        d = 0;
    return d;
}

static void *sat_thread_main(void *arg)
{
    struct sat_thread *a = arg;
    CUstream s;
    CUcontext mine;
    if (own_ctx() ? cuCtxCreate_v2(&mine, 0, 0) : cuCtxSetCurrent(a->ctx))
        return NULL;
    if (cuStreamCreate(&s, 1))
        return NULL;
    for (long k = 0; now_s() < a->end; k++) {
        if (a->lead && k % a->every == 0)
            cuLaunchKernel(a->f, (unsigned)a->lead, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        cuLaunchKernel(a->f, a->kus, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        if ((k + 1) % a->every == 0)
            work_sync(s);
    }
    work_sync(s);
    return NULL;
}

/* The primary context of card 0 reset (or released for the last time), retained and made
 * current again. */
static CUresult primary_renew(void)
{
    const char *how = getenv("CUPROG_PRIMARY_HOW");
    CUcontext c;
    CUresult rc = how && !strcmp(how, "release") ? cuDevicePrimaryCtxRelease_v2(0) : cuDevicePrimaryCtxReset_v2(0);
    if (!rc)
        rc = cuDevicePrimaryCtxRetain(&c, 0);
    if (!rc && how && !strcmp(how, "release"))
        rc = cuCtxSetCurrent(c);
    return rc ? 994 : 0;
}

static int cmd_work(int argc, char **argv)
{
    const char *mode = argv[2];
    double secs = atof(argv[3]);
    unsigned kus = (unsigned)atol(argv[4]);
    long a = argc > 5 ? atol(argv[5]) : 1, b = argc > 6 ? atol(argv[6]) : 1;
    setup(0);
    CUfunction f = kernel();
    CUstream st[8] = {NULL};
    const char *gs = getenv("CUPROG_GAP_STREAMS"); /* gap: launches round-robin on so many streams */
    int ns = !strcmp(mode, "sat") && b > 1 ? (int)(b > 8 ? 8 : b) : !strcmp(mode, "gap") && gs ? atoi(gs) : 1;
    ns = ns < 1 ? 1 : ns > 8 ? 8 : ns;
    const char *nb = getenv("CUPROG_NB_STREAMS"); /* 1: CU_STREAM_NON_BLOCKING, as torch's side streams */
    for (int i = 1; i < ns; i++)
        cuStreamCreate(&st[i], nb && *nb == '1' ? 1 : 0);
    static double lat[100000];
    long n = 0, nreq = 0;
    const char *wu = getenv("CUPROG_WARMUP_MS"); /* a saturating warm-up before measuring */
    const char *wk = getenv("CUPROG_WARMUP_KUS"); /* its kernels' length (default: kus) */
    unsigned wkus = wk ? (unsigned)atol(wk) : kus;
    for (double e = now_s() + (wu ? atof(wu) : 0) / 1e3; wu && now_s() < e;) {
        for (int i = 0; i < 10; i++)
            cuLaunchKernel(f, wkus, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        work_sync(NULL);
    }
    const char *idle = getenv("CUPROG_IDLE_MS"); /* light use first: a short kernel every 100 ms */
    for (double e = now_s() + (idle ? atof(idle) : 0) / 1e3; idle && now_s() < e;) {
        cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        work_sync(NULL);
        struct timespec ts = {0, 100000000L};
        nanosleep(&ts, NULL);
    }
    double pre = now_s();
    CUresult prc = !strcmp(mode, "waitval") ? wait_value_then_write(f, kus, a, &st[0]) : 0;
    pre = now_s() - pre;
    const char *pause = getenv("CUPROG_PAUSE_MS"); /* then no CUDA call at all for N ms */
    if (pause) {
        long ms = atol(pause);
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    static struct per_sec per;
    double t0 = now_s(), d0 = done_s(), next = t0, t;
    static struct sat_thread more[7];
    int nmore = !strcmp(mode, "sat") && getenv("CUPROG_THREADS") ? atoi(getenv("CUPROG_THREADS")) - 1 : 0;
    nmore = nmore < 0 ? 0 : nmore > 7 ? 7 : nmore;
    for (int i = 0; i < nmore; i++) {
        more[i] = (struct sat_thread){.f = f, .kus = kus, .every = a > 0 ? a : 1, .end = t0 + secs,
                                      .lead = getenv("CUPROG_LEAD_KUS") ? atol(getenv("CUPROG_LEAD_KUS")) : 0};
        /* CUPROG_TINY_THREADS=k: the last k of them launch 5 us kernels only, each waited for */
        if (getenv("CUPROG_TINY_THREADS") && i >= nmore - atoi(getenv("CUPROG_TINY_THREADS")))
            more[i].kus = 5, more[i].every = 1, more[i].lead = 0;
        cuCtxGetCurrent(&more[i].ctx);
        pthread_create(&more[i].t, NULL, sat_thread_main, &more[i]);
    }
    per.t0 = t0, per.d0 = d0;
    pthread_t per_thread;
    pthread_create(&per_thread, NULL, per_sec_main, &per);
    CUresult rc = prc;
    while (!rc && (t = now_s()) - t0 < secs) {
        if (!strcmp(mode, "sat")) {
            /* CUPROG_SIDE_ONLY=1: round-robin on the created streams only, never the legacy one */
            static int side = -1;
            if (side < 0)
                side = ns > 1 && getenv("CUPROG_SIDE_ONLY") && *getenv("CUPROG_SIDE_ONLY") == '1';
            CUstream sn = side ? st[1 + n % (ns - 1)] : st[n % ns];
            /* CUPROG_LEAD_KUS: a kernel that long first after each sync (a batch's first kernel) */
            static long lead = -1;
            if (lead < 0)
                lead = getenv("CUPROG_LEAD_KUS") ? atol(getenv("CUPROG_LEAD_KUS")) : 0;
            /* CUPROG_CTX2=1 (one stream): the lead kernel in the primary context, the others in a
             * second context of the card, switched to and back around them */
            static CUcontext ctx_a, ctx_b;
            if (own_ctx() && ns == 1 && !ctx_b && (cuCtxGetCurrent(&ctx_a) || cuCtxCreate_v2(&ctx_b, 0, ctx2_dev()) ||
                                                   cuCtxSetCurrent(ctx_a)))
                rc = 996;
            /* CUPROG_CTX2_RENEW=N: every N syncs the second context is destroyed and made anew
             * (CUPROG_CTX2_V1=1: by the CUDA < 4.0 name, cuCtxDestroy) */
            static long renew = -1;
            static CUresult (*destroy)(CUcontext);
            if (renew < 0) {
                renew = getenv("CUPROG_CTX2_RENEW") ? atol(getenv("CUPROG_CTX2_RENEW")) : 0;
                destroy = getenv("CUPROG_CTX2_V1") && *getenv("CUPROG_CTX2_V1") == '1' ? cuCtxDestroy : cuCtxDestroy_v2;
            }
            if (!rc && ctx_b && renew > 0 && n && n % ((a > 0 ? a : 1) * renew) == 0 &&
                (destroy(ctx_b) || cuCtxCreate_v2(&ctx_b, 0, ctx2_dev()) || cuCtxSetCurrent(ctx_a)))
                rc = 995;
            /* CUPROG_PRIMARY_RESET=N: every N syncs the primary context is reset (cudaDeviceReset),
             * or with CUPROG_PRIMARY_HOW=release released for the last time, then retained again
             * (the driver hands back the same handle) */
            static long reset = -1;
            if (reset < 0)
                reset = getenv("CUPROG_PRIMARY_RESET") ? atol(getenv("CUPROG_PRIMARY_RESET")) : 0;
            if (!rc && reset > 0 && n && n % ((a > 0 ? a : 1) * reset) == 0)
                rc = primary_renew();
            if (!rc && lead && n % (a > 0 ? a : 1) == 0) {
                if (ctx_b)
                    cuCtxSetCurrent(ctx_a);
                rc = cuLaunchKernel(f, (unsigned)lead, 1, 1, 1, 1, 1, 0, sn, NULL, NULL);
            }
            /* CUPROG_CTX2_STREAM=1: the others on a stream made in the second context, the primary
             * one staying current (a CUkernel launch takes its context from the stream) */
            static CUstream sb;
            static int via_stream = -1;
            if (via_stream < 0)
                via_stream = ctx_b && getenv("CUPROG_CTX2_STREAM") && *getenv("CUPROG_CTX2_STREAM") == '1';
            if (via_stream && !sb && !rc && (cuCtxSetCurrent(ctx_b) || cuStreamCreate(&sb, 1) || cuCtxSetCurrent(ctx_a)))
                rc = 994;
            if (ctx_b && !via_stream)
                cuCtxSetCurrent(ctx_b);
            /* CUPROG_GRAPH=1: the others as graph launches (the stub runs STUB_GRAPH_US of work) */
            static int graphs = -1;
            if (graphs < 0)
                graphs = getenv("CUPROG_GRAPH") && *getenv("CUPROG_GRAPH") == '1';
            if (!rc)
                rc = graphs ? cuGraphLaunch(NULL, via_stream ? sb : sn)
                            : cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, via_stream ? sb : sn, NULL, NULL);
            if (++n % (a > 0 ? a : 1) == 0) {
                for (int i = side; i < (side ? ns : 1); i++)
                    work_sync(side ? st[i] : st[n % ns]);
                if (via_stream)
                    work_sync(sb);
            }
        } else if (!strcmp(mode, "waitval")) {
            rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, st[0], NULL, NULL);
            if (++n % (b > 0 ? b : 1) == 0)
                work_sync(st[0]);
        } else if (!strcmp(mode, "nbwait")) {
            static CUstream nb, other;
            if (!nb) {
                cuStreamCreate(&nb, 1); /* CU_STREAM_NON_BLOCKING */
                cuStreamCreate(&other, 0);
            }
            for (long i = 0; i < a && !rc; i++, n++)
                rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, nb, NULL, NULL);
            if (!rc)
                rc = work_sync(other);
            if (!rc)
                rc = work_sync(nb);
        } else if (!strcmp(mode, "capture")) {
            /* launches on a stream, then a capture of a few more on it (torch.cuda.graph warms up
             * and captures on one side stream): the capture must end cleanly */
            static CUstream cs;
            if (!cs)
                cuStreamCreate(&cs, 1);
            for (int i = 0; i < 20 && !rc; i++, n++)
                rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, cs, NULL, NULL);
            void *gr = NULL;
            static int ncap; /* the stub holds 64 graphs */
            if (!rc && ncap++ < 40 && !(rc = cuStreamBeginCapture_v2(cs, 0))) {
                for (int i = 0; i < 5 && !rc; i++)
                    rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, cs, NULL, NULL);
                CUresult end = cuStreamEndCapture(cs, &gr);
                rc = rc ? rc : end;
            }
            if (!rc)
                rc = work_sync(cs);
        } else if (!strcmp(mode, "gap")) {
            /* CUPROG_MIX=1: kernels of mixed lengths, as in a training step (mean 1.25 x KERNEL_US) */
            static const unsigned mix[8] = {16, 1, 2, 1, 8, 1, 4, 7};
            static int mixed = -1;
            if (mixed < 0)
                mixed = getenv("CUPROG_MIX") && *getenv("CUPROG_MIX") == '1';
            unsigned k = mixed ? (kus * mix[n % 8] + 2) / 4 : kus;
            rc = cuLaunchKernel(f, k ? k : 1, 1, 1, 1, 1, 1, 0, st[n % ns], NULL, NULL);
            for (double e = now_s() + a / 1e6; now_s() < e;)
                ; /* the CPU's share of each step */
            if (++n % (b > 0 ? b : 1) == 0)
                for (int i = 0; i < ns; i++)
                    work_sync(st[i]);
        } else {
            if (t < next) {
                struct timespec ts = {0, (long)((next - t) * 1e9)};
                nanosleep(&ts, NULL);
                continue;
            }
            for (long i = 0; i < a && !rc; i++, n++)
                rc = cuLaunchKernel(f, kus, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            work_sync(NULL);
            if (nreq < 100000)
                lat[nreq++] = (now_s() - next) * 1e3;
            next += b / 1e3;
        }
        if (rc)
            break;
    }
    for (int i = 0; i < nmore; i++)
        pthread_join(more[i].t, NULL);
    cuCtxSynchronize();
    t = now_s() - t0;
    double busy = (done_s() - d0) / t;
    pthread_cancel(per_thread); /* it sleeps until the next second: a cancellation point */
    pthread_join(per_thread, NULL);
    int nper = atomic_load(&per.n);
    qsort(lat, (size_t)nreq, sizeof lat[0], cmp_d);
    double p50 = nreq ? lat[nreq / 2] : 0, p99 = nreq ? lat[(nreq * 99) / 100 < nreq ? (nreq * 99) / 100 : nreq - 1] : 0;
    printf("{\"mode\": \"%s\", \"launches\": %ld, \"secs\": %.4f, \"busy\": %.4f, \"requests\": %ld, "
           "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"rc\": %d, \"pre_s\": %.3f, \"per_sec\": [", mode, n, t, busy, nreq,
           p50, p99, rc, pre);
    for (int i = 0; i < nper; i++)
        printf("%s%.4f", i ? ", " : "", per.v[i]);
    printf("]}\n");
    fflush(stdout);
    const char *linger = getenv("CUPROG_LINGER_MS"); /* then idle that long, its context kept */
    if (linger) {
        long ms = atol(linger);
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return rc != 0;
}

#define CU_STREAM_PER_THREAD ((CUstream)0x2)

struct relay {
    pthread_barrier_t step;
    CUcontext ctx;
    CUfunction f;
    unsigned kus;
    long n;
    _Atomic int stop;
};

static void *relay_second(void *arg)
{
    struct relay *r = arg;
    cuCtxSetCurrent(r->ctx);
    for (;;) {
        pthread_barrier_wait(&r->step); /* the main thread's kernel is launched */
        if (atomic_load(&r->stop))
            return NULL;
        for (long i = 0; i < r->n; i++)
            cuLaunchKernel(r->f, r->kus, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
        pthread_barrier_wait(&r->step); /* ours are launched */
        pthread_barrier_wait(&r->step); /* the main thread waited for its stream */
        work_sync(CU_STREAM_PER_THREAD);
    }
}

static int cmd_relay(double secs, unsigned kus, long n)
{
    setup(0);
    static struct relay r;
    r.f = kernel(), r.kus = kus, r.n = n;
    cuCtxGetCurrent(&r.ctx);
    pthread_barrier_init(&r.step, NULL, 2);
    pthread_t second;
    pthread_create(&second, NULL, relay_second, &r);
    CUresult rc = 0;
    long rounds = 0;
    for (double e = now_s() + 0.3; now_s() < e;) { /* 5 us kernels first: a low estimate */
        for (int i = 0; i < 10; i++)
            cuLaunchKernel(r.f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
        work_sync(CU_STREAM_PER_THREAD);
    }
    double t0 = now_s(), d0 = done_s();
    while (!rc && now_s() - t0 < secs) {
        rc = cuLaunchKernel(r.f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
        pthread_barrier_wait(&r.step);
        pthread_barrier_wait(&r.step);
        work_sync(CU_STREAM_PER_THREAD);
        pthread_barrier_wait(&r.step);
        rounds++;
    }
    atomic_store(&r.stop, 1);
    pthread_barrier_wait(&r.step);
    pthread_join(second, NULL);
    cuCtxSynchronize();
    double t = now_s() - t0;
    printf("{\"rounds\": %ld, \"secs\": %.4f, \"busy\": %.4f, \"rc\": %d}\n", rounds, t, (done_s() - d0) / t, rc);
    return rc != 0;
}

/* cuprog ptds: two threads on their per-thread default streams, each at its own pace: the main
 * thread launches a 5 us kernel and waits for its stream, over and over; the second launches N
 * kernels of KERNEL_US and waits for its stream, each round (suite_cu's ptds on a GPU). The
 * relay's state, its barrier unused. */
static void *ptds_second(void *arg)
{
    struct relay *p = arg;
    cuCtxSetCurrent(p->ctx);
    while (!atomic_load(&p->stop)) {
        for (long i = 0; i < p->n; i++)
            cuLaunchKernel(p->f, p->kus, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
        work_sync(CU_STREAM_PER_THREAD);
    }
    return NULL;
}

static int cmd_ptds(double secs, unsigned kus, long n)
{
    setup(0);
    static struct relay p;
    p.f = kernel(), p.kus = kus, p.n = n;
    cuCtxGetCurrent(&p.ctx);
    pthread_t second;
    pthread_create(&second, NULL, ptds_second, &p);
    CUresult rc = 0;
    for (double e = now_s() + 0.5; !rc && now_s() < e;) /* not measured: the estimate settles */
        if (!(rc = cuLaunchKernel(p.f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL)))
            rc = work_sync(CU_STREAM_PER_THREAD);
    static struct per_sec per;
    double t0 = now_s(), d0 = done_s();
    per.t0 = t0, per.d0 = d0;
    pthread_t per_thread;
    pthread_create(&per_thread, NULL, per_sec_main, &per);
    while (!rc && now_s() - t0 < secs)
        if (!(rc = cuLaunchKernel(p.f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL)))
            rc = work_sync(CU_STREAM_PER_THREAD);
    double t = now_s() - t0, busy = (done_s() - d0) / t;
    atomic_store(&p.stop, 1);
    pthread_join(second, NULL);
    int nper = atomic_load(&per.n);
    printf("{\"busy\": %.4f, \"secs\": %.4f, \"rc\": %d, \"per_sec\": [", busy, t, rc);
    for (int i = 0; i < nper; i++)
        printf("%s%.4f", i ? ", " : "", per.v[i]);
    printf("]}\n");
    return rc != 0;
}

static int cmd_bench(long n)
{
    setup(0);
    CUfunction f = kernel();
    for (int i = 0; i < 1000; i++)
        cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    cuCtxSynchronize();
    double t0 = now_s();
    for (long i = 0; i < n; i++)
        cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    double launch_cpu = (now_s() - t0) / n;
    cuCtxSynchronize();
    double launch_sustained = (now_s() - t0) / n;
    long m = n / 20 > 100 ? n / 20 : 100;
    t0 = now_s();
    for (long i = 0; i < m; i++) {
        CUdeviceptr p;
        cuMemAlloc_v2(&p, 2 << 20);
        cuMemFree_v2(p);
    }
    double allocfree = (now_s() - t0) / m;
    size_t fr, to;
    t0 = now_s();
    for (long i = 0; i < m; i++)
        cuMemGetInfo_v2(&fr, &to);
    double info = (now_s() - t0) / m;
    printf("{\"launch_ns\": %.1f, \"launch_sustained_ns\": %.1f, \"allocfree_ns\": %.1f, \"meminfo_ns\": %.1f}\n",
           launch_cpu * 1e9, launch_sustained * 1e9, allocfree * 1e9, info * 1e9);
    return 0;
}

/* ------------------------------------------------------------------ threads and fork */

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;

static CUcontext g_ctx;
static CUfunction g_fn;
static volatile int g_stop;
static pthread_barrier_t g_bar;
static long g_n;
static size_t g_chunk;

static long used_bytes(void)
{
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    return (long)(t - f);
}

static void *thread_body(void *arg)
{
    CUdeviceptr *held = arg;
    cuCtxSetCurrent(g_ctx);
    pthread_barrier_wait(&g_bar);
    size_t f, t;
    for (long i = 0; i < g_n; i++) {
        if (cuMemAlloc_v2(&held[i], g_chunk))
            held[i] = 0;
        cuLaunchKernel(g_fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        cuMemGetInfo_v2(&f, &t);
    }
    pthread_barrier_wait(&g_bar); /* all hold */
    pthread_barrier_wait(&g_bar); /* main has measured */
    for (long i = 0; i < g_n; i++)
        if (held[i])
            cuMemFree_v2(held[i]);
    cuStreamSynchronize(NULL);
    return NULL;
}

static int cmd_threads(int nt, long n, size_t chunk)
{
    CUdevice d = setup(0);
    (void)d;
    cuCtxGetCurrent(&g_ctx);
    g_fn = kernel();
    g_n = n, g_chunk = chunk;
    if (nt > 64)
        nt = 64;
    pthread_t th[64];
    CUdeviceptr *held = calloc((size_t)nt * (size_t)n, sizeof *held);
    usleep(300000); /* reconciliation settles before the baseline (one every 200 ms) */
    long base = used_bytes();
    pthread_barrier_init(&g_bar, NULL, (unsigned)nt + 1);
    for (int i = 0; i < nt; i++)
        pthread_create(&th[i], NULL, thread_body, held + (size_t)i * (size_t)n);
    pthread_barrier_wait(&g_bar); /* go */
    pthread_barrier_wait(&g_bar); /* all hold */
    long ok = 0;
    for (long i = 0; i < (long)nt * n; i++)
        ok += held[i] != 0;
    usleep(300000);
    long hold = used_bytes();
    pthread_barrier_wait(&g_bar);
    for (int i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    usleep(300000);
    long after = used_bytes();
    printf("{\"threads\": %d, \"allocated\": %ld, \"base\": %ld, \"held\": %ld, \"after\": %ld}\n",
           nt, ok, base, hold - base, after - base);
    return 0;
}

static void *busy_body(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(g_ctx);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    int (*ninit)(void) = nvml ? (int (*)(void))dlsym(nvml, "nvmlInit_v2") : NULL;
    int (*nget)(unsigned, void **) = nvml ? (int (*)(unsigned, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2") : NULL;
    int (*nmem)(void *, nvmlMemory_t *) = nvml ? (int (*)(void *, nvmlMemory_t *))dlsym(nvml, "nvmlDeviceGetMemoryInfo") : NULL;
    void *h = NULL;
    if (ninit && ninit() == 0 && nget)
        nget(0, &h);
    size_t f, t;
    while (!g_stop) {
        CUdeviceptr p;
        if (!cuMemAlloc_v2(&p, 2 << 20))
            cuMemFree_v2(p);
        cuLaunchKernel(g_fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        cuMemGetInfo_v2(&f, &t);
        nvmlMemory_t m;
        if (h && nmem)
            nmem(h, &m);
    }
    return NULL;
}

static int child_cuda(void)
{
    /* A child that uses the hooks (with the stub driver CUDA "survives" fork). */
    CUdevice d;
    CUcontext c;
    CUdeviceptr p;
    size_t f, t;
    cuInit(0);
    cuDeviceGet(&d, 0);
    cuDevicePrimaryCtxRetain(&c, d);
    cuCtxSetCurrent(c);
    for (int i = 0; i < 20; i++) {
        if (!cuMemAlloc_v2(&p, 1 << 20))
            cuMemFree_v2(p);
        cuLaunchKernel(g_fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        cuMemGetInfo_v2(&f, &t);
    }
    cuStreamSynchronize(NULL);
    return 0;
}

static int cmd_fork(const char *kind, int n, int busy, const char *self)
{
    setup(0);
    cuCtxGetCurrent(&g_ctx);
    g_fn = kernel();
    CUdeviceptr keep;
    CUresult krc = cuMemAlloc_v2(&keep, 8 << 20); /* the parent holds memory across the forks */
    pthread_t th[16];
    if (busy > 16)
        busy = 16;
    for (int i = 0; i < busy; i++)
        pthread_create(&th[i], NULL, busy_body, NULL);
    usleep(20000);
    int ok = 0, stuck = 0, failed = 0;
    for (int i = 0; i < n; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(10);
            if (!strcmp(kind, "exec")) {
                const char *chunk = getenv("CUPROG_EXEC_CHUNK");
                execl(self, self, "fill", "alloc", chunk ? chunk : "1048576", "4", (char *)NULL);
                _exit(127);
            }
            if (!strcmp(kind, "cuda"))
                child_cuda();
            exit(0); /* atexit handlers and destructors run, as in a worker that returns */
        }
        int st = 0;
        if (pid < 0 || waitpid(pid, &st, 0) < 0)
            failed++;
        else if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM)
            stuck++;
        else if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
            ok++;
        else {
            failed++;
            fprintf(stderr, "child %d: status 0x%x\n", (int)pid, st);
        }
    }
    g_stop = 1;
    for (int i = 0; i < busy; i++)
        pthread_join(th[i], NULL);
    if (!krc)
        cuMemFree_v2(keep);
    usleep(300000); /* the next cuMemGetInfo reconciles with NVML at rest (every 200 ms at most) */
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    printf("{\"kind\": \"%s\", \"children\": %d, \"ok\": %d, \"stuck\": %d, \"failed\": %d, \"keep_rc\": %d, "
           "\"free\": %zu, \"total\": %zu}\n", kind, n, ok, stuck, failed, krc, f, t);
    return stuck || failed;
}

/* ------------------------------------------------------------------ hostile tenants */

/* cuprog hostile VARIANT SECS HEAVY_US K: after 0.3 s of 5 us kernels on the
 * per-thread stream (a low estimate), for SECS:
 *   ptforeign: the main thread launches a 5 us kernel on its per-thread stream (a batch opens
 *       there), one into a stream it keeps capturing (no gap tracking for this batch), then K
 *       kernels of HEAVY_US on a non-blocking stream; a second thread then waits for that stream
 *       (its wait closes the batch: a close by another thread than the per-thread stream's).
 *   gaveup: first a kernel of 1.5 s (the first batch's wait runs out: the gate never waits
 *       again), then K kernels of HEAVY_US on one stream and a wait on another, idle, stream
 *       (each closes a batch), never a wait for the work itself.
 *   primrace: a second thread releases the primary context for the last time and retains it
 *       again in a loop while the main thread launches 5 us kernels and waits for each.
 *   cancel: a second thread launches kernels of HEAVY_US on a stream of its own, waiting for
 *       every K-th (throttled: it sleeps in the gate); the main thread cancels it
 *       (pthread_cancel) after 2-20 ms, joins it, starts another, and between two launches a
 *       5 us kernel of its own and waits for it ("rounds": threads cancelled).
 *   sdestroy: a non-blocking stream is created, K kernels of HEAVY_US go on it, and it is
 *       destroyed at once (its work runs on); after a sleep as long as that work, 20 times a
 *       5 us kernel on the legacy stream and a wait for it, and the next one.
 *   gapbias: rounds of an idle batch (ten 5 us kernels on the legacy stream, 300 us apart, and
 *       a wait) and a dense one (a kernel of HEAVY_US on a created stream, one launch into a
 *       stream it keeps capturing, K-1 more of HEAVY_US, and a wait): the capture launch ends
 *       the dense batch's gap tracking, so only idle batches stay tracked.
 *   capture: a 5 us kernel on a blocking stream opens a batch, K kernels of HEAVY_US on a
 *       non-blocking one join it, a capture begins on that one, and once that work has run a
 *       5 us kernel on the first stream (its slow path closes the batch: the close on the
 *       capturing stream would be captured); the capture ends, everything is waited for, then
 *       20 times a 5 us kernel and a wait (a low estimate).
 *   capend: a capture begins on a non-blocking stream and a kernel of HEAVY_US goes into it,
 *       which the capture ends under (the stub's STUB_CAPTURE_ENDS_AFTER_CHECK ends it right
 *       after the shim's check: another thread's cuStreamEndCapture), so the kernel runs; then
 *       5 us kernels and a wait, 20 times, on a blocking stream (which does not wait for it).
 *   caprestart: as capend, and a new capture begins on the stream right after the kernel ran
 *       (STUB_CAPTURE_RESTARTS_AROUND_LAUNCH: another thread's end and begin), which the
 *       program then ends.
 *   cfgswap: a capture begins on a stream and a kernel of HEAVY_US is launched with
 *       cuLaunchKernelEx on it, its config's stream rewritten to a non-blocking stream right
 *       after the shim's capture check (stub_race_config: another thread's write); the capture
 *       ends, then 5 us kernels and a wait, 20 times, as in capend.
 * "busy": the share of wall time this process's kernels ran. */
struct hostile {
    pthread_barrier_t step;
    CUcontext ctx;
    CUstream nb;
    _Atomic int stop;
    long rounds;
};

static void *hostile_closer(void *arg)
{
    struct hostile *h = arg;
    cuCtxSetCurrent(h->ctx);
    for (;;) {
        pthread_barrier_wait(&h->step); /* the batch is launched */
        if (atomic_load(&h->stop))
            return NULL;
        cuStreamSynchronize(h->nb); /* closes the main thread's batch, then waits */
        pthread_barrier_wait(&h->step);
    }
}

static void *hostile_releaser(void *arg)
{
    struct hostile *h = arg;
    while (!atomic_load(&h->stop)) {
        CUcontext c;
        if (cuDevicePrimaryCtxRelease_v2(0) == 0 && cuDevicePrimaryCtxRetain(&c, 0) == 0)
            h->rounds++;
        cuCtxSetCurrent(c);
    }
    return NULL;
}

static struct { CUfunction f; unsigned heavy; long k; } canc;

static void *hostile_cancelled(void *arg)
{
    struct hostile *h = arg;
    cuCtxSetCurrent(h->ctx);
    for (long i = 1;; i++) {
        cuLaunchKernel(canc.f, canc.heavy, 1, 1, 1, 1, 1, 0, h->nb, NULL, NULL);
        if (i % canc.k == 0)
            cuStreamSynchronize(h->nb);
        pthread_testcancel(); /* a launch that never sleeps still ends here */
    }
    return NULL;
}

static int cmd_hostile(const char *variant, double secs, unsigned heavy, long k)
{
    setup(0);
    static struct hostile h;
    CUfunction f = kernel();
    cuCtxGetCurrent(&h.ctx);
    cuStreamCreate(&h.nb, 1); /* CU_STREAM_NON_BLOCKING */
    CUstream other, cap;
    cuStreamCreate(&other, 0);
    cuStreamCreate(&cap, 1);
    CUresult rc = 0;
    long n = 0;
    typedef CUresult (*memop_fn)(CUstream, CUdeviceptr, unsigned, unsigned);
    memop_fn waitv = (memop_fn)dlsym(RTLD_DEFAULT, "cuStreamWaitValue32_v2");
    memop_fn writev = (memop_fn)dlsym(RTLD_DEFAULT, "cuStreamWriteValue32_v2");
    static unsigned value;
    for (double e = now_s() + 0.3; now_s() < e;) {
        for (int i = 0; i < 10; i++)
            cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
        cuStreamSynchronize(CU_STREAM_PER_THREAD);
    }
    cuCtxSynchronize();
    pthread_t t;
    int two = !strcmp(variant, "ptforeign") || !strcmp(variant, "primrace"); /* a second thread to join */
    if (!strcmp(variant, "gaveup") && (!waitv || !writev))
        return 6;
    if (!strcmp(variant, "gapbias") && cuStreamBeginCapture_v2(cap, 2))
        return 5;
    if (!strcmp(variant, "ptforeign")) {
        pthread_barrier_init(&h.step, NULL, 2);
        pthread_create(&t, NULL, hostile_closer, &h);
        if (cuStreamBeginCapture_v2(cap, 0))
            return 5;
    } else if (!strcmp(variant, "primrace"))
        pthread_create(&t, NULL, hostile_releaser, &h);
    else if (!strcmp(variant, "cancel")) {
        canc.f = f, canc.heavy = heavy, canc.k = k > 0 ? k : 1;
    }
    double t0 = now_s(), d0 = done_s();
    while (!rc && now_s() - t0 < secs) {
        if (!strcmp(variant, "ptforeign")) {
            rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, NULL, NULL);
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, cap, NULL, NULL);
            for (long i = 0; i < k && !rc; i++, n++)
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, h.nb, NULL, NULL);
            pthread_barrier_wait(&h.step);
            pthread_barrier_wait(&h.step);
        } else if (!strcmp(variant, "gaveup")) {
            /* the stream held until the value is written: K batches of one kernel queue behind
             * it (a wait on another, idle, stream closes each), then the value is written */
            unsigned v = ++value;
            rc = waitv(h.nb, (CUdeviceptr)(uintptr_t)&value + 0 * v, v + 1000000, 0);
            for (long i = 0; i < k && !rc; i++, n++) {
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, h.nb, NULL, NULL);
                cuStreamSynchronize(other);
            }
            for (int i = 0; i < 20 && !rc; i++) { /* the ring's last batches: tiny ones */
                rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, h.nb, NULL, NULL);
                cuStreamSynchronize(other);
            }
            if (!rc)
                rc = writev(other, (CUdeviceptr)(uintptr_t)&value, v + 1000000, 0);
            if (!rc)
                rc = cuStreamSynchronize(h.nb);
            value = v;
        } else if (!strcmp(variant, "sdestroy")) {
            CUstream st;
            if ((rc = cuStreamCreate(&st, 1)))
                break;
            for (long i = 0; i < k && !rc; i++, n++)
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, st, NULL, NULL);
            if (!rc)
                rc = cuStreamDestroy_v2(st);
            h.rounds++;
            usleep((useconds_t)(k * heavy + 1000)); /* the destroyed stream's work ends meanwhile */
            for (int i = 0; i < 20 && !rc; i++) { /* tiny batches: the estimate stays low */
                rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                cuStreamSynchronize(NULL);
            }
        } else if (!strcmp(variant, "gapbias")) {
            for (int i = 0; i < 10 && !rc; i++) {
                rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                usleep(300);
            }
            cuStreamSynchronize(NULL);
            rc = rc ? rc : cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, other, NULL, NULL);
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, cap, NULL, NULL);
            for (long i = 1; i < k && !rc; i++)
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, other, NULL, NULL);
            cuStreamSynchronize(other);
            n += k;
            h.rounds++;
        } else if (!strcmp(variant, "capture")) {
            void *graph = NULL;
            rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, other, NULL, NULL);
            for (long i = 0; i < k && !rc; i++, n++)
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, h.nb, NULL, NULL);
            if (rc || (rc = cuStreamBeginCapture_v2(h.nb, 2))) /* CU_STREAM_CAPTURE_MODE_RELAXED */
                break;
            usleep((useconds_t)(k * heavy + 5000)); /* the heavy work ends meanwhile */
            rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, other, NULL, NULL);
            CUresult ec = cuStreamEndCapture(h.nb, &graph);
            rc = rc ? rc : ec;
            cuCtxSynchronize();
            h.rounds++;
            for (int i = 0; i < 20 && !rc; i++) {
                rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                cuStreamSynchronize(NULL);
            }
        } else if (!strcmp(variant, "capend") || !strcmp(variant, "caprestart") || !strcmp(variant, "cfgswap")) {
            void *graph = NULL;
            CUstream on = strcmp(variant, "cfgswap") ? h.nb : cap;
            if ((rc = cuStreamBeginCapture_v2(on, 2)))
                break;
            if (strcmp(variant, "cfgswap")) {
                rc = cuLaunchKernel(f, heavy, 1, 1, 1, 1, 1, 0, on, NULL, NULL);
            } else {
                void (*race)(CUlaunchConfig *, CUstream) =
                    (void (*)(CUlaunchConfig *, CUstream))dlsym(RTLD_DEFAULT, "stub_race_config");
                CUlaunchConfig cfg = {heavy, 1, 1, 1, 1, 1, 0, on, NULL, 0};
                if (!race)
                    return 7;
                race(&cfg, h.nb);
                rc = cuLaunchKernelEx(&cfg, f, NULL, NULL);
            }
            if (!cuStreamEndCapture(on, &graph) && graph) /* capend: already over */
                cuGraphDestroy(graph);
            n++, h.rounds++;
            for (int i = 0; i < 20 && !rc; i++) { /* on a stream that does not wait for h.nb */
                rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, other, NULL, NULL);
                cuStreamSynchronize(other);
            }
        } else if (!strcmp(variant, "cancel")) {
            pthread_create(&t, NULL, hostile_cancelled, &h);
            usleep(2000 + (unsigned)(h.rounds * 7919 % 18000));
            pthread_cancel(t);
            pthread_join(t, NULL);
            h.rounds++;
            rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            cuStreamSynchronize(NULL);
            n++;
        } else {
            rc = cuLaunchKernel(f, 5, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            cuStreamSynchronize(NULL);
            n++;
        }
    }
    atomic_store(&h.stop, 1);
    if (!strcmp(variant, "ptforeign"))
        pthread_barrier_wait(&h.step);
    if (two)
        pthread_join(t, NULL);
    double t1 = now_s() - t0, d1 = done_s() - d0; /* the kernels' time in the window */
    printf("{\"variant\": \"%s\", \"launches\": %ld, \"secs\": %.4f, \"busy\": %.4f, \"rounds\": %ld, \"rc\": %d}\n",
           variant, n, t1, d1 / t1, h.rounds, rc);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) { fprintf(stderr, "usage: see the header of cuprog.c\n"); return 2; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "info")) {
        CUdevice d = setup(argc > 2 ? atoi(argv[2]) : 0);
        size_t f = 0, t = 0, tm = 0;
        CUresult r1 = cuMemGetInfo_v2(&f, &t), r2 = cuDeviceTotalMem_v2(&tm, d);
        CUuuid u;
        cuDeviceGetUuid(&u, d);
        unsigned char *b = (unsigned char *)u.bytes;
        printf("{\"rc\": %d, \"free\": %zu, \"total\": %zu, \"totalmem_rc\": %d, \"totalmem\": %zu, \"uuid_last\": %d}\n",
               r1, f, t, r2, tm, b[15]);
        return 0;
    }
    if (!strcmp(cmd, "info_v1")) {
        CUdevice d = setup(0);
        CUresult (*info)(unsigned *, unsigned *) = NULL;
        CUresult (*total)(unsigned *, CUdevice) = NULL;
        unsigned f = 0, t = 0, tm = 0;
        CUresult g1 = cuGetProcAddress("cuMemGetInfo", (void **)&info, 3010, 0);
        CUresult g2 = cuGetProcAddress("cuDeviceTotalMem", (void **)&total, 3010, 0);
        if (g1 || g2 || !info || !total)
            return 4;
        CUresult r1 = info(&f, &t), r2 = total(&tm, d);
        printf("{\"rc\": %d, \"free\": %u, \"total\": %u, \"totalmem_rc\": %d, \"totalmem\": %u}\n",
               r1, f, t, r2, tm);
        return 0;
    }
    if (!strcmp(cmd, "null")) {
        setup(0);
        size_t f = 0, t = 0;
        CUresult a = cuMemGetInfo_v2(NULL, &t), b = cuMemGetInfo_v2(&f, NULL), c = cuMemGetInfo_v2(NULL, NULL);
        CUresult d = cuDeviceTotalMem_v2(NULL, 0);
        printf("{\"null_free_rc\": %d, \"total\": %zu, \"null_total_rc\": %d, \"free\": %zu, \"both_null_rc\": %d, \"totalmem_null_rc\": %d}\n",
               a, t, b, f, c, d);
        return 0;
    }
    if (!strcmp(cmd, "hostile") && argc >= 6)
        return cmd_hostile(argv[2], atof(argv[3]), (unsigned)atol(argv[4]), atol(argv[5]));
    if (!strcmp(cmd, "relay") && argc >= 5)
        return cmd_relay(atof(argv[2]), (unsigned)atol(argv[3]), atol(argv[4]));
    if (!strcmp(cmd, "ptds") && argc >= 5)
        return cmd_ptds(atof(argv[2]), (unsigned)atol(argv[3]), atol(argv[4]));
    if (!strcmp(cmd, "vmmexport") && argc >= 4)
        return cmd_vmmexport(atoi(argv[2]), strtoull(argv[3], NULL, 0));
    if (!strcmp(cmd, "ctxend") && argc >= 4)
        return cmd_ctxend(argv[2], strtoull(argv[3], NULL, 0));
    if (!strcmp(cmd, "xdev") && argc >= 4)
        return cmd_xdev(argv[2], strtoull(argv[3], NULL, 0));
    if (!strcmp(cmd, "fill") && argc >= 4)
        return cmd_fill(argv[2], strtoull(argv[3], NULL, 0), argc > 4 ? atol(argv[4]) : 0, argc > 5 ? atof(argv[5]) : 0);
    if (!strcmp(cmd, "pitch") && argc >= 4) {
        setup(0);
        CUdeviceptr p;
        size_t pitch = 0;
        CUresult rc = cuMemAllocPitch_v2(&p, &pitch, strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), 4);
        printf("{\"rc\": %d, \"pitch\": %zu}\n", rc, pitch);
        return 0;
    }
    if (!strcmp(cmd, "race") && argc >= 4) {
        setup(0);
        while (access(argv[3], F_OK) != 0)
            usleep(200);
        size_t chunk = strtoull(argv[2], NULL, 0);
        long n = 0;
        CUdeviceptr p;
        while (cuMemAlloc_v2(&p, chunk) == 0)
            n++;
        printf("{\"n\": %ld, \"bytes\": %llu}\n", n, (unsigned long long)n * chunk);
        fflush(stdout);
        usleep(1000000);
        return 0;
    }
    if (!strcmp(cmd, "work") && argc >= 5)
        return cmd_work(argc, argv);
    if (!strcmp(cmd, "launch") && argc >= 5)
        return cmd_launch(argv[2], atof(argv[3]), atol(argv[4]));
    if (!strcmp(cmd, "graphmem") && argc >= 4) {
        setup(0);
        long n = atol(argv[2]), k = 0;
        size_t chunk = strtoull(argv[3], NULL, 0);
        CUdeviceptr p;
        for (long i = 0; i < n; i++)
            cuMemAlloc_v2(&p, chunk);
        CUresult g1 = cuGraphLaunch(NULL, NULL);
        cuCtxSynchronize();
        CUresult g2 = cuGraphLaunch(NULL, NULL);
        cuCtxSynchronize();
        while (cuMemAlloc_v2(&p, chunk) == 0)
            k++;
        printf("{\"graph1_rc\": %d, \"graph2_rc\": %d, \"more\": %ld}\n", g1, g2, k);
        return 0;
    }
    if (!strcmp(cmd, "bench") && argc >= 3)
        return cmd_bench(atol(argv[2]));
    if (!strcmp(cmd, "threads") && argc >= 5)
        return cmd_threads(atoi(argv[2]), atol(argv[3]), strtoull(argv[4], NULL, 0));
    if (!strcmp(cmd, "fork") && argc >= 4)
        return cmd_fork(argv[2], atoi(argv[3]), argc > 4 ? atoi(argv[4]) : 4, "/proc/self/exe");
    fprintf(stderr, "bad command\n");
    return 2;
}
