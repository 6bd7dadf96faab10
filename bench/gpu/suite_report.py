"""The workload suite's report: the markdown tables, the plot and the written result files
(see suite.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from suite_analysis import analyze, rnd
from suite_plan import GROUPS, MEMORY_LIMITS, SINGLES, START_LIMIT, START_RACERS, START_ROUNDS

# ------------------------------------------------------------------------------------ reports



def single_limits(doc: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """Each single workload and the limits it ran at: its own, or the run's LIMITS for it."""
    chosen = doc.get("env", {}).get("limits") or {}
    return [(ident, list(chosen.get(ident, limits))) for ident, _kind, limits in SINGLES]

def f(x: Any, n: int = 1, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, (int, float)):
        return f"{x:.{n}f}{suffix}"
    return str(x)


def pick(runs: list[dict[str, Any]], section: str, ident: str, mode: str) -> dict[str, Any] | None:
    for r in runs:
        if r.get("section") == section and r.get("id") == ident and r.get("mode") == mode:
            return r
    return None


def err_text(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    if r.get("skipped"):
        return f"skipped ({r['skipped']})"
    m = r.get("metrics", {})
    e = m.get("failed") or m.get("error")
    return "failed: " + str(e).replace("|", "/").replace("\n", " ")[:160] if e else ""


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    L: list[str] = []
    env = doc.get("env", {})
    L.append(f"# kvgpu workload suite — {env.get('date', '')}\n")
    L.append(f"card: {env.get('card', '')} `{env.get('uuid', '')}`; secs per workload: {env.get('secs')}; "
             f"modes: {' '.join(env.get('modes', []))}; NVML sample period "
             f"{f(env.get('sample_period_s'), 3)} s; sampler errors: {env.get('sampler_errors') or 'none'}\n")
    L.append("## Compute, one tenant\n")
    L.append("busy = the card's busy share (NVML GPU-utilization samples, time-weighted over the measured "
             "window); share = throughput as % of native; target = min(limit, native busy); err = busy − "
             "target in points; per-second = busy share of each whole second (min/max/sd). Goal: busy "
             "within ± 3 points of the limit; for a tenant that wants less (native busy < limit), "
             "busy between native busy − 3 and limit + 3 and share ≥ 97 %.\n")
    L.append("| workload | limit | native its (busy %) | mode | share % | busy % | target | err pts | "
             "per-second busy min/max/sd | goal met (mean / every s) | note |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for ident, limits in single_limits(doc):
        nat = pick(runs, "single", ident, "native")
        nm = (nat or {}).get("metrics", {})
        ntxt = f"{f(nm.get('its'), 2)} {nm.get('unit') or ''}/s ({f(nm.get('busy'))} %)" if nat else "–"
        if not limits:
            L.append(f"| {ident} | – | {ntxt} | native | 100 | {f(nm.get('busy'))} | | | "
                     f"{fmt_stats(nm.get('busy_sec_stats'))} | | {err_text(nat)} |")
        for lim in limits:
            for mode in doc["env"].get("modes", []):
                if mode == "native":
                    continue
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                m = (r or {}).get("metrics", {})
                met = f"{f(m.get('met_busy'))} / {f(m.get('met_even'))}" if "met_busy" in m else ""
                L.append(f"| {ident} | {lim} % | {ntxt} | {mode} | {f(m.get('share'))} | {f(m.get('busy'))} | "
                         f"{f(m.get('target_busy'))} | {f(m.get('err_pts'), 1)} | "
                         f"{fmt_stats(m.get('busy_sec_stats'))} | {met} | {err_text(r)} |")
    L.append("\n## Latency-sensitive inference (a ~6 ms request every 50 ms)\n")
    L.append("| mode | limit | p50 ms | p99 ms | max ms | p99 ÷ native | goal p99 ≤ 1.2 × native |")
    L.append("|---|---|---|---|---|---|---|")
    for mode in doc["env"].get("modes", []):
        r = pick(runs, "single", "infer" if mode == "native" else "infer@30", mode)
        m = (r or {}).get("metrics", {})
        L.append(f"| {mode} | {'–' if mode == 'native' else '30 %'} | {f(m.get('p50_ms'), 2)} | "
                 f"{f(m.get('p99_ms'), 2)} | {f(m.get('max_ms'), 2)} | {f(m.get('p99_vs_native'), 2)} | "
                 f"{f(m.get('met_latency')) if 'met_latency' in m else ''} {err_text(r)} |")
    L.append("\n## Co-tenants (each tenant the fp32 matmul loop; share = % of the native single tenant)\n")
    L.append("| group | mode | tenant (prio, limit) | share % | expected % | err pts | per-process busy % | "
             "per-second share min/max | met | note |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for gid, tenants in [*GROUPS, ("pair-native", [(1, 0), (1, 0)])]:
        for mode in doc["env"].get("modes", []):
            if (gid == "pair-native") != (mode == "native"):
                continue
            r = pick(runs, "group", gid, mode)
            ts = (r or {}).get("metrics", {}).get("tenants") or [{}] * len(tenants)
            for i, ((pr, c), m) in enumerate(zip(tenants, ts, strict=False)):
                st = m.get("share_sec_stats") or {}
                L.append(f"| {gid} | {mode} | {chr(65 + i)} ({pr}, {c or 'none'}) | {f(m.get('share'))} | "
                         f"{f(m.get('expected'))} | {f(m.get('err_pts'))} | {f(m.get('proc_busy'))} | "
                         f"{f(st.get('min'))}/{f(st.get('max'))} | {f(m.get('met')) if 'met' in m else ''} | "
                         f"{err_text(r) if i == 0 else ''} |")
            g = (r or {}).get("metrics", {})
            if "expected_total" in g:  # processes of one container: their sum is judged
                bs = g.get("busy_sec_stats") or {}
                L.append(f"| {gid} | {mode} | the container ({len(tenants)} processes) | {f(g.get('sum_share'))} | "
                         f"{f(g.get('expected_total'))} | {f(g.get('err_pts_total'))} | card {f(g.get('busy'))} "
                         f"({f(bs.get('min'))}–{f(bs.get('max'))} a second) | | "
                         f"{f(g.get('met')) if 'met' in g else ''} | |")
    L.append("\n## Memory limit on paths the hooks do not see (NVML per-process peak, read outside)\n")
    L.append("| case | mode | limit MiB | NVML peak MiB | over limit MiB | chunks of 256 MiB granted | "
             "details | peak ≤ limit |")
    L.append("|---|---|---|---|---|---|---|---|")
    for case in MEMORY_LIMITS:
        for mode in doc["env"].get("modes", []):
            r = pick(runs, "memory", case, mode)
            m = (r or {}).get("metrics", {})
            det = ", ".join(f"{k} {m[k]}" for k in ("launch_rc", "limit_rc", "kernel_rc", "contexts", "ctx_rc",
                                                     "mallocs_ok", "last_rc") if k in m)
            L.append(f"| {case} | {mode} | {(r or {}).get('limit_mib') or '–'} | {f(m.get('nvml_peak_mib'), 0)} | "
                     f"{f(m.get('over_limit_mib'), 0)} | {f(m.get('chunks'), 0)} | {det} {err_text(r)} | "
                     f"{f(m.get('met')) if 'met' in m else ''} |")
    L.append(f"\n## Start-up under contention ({START_RACERS} processes of the container racing "
             f"64 MiB allocations at a {START_LIMIT} MiB limit; {START_ROUNDS} newcomers, medians of those that "
             "got a context; a context refused for want of memory is counted, not timed)\n")
    L.append("| mode | contexts granted | exec→main s | cuInit s | context s | first cuMemAlloc s | "
             "spawn → first answer s | goal (1.2 × native + 50 ms) | met |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for mode in doc["env"].get("modes", []):
        r = pick(runs, "startup", "startup", mode)
        m = (r or {}).get("metrics", {})
        got = f"{m['contexts']} of {m['rounds']}" if "contexts" in m else "–"
        L.append(f"| {mode} | {got} | {f(m.get('spawn_to_main_s'), 3)} | {f(m.get('init_s'), 3)} | "
                 f"{f(m.get('ctx_s'), 3)} | "
                 f"{f(m.get('first_alloc_s'), 4)} | {f(m.get('to_first_answer_s'), 3)} | {f(m.get('goal_s'), 3)} | "
                 f"{f(m.get('met')) if 'met' in m else ''} {err_text(r)} |")
    return "\n".join(L) + "\n"


def fmt_stats(s: dict[str, Any] | None) -> str:
    if not s or s.get("min") is None:
        return "–"
    return f"{s['min']:.0f}/{s['max']:.0f}/{s['sd']:.1f}"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    modes = [m for m in doc["env"].get("modes", []) if m != "native"]
    colors = {"hami": "tab:orange", "kvgpu": "tab:blue", "mps": "tab:green", "native": "tab:gray"}
    fig, ax = plt.subplots(2, 2, figsize=(16, 10))
    # (a) busy share per single workload
    labels: list[str] = []
    x = 0
    a = ax[0][0]
    for ident, limits in single_limits(doc):
        for lim in limits:
            nat = pick(runs, "single", ident, "native")
            nb = (nat or {}).get("metrics", {}).get("busy")
            for j, mode in enumerate(modes):
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                v = (r or {}).get("metrics", {}).get("busy")
                if v is not None:
                    a.bar(x + j * 0.4 - 0.2, v, 0.38, color=colors.get(mode, "k"),
                          label=mode if not labels else None)
            tgt = min(lim, nb) if nb is not None else lim
            a.plot([x - 0.45, x + 0.45], [tgt, tgt], "k-", lw=2)
            if nb is not None:
                a.plot([x], [nb], "v", color="tab:gray")
            labels.append(f"{ident}\n@{lim}%")
            x += 1
    a.set_xticks(range(len(labels)), labels, fontsize=7)
    a.set_ylabel("card busy %  (black: target; ▼ native)")
    a.set_title("one tenant: busy share vs target")
    if a.patches:
        a.legend()
    # (b) per-second busy share, kvgpu and HAMi
    b = ax[0][1]
    for ident, limits in single_limits(doc):
        for lim in limits:
            for mode in modes:
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                sec = (r or {}).get("metrics", {}).get("busy_sec") or []
                if sec:
                    b.plot(range(1, len(sec) + 1), sec, "-" if mode == "kvgpu" else ":", marker=".", alpha=0.7,
                           label=f"{ident}@{lim} {mode}")
    b.set_xlabel("second of the measured window")
    b.set_ylabel("busy %")
    b.set_title("per-second busy share (solid kvgpu, dotted HAMi-core)")
    if b.lines:
        b.legend(fontsize=6, ncol=2)
    # (c) co-tenants
    c = ax[1][0]
    labels = []
    x = 0
    for gid, tenants in GROUPS:
        for i, (pr, lim) in enumerate(tenants):
            for j, mode in enumerate(modes):
                r = pick(runs, "group", gid, mode)
                ts = (r or {}).get("metrics", {}).get("tenants") or []
                if i < len(ts) and ts[i].get("share") is not None:
                    c.bar(x + j * 0.4 - 0.2, ts[i]["share"], 0.38, color=colors.get(mode))
                if i < len(ts) and ts[i].get("expected") is not None and mode == "kvgpu":
                    c.plot([x - 0.45, x + 0.45], [ts[i]["expected"]] * 2, "k-", lw=2)
            labels.append(f"{gid}\n{chr(65 + i)} p{pr} {lim or '-'}%")
            x += 1
    c.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60)
    c.set_ylabel("% of native single-tenant throughput")
    c.legend(handles=[matplotlib.patches.Patch(color=colors[m], label=m) for m in modes if m in colors])
    c.set_title("co-tenants (black: documented split)")
    # (d) memory peaks
    d = ax[1][1]
    labels = []
    x = 0
    for case in MEMORY_LIMITS:
        for mode in doc["env"].get("modes", []):
            r = pick(runs, "memory", case, mode)
            v = (r or {}).get("metrics", {}).get("nvml_peak_mib")
            if v is not None:
                d.bar(x, v, 0.7, color=colors.get(mode))
            lim = MEMORY_LIMITS[case]
            d.plot([x - 0.4, x + 0.4], [lim, lim], "r-", lw=2)
            labels.append(f"{case}\n{mode}")
            x += 1
    d.set_xticks(range(len(labels)), labels, fontsize=7)
    d.set_ylabel("NVML per-process peak MiB (red: limit)")
    d.set_title("memory cases")
    fig.suptitle(f"kvgpu workload suite, {doc['env'].get('card', '')}, {doc['env'].get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BULKY = ("marks", "done_ms", "lat_ms")


def slim_run(r: dict[str, Any]) -> dict[str, Any]:
    """A run without its samples and per-unit lists (those stay in raw.json)."""
    out = {k: v for k, v in r.items() if k != "samples"}
    if isinstance(r.get("result"), dict):
        out["result"] = {k: v for k, v in r["result"].items() if k not in BULKY}
    if "tenants" in r:
        out["tenants"] = [{**t, "result": {k: v for k, v in t["result"].items() if k not in BULKY}}
                          for t in r["tenants"]]
    return out


def write_outputs(doc: dict[str, Any], out: Path) -> None:
    analyze(doc["runs"], doc.get("_baseline", {}))
    slim = {k: v for k, v in doc.items() if k != "_baseline"}
    (out / "raw.json").write_text(json.dumps(rnd(slim, 4)))
    slim = {**slim, "runs": [slim_run(r) for r in slim["runs"]]}
    (out / "results.json").write_text(json.dumps(rnd(slim, 3), indent=1))
    (out / "summary.md").write_text(markdown(slim))
    try:
        plot(slim, out / "suite.png")
    except Exception as e:  # the numbers matter more than the picture
        (out / "plot-error.txt").write_text(repr(e))
