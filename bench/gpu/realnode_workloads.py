"""The workload suite's tenants as pods on the real node (issue 21; ``realnode_run.py --parts
workloads``): the same workloads (bench/gpu/suite_wl.py) and the same analysis as
bench/gpu/suite.py, but each tenant is a pod placed by kvgpu on the real kubelet node, its limits
come from its claim through the device plugin, and the co-tenant schedule is the one the node
agent writes (the suite writes its own).

Pods ``wl-a`` (30 % of the SMs) and ``wl-b`` (70 %), each with ``WL_MEM_MIB`` of memory:

- native on the host first: gpt (training step loop), infer (a request every 50 ms, calibrated
  here to ~6 ms of GPU work), graphs (CUDA graph replays) and mm (the co-tenants' matmul), one at
  a time;
- in ``wl-a`` alone (``wl-b`` idle): gpt, infer with the native calibration, graphs;
- ``wl-a`` and ``wl-b`` at once, both mm, started together through a host folder both mount;
- two mm processes in ``wl-a`` (one container: together its 30 %), and for reference two on the
  host at once without a limit (their sum, % of one: what the context switches cost natively);
- ``wl-a`` replaced by ``wl-h`` (priority 0, no compute limit), then mm in ``wl-h`` and ``wl-b``
  (priority 1, 70 %) at once: low priority gets what high priority leaves, here nothing.

Judged as the suite judges (suite_analysis): gpt and graphs busy within ± 3 points of 30 %,
infer's p99 ≤ 1.2 × native, each co-tenant's throughput within ± 3 points of its documented
split (30 / 70; 100 / 0), the container's two processes together within ± 3 points of 30 %.
NVML is read on the host (bench/gpu/suite_nvml.py); a pod's processes are found there by their
command line, since a container's PIDs are not the host's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import suite_plan  # noqa: F401 (puts the tree under test on sys.path)
from kvgpu.demo import wait
from kvgpu.devcluster import Cluster
from realnode_kit import TORCH_PY, running, say, seed_pod, show
from suite_analysis import analyze_group, analyze_single, rate, rnd
from suite_nvml import NvmlSampler

WL_MEM_MIB = 30000
SECS = 6
SYNC = Path("/tmp/kvgpu-wl-sync")  # host folder, /sync in both pods: ready and go files
PODS = {"wl-a": 30, "wl-b": 70}
HIGH = "wl-h"  # priority 0 and no compute limit, in place of wl-a for the priority pair
HERE = Path(__file__).resolve().parent
GROUPS = itertools.count()


def wl_pod(name: str, cores: int | None, priority: int | None = None) -> dict[str, Any]:
    pod = seed_pod(name, WL_MEM_MIB, cores)
    ctr = pod["spec"]["containers"][0]  # type: ignore[index]
    if priority is not None:  # HAMi's form, as the seed's limits
        ctr["resources"]["limits"]["nvidia.com/priority"] = priority
    ctr["volumeMounts"].append({"name": "sync", "mountPath": "/sync"})
    pod["spec"]["volumes"].append(  # type: ignore[index]
        {"name": "sync", "hostPath": {"path": str(SYNC), "type": "DirectoryOrCreate"}})
    return pod


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except ValueError:
                break
    return {"error": (text.strip().splitlines() or ["no output"])[-1][-300:]}


def wl_argv(kind: str, calib: int | None, tag: str, sync: str) -> list[str]:
    argv = [kind, str(SECS)]
    if calib is not None:
        argv += ["--calib", str(calib)]
    if tag:
        argv += ["--ready", f"{sync}/{tag}.ready", "--go", f"{sync}/go"]
    return argv


def host_pid(tag: str) -> int | None:
    """The host PID of the process whose command line names ``{tag}.ready`` (a pod's workload)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the workload's python itself, not the kubectl exec that names the same arguments
        if len(cmd) > 1 and cmd[1].endswith(b"suite_wl.py") and f"/{tag}.ready".encode() in b" ".join(cmd):
            return int(p.name)
    return None


def run_started(procs: dict[str, subprocess.Popen[str]]) -> dict[str, int | None]:
    """Waits until every tagged process touched its ready file (or one ended), notes each host PID,
    then starts all."""
    def ready() -> bool:
        return all((SYNC / f"{t}.ready").exists() for t in procs) or any(p.poll() is not None for p in procs.values())

    wait(ready, 240, "every workload warmed up")
    pids = {t: host_pid(t) for t in procs}
    (SYNC / "go").touch()
    return pids


def finish(procs: dict[str, subprocess.Popen[str]], pids: dict[str, int | None], errs: dict[str, IO[bytes]]
           ) -> dict[str, dict[str, Any]]:
    out = {}
    for tag, p in procs.items():
        try:
            stdout, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:  # a pod's workload outlives its kubectl exec: ended too
            if pids.get(tag):
                with contextlib.suppress(OSError):
                    os.kill(pids[tag], signal.SIGKILL)  # type: ignore[arg-type]
            p.kill()
            stdout, _ = p.communicate()
        res = last_json(stdout)
        errs[tag].seek(0)
        stderr = errs[tag].read().decode(errors="replace")
        if "error" in res and stderr.strip():
            res["error"] = stderr.strip().splitlines()[-1][-300:]
        if pids.get(tag) not in (None, res.get("pid")):  # a pod's: NVML knows its host PID
            res["pid_in_container"], res["pid"] = res.get("pid"), pids[tag]
        out[tag] = res
    return out


def launch(c: Cluster, where: str, kind: str, calib: int | None, tag: str, err: IO[bytes]) -> subprocess.Popen[str]:
    """A workload on the host (where="host") or in a pod through ``kubectl exec``; its stderr to
    ``err`` (read at the end: a pipe could fill during a long warm-up and block it)."""
    if where == "host":
        cmd = [TORCH_PY, str(HERE / "suite_wl.py"), *wl_argv(kind, calib, tag, str(SYNC))]
    else:
        cmd = [str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}", "exec", where, "--",
               TORCH_PY, "/repo/bench/gpu/suite_wl.py", *wl_argv(kind, calib, tag, "/sync")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)


def run_group(c: Cluster, sampler: NvmlSampler, members: list[tuple[str, str]], calib: int | None = None
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``members``: (where, kind); all started at once. Returns their results (in that order) and
    the samples of the window they all ran in."""
    SYNC.mkdir(parents=True, exist_ok=True)
    for f in SYNC.iterdir():  # emptied, not replaced: the pods have this folder mounted
        f.unlink()
    n = next(GROUPS)  # tags of their own: a workload left over from another group never matches
    tags = [f"g{n}-{where}-{kind}-{i}" for i, (where, kind) in enumerate(members)]
    errs = {t: tempfile.TemporaryFile() for t in tags}
    procs = {t: launch(c, where, kind, calib, t, errs[t]) for t, (where, kind) in zip(tags, members, strict=True)}
    pids = run_started(procs)
    got = finish(procs, pids, errs)
    for f in errs.values():
        f.close()
    for tag, res in got.items():
        print(f"{tag}: {json.dumps({k: v for k, v in res.items() if k not in ('marks', 'lat_ms')})[:600]}", flush=True)
    ok = [r for r in got.values() if "t0" in r]
    a = max((r["t0"] for r in ok), default=0.0)
    b = min((r["t1"] for r in ok), default=0.0)
    time.sleep(1.5)  # the sampler's last samples of the window
    return [got[t] for t in tags], {"window": [a, b], "samples": sampler.window(a, b)}


def group(c: Cluster, sampler: NvmlSampler, native_mm: dict[str, Any], pods: list[tuple[str, int, int]],
          one_container: bool = False) -> dict[str, Any]:
    """mm in each of ``pods`` (name, priority, cores) at once, judged as the suite's groups."""
    got, w = run_group(c, sampler, [(name, "mm") for name, _, _ in pods])
    tenants = [{"prio": prio, "cores": cores, "result": r} for (_, prio, cores), r in zip(pods, got, strict=True)]
    rec = {"mode": "kvgpu", "one_container": one_container, **w, "tenants": tenants}
    return dict(rnd(analyze_group(rec, native_mm)))


def single(c: Cluster, sampler: NvmlSampler, where: str, kind: str, limit: int | None,
           calib: int | None = None) -> dict[str, Any]:
    got, w = run_group(c, sampler, [(where, kind)], calib)
    return {"mode": "native" if where == "host" else "kvgpu", "limit": limit, "result": got[0],
            "samples": w["samples"]}


def workloads(c: Cluster, res: dict[str, Any]) -> None:
    """Runs the part; res["workloads"] gets each case's metrics and goals."""
    out: dict[str, Any] = {}
    res["workloads"] = out
    SYNC.mkdir(parents=True, exist_ok=True)
    for name, cores in PODS.items():
        c.kubectl("apply", "-f", "-", input=json.dumps(wl_pod(name, cores)))
    sampler = NvmlSampler()
    sampler.start()
    try:
        say("native on the host: gpt, infer, graphs, mm (one at a time)")
        native = {k: single(c, sampler, "host", k, None) for k in ("gpt", "infer", "graphs", "mm")}
        for rec in native.values():
            rec["metrics"] = analyze_single(rec, None)
        out["native"] = {k: rnd(v["metrics"]) for k, v in native.items()}
        running(c, *PODS, timeout=180)
        show(c, "get", "pods", "-o", "wide")
        show(c, "get", "vgpuclaims", "-o", "wide")
        show(c, "exec", "wl-a", "--", "/usr/bin/sh", "-c", "env | grep -E 'KVGPU|CUDA_DEVICE' | sort")
        say("wl-a (30 %) alone: gpt, infer, graphs")
        for kind in ("gpt", "infer", "graphs"):
            calib = native["infer"]["result"].get("calib") if kind == "infer" else None
            rec = single(c, sampler, "wl-a", kind, PODS["wl-a"], calib)
            out[f"{kind}-30"] = rnd(analyze_single(rec, native[kind]))
        say("wl-a (30 %) and wl-b (70 %) at once: mm in both")
        out["pair-30-70"] = group(c, sampler, native["mm"], [(n, 1, PODS[n]) for n in PODS])
        say("two mm processes in wl-a: the container's 30 % together")
        out["procs2-30"] = group(c, sampler, native["mm"], [("wl-a", 1, PODS["wl-a"])] * 2, one_container=True)
        # the reference (not judged): what two processes at once keep of one natively, the cost of
        # the card switching between their contexts, which a limit cannot give back
        got, w = run_group(c, sampler, [("host", "mm"), ("host", "mm")])
        base = native["mm"]["metrics"]["its"]
        a, b = w["window"]
        out["native-two-processes-sum"] = rnd(sum(rate(r, a, b) or 0.0 for r in got) * 100 / base if base else None)
        say(f"{HIGH} (priority 0, no compute limit) in place of wl-a, beside wl-b (priority 1, 70 %): mm in both")
        c.kubectl("delete", "pod", "wl-a", "--wait=true", "--timeout=60s", check=False)
        c.kubectl("apply", "-f", "-", input=json.dumps(wl_pod(HIGH, None, priority=0)))
        running(c, HIGH, timeout=180)
        show(c, "get", "vgpuclaims", "-o", "wide")
        out["prio-h0none-b70"] = group(c, sampler, native["mm"], [(HIGH, 0, 0), ("wl-b", 1, PODS["wl-b"])])
    finally:
        sampler.stop()
        out["nvml_errors"] = sampler.errors
        c.kubectl("delete", "pod", *PODS, HIGH, "--ignore-not-found", "--wait=true", "--timeout=60s", check=False)
        shutil.rmtree(SYNC, ignore_errors=True)
    print(json.dumps({k: v for k, v in out.items() if k != "native"}, indent=1)[:6000], flush=True)


def workloads_ok(res: dict[str, Any]) -> bool:
    w = res.get("workloads", {})
    pairs = [w.get(k, {}).get("tenants", []) for k in ("pair-30-70", "prio-h0none-b70")]
    return bool(w.get("gpt-30", {}).get("met_busy") and w.get("graphs-30", {}).get("met_busy")
                and w.get("infer-30", {}).get("met_latency") and w.get("procs2-30", {}).get("met")
                and all(len(p) == 2 and all(t.get("met") for t in p) for p in pairs))
