"""Saturating fp32 matmul loop (run by bench/gpu/run.sh).

    python3 matmul.py SECONDS [LABEL]

4096x4096 fp32 torch.mm(out=) with torch.cuda.synchronize() every 20 products, after 10
warm-up products. Prints JSON: iterations per second over SECONDS and per-second counts.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    secs = float(sys.argv[1])
    label = sys.argv[2] if len(sys.argv) > 2 else ""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    c = torch.empty(4096, 4096, device="cuda")
    for _ in range(10):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    n, per_sec, t0 = 0, [], time.perf_counter()
    mark, last_n = t0 + 1.0, 0
    while True:
        for _ in range(20):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        n += 20
        now = time.perf_counter()
        if now >= mark:
            per_sec.append(n - last_n)
            last_n, mark = n, mark + 1.0
        if now - t0 >= secs:
            break
    el = time.perf_counter() - t0
    print(json.dumps({"label": label, "its": round(n / el, 2), "n": n, "secs": round(el, 3),
                      "per_sec": per_sec}), flush=True)


if __name__ == "__main__":
    main()
