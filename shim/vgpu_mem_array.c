/*
 * vgpu_mem_array.c - CUDA array hooks: cuArrayCreate(_v2), cuArray3DCreate(_v2),
 * cuMipmappedArrayCreate and their destroys. An element-size estimate is charged before the
 * driver is asked, then settled to the driver's own figure (cu*GetMemoryRequirements; the
 * driver gives none for an array with memory of its own, so then NVML's, by reconciling); the
 * accounting rule: vgpu_cuda_mem.c. A sparse or deferred-mapping array has no memory of its own:
 * its tiles are handles mapped in later (cuMemMapArrayAsync), charged at their cuMemCreate, so
 * the array itself is not charged.
 */
#include "vgpu_mem.h"

/* ------------------------------------------------------------------ arrays */

static uint64_t elem_bytes(int fmt)
{
    switch (fmt) {
    case 0x01: case 0x08: return 1;              /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;   /* INT16, HALF */
    default: return 4;                           /* INT32, FLOAT, others: corrected below */
    }
}

static uint64_t array_est(size_t w, size_t h, size_t dpt, int fmt, unsigned ch)
{
    return (uint64_t)w * (h ? h : 1) * (dpt ? dpt : 1) * elem_bytes(fmt) * (ch ? ch : 1);
}

static void array_destroy(int kind, void *arr)
{
    if (kind == K_MIPMAP)
        REAL_FN(cuMipmappedArrayDestroy)(arr);
    else
        REAL_FN(cuArrayDestroy)(arr);
}

/* An array whose size the driver does not tell (its memory requirements are given for a
 * deferred-mapping array only): what its layout takes past the estimate (a block-linear array
 * pads its extents) shows in NVML, so the container is reconciled now, and the array is
 * destroyed again and refused when that takes the container over its limit. 0 ok, -1 refused. */
static int array_unmeasured(int kind, void *arr, uint64_t charged, int d)
{
    if (!vgpu.region.r->dev[d].limit)
        return 0;
    if (!vgpu_reconcile_over(d)) /* an NVML query per array: a rate would let a burst pass */
        return 0;
    uint64_t size;
    int dev;
    if (!vgpu_tab_take(kind, (uint64_t)(uintptr_t)arr, &size, &dev))
        return 0; /* another thread destroyed it meanwhile (its charge went with it) */
    array_destroy(kind, arr);
    vgpu_uncharge(d, charged);
    vgpu_reconcile(d, 3); /* what it took past the charge went back: this process's charge settled now */
    vgpu_log(1, "device %d: array refused: with what NVML shows it took the container is over its limit", d);
    return -1;
}

/* After the driver call of an array path that charged the estimate `est`: on success (`arr` the
 * array made, NULL when the caller passed no out-pointer), settle the charge to the driver's own
 * figure (cu*GetMemoryRequirements on the current context's device; without one, the estimate and
 * a reconciliation: array_unmeasured) and record the array; when that does not fit, the array is
 * destroyed again and the call refused. On failure, the charge returns. */
static CUresult array_end(CUresult rc, int kind, void *arr, int made, uint64_t est, int d)
{
    if (rc != CUDA_SUCCESS || d < 0 || !made) {
        vgpu_uncharge(d, est);
        return rc;
    }
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*q)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice) =
        kind == K_MIPMAP ? drv->mipmap_mem_req : drv->array_mem_req;
    CUdevice dev = 0;
    if (drv->ctx_get_device)
        drv->ctx_get_device(&dev);
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    uint64_t actual = est;
    int measured = q && q(&req, arr, dev) == CUDA_SUCCESS && req.size;
    if (measured)
        actual = req.size;
    if (vgpu_settle(d, est, actual)) {
        array_destroy(kind, arr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_tab_put_owned(kind, (uint64_t)(uintptr_t)arr, actual, d);
    if (!measured && array_unmeasured(kind, arr, actual, d))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return rc;
}

static int mapped_later(unsigned flags)
{
    return (flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)) != 0;
}

/* Hook `idx` (an array creation of any ABI) for a descriptor whose estimate is `est` (`later`:
 * its memory is mapped in later, not charged here). */
static CUresult array_common(int idx, CUarray *arr, const void *desc, uint64_t est, int later)
{
    CUresult (*real)(CUarray *, const void *) = REAL(idx, CUresult(*)(CUarray *, const void *));
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    if (mode() != M_LIMITED || !desc || later)
        return real(arr, desc);
    int d = vgpu_cur_dev();
    if (vgpu_charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(arr, desc);
    return array_end(rc, K_ARRAY, rc == CUDA_SUCCESS && arr ? (void *)*arr : NULL, arr != NULL, est, d);
}

VGPU_API CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    BROKEN_GUARD();
    return array_common(H_ARRAY, arr, desc,
                        desc ? array_est(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels) : 0, 0);
}

VGPU_API CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    BROKEN_GUARD();
    return array_common(H_ARRAY3D, arr, desc,
                        desc ? array_est(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels)
                             : 0,
                        desc && mapped_later(desc->Flags));
}

/* The CUDA < 3.2 ABI (32-bit extents): charged as the v2 forms. */
VGPU_API CUresult cuArrayCreate(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR_v1 *desc)
{
    BROKEN_GUARD();
    return array_common(H_ARRAY_V1, arr, desc,
                        desc ? array_est(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels) : 0, 0);
}

VGPU_API CUresult cuArray3DCreate(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc)
{
    BROKEN_GUARD();
    return array_common(H_ARRAY3D_V1, arr, desc,
                        desc ? array_est(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels)
                             : 0,
                        desc && mapped_later(desc->Flags));
}

VGPU_API CUresult cuArrayDestroy(CUarray arr)
{
    BROKEN_GUARD();
    vgpu_fn_cuArrayDestroy real = REAL_FN(cuArrayDestroy);
    uint64_t size;
    int d;
    vgpu_lock(&vgpu_vmm_mu); /* no map into an array the driver hands out again meanwhile */
    int tracked = vgpu_release_begin(K_ARRAY, (uint64_t)(uintptr_t)arr, &size, &d);
    CUresult rc = tracked ? vgpu_release_end(real(arr), K_ARRAY, (uint64_t)(uintptr_t)arr, size, d) : real(arr);
    if (rc == CUDA_SUCCESS)
        vgpu_vmm_array_gone(arr); /* a sparse array's mappings go with it */
    if (rc == CUDA_SUCCESS && tracked)
        vgpu_reconcile_soon(d); /* what it took past its charge left NVML's figure too */
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}

VGPU_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                         unsigned levels)
{
    BROKEN_GUARD();
    vgpu_fn_cuMipmappedArrayCreate real = REAL_FN(cuMipmappedArrayCreate);
    if (mode() != M_LIMITED || !desc || mapped_later(desc->Flags))
        return real(arr, desc, levels);
    uint64_t base = array_est(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels);
    uint64_t est = levels > 1 ? base * 2 : base; /* upper bound of the level sum */
    int d = vgpu_cur_dev();
    if (vgpu_charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(arr, desc, levels);
    return array_end(rc, K_MIPMAP, rc == CUDA_SUCCESS && arr ? (void *)*arr : NULL, arr != NULL, est, d);
}

VGPU_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr)
{
    BROKEN_GUARD();
    vgpu_fn_cuMipmappedArrayDestroy real = REAL_FN(cuMipmappedArrayDestroy);
    uint64_t size;
    int d;
    vgpu_lock(&vgpu_vmm_mu);
    int tracked = vgpu_release_begin(K_MIPMAP, (uint64_t)(uintptr_t)arr, &size, &d);
    CUresult rc = tracked ? vgpu_release_end(real(arr), K_MIPMAP, (uint64_t)(uintptr_t)arr, size, d) : real(arr);
    if (rc == CUDA_SUCCESS)
        vgpu_vmm_array_gone(arr);
    if (rc == CUDA_SUCCESS && tracked)
        vgpu_reconcile_soon(d);
    vgpu_unlock(&vgpu_vmm_mu);
    return rc;
}
