"""What a context's NVML accounting costs a starting process on the card (issue 21, start-up under
contention): nvmlInit and nvmlDeviceGetComputeRunningProcesses_v3, timed alone and while N
processes race 64 MiB allocations (bench/gpu/suite_cu.c racer). One JSON line per phase.

    python3 bench/gpu/nvml_cost.py SUITE_CU [N]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time


def timings() -> dict[str, float]:
    t0 = time.perf_counter()
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    assert lib.nvmlInit_v2() == 0
    init = time.perf_counter() - t0
    h = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
    buf = (ctypes.c_ubyte * (64 * 64))()
    qs = []
    for _ in range(20):
        n = ctypes.c_uint(64)
        a = time.perf_counter()
        lib.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(n), buf)
        qs.append(time.perf_counter() - a)
    lib.nvmlShutdown()
    qs.sort()
    return {"init_ms": init * 1e3, "query_p50_ms": qs[10] * 1e3, "query_max_ms": qs[-1] * 1e3}


def main() -> None:
    cu, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(json.dumps({"phase": "alone", **timings()}), flush=True)
    go = os.path.join(tempfile.mkdtemp(), "go")
    racers = [subprocess.Popen([cu, "racer", str(64 << 20), str(1000 << 20), "6", go],
                               stdout=subprocess.DEVNULL) for _ in range(n)]
    time.sleep(1.5)
    open(go, "w").close()
    time.sleep(1.0)
    try:
        for i in range(3):
            print(json.dumps({"phase": f"racing-{n}-{i}", **timings()}), flush=True)
    finally:
        for p in racers:
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
