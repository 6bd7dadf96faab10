"""Quick checks of the compute limiter's workload classes on a real card (issue 21).

    python3 limiter_check.py req SECS LABEL     ~6 ms of matmuls every 50 ms: p50/p99 latency
    python3 limiter_check.py long SECS LABEL    ~100 ms kernels, synchronized after each: per second

Prints one JSON line. Run natively and under the shim (bench/gpu/run.sh, part "limiter").
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    mode, secs, label = sys.argv[1], float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
    torch.backends.cuda.matmul.allow_tf32 = False
    n = 4096 if mode == "req" else 16384
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    c = torch.empty(n, n, device="cuda")
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    out: dict[str, object] = {"label": label, "mode": mode, "kernel_ms": round(one * 1e3, 2)}
    if mode == "req":
        k = max(1, round(0.006 / one))  # ~6 ms of GPU work per request
        lat, nxt, t0 = [], time.perf_counter(), time.perf_counter()
        while time.perf_counter() - t0 < secs:
            now = time.perf_counter()
            if now < nxt:
                time.sleep(nxt - now)
            for _ in range(k):
                torch.mm(a, b, out=c)
            torch.cuda.synchronize()
            lat.append((time.perf_counter() - nxt) * 1e3)
            nxt += 0.05
        lat.sort()
        out.update(requests=len(lat), p50_ms=round(lat[len(lat) // 2], 2),
                   p99_ms=round(lat[min(len(lat) - 1, len(lat) * 99 // 100)], 2))
    else:
        per, cnt, t0 = [], 0, time.perf_counter()
        mark = t0 + 1
        while time.perf_counter() - t0 < secs:
            torch.mm(a, b, out=c)
            torch.cuda.synchronize()
            cnt += 1
            if time.perf_counter() >= mark:
                per.append(cnt)
                cnt, mark = 0, mark + 1
        el = time.perf_counter() - t0
        out.update(kernels_per_s_each_second=per, busy_est=round(sum(per) * one / max(1, len(per)), 3),
                   secs=round(el, 2))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
