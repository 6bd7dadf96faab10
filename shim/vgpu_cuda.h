/*
 * vgpu_cuda.h - what the two CUDA hook units share (vgpu_cuda.c: devices, cuInit, compute
 * gate, launches, the hook table; vgpu_cuda_mem.c: allocation paths, memory info, graph
 * memory). Internal to those two units.
 */
#ifndef VGPU_CUDA_H
#define VGPU_CUDA_H

#include "vgpu.h"

enum {
    H_GPA, H_GPA2, H_INIT, H_ALLOC, H_PITCH, H_MANAGED, H_FREE, H_ASYNC, H_ASYNC_PTSZ,
    H_POOL, H_POOL_PTSZ, H_FREEASYNC, H_FREEASYNC_PTSZ, H_CREATE, H_RELEASE, H_ARRAY,
    H_ARRAY3D, H_ARRAYDESTROY, H_MIPMAP, H_MIPMAPDESTROY, H_GETINFO, H_TOTALMEM, H_LAUNCH,
    H_LAUNCH_PTSZ, H_LAUNCHEX, H_LAUNCHEX_PTSZ, H_COOP, H_COOP_PTSZ, H_GRAPH, H_GRAPH_PTSZ,
    H_ALLOC_V1, H_FREE_V1, H_COUNT
};

/* mode of this process: decided once after vgpu_init (vgpu_cuda.c) */
enum { M_UNSET, M_PASS, M_LIMITED, M_BROKEN };
extern int vgpu_cuda_mode_v;
int vgpu_cuda_mode_slow(void);
static inline int mode(void)
{
    if (__builtin_expect(vgpu_cuda_mode_v == M_UNSET, 0))
        return vgpu_cuda_mode_slow();
    return vgpu_cuda_mode_v;
}

#define REAL(i, T) ((T)vgpu_real_cuda(i))
#define BROKEN_GUARD()                                                                          \
    do {                                                                                        \
        if (__builtin_expect(mode() == M_BROKEN, 0))                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
    } while (0)

int vgpu_cur_dev(void);               /* region device of the current context, -1/-2 */
void vgpu_cuda_mem_after_fork(void);  /* vgpu_cuda_mem.c: reset its locks and table */
/* The memory side of cuGraphLaunch(_ptsz) in a limited process (after the compute gate). */
CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s);

/* The memory hooks (vgpu_cuda_mem.c), for the hook table. */
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

#endif
