"""What a context's end frees on a real driver: the memory of each allocation kind (linear,
stream-ordered, VMM, managed) before and after cuDevicePrimaryCtxReset (cudaDeviceReset) and
cuCtxDestroy, and what freeing the old objects afterwards returns; then what an exported and
re-imported VMM handle shows (export_probe). The shim's bookkeeping follows
what this shows (docs/shim.md, contexts).

Device call, alone on the card (cuMemGetInfo's free memory is the card's):
    python3 bench/gpu/reset_probe.py > $OUT/reset-probe.json
Output: one JSON object; sizes in MiB of the card's used memory, rc: CUresult codes.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess

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


def fd_facts(fd: int) -> dict[str, object]:
    """What a process can learn of an exported handle's file descriptor (its identity?)."""
    try:
        st = os.fstat(fd)
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        return {"error": repr(e)}
    return {"dev": st.st_dev, "ino": st.st_ino, "rdev": st.st_rdev, "mode": oct(st.st_mode), "link": link}


def smi_used() -> str:
    """This process's used memory as nvidia-smi's process list shows it (NVML's per-process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return repr(e)
    return ";".join(ln.strip() for ln in out.splitlines() if ln.split(",")[0].strip() == str(os.getpid()))


def export_probe(size: int) -> dict[str, object]:
    """A VMM handle exported as a POSIX file descriptor and imported again: whether the exported
    descriptors name their allocation (so a hook could tell which handle an import refers to),
    whether an import outlives the exporter's release on the card and in NVML's process list,
    and whether a mapping longer than the allocation is refused (so a hook could find an
    imported handle's size)."""
    out: dict[str, object] = {}
    h1, h2, h3, va = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    prop = AllocProp(type=1, handle_types=1, loc=Loc(type=1, id=0))  # POSIX_FILE_DESCRIPTOR
    out["before"], out["smi_before"] = used(), smi_used()
    out["create_rc"] = call("cuMemCreate", ctypes.byref(h1), ctypes.c_size_t(size), ctypes.byref(prop),
                            ctypes.c_ulonglong(0))
    out["create2_rc"] = call("cuMemCreate", ctypes.byref(h3), ctypes.c_size_t(size // 2), ctypes.byref(prop),
                             ctypes.c_ulonglong(0))
    fds = [ctypes.c_int(-1) for _ in range(3)]
    out["export_rc"] = [call("cuMemExportToShareableHandle", ctypes.byref(fds[i]), h, 1, ctypes.c_ulonglong(0))
                        for i, h in enumerate((h1, h1, h3))]
    out["fds (h1, h1 again, h3)"] = [fd_facts(f.value) for f in fds]
    out["import_rc"] = call("cuMemImportFromShareableHandle", ctypes.byref(h2), ctypes.c_void_p(fds[1].value), 1)
    out["import_same_value"] = h2.value == h1.value
    out["after_import"], out["smi_after_import"] = used(), smi_used()
    out["release_h1_rc"] = call("cuMemRelease", h1)
    out["after_release_h1"], out["smi_after_release_h1"] = used(), smi_used()
    gran = ctypes.c_size_t()
    call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    out["reserve_rc"] = call("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(2 * size), ctypes.c_size_t(0),
                             ctypes.c_uint64(0), ctypes.c_ulonglong(0))
    out["map_2x_rc"] = call("cuMemMap", va, ctypes.c_size_t(2 * size), ctypes.c_size_t(0), h2, ctypes.c_ulonglong(0))
    if out["map_2x_rc"] == 0:
        call("cuMemUnmap", va, ctypes.c_size_t(2 * size))
    out["map_plus_gran_rc"] = call("cuMemMap", va, ctypes.c_size_t(size + gran.value), ctypes.c_size_t(0), h2,
                                   ctypes.c_ulonglong(0))
    if out["map_plus_gran_rc"] == 0:
        call("cuMemUnmap", va, ctypes.c_size_t(size + gran.value))
    out["map_1x_rc"] = call("cuMemMap", va, ctypes.c_size_t(size), ctypes.c_size_t(0), h2, ctypes.c_ulonglong(0))
    out["release_h2_rc"] = call("cuMemRelease", h2)
    out["after_release_h2_mapped"], out["smi_mapped"] = used(), smi_used()
    out["unmap_rc"] = call("cuMemUnmap", va, ctypes.c_size_t(size))
    out["after_unmap"] = used()
    call("cuMemAddressFree", va, ctypes.c_size_t(2 * size))
    call("cuMemRelease", h3)
    for f in fds:
        if f.value >= 0:
            os.close(f.value)
    out["after_all"] = used()
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
    try:
        res["export_import"] = export_probe(size)
    except Exception as e:  # the rest of the probe stands
        res["export_import"] = {"error": repr(e)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
