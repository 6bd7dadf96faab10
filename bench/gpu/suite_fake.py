"""The workload suite's fakes for --selftest: a fake NVML sampler and fake workloads that
write what the real ones would (see suite.py)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from suite_nvml import NvmlSampler


class FakeSampler(NvmlSampler):
    """For --selftest: samples made up from what the fake workloads say they did."""

    def __init__(self) -> None:
        super().__init__()
        self.uuid, self.name = "GPU-00000000-fake-0000-0000-000000000000", "Fake H200"
        self.busy: dict[int, float] = {}  # pid -> busy % while alive
        self.alive: dict[int, tuple[float, float, float]] = {}  # pid -> (t0, t1, MiB)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rnd = random.Random(1)
        while not self._stop.is_set():
            now = time.time()
            with self._lock:
                live = {p: v for p, v in self.busy.items() if self.alive.get(p, (0, 0, 0))[0] <= now
                        <= self.alive.get(p, (0, 0, 0))[1]}
                tot = min(100.0, sum(live.values()))
                self.dev.append((now, max(0.0, tot + rnd.uniform(-2, 2)) if live else 0.0))
                self.rates.append((now, tot))
                for p, v in live.items():
                    self.proc.append((p, now, v))
                for p, (a, b, m) in self.alive.items():
                    if a <= now <= b:
                        self.mem.append((now, p, m))
            self._stop.wait(0.05)



# ------------------------------------------------------------------------------------ fakes


def fake_busy(kind: str, mode: str, limit: int | None) -> float:
    nat = {"gpt": 80, "conv": 90, "infer": 12, "graphs": 99, "compile": 97, "mm": 99, "streams": 90}.get(kind, 99)
    if mode == "native" or not limit:
        return nat
    if mode == "hami":
        return nat * 0.97
    return min(nat, limit * 0.95)


def fake_group_busy(tenants: list[tuple[int, int]], i: int, mode: str, one_container: bool = False) -> float:
    if mode == "native":
        return 100 / len(tenants)
    if one_container:  # the container's limit, shared by its processes
        return (tenants[0][1] or 100) / len(tenants)
    c = tenants[i][1] or 100
    return c * 100 / max(100, sum(x or 100 for _, x in tenants))


def fake_mem(case: str, mode: str, limit: int) -> float:
    return {"native": 3100.0, "hami": limit * 1.4, "kvgpu": limit * 0.95, "mps": limit * 0.95}[mode]


def fake_wl(kind: str, secs: float, calib: str | None, ready: str | None, go: str | None) -> None:
    """Stands in for suite_wl.py / suite_cu spin in --selftest: sleeps through a short window."""
    time.sleep(0.05)
    if ready:
        Path(ready).touch()
        while go and not os.path.exists(go):
            time.sleep(0.005)
    t0 = time.time()
    time.sleep(secs)
    rate = {"gpt": 60, "conv": 40, "infer": 20, "graphs": 50, "compile": 80, "mm": 370, "streams": 70, "threads": 90,
            "spin1": 10, "spin10": 10, "spingrid1": 10, "spinctx2": 10, "spinptds": 10}[kind]
    n = int(rate * secs)
    res: dict[str, Any] = {"kind": kind, "unit": "units", "t0": t0, "t1": t0 + secs, "n": n, "its": n / secs,
                           "marks": [[round((i + 1) / rate, 4), i + 1] for i in range(n)], "pid": os.getpid()}
    if kind == "infer":
        lat = [6 + random.random() * 3 for _ in range(n)]
        res.update({"lat_ms": lat, "p50_ms": sorted(lat)[len(lat) // 2], "p99_ms": max(lat), "calib": 30})
    if kind.startswith("spin"):
        res = {"kind": "spin", "unit": "kernels", "iters": 123, "t0": t0, "t1": t0 + secs, "launched": n,
               "completed": n, "done_ms": [100.0 * (i + 1) for i in range(n)]}
    print(json.dumps(res))


def fake_cu(args: list[str]) -> None:
    if args[0] == "racer":
        print(json.dumps({"ready": time.time()}), flush=True)
        while not os.path.exists(args[4]):
            time.sleep(0.005)
        time.sleep(float(args[3]))
        print(json.dumps({"kind": "racer", "cycles": 10, "allocs": 100, "refused": 5}))
    elif args[0] == "newcomer":
        print(json.dumps({"kind": "newcomer", "spawn_to_main_s": time.time() - float(args[1]), "init_s": 0.2,
                          "ctx_s": 0.1, "init_ctx_s": 0.3, "first_alloc_s": 0.001, "to_first_answer_s": 0.35,
                          "ctx_rc": 0, "alloc_rc": 0}))
    else:
        time.sleep(1.2)
        print(json.dumps({"kind": args[0], "chunks": 3, "chunk_mib": 256, "last_rc": 2, "launch_rc": 0}))
