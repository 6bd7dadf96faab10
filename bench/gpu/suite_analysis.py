"""The workload suite's analysis: busy shares, rates and statistics of each run from the
sampled NVML records (see suite.py)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import suite_plan  # noqa: F401 (puts the tree under test on sys.path)
from kvgpu.agent.schedule import Tenant, layout, limited

# ------------------------------------------------------------------------------------ analysis


def busy_share(samples: Sequence[Sequence[float]], a: float, b: float, period: float
               ) -> tuple[float | None, list[float]]:
    """Time-weighted mean of a busy-% step function over [a, b], and per whole second from a.
    Each sample (t, v) covers (max(previous t, t - period), t]."""
    pts = sorted((float(s[0]), float(s[1])) for s in samples)
    if b <= a or not pts:
        return None, []
    secs = max(1, int(b - a + 1e-6))
    edges = [(a + i, min(b, a + i + 1)) for i in range(secs)] + [(a, b)]
    acc = [0.0] * len(edges)
    cov = [0.0] * len(edges)
    prev = None
    for t, v in pts:
        lo = t - period if prev is None else max(prev, t - period)
        prev = t
        for k, (x, y) in enumerate(edges):
            o = min(t, y) - max(lo, x)
            if o > 0:
                acc[k] += v * o
                cov[k] += o
    vals = [acc[k] / (y - x) if cov[k] > 0.5 * (y - x) else math.nan for k, (x, y) in enumerate(edges)]
    mean = vals[-1]
    return (None if math.isnan(mean) else mean), list(vals[:-1])


def sample_period(dev: Sequence[Sequence[float]]) -> float:
    ts = sorted(float(s[0]) for s in dev)
    d = [y - x for x, y in itertools.pairwise(ts) if y > x]
    return statistics.median(d) if d else 0.1667


def proc_share(proc: Sequence[Sequence[float]], pid: int, a: float, b: float, period: float
               ) -> tuple[float | None, list[float]]:
    """One process's share from nvmlDeviceGetProcessUtilization samples: on a grid of the sample
    period, the process's latest sample in each step, 0 where it has none (NVML reports only
    processes that used the GPU in the last period)."""
    if not proc:
        return None, []
    mine = sorted((float(p[1]), float(p[2])) for p in proc if int(p[0]) == pid)
    grid: list[tuple[float, float]] = []
    t, j = a - period, 0
    while t <= b + period:
        v = 0.0
        while j < len(mine) and mine[j][0] <= t:
            if mine[j][0] > t - period:
                v = mine[j][1]
            j += 1
        grid.append((t, v))
        t += period
    return busy_share(grid, a, b, period)


def units_at(marks: Sequence[Sequence[float]], t: float) -> float:
    """Units done at t seconds after the workload's t0 (linear between its sync marks)."""
    px, py = 0.0, 0.0
    for x, y in marks:
        if x >= t:
            return py + (y - py) * ((t - px) / (x - px) if x > px else 1.0)
        px, py = x, y
    return py


def marks_of(res: dict[str, Any]) -> list[list[float]]:
    if res.get("kind") == "spin":
        return [[ms / 1e3, i + 1] for i, ms in enumerate(res.get("done_ms", []))]
    return res.get("marks", [])


def rate(res: dict[str, Any], a: float, b: float) -> float | None:
    """Units per second in the wall-clock window [a, b]."""
    if "t0" not in res or b <= a:
        return None
    m = marks_of(res)
    return (units_at(m, b - res["t0"]) - units_at(m, a - res["t0"])) / (b - a)


def per_second_rates(res: dict[str, Any], a: float, b: float) -> list[float]:
    return [r for i in range(max(0, int(b - a + 1e-6))) if (r := rate(res, a + i, a + i + 1)) is not None]


def stats(vals: Iterable[float]) -> dict[str, float | None]:
    v = [x for x in vals if x is not None and not math.isnan(x)]
    if not v:
        return {"min": None, "max": None, "sd": None}
    return {"min": min(v), "max": max(v), "sd": statistics.pstdev(v) if len(v) > 1 else 0.0}


def rnd(x: Any, n: int = 2) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, n)
    if isinstance(x, dict):
        return {k: rnd(v, n) for k, v in x.items()}
    if isinstance(x, list):
        return [rnd(v, n) for v in x]
    return x


def window_of(rec: dict[str, Any]) -> tuple[float, float] | None:
    res = rec.get("result", {})
    if "t0" not in res or "t1" not in res:
        return None
    if res.get("kind") == "spin":
        return res["t0"], res["t0"] + rec.get("secs", res["t1"] - res["t0"])
    return res["t0"], res["t1"]


def analyze_single(rec: dict[str, Any], native: dict[str, Any] | None) -> dict[str, Any]:
    res = rec.get("result", {})
    w = window_of(rec)
    m: dict[str, Any] = {}
    if w is None:
        return {"failed": res.get("error", "no result")}
    a, b = w
    s = rec.get("samples") or {"dev": [], "proc": [], "rates": []}
    per = sample_period(s["dev"])
    busy, busy_sec = busy_share(s["dev"], a, b, per)
    rates_busy, _ = busy_share(s.get("rates", []), a, b, 0.1)
    its = rate(res, a, b)
    m.update({"its": its, "unit": res.get("unit"), "busy": busy, "busy_rates": rates_busy,
              "busy_sec": busy_sec, "busy_sec_stats": stats(busy_sec), "sample_period_s": per,
              "n_samples": len(s["dev"])})
    pid = res.get("pid", res.get("_pid"))
    if pid is not None and s.get("proc"):
        m["proc_busy"], _ = proc_share(s["proc"], int(pid), a, b, per)
    if "p50_ms" in res:
        m.update({k: res[k] for k in ("p50_ms", "p99_ms", "max_ms", "mean_ms") if k in res})
    if res.get("kind") == "spin":
        m["kernel_ms"] = res.get("calib_ms")
        m["completed"] = sum(1 for ms in res.get("done_ms", []) if ms / 1e3 <= b - a)
    if "error" in res:
        m["error"] = res["error"]
    if native is None or rec["mode"] == "native":
        return m
    nm = native.get("metrics", {})
    lim = rec.get("limit")
    if nm.get("its") and its is not None:
        m["share"] = 100 * its / nm["its"]
        sec = per_second_rates(res, a, b)
        m["share_sec"] = [100 * r / nm["its"] for r in sec]
        m["share_sec_stats"] = stats(m["share_sec"])
    nb = nm.get("busy")
    if lim and nb is not None:
        tb = min(float(lim), nb)
        m["target_busy"] = tb
        m["target_share"] = min(100.0, 100 * lim / nb) if nb > 0 else None
        if busy is not None:
            m["err_pts"] = busy - tb
            full = [v for v in busy_sec if not math.isnan(v)]
            m["sec_max_dev"] = max((abs(v - tb) for v in full), default=None)
            m["met_busy"], m["met_even"] = single_goal(busy, full, m.get("share"), float(lim), nb)
        if "share" in m and m["target_share"] is not None:
            m["share_err_pts"] = m["share"] - m["target_share"]
    if "p99_ms" in m and nm.get("p99_ms"):
        m["p99_vs_native"] = m["p99_ms"] / nm["p99_ms"]
        m["met_latency"] = m["p99_ms"] <= 1.2 * nm["p99_ms"]
    return m


def single_goal(busy: float, busy_sec: Sequence[float], share: float | None, limit: float,
                native_busy: float) -> tuple[bool, bool]:
    """(goal met on the mean, goal met in every whole second) for one limited tenant, in busy
    points of the card (issue 21's reading of a limit).

    Wants more than its share (native busy ≥ limit): busy within ± 3 points of the limit.
    Wants less (native busy < limit): not held back and not over the limit, i.e. busy between
    native busy − 3 and limit + 3, and (mean only) throughput ≥ 97 % of native when known. A
    run faster than the native run (host noise) is then busier than native without missing."""
    tol = 3.0
    if native_busy >= limit:
        return abs(busy - limit) <= tol, bool(busy_sec) and all(abs(v - limit) <= tol for v in busy_sec)
    lo, hi = native_busy - tol, limit + tol
    mean_ok = lo <= busy <= hi and (share is None or share >= 100 - tol)
    return mean_ok, bool(busy_sec) and all(lo <= v <= hi for v in busy_sec)


def expected_split(tenants: Sequence[tuple[int, int]]) -> list[float]:
    """The documented split (docs/shim.md, "Schedule file"): the agent's layout for the limited
    tenants; an unlimited priority-0 tenant takes what the limited priority-0 ones leave and
    priority-1 tenants get nothing then (low priority gets what high priority leaves)."""
    lim = [Tenant(f"t{i}", p, c * 10, i) for i, (p, c) in enumerate(tenants) if limited(c)]
    wins = {w.key: w.len_pm / 10 for w in layout(lim)}
    hi_free = [i for i, (p, c) in enumerate(tenants) if p == 0 and not limited(c)]
    out = []
    for i, (p, c) in enumerate(tenants):
        if hi_free:
            taken = sum(wins.get(f"t{j}", 0.0) for j, (pj, _) in enumerate(tenants) if pj == 0)
            out.append((100 - taken) / len(hi_free) if i in hi_free else (wins.get(f"t{i}", 0.0) if p == 0 else 0.0))
        elif not limited(c):
            out.append(100.0 - sum(wins.values()))
        else:
            out.append(wins.get(f"t{i}", 0.0))
    return out


def analyze_group(rec: dict[str, Any], native_mm: dict[str, Any] | None) -> dict[str, Any]:
    if "window" not in rec:
        errs = [t["result"].get("error") for t in rec["tenants"] if t["result"].get("error")]
        return {"failed": "; ".join(e for e in errs if e) or "no result"}
    a, b = rec["window"]
    s = rec.get("samples") or {"dev": [], "proc": []}
    per = sample_period(s["dev"])
    one = bool(rec.get("one_container"))
    n = len(rec["tenants"])
    # one container's processes: its limit is their sum's; an equal part each is only a guide
    exp = ([float(rec["tenants"][0]["cores"]) / n] * n if one else
           expected_split([(t["prio"], t["cores"]) for t in rec["tenants"]]))
    base = (native_mm or {}).get("metrics", {}).get("its")
    out = []
    for t, e in zip(rec["tenants"], exp, strict=True):
        r = t["result"]
        its = rate(r, a, b)
        pb, pbs = proc_share(s["proc"], int(r.get("pid", r.get("_pid", -1))), a, b, per) if s["proc"] else (None, [])
        d: dict[str, Any] = {"its": its, "proc_busy": pb, "proc_busy_sec_stats": stats(pbs),
                             "expected": e if rec["mode"] != "native" else None}
        if base and its is not None:
            d["share"] = 100 * its / base
            d["share_sec_stats"] = stats(100 * x / base for x in per_second_rates(r, a, b))
            if rec["mode"] != "native":
                d["err_pts"] = d["share"] - e
                if not one:
                    d["met"] = abs(d["err_pts"]) <= 3
        if "error" in r:
            d["error"] = r["error"]
        out.append(d)
    busy, busy_sec = busy_share(s["dev"], a, b, per)
    m: dict[str, Any] = {"tenants": out, "busy": busy, "window_s": b - a,
                         "sum_share": sum(d.get("share", 0) for d in out) if base else None}
    if one and rec["mode"] != "native":
        lim = float(rec["tenants"][0]["cores"])
        m["expected_total"] = lim
        if m["sum_share"] is not None:
            m["err_pts_total"] = m["sum_share"] - lim
            m["met"] = abs(m["err_pts_total"]) <= 3
        if busy is not None:
            m["busy_err_pts"] = busy - lim
            m["busy_sec_stats"] = stats(v for v in busy_sec if not math.isnan(v))
    return m


def analyze_memory(rec: dict[str, Any]) -> dict[str, Any]:
    r = rec["result"]
    lim = rec.get("limit_mib")
    m: dict[str, Any] = {"nvml_peak_mib": rec.get("nvml_peak_mib"), "chunks": r.get("chunks"),
                         "granted_mib": (r.get("chunks") or 0) * (r.get("chunk_mib") or 0)}
    for k in ("launch_rc", "instantiate_rc", "node_rc", "limit_rc", "kernel_rc", "contexts", "ctx_rc",
              "mallocs_ok", "last_rc", "meminfo"):
        if k in r:
            m[k] = r[k]
    if lim and m["nvml_peak_mib"] is not None:
        m["over_limit_mib"] = m["nvml_peak_mib"] - lim
        m["met"] = m["nvml_peak_mib"] <= lim
    if "error" in r:
        m["error"] = r["error"]
    return m


def analyze_startup(rec: dict[str, Any], native: dict[str, Any] | None) -> dict[str, Any]:
    """Medians over the newcomers that got a context (one refused with CUDA_ERROR_OUT_OF_MEMORY
    because its siblings filled the limit answers fast without creating one, so it is counted,
    not timed); met needs at least one context and its median within 1.2 × native + 50 ms."""
    ok = [r for r in rec["rounds"] if "init_ctx_s" in r]
    if not ok:
        return {"failed": "; ".join(str(r.get("error")) for r in rec["rounds"])}
    timed = [r for r in ok if r.get("ctx_rc") == 0]
    m: dict[str, Any] = {"rounds": len(ok), "contexts": len(timed), "ctx_rcs": [r.get("ctx_rc") for r in ok]}
    for k in ("spawn_to_main_s", "init_s", "ctx_s", "init_ctx_s", "first_alloc_s", "to_first_answer_s"):
        m[k] = statistics.median(r[k] for r in timed) if timed else None
    m["alloc_rcs"] = [r.get("alloc_rc") for r in ok]
    m["racers"] = [{k: r.get(k) for k in ("cycles", "allocs", "refused", "error") if k in r} for r in rec["racers"]]
    nm = (native or {}).get("metrics", {})
    if rec["mode"] != "native" and nm.get("to_first_answer_s") is not None:
        goal = 1.2 * nm["to_first_answer_s"] + 0.05
        m["goal_s"] = goal
        m["met"] = m["to_first_answer_s"] is not None and m["to_first_answer_s"] <= goal
        m["init_goal_s"] = 1.2 * nm["init_ctx_s"] + 0.05
    return m


def analyze(runs: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """Fill rec["metrics"] of every run (native records from this run, else from the baseline)."""
    nat: dict[tuple[str, str], dict[str, Any]] = {}
    natc: dict[tuple[str, str, int], dict[str, Any]] = {}
    for src in (baseline.get("runs", []), runs):
        for r in src:
            if r.get("mode") == "native" and not r.get("skipped"):
                nat[(r["section"], r["id"])] = r
                natc[(r["section"], r["id"], r.get("call", 0))] = r

    def native(section: str, ident: str, r: dict[str, Any]) -> dict[str, Any] | None:
        """The native run of the same call (merged documents), else any."""
        return natc.get((section, ident, r.get("call", 0))) or nat.get((section, ident))

    for r in runs:
        if r.get("skipped"):
            continue
        if r["section"] == "single":
            n = native("single", r["id"].split("@")[0], r)
            if r["mode"] == "native":
                r["metrics"] = analyze_single(r, None)
            else:
                if n is not None and "metrics" not in n:
                    n["metrics"] = analyze_single(n, None)
                r["metrics"] = analyze_single(r, n)
        elif r["section"] == "group":
            n = native("single", "mm", r)
            if n is not None and "metrics" not in n:
                n["metrics"] = analyze_single(n, None)
            r["metrics"] = analyze_group(r, n)
        elif r["section"] == "memory":
            r["metrics"] = analyze_memory(r)
        elif r["section"] == "startup":
            n = native("startup", "startup", r)
            if n is not None and "metrics" not in n:
                n["metrics"] = analyze_startup(n, None)
            r["metrics"] = analyze_startup(r, n if r["mode"] != "native" else None)
