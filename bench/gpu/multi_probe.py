"""The child processes of bench/gpu/multi.py: each probe prints one JSON line (torch, GPU).

    python3 multi_probe.py mem [--block MIB]        every visible card: total, blocks until OOM
    python3 multi_probe.py view                     every visible card: UUID, mem_get_info
    python3 multi_probe.py matmul --secs S [--device I --sync DIR]
                                                    4096^2 fp32 products: iterations/s per card
    python3 multi_probe.py peer [--mib MIB]         can_device_access_peer, a copy 0 -> 1 -> 0
    python3 multi_probe.py allreduce --result DIR   a torchrun worker: NCCL all-reduce of 128 floats

Memory in MiB, rates in iterations/s, bandwidth in GB/s (1e9 bytes), time in seconds. A probe
that fails prints ``{"error": "..."}``. Run natively or under the shim: the probe does not know.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
N = 4096


def card_uuid(i: int) -> str:
    """The CUDA ordinal's UUID (``cuDeviceGetUuid``), as nvidia-smi writes it."""
    u = getattr(torch.cuda.get_device_properties(i), "uuid", "")
    s = str(u)
    return s if not s or s.startswith("GPU-") else "GPU-" + s


def nvml_handle(uuid: str) -> Any:
    """pynvml's handle of the card ``uuid``, or None where NVML is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        return None


def nvml_mib(handle: Any) -> float:
    """This process's memory on the card (NVML per process, never virtualised), MiB; -1 unknown."""
    if handle is None:
        return -1.0
    from memtest import nvml_proc_mib

    return float(nvml_proc_mib(handle))


def fill(i: int, block: int, held: list[torch.Tensor]) -> dict[str, Any]:
    """Allocate ``block`` MiB tensors on ordinal ``i`` until an exception; keep them in ``held``."""
    uuid = card_uuid(i)
    h = nvml_handle(uuid)
    free, total = torch.cuda.mem_get_info(i)
    n, peak, err = 0, nvml_mib(h), ""
    try:
        while True:
            held.append(torch.empty(block * MIB, dtype=torch.uint8, device=f"cuda:{i}"))
            n += 1
            peak = max(peak, nvml_mib(h))
    except Exception as e:  # the point: which exception, and when
        err = f"{type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return {"ordinal": i, "uuid": uuid, "total_mib": round(total / MIB), "free_mib": round(free / MIB),
            "granted_mib": n * block, "error": err, "nvml_peak_mib": max(peak, nvml_mib(h))}


def probe_mem(a: argparse.Namespace) -> dict[str, Any]:
    """Every visible card in turn, holding the earlier cards' blocks."""
    n = torch.cuda.device_count()
    for i in range(n):
        torch.zeros(1, device=f"cuda:{i}")
    held: list[torch.Tensor] = []
    return {"devices": [fill(i, a.block, held) for i in range(n)]}


def probe_view(_: argparse.Namespace) -> dict[str, Any]:
    """UUID and mem_get_info (MiB) per visible ordinal."""
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append({"ordinal": i, "uuid": card_uuid(i), "total_mib": round(total / MIB),
                    "free_mib": round(free / MIB)})
    return {"devices": out}


def products(dev: int, secs: float, start: Callable[[], object]) -> dict[str, Any]:
    """fp32 N x N products on ``dev`` for ``secs`` after ``start()``; a sync every 20."""
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = (torch.randn(N, N, device=f"cuda:{dev}") for _ in range(2))
    z = torch.empty_like(x)
    for _ in range(10):
        torch.mm(x, y, out=z)
    torch.cuda.synchronize(dev)
    start()
    t0, count = time.perf_counter(), 0
    seconds: list[int] = []  # products done by the end of each whole second
    while (now := time.perf_counter()) - t0 < secs:
        for _ in range(20):
            torch.mm(x, y, out=z)
        torch.cuda.synchronize(dev)
        count += 20
        if int(now - t0) >= len(seconds) + 1:
            seconds.append(count)
    el = time.perf_counter() - t0
    return {"ordinal": dev, "uuid": card_uuid(dev), "its": round(count / el, 2), "cumulative": seconds}


def sync_start(sync: str, dev: int) -> Callable[[], object]:
    """Say ready in ``sync``/<dev>.ready, then wait (at most 300 s) for ``sync``/go."""
    def start() -> None:
        Path(sync, f"{dev}.ready").touch()
        end = time.monotonic() + 300
        while not Path(sync, "go").exists() and time.monotonic() < end:
            time.sleep(0.005)
    return start


def probe_matmul(a: argparse.Namespace) -> dict[str, Any]:
    """One card (``--device``, started with the others through ``--sync``) or, without
    ``--device``, every visible card at once from threads of this process."""
    if a.device is not None:
        return {"devices": [products(a.device, a.secs, sync_start(a.sync, a.device))]}
    n = torch.cuda.device_count()
    barrier = threading.Barrier(n)
    res: list[dict[str, Any]] = [{} for _ in range(n)]

    def one(i: int) -> None:
        try:
            res[i] = products(i, a.secs, barrier.wait)
        except Exception as e:
            barrier.abort()
            res[i] = {"ordinal": i, "error": repr(e)}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"devices": res, "error": "; ".join(d["error"] for d in res if d.get("error"))}


def probe_peer(a: argparse.Namespace) -> dict[str, Any]:
    """can_device_access_peer for every pair, then ``a.mib`` MiB cuda:0 -> cuda:1 -> cuda:0."""
    n = torch.cuda.device_count()
    can = [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
           for i in range(n)]
    src = torch.randint(0, 256, (a.mib * MIB,), dtype=torch.uint8, device="cuda:0")
    src.to("cuda:1")  # warm-up: peer access is enabled on the first copy
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    dst = src.to("cuda:1")
    torch.cuda.synchronize(1)
    dt = time.perf_counter() - t0
    back = torch.empty_like(src)
    back.copy_(dst)
    torch.cuda.synchronize(0)
    return {"count": n, "can": can, "copy_ok": bool(torch.equal(src, back)),
            "gbps": round(a.mib * MIB / dt / 1e9, 2)}


def probe_allreduce(a: argparse.Namespace) -> dict[str, Any]:
    """A torchrun worker: rank r sends arange(128) + r; every rank must get the exact sum."""
    import datetime

    import torch.distributed as dist

    rank, local, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    torch.cuda.set_device(local)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=50))
    x = torch.arange(128, dtype=torch.float32, device=f"cuda:{local}") + rank
    dist.all_reduce(x)
    torch.cuda.synchronize(local)
    want = torch.arange(128, dtype=torch.float32) * world + sum(range(world))
    err = float((x.cpu() - want).abs().max())
    dist.destroy_process_group()
    out = {"rank": rank, "uuid": card_uuid(local), "ok": err == 0.0, "max_err": err,
           "secs": round(time.perf_counter() - t0, 3)}
    Path(a.result, f"rank{rank}.json").write_text(json.dumps(out))
    return out


PROBES = {"mem": probe_mem, "view": probe_view, "matmul": probe_matmul, "peer": probe_peer,
          "allreduce": probe_allreduce}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=sorted(PROBES))
    ap.add_argument("--block", type=int, default=256, help="MiB per tensor (mem)")
    ap.add_argument("--secs", type=float, default=8.0)
    ap.add_argument("--device", type=int)
    ap.add_argument("--sync", default="")
    ap.add_argument("--mib", type=int, default=256, help="MiB copied (peer)")
    ap.add_argument("--result", default=".")
    a = ap.parse_args()
    try:
        out = PROBES[a.probe](a)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
