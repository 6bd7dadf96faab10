/*
 * vgpu_cuda.h - what the CUDA hook units share (vgpu_cuda.c: devices, cuInit, the hook table;
 * vgpu_cuda_mem.c and vgpu_mem_*.c: the memory hooks, see vgpu_mem.h; vgpu_launch.c: launches,
 * waits, the compute limit's CUDA side). Internal to those units.
 */
#ifndef VGPU_CUDA_H
#define VGPU_CUDA_H

#include "vgpu.h"

enum {
    H_GPA, H_GPA2, H_INIT, H_ALLOC, H_PITCH, H_MANAGED, H_FREE, H_ASYNC, H_ASYNC_PTSZ,
    H_POOL, H_POOL_PTSZ, H_FREEASYNC, H_FREEASYNC_PTSZ, H_CREATE, H_RELEASE, H_ARRAY,
    H_ARRAY3D, H_ARRAYDESTROY, H_MIPMAP, H_MIPMAPDESTROY, H_GETINFO, H_TOTALMEM, H_LAUNCH,
    H_LAUNCH_PTSZ, H_LAUNCHEX, H_LAUNCHEX_PTSZ, H_COOP, H_COOP_PTSZ, H_GRAPH, H_GRAPH_PTSZ,
    H_ALLOC_V1, H_FREE_V1,
    /* memory the allocation paths do not see (vgpu_mem_graph.c, vgpu_mem_ctx.c: "hidden consumers") */
    H_GINST, H_GINST_V2, H_GINST_FLAGS, H_GINST_PARAMS, H_GUPLOAD, H_GUPLOAD_PTSZ, H_GEXEC_DESTROY,
    H_CTX_CREATE, H_CTX_CREATE_V3, H_CTX_CREATE_V4, H_CTX_DESTROY, H_PRIMARY_RETAIN, H_CTX_SET_LIMIT,
    /* waits (vgpu_launch.c: the compute limiter measures what the application waits for) */
    H_STREAMSYNC, H_STREAMSYNC_PTSZ, H_CTXSYNC, H_EVENTSYNC,
    H_COUNT
};

/* Driver types of the graph and context hooks (CUDA driver API reference, cuda.h 12/13). */
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
#define CU_GRAPH_NODE_TYPE_GRAPH 5
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    unsigned char reserved[64];     /* maxSize, usage, reserved in CUDA >= 12.2: same size */
} CUmemPoolProps;
typedef struct {
    CUmemPoolProps poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps layout");
_Static_assert(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS layout");

/* mode of this process: decided once after vgpu_init (vgpu_cuda.c) */
enum { M_UNSET, M_PASS, M_LIMITED, M_BROKEN };
extern int vgpu_cuda_mode_v;
int vgpu_cuda_mode_slow(void);
static inline int mode(void)
{
    int m = VGPU_PEEK(vgpu_cuda_mode_v);
    if (__builtin_expect(m == M_UNSET, 0))
        return vgpu_cuda_mode_slow();
    return m;
}

#define REAL(i, T) ((T)vgpu_real_cuda(i))
#define BROKEN_GUARD()                                                                          \
    do {                                                                                        \
        if (__builtin_expect(mode() == M_BROKEN, 0))                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
    } while (0)

int vgpu_cur_dev(void);               /* region device of the current context, -1/-2 */
extern int vgpu_single_gate;          /* the only card with a compute gate, or -1 */
/* The memory units' locks across fork (vgpu_mem_table.c): 0 lock primary_mu, 1 lock join_mu,
 * 2 lock tab_mu, 3 unlock all three (parent), 4 re-initialise them and forget the parent's
 * allocations (child). */
void vgpu_cuda_mem_fork_lock(int op);
/* The memory side of cuGraphLaunch(_ptsz) in a limited process (after the compute gate). */
CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s);

/* ACTIVE_OOM_KILLER: after a reconciliation of device d (vgpu_nvml.c), end the process with the
 * most memory in the container if the container is over its limit (vgpu_mem_table.c). */
void vgpu_oom_check(int d);

/* The memory hooks (vgpu_cuda_mem.c, vgpu_mem_*.c), for the hook table. */
CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuMemAlloc(unsigned *dptr, unsigned size);
CUresult cuMemFree(unsigned p);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc);
CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc);
CUresult cuArrayDestroy(CUarray arr);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned levels);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr);
CUresult cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n);
CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, void *params);
CUresult cuGraphUpload(CUgraphExec e, CUstream s);
CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s);
CUresult cuGraphExecDestroy(CUgraphExec e);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext c);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetLimit(int limit, size_t value);

/* The launch and wait hooks (vgpu_launch.c), for the hook table. */
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shm, CUstream s, void **p, void **e);
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shm, CUstream s, void **p, void **e);
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e);
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned shm, CUstream s, void **p);
CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz, unsigned shm, CUstream s, void **p);
CUresult cuGraphLaunch(CUgraphExec g, CUstream s);
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuStreamSynchronize_ptsz(CUstream s);
CUresult cuCtxSynchronize(void);
CUresult cuEventSynchronize(CUevent e);

#endif
