/* graph_leak: a graph memory node whose allocation is never freed survives cuGraphExecDestroy
 * (CUDA Programming Guide: "Graph destruction does not automatically free any live
 * graph-allocated memory"); POOLCACHE=1: stream-ordered memory freed into a pool that keeps it.
 * Run under the shim as two processes of one container (bench/gpu/hidden_probe.sh): the first
 * leaks and idles, the second must see the container charged with it.
 *   graph_leak MIB CHUNK_MIB [HOLD_S] [ITER]
 * ITER times: graph with one MIB alloc node (no free node), instantiate, launch, sync, exec+graph
 * destroyed. Then CHUNK allocations until refused (or, CHUNK=0, none). Prints the process's NVML
 * usage (the stub's real holding) and what the shim shows (cuMemGetInfo). HOLD_S: then sleep. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef int CUresult; typedef int CUdevice; typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUgraph, *CUgraphNode, *CUgraphExec;
typedef struct {
    struct { int allocType, handleTypes; struct { int type, id; } location; void *w; unsigned char r[64]; } poolProps;
    const void *accessDescs; size_t accessDescCount; size_t bytesize; CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
CUresult cuInit(unsigned); CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice); CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemGetInfo_v2(size_t *, size_t *); CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream); CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph); CUresult cuCtxSynchronize(void);
CUresult cuDeviceGetDefaultMemPool(void **, CUdevice); __attribute__((weak)) CUresult cuMemPoolSetAttribute(void *, int, void *);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream); CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gi, ci; } nvmlProcessInfo_t;

static unsigned long long nvml_me(void)
{
    void *l = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    int (*init)(void) = dlsym(l, "nvmlInit_v2");
    int (*get)(unsigned, void **) = dlsym(l, "nvmlDeviceGetHandleByIndex_v2");
    int (*procs)(void *, unsigned *, nvmlProcessInfo_t *) = dlsym(l, "nvmlDeviceGetComputeRunningProcesses_v3");
    void *h; nvmlProcessInfo_t p[256]; unsigned n = 256;
    init(); get(0, &h); procs(h, &n, p);
    for (unsigned i = 0; i < n; i++) if (p[i].pid == (unsigned)getpid()) return p[i].usedGpuMemory >> 20;
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    size_t mib = strtoull(argv[1], 0, 0), chunk = strtoull(argv[2], 0, 0) << 20;
    double hold = argc > 3 ? atof(argv[3]) : 0;
    int iter = argc > 4 ? atoi(argv[4]) : 1;
    CUdevice dev; CUcontext c;
    cuInit(0); cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&c, dev); cuCtxSetCurrent(c);
    int lrc = -1, drc = -1;
    if (getenv("POOLCACHE") && mib) { /* variant: the default pool keeps freed pages (release threshold max) */
        void *pool; unsigned long long thr = ~0ull; CUdeviceptr p;
        cuDeviceGetDefaultMemPool(&pool, dev); if (cuMemPoolSetAttribute) cuMemPoolSetAttribute(pool, 4 /* RELEASE_THRESHOLD */, &thr);
        lrc = cuMemAllocAsync(&p, mib << 20, NULL); drc = cuMemFreeAsync(p, NULL); cuCtxSynchronize();
        iter = 0;
    }
    for (int k = 0; k < iter; k++) {
        CUgraph g; CUgraphNode n; CUgraphExec e;
        CUDA_MEM_ALLOC_NODE_PARAMS p; memset(&p, 0, sizeof p);
        p.poolProps.allocType = 1, p.poolProps.location.type = 1, p.poolProps.location.id = dev;
        p.bytesize = mib << 20;
        cuGraphCreate(&g, 0);
        cuGraphAddMemAllocNode(&n, g, NULL, 0, &p);   /* no free node: the allocation outlives the launch */
        cuGraphInstantiateWithFlags(&e, g, 0);
        lrc = cuGraphLaunch(e, NULL);
        cuCtxSynchronize();
        drc = cuGraphExecDestroy(e);
        cuGraphDestroy(g);
    }
    long granted = 0; CUdeviceptr d;
    while (chunk && cuMemAlloc_v2(&d, chunk) == 0) granted++;
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    printf("{\"launch_rc\": %d, \"destroy_rc\": %d, \"chunks_after\": %ld, \"shim_used_mib\": %zu, "
           "\"shim_total_mib\": %zu, \"nvml_process_mib\": %llu}\n", lrc, drc, granted, (t - f) >> 20, t >> 20, nvml_me());
    if (hold > 0) usleep((useconds_t)(hold * 1e6));
    return 0;
}
