"""What a context's end frees on a real driver: the memory of each allocation kind (linear,
stream-ordered, VMM, managed) before and after cuDevicePrimaryCtxReset (cudaDeviceReset) and
cuCtxDestroy, and what freeing the old objects afterwards returns. The shim's bookkeeping follows
what this shows (docs/shim.md, contexts).

Device call, alone on the card (cuMemGetInfo's free memory is the card's):
    python3 bench/gpu/reset_probe.py > $OUT/reset-probe.json
Output: one JSON object; sizes in MiB of the card's used memory, rc: CUresult codes.
"""

from __future__ import annotations

import ctypes
import json

MIB = 1 << 20
cu = ctypes.CDLL("libcuda.so.1")


def call(name: str, *args: object) -> int:
    return int(getattr(cu, name)(*args))


def used() -> float:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    return round((total.value - free.value) / MIB, 1)


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc", Loc),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


def retain(dev: ctypes.c_int) -> ctypes.c_void_p:
    ctx = ctypes.c_void_p()
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)
    return ctx


def alloc_all(size: int) -> dict[str, object]:
    """One of each kind the shim charges in the current context, `size` bytes each (the managed
    allocation written over, so that its pages live on the card)."""
    p1, p2, h, pm = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    out: dict[str, object] = {"before": used()}
    out["cuMemAlloc"] = call("cuMemAlloc_v2", ctypes.byref(p1), ctypes.c_size_t(size))
    out["after_alloc"] = used()
    out["cuMemAllocAsync"] = call("cuMemAllocAsync", ctypes.byref(p2), ctypes.c_size_t(size), None)
    call("cuStreamSynchronize", None)
    out["after_async"] = used()
    prop = AllocProp(type=1, handle_types=0, loc=Loc(type=1, id=0))
    out["cuMemCreate"] = call("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop),
                              ctypes.c_ulonglong(0))
    out["after_create"] = used()
    out["cuMemAllocManaged"] = call("cuMemAllocManaged", ctypes.byref(pm), ctypes.c_size_t(size), 1)  # GLOBAL
    if hasattr(cu, "cuMemsetD32_v2"):  # (a stub driver may not have it)
        out["cuMemsetD32"] = call("cuMemsetD32_v2", pm, ctypes.c_uint(1), ctypes.c_size_t(size // 4))
    call("cuCtxSynchronize")
    out["after_managed"] = used()
    out["objects"] = (p1, p2, h, pm)
    return out


def free_all(objs: tuple[ctypes.c_uint64, ...]) -> dict[str, object]:
    p1, p2, h, pm = objs
    out: dict[str, object] = {}
    out["cuMemFree_rc"] = call("cuMemFree_v2", p1)
    out["after_free"] = used()
    out["cuMemFreeAsync_rc"] = call("cuMemFreeAsync", p2, None)
    call("cuStreamSynchronize", None)
    out["after_free_async"] = used()
    out["cuMemRelease_rc"] = call("cuMemRelease", h)
    out["after_release"] = used()
    out["cuMemFree_managed_rc"] = call("cuMemFree_v2", pm)
    out["after_free_managed"] = used()
    return out


def main() -> None:
    res: dict[str, object] = {"cuInit": call("cuInit", 0)}
    dev = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(dev), 0)
    retain(dev)
    size = 1024 * MIB
    a = alloc_all(size)
    objs = a.pop("objects")
    res["primary"] = a
    res["reset_rc"] = call("cuDevicePrimaryCtxReset_v2", dev)
    res["after_reset_before_retain"] = used()
    retain(dev)
    res["after_reset_retained"] = used()
    res["primary_after_reset"] = free_all(objs)  # type: ignore[arg-type]
    # a created context: its memory at cuCtxDestroy
    ctx = ctypes.c_void_p()
    res["cuCtxCreate"] = call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
    c = alloc_all(size)
    objs = c.pop("objects")
    res["created"] = c
    res["destroy_rc"] = call("cuCtxDestroy_v2", ctx)
    retain(dev)
    res["after_destroy"] = used()
    res["created_after_destroy"] = free_all(objs)  # type: ignore[arg-type]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
