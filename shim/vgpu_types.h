/*
 * vgpu_types.h - the CUDA driver and NVML types, constants and structure layouts the shim uses,
 * declared here so that no CUDA or NVML header is needed to build it: the layouts of the CUDA
 * driver API reference (cuda.h, CUDA 12/13) and of nvml.h. Included by vgpu.h.
 */
#ifndef VGPU_TYPES_H
#define VGPU_TYPES_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgreenCtx_st *CUgreenCtx; /* a context on a partition of the card's SMs (CUDA 12.4) */
typedef struct CUevent_st *CUevent;
typedef struct { char bytes[16]; } CUuuid;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_SUPPORTED 801

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2             /* ... _HOST_NUMA 3, _HOST_NUMA_CURRENT 4 */
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    unsigned char reserved[64];     /* maxSize, usage, reserved in CUDA >= 12.2: same size */
} CUmemPoolProps;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
/* The CUDA < 3.2 descriptors (32-bit extents), taken by cuArrayCreate / cuArray3DCreate v1. */
typedef struct { unsigned Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct { unsigned Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR_v1;
typedef struct { size_t size, alignment; unsigned reserved[4]; } CUDA_ARRAY_MEMORY_REQUIREMENTS;
/* One operation of cuMemMapArrayAsync (CUarrayMapInfo, 96 bytes): map (1) or unmap (2) a
 * generic allocation handle (memHandleType 0) into a sparse array's (resourceType 0) or
 * mipmapped array's (1) tile range (subresourceType 0: level, layer, offset x/y/z, extent
 * w/h/d) or mip tail (1). */
typedef struct {
    int resourceType;
    void *resource;
    int subresourceType;
    union {
        unsigned sparseLevel[8];
        struct { unsigned layer; unsigned long long offset, size; } miptail;
    } subresource;
    int memOperationType;
    int memHandleType;
    CUmemGenericAllocationHandle memHandle;
    unsigned long long offset;
    unsigned deviceBitMask, flags, reserved[2];
} CUarrayMapInfo;
_Static_assert(sizeof(CUarrayMapInfo) == 96, "CUarrayMapInfo layout");
#define CU_MEM_OPERATION_TYPE_MAP 1
#define CU_MEM_OPERATION_TYPE_UNMAP 2
#define CU_MEM_HANDLE_TYPE_GENERIC 0
#define CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL 1
/* CUDA_ARRAY3D_DESCRIPTOR Flags of arrays whose memory is mapped in later (cuMemMapArrayAsync) */
#define CUDA_ARRAY3D_SPARSE 0x40
#define CUDA_ARRAY3D_DEFERRED_MAPPING 0x80
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
/* nvmlDeviceGetSamples: a timestamp (us) and an 8-byte value whose type the call reports */
typedef union { double dVal; unsigned uiVal; unsigned long ulVal; unsigned long long ullVal; } nvmlValue_t;
typedef struct { unsigned long long timeStamp; nvmlValue_t sampleValue; } nvmlSample_t;
#define NVML_GPU_UTILIZATION_SAMPLES 1
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7

#endif
