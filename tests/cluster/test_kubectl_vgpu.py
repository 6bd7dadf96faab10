"""The real ``kubectl-vgpu`` executable against the real control plane with the whole kvgpu system
(operator, kvgpu kube-scheduler, fake GPU nodes): what it prints matches what the operator did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.cluster.conftest import GpuEnv

PLUGIN = Path(sys.executable).with_name("kubectl-vgpu")


def vgpu(gpu: GpuEnv, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(PLUGIN), f"--kubeconfig={gpu.cluster.kubeconfig}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


def vgpu_json(gpu: GpuEnv, *args: str) -> Any:
    return json.loads(vgpu(gpu, *args, "-o", "json").stdout)


def test_nodes_claims_and_why(gpu: GpuEnv) -> None:
    assert PLUGIN.exists(), "the console script kubectl-vgpu is installed with the package"
    [node] = gpu.nodes(1, cards=2, memory_mib=10000)
    gpu.create(gpu.pod("small", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}),
               gpu.pod("big", {"kvgpu.io/gpumem": "12000"}))
    pod = gpu.wait_bound("small")
    assert pod["spec"]["nodeName"] == node
    gpu.wait(lambda: any(e.startswith("NoGPUCapacity") for e in gpu.events("big")),
             what="NoGPUCapacity event")

    # nodes: counted from the claims, so a bound pod's slice shows at once (the claim is created
    # before the Binding); nothing per allocation is written on the Node.
    rows = vgpu_json(gpu, "nodes", node)
    assert sum(r["slots"][0] or 0 for r in rows) == 1
    assert "kvgpu.io/allocation" not in gpu.cluster.kubectl(
        "get", "node", node, "-o", "jsonpath={.metadata.annotations}").stdout
    assert [r["index"] for r in rows] == [0, 1]
    taken = next(r for r in rows if r["slots"][0] == 1)
    assert taken["memory_mib"] == [3000, 10000] and taken["cores"] == [30, 100]
    assert taken["health"] == "Healthy" and taken["pool"] == "default"
    table = vgpu(gpu, "nodes", node).stdout.splitlines()
    assert table[0].split()[:5] == ["NODE", "GPU", "MODEL", "POOL", "SLOTS"]
    assert any("3000/10000" in line and "30/100" in line for line in table[1:])

    # claims: flags after the sub-command like kubectl; no agent runs, so usage is unknown.
    [claim] = vgpu_json(gpu, "claims", "-n", gpu.ns)
    assert (claim["pod"], claim["container"], claim["node"], claim["memory"], claim["cores"]) == \
        ("small", "main", node, "3000Mi", "30%")
    assert claim["memory_used"] == "-" and claim["phase"] in ("Bound", "Running")
    text = vgpu(gpu, "-n", gpu.ns, "claims").stdout.splitlines()
    assert text[0].split() == ["POD", "CONTAINER", "NODE", "GPU", "MEMORY", "CORES", "PHASE", "MEM-USED",
                               "SM-UTIL", "AGE"]
    everywhere = vgpu(gpu, "claims", "-A").stdout.splitlines()
    assert everywhere[0].startswith("NAMESPACE") and any(line.startswith(gpu.ns) for line in everywhere)

    # why: the pending pod's request, the extender's event, and no room on this node.
    ex = vgpu_json(gpu, "why", "big", "-n", gpu.ns)
    assert ex["phase"] == "Pending"
    assert ex["request"] == ["main: 1 card, 12000 MiB, no core limit, priority 1"]
    assert any("NoGPUCapacity" in e for e in ex["events"])
    assert ex["feasible"] == [] and list(ex["reasons"]) == [node] and ex["nodes_considered"] == 1
    out = vgpu(gpu, "why", "pod/big", "-n", gpu.ns).stdout
    assert "Room now: none of 1 GPU node(s) fits the request:" in out and f"  {node}: " in out
    # ... and for the bound pod, where it went.
    out = vgpu(gpu, "why", "small", "-n", gpu.ns).stdout
    assert f"on node {node}" in out and "Claims: small-main-" in out

    missing = vgpu(gpu, "why", "nope", "-n", gpu.ns, check=False)
    assert missing.returncode == 1 and 'pod "nope" not found' in missing.stderr
