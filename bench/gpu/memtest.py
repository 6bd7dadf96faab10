"""Memory-limit checks with PyTorch on a real GPU (run by bench/gpu/run.sh).

    python3 memtest.py BLOCK_MIB [--smi]

Creates the CUDA context, then allocates BLOCK_MIB tensors until an exception, sampling
NVML's per-process memory (nvmlDeviceGetComputeRunningProcesses, not virtualised by the
shim) after every block. Prints one JSON object: context MiB, blocks, reachable MiB, the
exception type and message, mem_get_info / total_memory before and while holding, the
maximum NVML per-process MiB, and (--smi) nvidia-smi's output while holding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pynvml
import torch

MIB = 1024 * 1024


def nvml_proc_mib(handle) -> float:
    for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses"):
        f = getattr(pynvml, fn, None)
        if f is None:
            continue
        try:
            for p in f(handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return p.usedGpuMemory / MIB
            return 0.0
        except pynvml.NVMLError:
            continue
    return -1.0


def main() -> None:
    block = int(sys.argv[1])
    smi = "--smi" in sys.argv
    t0 = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    pynvml.nvmlInit()
    # The physical card by PCI bus id (index 0 inside this machine).
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    ctx_mib = nvml_proc_mib(h)
    free0, total0 = torch.cuda.mem_get_info()
    props_total = torch.cuda.get_device_properties(0).total_memory
    held, peak, err_type, err_msg = [], ctx_mib, "", ""
    t1 = time.perf_counter()
    try:
        while True:
            held.append(torch.empty(block * MIB, dtype=torch.uint8, device="cuda"))
            peak = max(peak, nvml_proc_mib(h))
    except Exception as e:  # the point: which exception, and when
        err_type, err_msg = type(e).__module__ + "." + type(e).__name__, str(e).split("\n")[0][:300]
    alloc_s = time.perf_counter() - t1
    peak = max(peak, nvml_proc_mib(h))
    free1, total1 = torch.cuda.mem_get_info()
    out = {
        "block_mib": block,
        "first_call_s": round(first_call_s, 4),
        "context_mib": ctx_mib,
        "mem_get_info_before_mib": [round(free0 / MIB, 1), round(total0 / MIB, 1)],
        "total_memory_mib": round(props_total / MIB, 1),
        "blocks": len(held),
        "reachable_mib": len(held) * block,
        "error": err_type,
        "message": err_msg,
        "nvml_process_peak_mib": peak,
        "mem_get_info_holding_mib": [round(free1 / MIB, 1), round(total1 / MIB, 1)],
        "alloc_s": round(alloc_s, 4),
    }
    if smi:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader"],
            capture_output=True, text=True,
        )
        out["smi_query"] = q.stdout.strip() or q.stderr.strip()
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        out["smi_memory_line"] = [ln.strip() for ln in full.splitlines() if "MiB /" in ln]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
