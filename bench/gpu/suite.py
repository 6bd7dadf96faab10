"""The workload suite (issue 21 item 4): every workload natively, under HAMi-core and under kvgpu.

    python3 bench/gpu/suite.py            (bench/gpu/suite.sh builds the libraries, then runs this)
    python3 bench/gpu/suite.py --report RESULTS.json [--out DIR]   re-render tables and plot
    python3 bench/gpu/suite.py --selftest [--out DIR]              the whole pipeline on fake
                                                                   workloads and a fake NVML

Environment: OUT (results folder), MODES (default "native hami kvgpu"), PARTS (default
"memory startup single group"), ONLY (workload or group ids, default all), LIMITS (a single
workload's limits instead of its own, e.g. "gpt:30,50,80"; 100: no compute limit), SECS (measured
seconds per workload, default 4), SUITE_BUDGET_S with SUITE_T0 (skip what no longer fits, default
unlimited), BASELINE (results.json of an earlier run whose native runs serve when MODES has no
native), KVGPU_TREE (the kvgpu tree under test, default this one), KVGPU_LIB, HAMI_LIB, SUITE_CU
(the built libraries and driver-API program), SUITE_STATIC_SCHEDULE=1 (no agent Scheduler), PY.

MODES may include mps: the kvgpu shim with mode=mps claims, as MPS clients of one MPS control
daemon this run starts for the card (private pipe and log folders) and quits at the end.

Every run is one or more processes on the card alone. A sampler thread in this process (never
preloaded) reads NVML: nvmlDeviceGetSamples(GPU_UTILIZATION) — the driver's own record of the
fraction of each sample period in which a kernel ran, every sample period, so nothing between
polls is lost — for the card's busy share; nvmlDeviceGetProcessUtilization for each process's
share (co-tenants); nvmlDeviceGetComputeRunningProcesses_v3 at 20 Hz for per-process memory;
nvmlDeviceGetUtilizationRates at 10 Hz as a cross-check. kvgpu co-tenants get a schedule file
written with the node agent's own code (kvgpu.agent.schedule.layout/encode/write_schedule), as the
agent would write it for those claims on a real node.

The code, beside this entry point: suite_plan.py (the cases, Config, the order and cost of runs),
suite_nvml.py (the sampler), suite_fake.py (the fake sampler and workloads of --selftest),
suite_run.py (the modes' environments, the agent's schedule, the MPS daemon, the runner),
suite_analysis.py (shares, rates, statistics) and suite_report.py (tables, plot, result files).
"""


from __future__ import annotations

import argparse
import json
import lzma
import os
from pathlib import Path
from typing import Any

from suite_fake import FakeSampler, fake_cu, fake_wl
from suite_nvml import NvmlSampler
from suite_plan import ROOT, Config
from suite_report import write_outputs
from suite_run import run_suite


def read_json(path: Path) -> Any:
    """A results or raw file, plain or xz-compressed (``raw.json.xz``, as suite.sh packs it)."""
    if path.suffix == ".xz":
        with lzma.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--report")
    ap.add_argument("--merge", nargs="+", metavar="RAW_JSON",
                    help="one report of several calls' raw.json (a later call's run fills a skipped one)")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--fake-wl", nargs="+")
    ap.add_argument("--fake-cu", nargs="+")
    ap.add_argument("--calib")
    ap.add_argument("--ready")
    ap.add_argument("--go")
    a = ap.parse_args()
    if a.fake_wl:
        fake_wl(a.fake_wl[0], float(a.fake_wl[1]), a.calib, a.ready, a.go)
        return
    if a.fake_cu:
        fake_cu(a.fake_cu)
        return
    out = Path(a.out or os.environ.get("OUT") or ROOT / "bench/results/raw/suite")
    if a.merge:
        docs = [read_json(Path(p)) for p in a.merge]
        merged: list[dict[str, Any]] = []
        doc = {"env": {**docs[0]["env"], "calls": [d["env"] for d in docs]}, "runs": merged}
        for i, d in enumerate(docs, 1):
            for r in d["runs"]:
                r["call"] = i
                same = [x for x in merged if (x["section"], x["id"], x.get("mode")) ==
                        (r["section"], r["id"], r.get("mode"))]
                if r.get("skipped") and same:
                    continue
                for x in same:
                    if x.get("skipped"):
                        merged.remove(x)
                merged.append(r)  # the tables show a call's first run; each call keeps its natives
        for r in merged:
            r.pop("metrics", None)
        out.mkdir(parents=True, exist_ok=True)
        write_outputs(doc, out)
        print((out / "summary.md").read_text())
        return
    if a.report:
        doc = read_json(Path(a.report))
        for r in doc["runs"]:
            r.pop("metrics", None)
        out.mkdir(parents=True, exist_ok=True)
        if os.environ.get("BASELINE"):
            doc["_baseline"] = json.loads(Path(os.environ["BASELINE"]).read_text())
        write_outputs(doc, out)
        print((out / "summary.md").read_text())
        return
    cfg = Config.from_env(out, fake=a.selftest)
    run_suite(cfg, FakeSampler() if a.selftest else NvmlSampler())
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
