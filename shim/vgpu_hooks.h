/*
 * vgpu_hooks.h - the shim's hook list: every driver symbol it intercepts, defined once.
 *
 * VGPU_CUDA_HOOKS(X) and VGPU_NVML_HOOKS(X) list each hook as
 *     X(id, name, base, min_version, ptds, ret, params)
 * id: its index (H_* for libcuda, N_* for libnvidia-ml); name: the exported symbol, which is also
 * our wrapper's name; base: the name asked through cuGetProcAddress; min_version: the CUDA
 * version from which `base` means this ABI; ptds: 1 for a per-thread default stream variant;
 * ret, params: its C signature (the CUDA driver API and NVML references).
 *
 * From the lists come, here: the index enums, the wrappers' prototypes, a pointer type per hook
 * (vgpu_fn_<name>) and the typed accessors of the driver's functions (REAL_FN(name),
 * NREAL_FN(name)); in vgpu_cuda.c and vgpu_nvml.c, the tables (VGPU_HOOK_ENTRY). Adding a hook is
 * one line in a list and its wrapper.
 */
#ifndef VGPU_HOOKS_H
#define VGPU_HOOKS_H

#include "vgpu.h"

/* Driver types only the hooks' signatures need (CUDA driver API reference, cuda.h 12/13). */
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct { /* cuLaunchCooperativeKernelMultiDevice's launches, one per device */
    CUfunction function;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

#define VGPU_CUDA_HOOKS(X)                                                                               \
    X(H_GPA, cuGetProcAddress, "cuGetProcAddress", 11030, 0, CUresult,                                   \
      (const char *, void **, int, cuuint64_t))                                                          \
    X(H_GPA2, cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0, CUresult,                               \
      (const char *, void **, int, cuuint64_t, int *))                                                   \
    X(H_INIT, cuInit, "cuInit", 2000, 0, CUresult, (unsigned))                                           \
    /* memory (vgpu_cuda_mem.c, vgpu_mem_array.c) */                                                     \
    X(H_ALLOC, cuMemAlloc_v2, "cuMemAlloc", 3020, 0, CUresult, (CUdeviceptr *, size_t))                  \
    X(H_PITCH, cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0, CUresult,                                 \
      (CUdeviceptr *, size_t *, size_t, size_t, unsigned))                                               \
    X(H_MANAGED, cuMemAllocManaged, "cuMemAllocManaged", 6000, 0, CUresult, (CUdeviceptr *, size_t, unsigned)) \
    X(H_FREE, cuMemFree_v2, "cuMemFree", 3020, 0, CUresult, (CUdeviceptr))                               \
    X(H_ASYNC, cuMemAllocAsync, "cuMemAllocAsync", 11020, 0, CUresult, (CUdeviceptr *, size_t, CUstream)) \
    X(H_ASYNC_PTSZ, cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1, CUresult,                         \
      (CUdeviceptr *, size_t, CUstream))                                                                 \
    X(H_POOL, cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0, CUresult,                    \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                                   \
    X(H_POOL_PTSZ, cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1, CUresult,          \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                                   \
    X(H_POOLCREATE, cuMemPoolCreate, "cuMemPoolCreate", 11020, 0, CUresult,                             \
      (CUmemoryPool *, const CUmemPoolProps *))                                                          \
    X(H_POOLDESTROY, cuMemPoolDestroy, "cuMemPoolDestroy", 11020, 0, CUresult, (CUmemoryPool))           \
    X(H_DEFPOOL, cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020, 0, CUresult,             \
      (CUmemoryPool *, CUdevice))                                                                        \
    X(H_DEVPOOL, cuDeviceGetMemPool, "cuDeviceGetMemPool", 11020, 0, CUresult, (CUmemoryPool *, CUdevice)) \
    X(H_FREEASYNC, cuMemFreeAsync, "cuMemFreeAsync", 11020, 0, CUresult, (CUdeviceptr, CUstream))        \
    X(H_FREEASYNC_PTSZ, cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1, CUresult, (CUdeviceptr, CUstream)) \
    X(H_CREATE, cuMemCreate, "cuMemCreate", 10020, 0, CUresult,                                          \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))         \
    X(H_RELEASE, cuMemRelease, "cuMemRelease", 10020, 0, CUresult, (CUmemGenericAllocationHandle))       \
    X(H_MEMMAP, cuMemMap, "cuMemMap", 10020, 0, CUresult,                                               \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))                  \
    X(H_MEMUNMAP, cuMemUnmap, "cuMemUnmap", 10020, 0, CUresult, (CUdeviceptr, size_t))                   \
    X(H_MEMRETAIN, cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 11000, 0, CUresult,       \
      (CUmemGenericAllocationHandle *, void *))                                                          \
    X(H_MEMEXPORT, cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 10020, 0, CUresult,    \
      (void *, CUmemGenericAllocationHandle, int, unsigned long long))                                   \
    X(H_MAPARRAY, cuMemMapArrayAsync, "cuMemMapArrayAsync", 11010, 0, CUresult,                          \
      (CUarrayMapInfo *, unsigned, CUstream))                                                            \
    X(H_MAPARRAY_PTSZ, cuMemMapArrayAsync_ptsz, "cuMemMapArrayAsync", 11010, 1, CUresult,                \
      (CUarrayMapInfo *, unsigned, CUstream))                                                            \
    X(H_ARRAY, cuArrayCreate_v2, "cuArrayCreate", 3020, 0, CUresult, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    X(H_ARRAY3D, cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0, CUresult,                               \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                                                      \
    X(H_ARRAYDESTROY, cuArrayDestroy, "cuArrayDestroy", 2000, 0, CUresult, (CUarray))                    \
    X(H_MIPMAP, cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0, CUresult,                     \
      (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned))                                   \
    X(H_MIPMAPDESTROY, cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0, CUresult, (CUmipmappedArray)) \
    X(H_GETINFO, cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0, CUresult, (size_t *, size_t *))               \
    X(H_TOTALMEM, cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0, CUresult, (size_t *, CUdevice))      \
    /* launches (vgpu_launch.c) */                                                                       \
    X(H_LAUNCH, cuLaunchKernel, "cuLaunchKernel", 4000, 0, CUresult,                                     \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,       \
       void **, void **))                                                                                \
    X(H_LAUNCH_PTSZ, cuLaunchKernel_ptsz, "cuLaunchKernel", 4000, 1, CUresult,                           \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,       \
       void **, void **))                                                                                \
    X(H_LAUNCHEX, cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0, CUresult,                              \
      (const CUlaunchConfig *, CUfunction, void **, void **))                                            \
    X(H_LAUNCHEX_PTSZ, cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, 1, CUresult,                    \
      (const CUlaunchConfig *, CUfunction, void **, void **))                                            \
    X(H_COOP, cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0, CUresult,                 \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,       \
       void **))                                                                                         \
    X(H_COOP_PTSZ, cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, 1, CUresult,       \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,       \
       void **))                                                                                         \
    X(H_COOP_MULTI, cuLaunchCooperativeKernelMultiDevice, "cuLaunchCooperativeKernelMultiDevice", 9000, 0, \
      CUresult, (CUDA_LAUNCH_PARAMS *, unsigned, unsigned))                                              \
    X(H_GRAPH, cuGraphLaunch, "cuGraphLaunch", 10000, 0, CUresult, (CUgraphExec, CUstream))              \
    X(H_GRAPH_PTSZ, cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 1, CUresult, (CUgraphExec, CUstream))    \
    /* the pre-4.0 launches (deprecated, still exported: parameters set by cuParamSet*) */            \
    X(H_LAUNCH_V0, cuLaunch, "cuLaunch", 2000, 0, CUresult, (CUfunction))                                \
    X(H_LAUNCHGRID, cuLaunchGrid, "cuLaunchGrid", 2000, 0, CUresult, (CUfunction, int, int))             \
    X(H_LAUNCHGRID_ASYNC, cuLaunchGridAsync, "cuLaunchGridAsync", 2000, 0, CUresult,                     \
      (CUfunction, int, int, CUstream))                                                                  \
    /* the CUDA < 3.2 ABI (32-bit sizes and pointers) */                                                 \
    X(H_ALLOC_V1, cuMemAlloc, "cuMemAlloc", 2000, 0, CUresult, (unsigned *, unsigned))                   \
    X(H_FREE_V1, cuMemFree, "cuMemFree", 2000, 0, CUresult, (unsigned))                                  \
    X(H_PITCH_V1, cuMemAllocPitch, "cuMemAllocPitch", 2000, 0, CUresult,                                 \
      (unsigned *, unsigned *, unsigned, unsigned, unsigned))                                            \
    X(H_ARRAY_V1, cuArrayCreate, "cuArrayCreate", 2000, 0, CUresult,                                     \
      (CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *))                                                     \
    X(H_ARRAY3D_V1, cuArray3DCreate, "cuArray3DCreate", 2000, 0, CUresult,                               \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *))                                                   \
    X(H_GETINFO_V1, cuMemGetInfo, "cuMemGetInfo", 2000, 0, CUresult, (unsigned *, unsigned *))           \
    X(H_TOTALMEM_V1, cuDeviceTotalMem, "cuDeviceTotalMem", 2000, 0, CUresult, (unsigned *, CUdevice))    \
    /* memory the allocation paths do not see (vgpu_mem_graph.c, vgpu_mem_ctx.c: "hidden consumers") */ \
    X(H_GINST, cuGraphInstantiate, "cuGraphInstantiate", 10000, 0, CUresult,                             \
      (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t))                                           \
    X(H_GINST_V2, cuGraphInstantiate_v2, "cuGraphInstantiate", 11000, 0, CUresult,                       \
      (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t))                                           \
    X(H_GINST_FLAGS, cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040, 0, CUresult,     \
      (CUgraphExec *, CUgraph, unsigned long long))                                                      \
    X(H_GINST_PARAMS, cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, 0, CUresult,  \
      (CUgraphExec *, CUgraph, void *))                                                                  \
    X(H_GUPLOAD, cuGraphUpload, "cuGraphUpload", 11010, 0, CUresult, (CUgraphExec, CUstream))            \
    X(H_GUPLOAD_PTSZ, cuGraphUpload_ptsz, "cuGraphUpload", 11010, 1, CUresult, (CUgraphExec, CUstream))  \
    X(H_GEXEC_DESTROY, cuGraphExecDestroy, "cuGraphExecDestroy", 10000, 0, CUresult, (CUgraphExec))      \
    X(H_CTX_CREATE, cuCtxCreate_v2, "cuCtxCreate", 3020, 0, CUresult, (CUcontext *, unsigned, CUdevice)) \
    /* the CUDA < 3.2 name, same arguments: after _v2, so a driver that aliases the two gets _v2's */ \
    X(H_CTX_CREATE_V1, cuCtxCreate, "cuCtxCreate", 2000, 0, CUresult, (CUcontext *, unsigned, CUdevice)) \
    X(H_CTX_CREATE_V3, cuCtxCreate_v3, "cuCtxCreate", 11040, 0, CUresult,                                \
      (CUcontext *, void *, int, unsigned, CUdevice))                                                    \
    X(H_CTX_CREATE_V4, cuCtxCreate_v4, "cuCtxCreate", 12050, 0, CUresult,                                \
      (CUcontext *, void *, unsigned, CUdevice))                                                         \
    X(H_CTX_DESTROY, cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0, CUresult, (CUcontext))                    \
    X(H_CTX_DESTROY_V1, cuCtxDestroy, "cuCtxDestroy", 2000, 0, CUresult, (CUcontext))                    \
    X(H_GREEN_CREATE, cuGreenCtxCreate, "cuGreenCtxCreate", 12040, 0, CUresult,                          \
      (CUgreenCtx *, void *, CUdevice, unsigned))                                                        \
    X(H_GREEN_DESTROY, cuGreenCtxDestroy, "cuGreenCtxDestroy", 12040, 0, CUresult, (CUgreenCtx))         \
    X(H_PRIMARY_RETAIN, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, 0, CUresult,         \
      (CUcontext *, CUdevice))                                                                           \
    X(H_PRIMARY_RELEASE, cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0, CUresult,  \
      (CUdevice))                                                                                        \
    X(H_PRIMARY_RELEASE_V1, cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 7000, 0, CUresult,   \
      (CUdevice))                                                                                        \
    X(H_PRIMARY_RESET, cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0, CUresult,        \
      (CUdevice))                                                                                        \
    X(H_PRIMARY_RESET_V1, cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset", 7000, 0, CUresult,         \
      (CUdevice))                                                                                        \
    X(H_CTX_SET_LIMIT, cuCtxSetLimit, "cuCtxSetLimit", 3010, 0, CUresult, (int, size_t))                 \
    /* modules and libraries (vgpu_mem_module.c) */                                                     \
    X(H_MOD_LOAD, cuModuleLoad, "cuModuleLoad", 2000, 0, CUresult, (CUmodule *, const char *))           \
    X(H_MOD_DATA, cuModuleLoadData, "cuModuleLoadData", 2000, 0, CUresult, (CUmodule *, const void *))   \
    X(H_MOD_DATAEX, cuModuleLoadDataEx, "cuModuleLoadDataEx", 2010, 0, CUresult,                         \
      (CUmodule *, const void *, unsigned, int *, void **))                                              \
    X(H_MOD_FATBIN, cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 2000, 0, CUresult,                   \
      (CUmodule *, const void *))                                                                        \
    X(H_MOD_UNLOAD, cuModuleUnload, "cuModuleUnload", 2000, 0, CUresult, (CUmodule))                    \
    X(H_LIB_DATA, cuLibraryLoadData, "cuLibraryLoadData", 12000, 0, CUresult,                            \
      (CUlibrary *, const void *, int *, void **, unsigned, int *, void **, unsigned))                   \
    X(H_LIB_FILE, cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 12000, 0, CUresult,                    \
      (CUlibrary *, const char *, int *, void **, unsigned, int *, void **, unsigned))                   \
    X(H_LIB_UNLOAD, cuLibraryUnload, "cuLibraryUnload", 12000, 0, CUresult, (CUlibrary))                \
    X(H_LIB_MODULE, cuLibraryGetModule, "cuLibraryGetModule", 12000, 0, CUresult, (CUmodule *, CUlibrary)) \
    X(H_LIB_GLOBAL, cuLibraryGetGlobal, "cuLibraryGetGlobal", 12000, 0, CUresult,                        \
      (CUdeviceptr *, size_t *, CUlibrary, const char *))                                                \
    X(H_KERNEL_FUNC, cuKernelGetFunction, "cuKernelGetFunction", 12000, 0, CUresult, (CUfunction *, CUkernel)) \
    X(H_LIB_MANAGED, cuLibraryGetManaged, "cuLibraryGetManaged", 12000, 0, CUresult,                      \
      (CUdeviceptr *, size_t *, CUlibrary, const char *))                                                \
    X(H_KERNEL_ATTR, cuKernelGetAttribute, "cuKernelGetAttribute", 12000, 0, CUresult,                    \
      (int *, int, CUkernel, CUdevice))                                                                  \
    /* waits (vgpu_launch.c: the compute limiter measures what the application waits for) */           \
    X(H_STREAMSYNC, cuStreamSynchronize, "cuStreamSynchronize", 2000, 0, CUresult, (CUstream))           \
    X(H_STREAMSYNC_PTSZ, cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, 1, CUresult, (CUstream)) \
    X(H_CTXSYNC, cuCtxSynchronize, "cuCtxSynchronize", 2000, 0, CUresult, (void))                        \
    X(H_EVENTSYNC, cuEventSynchronize, "cuEventSynchronize", 2000, 0, CUresult, (CUevent))             \
    X(H_STREAM_DESTROY, cuStreamDestroy_v2, "cuStreamDestroy", 4000, 0, CUresult, (CUstream))           \
    X(H_STREAM_DESTROY_V1, cuStreamDestroy, "cuStreamDestroy", 2000, 0, CUresult, (CUstream))           \
    X(H_CAPTURE, cuStreamBeginCapture, "cuStreamBeginCapture", 10000, 0, CUresult, (CUstream))          \
    X(H_CAPTURE_PTSZ, cuStreamBeginCapture_ptsz, "cuStreamBeginCapture", 10000, 1, CUresult, (CUstream)) \
    X(H_CAPTURE_V2, cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0, CUresult, (CUstream, int)) \
    X(H_CAPTURE_V2_PTSZ, cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, 1, CUresult,      \
      (CUstream, int))                                                                                   \
    X(H_CAPTURE_TO_GRAPH, cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 12030, 0, CUresult, \
      (CUstream, void *, const void *, const void *, size_t, int))                                       \
    X(H_CAPTURE_TO_GRAPH_PTSZ, cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 12030, 1, \
      CUresult, (CUstream, void *, const void *, const void *, size_t, int))

#define VGPU_NVML_HOOKS(X)                                                                               \
    X(N_INIT, nvmlInit, "nvmlInit", 0, 0, nvmlReturn_t, (void))                                          \
    X(N_INIT_V2, nvmlInit_v2, "nvmlInit_v2", 0, 0, nvmlReturn_t, (void))                                 \
    X(N_INIT_FLAGS, nvmlInitWithFlags, "nvmlInitWithFlags", 0, 0, nvmlReturn_t, (unsigned))              \
    X(N_MEM, nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", 0, 0, nvmlReturn_t,                     \
      (nvmlDevice_t, nvmlMemory_t *))                                                                    \
    X(N_MEM_V2, nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", 0, 0, nvmlReturn_t,            \
      (nvmlDevice_t, nvmlMemory_v2_t *))

/* The indices: H_* / N_* in list order, then by name (VGPU_IDX_<name>) for the accessors. */
#define VGPU_HOOK_ID(id, name, base, ver, ptds, ret, params) id,
#define VGPU_HOOK_IDX(id, name, base, ver, ptds, ret, params) VGPU_IDX_##name = id,
enum { VGPU_CUDA_HOOKS(VGPU_HOOK_ID) H_COUNT };
enum { VGPU_NVML_HOOKS(VGPU_HOOK_ID) N_COUNT };
enum { VGPU_CUDA_HOOKS(VGPU_HOOK_IDX) VGPU_NVML_HOOKS(VGPU_HOOK_IDX) };

/* Our wrappers and a pointer type of each (the driver's function has the same signature). */
#define VGPU_HOOK_DECL(id, name, base, ver, ptds, ret, params)                                         \
    ret name params;                                                                                    \
    typedef ret(*vgpu_fn_##name) params;
VGPU_CUDA_HOOKS(VGPU_HOOK_DECL)
VGPU_NVML_HOOKS(VGPU_HOOK_DECL)

/* One hook table entry: {name, base, min_version, ptds, our wrapper, the driver's (bound later)}. */
struct vgpu_hook {
    const char *name;           /* exported name in libcuda.so.1, e.g. "cuMemAlloc_v2" */
    const char *base;           /* name as asked through cuGetProcAddress, e.g. "cuMemAlloc" */
    int min_version;            /* CUDA version from which `base` means this ABI */
    int ptds;                   /* 1: per-thread default stream variant */
    void *hook;                 /* our wrapper */
    void *real;                 /* the driver's function (set by vgpu_symbols_bind) */
};
#define VGPU_HOOK_ENTRY(id, name, base, ver, ptds, ret, params) [id] = {#name, base, ver, ptds, (void *)name, NULL},
extern struct vgpu_hook vgpu_cuda_hooks[H_COUNT];
extern struct vgpu_hook vgpu_nvml_hooks[N_COUNT];

/* The driver's function behind a hook, by index (any hook of that signature) or typed by name. */
#define REAL(i, T) ((T)vgpu_real_cuda(i))
#define REAL_FN(name) ((vgpu_fn_##name)vgpu_real_cuda(VGPU_IDX_##name))
#define NREAL_FN(name) ((vgpu_fn_##name)vgpu_real_nvml(VGPU_IDX_##name))

#endif
