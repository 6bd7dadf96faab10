"""A hostile tenant for the node-side backstop (bench/gpu/realnode_backstop.py), run in a pod.

    python3 escape_zero.py TARGET_MIB HOLD_S

Allocates TARGET_MIB of GPU memory with torch in 128 MiB tensors, then holds it for HOLD_S
seconds. Before each block it zeroes its container's region counters (every card's charge, every
slot's data and overhead) through the region file, which the container can write, so its own
shim grants past the limit.

Prints one JSON line per block (``mib``: allocated so far, ``t``: Unix time, ``nvml_mib``: NVML's
figure for this process, ``error`` when a block was refused) and ``{"done": ...}`` at the end: a
process killed while holding prints no ``done`` line, and its last block line says how far it got.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time

import pynvml
import torch

sys.path.insert(0, "/repo/operator")
from kvgpu.shimregion import MAX_DEV, MAX_SLOTS, REGION_SIZE, Region

MIB = 1 << 20
REGION = "/var/run/kvgpu/vgpu.region"


def zero_region(path: str = REGION) -> None:
    """Set every charge of the region to 0 (the shim's and the agent's view of this container)."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            r = Region.from_buffer(mm)
            for d in range(MAX_DEV):
                r.dev[d].used = 0
            for s in range(MAX_SLOTS):
                ctypes.memset(ctypes.addressof(r.slot[s].data), 0, ctypes.sizeof(r.slot[s].data))
                ctypes.memset(ctypes.addressof(r.slot[s].overhead), 0, ctypes.sizeof(r.slot[s].overhead))
            del r
    finally:
        os.close(fd)


def nvml_mib(handle: object) -> float:
    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return round(p.usedGpuMemory / MIB, 1)
    except pynvml.NVMLError:
        return -1.0
    return 0.0


def main() -> None:
    target, hold = int(sys.argv[1]), float(sys.argv[2])
    torch.zeros(1, device="cuda")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    blocks, error = [], None
    while len(blocks) * 128 < target:
        zero_region()
        try:
            blocks.append(torch.empty(128 * MIB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch.cuda.synchronize()
        print(json.dumps({"mib": len(blocks) * 128, "t": round(time.time(), 2), "nvml_mib": nvml_mib(handle),
                          **({"error": error} if error else {})}), flush=True)
        if error:
            break
    end = time.monotonic() + hold
    while time.monotonic() < end:
        time.sleep(0.5)
    print(json.dumps({"done": True, "mib": len(blocks) * 128, "t": round(time.time(), 2)}), flush=True)


if __name__ == "__main__":
    main()
