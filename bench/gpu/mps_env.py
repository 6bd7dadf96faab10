"""What an MPS client process runs with (run in a pod by bench/gpu/realnode_run.py, part mps).

    python3 mps_env.py

Starts CUDA with torch (the shim, under a ``mode=mps`` claim, sets the client's MPS variables
before the driver's ``cuInit``), then prints one JSON object: the three ``CUDA_MPS_*`` variables
as the process started with them (``os.environ``: the container's env) and as the process holds
them after CUDA started (libc ``getenv``: what the driver read), and ``mem_get_info`` in MiB.
"""

from __future__ import annotations

import ctypes
import json
import os

import torch

KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def main() -> None:
    at_start = {k: os.environ.get(k) for k in KEYS}
    out: dict[str, object] = {"env_at_start": at_start}
    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out["mem_get_info_mib"] = [free >> 20, total >> 20]
    except Exception as e:  # the point: report, not crash
        out["error"] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:200]}"
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    out["env_after_init"] = {k: (libc.getenv(k.encode()) or b"").decode() for k in KEYS}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
