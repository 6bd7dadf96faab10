"""The node-side backstop on the GPU (``--parts backstop`` of bench/gpu/realnode_run.py).

Two tenants of 1000 MiB slices try to hold 2000 MiB of the card, each with the agent's defaults
(``--unenforced kill``, ``--over-limit kill``, 10 s grace, 64 MiB slack, checks every 5 s):

- ``escaper`` (bench/gpu/escape_direct.c) takes glibc's own ``dlsym`` and binds the driver's
  functions directly: its allocations never pass the shim, and only the agent can stop it;
- ``zeroer`` keeps the shim but zeroes its own region's counters before every block (the region is
  writable by the container), so its shim grants past the limit; NVML still sees the memory.

Each is expected to get past its limit and then be killed (exit 137) within 25 s, with an Event
``GPUUnenforcedKilled`` (escaper) or ``GPUOverLimitKilled`` (zeroer; or ``GPUOOMKilled``, its own
shim's OOM killer, once NVML reconciliation restored its charge) on its pod.

Then compute: ``spinner`` (a 30 % slice) runs ``escape_direct spin``, a kernel keeping every SM
busy launched around the shim, while ``steady`` (also 30 %) runs the seed's matmul under its
shim. The spinner is expected to be killed within 45 s with ``GPUOverCoresKilled`` (the agent's
30 s window of NVML's per-process SM samples, 20 points of slack); the steady tenant, busy at
its limit the whole time, never.
:func:`kill_events` lists every kill Event of the run, so the seed's and the MPS part's
workloads are checked never to have been killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

from kvgpu.devcluster import Cluster
from realnode_kit import TORCH_PY, running, say, seed_pod, show

KILL_REASONS = ("GPUUnenforcedKilled", "GPUOverLimitKilled", "GPUOverCoresKilled", "GPUOOMKilled")
TENANTS = ("escaper", "zeroer", "spinner")
LIMIT_MIB, TARGET_MIB, HOLD_S, SPIN_S = 1000, 2000, 60, 50
PARTS = os.environ.get("KVGPU_RN_BACKSTOP", "memory,compute")  # which tenants run
ESCAPER = "/repo/bench/gpu/_build/escape_direct"  # bench/gpu/escape_direct.c, built by realnode.sh


def attempt(c: Cluster, pod: str, command: str) -> dict[str, Any]:
    """Run the hostile ``command`` in ``pod``; how far it got, whether and how fast it was stopped."""
    argv = [str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}", "exec", pod, "--", "/usr/bin/sh", "-c", command]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=HOLD_S + 90, check=False)
    ended = time.time()
    print(f"$ kubectl exec {pod} -- sh -c {command!r}\n{(p.stdout + p.stderr).rstrip()[-3000:]}", flush=True)
    lines = []
    for ln in p.stdout.splitlines():
        try:
            lines.append(json.loads(ln))
        except ValueError:
            continue
    blocks = [x for x in lines if "done" not in x]
    # past the limit: memory over it, or (spin) the first second of launches
    over = next((x["t"] for x in blocks if x.get("mib", 0) > LIMIT_MIB + 64 or "launches" in x), None)
    return {"exit": p.returncode, "done": any(x.get("done") for x in lines),
            "reached_mib": max((x.get("mib", 0) for x in blocks), default=0),
            "nvml_peak_mib": max((x.get("nvml_mib", 0) for x in blocks), default=0),
            "refused": next((x["error"] for x in blocks if x.get("error")), None),
            "killed_after_s": round(ended - over, 1) if over is not None and p.returncode == 137 else None}


def kill_events(c: Cluster) -> list[dict[str, str]]:
    """Every backstop kill Event of the run: reason, pod, message."""
    items = json.loads(c.kubectl("get", "events", "-A", "-o", "json").stdout)["items"]
    return [{"reason": e["reason"], "pod": e["involvedObject"].get("name", ""), "message": e.get("message", "")}
            for e in items if e.get("reason") in KILL_REASONS]


def backstop(c: Cluster, res: dict[str, Any]) -> None:
    say(f"the backstop: two {LIMIT_MIB} MiB slices try to hold {TARGET_MIB} MiB (shim bypassed; region zeroed)")
    for name in (*TENANTS, "steady"):  # 10 + 10 + 30 + 30 % of the card's SMs: all fit on it
        cores = 30 if name in ("spinner", "steady") else 10
        c.kubectl("apply", "-f", "-", input=json.dumps(seed_pod(name, LIMIT_MIB, cores)))
    running(c, *TENANTS, "steady")
    if "memory" in PARTS:
        res["escaper"] = attempt(c, "escaper", f"{ESCAPER} {TARGET_MIB} {HOLD_S}")
        res["zeroer"] = attempt(c, "zeroer", f"{TORCH_PY} /repo/bench/gpu/escape_zero.py {TARGET_MIB} {HOLD_S}")
    if "compute" not in PARTS:
        return finish(c, res)
    say("compute: a 30 % slice spinning every SM around the shim, beside a 30 % matmul under it")
    steady = subprocess.Popen([str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}", "exec", "steady", "--",
                               TORCH_PY, "/repo/bench/gpu/matmul.py", str(SPIN_S + 15), "steady30"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res["spinner"] = attempt(c, "spinner", f"{ESCAPER} spin {SPIN_S}")
    out, _ = steady.communicate(timeout=SPIN_S + 120)
    print(f"$ kubectl exec steady -- matmul.py\n{out.rstrip()[-1500:]}", flush=True)
    res["steady_exit"] = steady.returncode
    finish(c, res)


def finish(c: Cluster, res: dict[str, Any]) -> None:
    for name in (*TENANTS, "steady"):
        show(c, "get", "events", "--field-selector", f"involvedObject.name={name}")
    res["backstop_events"] = kill_events(c)
    c.kubectl("delete", "pod", *TENANTS, "steady", "--wait=true", "--timeout=60s", check=False)


def stopped(r: dict[str, Any] | None, reasons: tuple[str, ...], events: list[dict[str, str]], pod: str,
            within_s: float = 25) -> bool:
    """The tenant got past its limit (the escape worked) and was killed within ``within_s`` of it,
    with one of ``reasons`` as an Event on its pod."""
    return bool(r and r.get("killed_after_s") is not None and r["killed_after_s"] <= within_s
                and any(e["reason"] in reasons and e["pod"] == pod for e in events))


def backstop_ok(res: dict[str, Any]) -> bool:
    ev = res.get("backstop_events", [])
    memory = "memory" not in PARTS or (
        stopped(res.get("escaper"), ("GPUUnenforcedKilled",), ev, "escaper")
        and stopped(res.get("zeroer"), ("GPUOverLimitKilled", "GPUOOMKilled"), ev, "zeroer"))
    compute = "compute" not in PARTS or (
        stopped(res.get("spinner"), ("GPUOverCoresKilled",), ev, "spinner", within_s=45)
        and res.get("steady_exit") == 0)
    return memory and compute and not any(e["pod"] not in TENANTS for e in ev)
