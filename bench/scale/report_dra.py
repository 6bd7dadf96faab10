"""The DRA part of the scale report (:mod:`bench.scale.report`): DRA-mode bursts of a run
(``--dra``, kind ``dra``) next to the extender-mode bursts of the same size and mode and the
no-GPU baselines of each phase."""

from __future__ import annotations

from typing import Any


def _f(x: float | None, nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _requests(b: dict[str, Any]) -> float:
    return float(b.get("api_requests_per_pod_total") or sum((b.get("api_requests_per_pod") or {}).values()))


def _apiserver_ms(b: dict[str, Any]) -> float | None:
    v = b.get("apiserver_cpu_ms_per_pod")
    return None if v is None else float(v)


def scheduling_ms(b: dict[str, Any]) -> float | None:
    """CPU ms per pod spent choosing nodes and allocating: for a DRA burst the default
    kube-scheduler (its DRA plugin allocates), for an extender burst the kvgpu kube-scheduler
    plus the operator (its extender filters and binds); None where not sampled."""
    cpu = b.get("cpu_seconds_by_process") or {}
    names = (("scheduler-default-scheduler",) if b["kind"] == "dra"
             else ("scheduler-kvgpu-scheduler", "operator"))
    if not all(n in cpu for n in names):
        return None
    return sum(cpu[n] for n in names) * 1000 / max(b["pods"], 1)


def _rate(b: dict[str, Any] | None) -> float | None:
    return None if not b or not b.get("bound_per_s") else float(b["bound_per_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def dra_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per DRA burst, in run order: ``{"mode", "pods", "dra", "dra_baseline", "gpu",
    "gpu_baseline"}`` with each burst's record (``None`` where the run has none): the baseline of
    each mode is the no-GPU burst of the same mode and size run just before it in its phase."""
    last_base: dict[tuple[str, str, int], dict[str, Any]] = {}
    gpu: dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any] | None]] = {}
    rows = []
    for b in run.get("bursts", []):
        key = (b["mode"], b["pods"])
        phase = b.get("phase", "extender")
        if b["kind"] == "baseline":
            last_base[(phase, *key)] = b
        elif b["kind"] == "gpu":
            gpu[key] = (b, last_base.get(("extender", *key)))
        elif b["kind"] == "dra":
            g, gb = gpu.get(key, (None, None))
            rows.append({"mode": key[0], "pods": key[1], "dra": b, "dra_baseline": last_base.get(("dra", *key)),
                         "gpu": g, "gpu_baseline": gb})
    return rows


def _claims(b: dict[str, Any]) -> str:
    a = b.get("dra_allocations")
    if not a:
        return "–"
    over = a.get("over_capacity") or []
    return (f"{a['allocated']}/{a['claims']} on {a['devices_used']} devices, ≤ {a['max_claims_per_device']} per "
            f"device, {'none' if not over else len(over)} over capacity")


def dra_table(run: dict[str, Any]) -> list[str]:
    """DRA against extender mode per burst: pods/s (and each against its phase's no-GPU
    baseline), requests and kube-apiserver CPU per pod, the DRA pod's requests by verb and
    resource and what kube-scheduler allocated. Empty when the run has no DRA bursts."""
    rows = dra_rows(run)
    if not rows:
        return []
    out = ["| burst | DRA pods/s (Bound) | extender pods/s (Bound) | DRA / extender | no-GPU pods/s: DRA phase / "
           "extender phase | DRA / its baseline | DRA create→Bound p50 / p99 (s) | requests per pod: no GPU / DRA / "
           "extender | kube-apiserver CPU per pod (ms): no GPU / DRA / extender | scheduling CPU per pod (ms): DRA / "
           "extender | DRA requests by verb and resource | claims allocated |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        d, g, db, gb = r["dra"], r["gpu"], r["dra_baseline"], r["gpu_baseline"]
        cb = d.get("create_to_bound_ms") or {}
        cbs = f"{cb['p50'] / 1000:.1f} / {cb['p99'] / 1000:.1f}" if r["mode"] == "stream" and cb else "–"
        reqs = " / ".join(f"{_requests(x):g}" if x else "–" for x in (db, d, g))
        cpu = " / ".join(_f(_apiserver_ms(x)) if x else "–" for x in (db, d, g))
        verbs = ", ".join(f"{k} {v:g}" for k, v in (d.get("api_requests_per_pod") or {}).items()) or "–"
        out.append(f"| {r['mode']} {r['pods']} | {_f(_rate(d))} | {_f(_rate(g))} | {_f(_ratio(_rate(d), _rate(g)), 2)} "
                   f"| {_f(_rate(db))} / {_f(_rate(gb))} | {_f(_ratio(_rate(d), _rate(db)), 2)} | {cbs} | {reqs} "
                   f"| {cpu} | {_f(scheduling_ms(d))} / {_f(scheduling_ms(g) if g else None)} | {verbs} "
                   f"| {_claims(d)} |")
    return out


def dra_summary(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The goal table's row for issue 18 item 6 (DRA mode against extender mode, same run):
    ``runs`` are (title, run) pairs; empty when no run has DRA bursts."""
    parts = []
    for title, run in runs:
        rows = [r for r in dra_rows(run) if _rate(r["dra"]) and _rate(r["gpu"])]
        if not rows:
            continue
        ratio = [_ratio(_rate(r["dra"]), _rate(r["gpu"])) or 0.0 for r in rows]
        dv = [_rate(r["dra"]) or 0.0 for r in rows]
        gv = [_rate(r["gpu"]) or 0.0 for r in rows]
        req = [_requests(r["dra"]) for r in rows]
        ms = [x for x in (_apiserver_ms(r["dra"]) for r in rows) if x is not None]
        gms = [x for x in (_apiserver_ms(r["gpu"]) for r in rows) if x is not None]
        sd = [x for x in (scheduling_ms(r["dra"]) for r in rows) if x is not None]
        sg = [x for x in (scheduling_ms(r["gpu"]) for r in rows) if x is not None]
        over = sum(len((r["dra"].get("dra_allocations") or {}).get("over_capacity") or []) for r in rows)
        cpu = (f", kube-apiserver CPU {min(ms):.1f}-{max(ms):.1f} ms per DRA pod against {min(gms):.1f}-{max(gms):.1f} "
               "ms per extender pod" if ms and gms else "")
        if sd and sg:
            cpu += (f"; scheduling CPU {min(sd):.1f}-{max(sd):.1f} ms per DRA pod (kube-scheduler) against "
                    f"{min(sg):.1f}-{max(sg):.1f} ms per extender pod (kube-scheduler + operator)")
        parts.append(f"{title}: DRA {min(dv):.0f}-{max(dv):.0f} pods/s against extender {min(gv):.0f}-{max(gv):.0f}, "
                     f"{min(ratio):.2f}-{max(ratio):.2f} × ({len(rows)} bursts); {min(req):g}-{max(req):g} API "
                     f"requests per DRA pod{cpu}; {'no' if not over else over} device over capacity")
    if not parts:
        return []
    return ["| DRA mode next to extender mode, same run (issue 18) | **measured**: " + "; ".join(parts) + " |"]
